"""Plan: plain data describing how every rank computes a fusion. JSON in and out, validated on load.

A plan holds values (a logical tensor in one layout), compute steps (an op run locally on every rank,
with the rule that justifies it) and collectives (kind, tensor, mesh axis, bytes, predicted time, and
why: the step that needed it), in execution order.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from .collectives import KINDS, RING_FLAGS, Move, cancellation, communicating, get, is_local
from .cost import CostModel, check_cost_model
from .errors import DtypeError, EgraphDidError, PlanError, ShapeError
from .explain import explain_plan
from .fusion import as_fusion
from .ir import TensorView
from .layout import Layout
from .pins import PinView, apply_layout, layout_view
from .shards import Operand, RankContext, local_extents
from .mesh import DeviceMesh, check_mesh
from .ops import OPS, SAVE_OP, canonical_dtype, complex_message  # SAVE_OP: grad's marker op

# A plan file says which format it is written in: "egraph-did-plan/<version>"; a file without the field
# is read as version 1 (a hand-written plan). Bump the version when a field changes meaning, and teach
# from_json to read the older ones. Versions: 1 wrote a value's layout as its code ("S1.R"); 2 writes
# str(layout) ("[S(1), R]"), the one text form of a layout. Both are read.
FORMAT_NAME = "egraph-did-plan"
FORMAT_VERSION = 2
FORMAT = f"{FORMAT_NAME}/{FORMAT_VERSION}"

# names ed.training_step gives (egraph_did/grad.py; the plan layer does not import it): memory_breakdown reads them
NEXT_PREFIX, GRAD_PREFIX = "next.", "grad_"
RECOMPUTE = "recompute"  # the rewrite replacing the marker saved(t) (rewrites/recompute.py)


@dataclass(frozen=True)
class StepMemory:
    """The memory model of a training step (a fusion whose backward reads forward values through the
    `saved` marker, as ed.grad and ed.training_step make it): what one device holds across the step.

    - persistent: the inputs, the outputs and the gradients (`grad_<p>`), in every layout the plan holds
      them (as the plain model counts them: FSDP's gathered weight counts);
    - saved activations: each `saved(t)` the plan keeps, t's bytes in the layout it keeps it (nothing for
      a persistent t: it is held anyway);
    - transient: everything else (forward and backward temporaries, values recomputed in the backward):
      not counted; they live inside a phase of the step, and the largest one is reported beside.

    Linear in the chosen nodes, so both extractors bound it (each node's `memory` weight: optimize.price).
    A plan of another fusion keeps the plain model: every value it holds, for the whole step.

    >>> m = StepMemory(frozenset({"x", "w", "loss"}))
    >>> m.counts("w"), m.counts("h"), m.counts("saved_3", SAVE_OP, "h"), m.counts("saved_4", SAVE_OP, "x")
    (True, False, True, False)
    >>> m.counts("gelu_9", "gelu"), m.counts("grad_w", "matmul")
    (False, True)
    """

    persistent: frozenset

    @classmethod
    def of_step(cls, inputs: Iterable[str], outputs: Iterable[str]) -> StepMemory:
        """The model of a step that reads `inputs` and writes `outputs` (tensor names): both persist.

        >>> sorted(StepMemory.of_step(["x", "w"], ["loss"]).persistent)
        ['loss', 'w', 'x']
        """
        return cls(frozenset(inputs) | frozenset(outputs))

    def counts(self, tensor: str, op: str | None = None, operand: str | None = None) -> bool:
        """Whether a value of `tensor` (made by `op` from `operand`, for a compute step) is held across the step."""
        if tensor in self.persistent or tensor.startswith(GRAD_PREFIX):
            return True
        return op == SAVE_OP and operand not in self.persistent and not (operand or "").startswith(GRAD_PREFIX)


@dataclass(frozen=True)
class Value:
    """A logical tensor held in one layout; its name is '<tensor>:<layout code>'. The layout may be
    given as a Layout or as its text (either spelling); it is held as a Layout.

    >>> v = Value("x:S1", "x", (8, 64), "float32", "S1", ("m", "n"))
    >>> str(v.layout), v.layout == "S1", v.layout.sharding_axes(1)
    ('[S(1)]', True, [0])
    """

    name: str
    tensor: str
    shape: tuple[int, ...]
    dtype: str
    layout: Layout
    axes: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.layout, Layout):
            object.__setattr__(self, "layout", Layout.parse(self.layout))

    def to_dict(self) -> dict:
        """The value as JSON data: its layout as str(layout)."""
        return {"name": self.name, "tensor": self.tensor, "shape": list(self.shape), "dtype": self.dtype,
                "layout": str(self.layout), "axes": list(self.axes)}


@dataclass(frozen=True)
class ComputeStep:
    """An op run locally on every rank: its arguments (value names for tensors, literals otherwise), the
    values it writes, the strategy's flags and its rule per mesh axis, and its predicted seconds.

    >>> step = ComputeStep("sum", (("x", "x:S1"), ("dims", 1), ("keepdim", False)), ("x",), ("y:P",), (),
    ...                    ("sum_over_sharded_axis",), 4e-6, key="y")
    >>> step.kind, dict(step.args)["x"], step.outputs
    ('compute', 'x:S1', ('y:P',))
    """

    op: str
    args: tuple[tuple[str, Any], ...]  # param -> value name (for tensors) or literal
    tensor_params: tuple[str, ...]  # which params are values
    outputs: tuple[str, ...]  # value names
    flags: tuple[tuple[str, tuple[int, ...]], ...]  # flag -> mesh axes it applies on
    rules: tuple[str, ...]  # per mesh axis
    time: float
    key: str = ""  # the expr of the optimized fusion this step runs (its first output's name)
    kind = "compute"

    @property
    def operands(self) -> dict[str, str]:
        """The tensor arguments: {parameter: value name}, in argument order."""
        return {k: v for k, v in self.args if k in self.tensor_params}

    @property
    def reads(self) -> list[str]:
        """The values this step reads, in argument order."""
        return list(self.operands.values())

    @property
    def writes(self) -> list[str]:
        """The values this step produces."""
        return list(self.outputs)

    def bind(self, value_of: Callable[[str], Any]) -> dict[str, Any]:
        """The op's arguments by parameter: each tensor argument's value name mapped through value_of
        (a rank's shard, an operand's shape), literals as they are.

        >>> step = ComputeStep("sum", (("x", "x:S1"), ("dims", 1)), ("x",), ("y:P",), (), ("r",), 0.0)
        >>> step.bind(str.upper)
        {'x': 'X:S1', 'dims': 1}
        """
        return {k: value_of(v) if k in self.tensor_params else v for k, v in self.args}

    def __str__(self) -> str:
        """The step in one line, as explain, the runtime's progress and the lowering's segments name it:
        values by name ('<tensor>:<layout code>'), literals other than None as param=value.

        >>> print(ComputeStep("sum", (("x", "x:S1"), ("dims", 1)), ("x",), ("y:P",), (), ("r",), 0.0))
        y:P = sum(x:S1, dims=1)
        """
        args = ", ".join(v if k in self.tensor_params else f"{k}={v}" for k, v in self.args
                         if k in self.tensor_params or v is not None)
        return f"{', '.join(self.outputs)} = {self.op}({args})"


@dataclass(frozen=True)
class Collective:
    """One collective over one mesh axis: it turns value src into value dst (the same tensor in another
    layout), moving `bytes` per rank in a predicted `time`; `why` names the step that needed it.

    >>> c = Collective("reduce_scatter", "y", "y:P", "y:S0", 0, "x", bytes=32.0, time=1e-5)
    >>> str(c), c.reads, c.writes
    ('reduce_scatter[x] y:P -> y:S0', ['y:P'], ['y:S0'])
    """

    kind: str  # allgather | reduce_scatter | allreduce | alltoall | slice
    tensor: str
    src: str
    dst: str
    mesh_axis: int
    mesh_axis_name: str
    bytes: float
    time: float
    reduce: str = "sum"
    why: str = ""

    @property
    def reads(self) -> list[str]:
        """The value this collective reads."""
        return [self.src]

    @property
    def writes(self) -> list[str]:
        """The value this collective produces."""
        return [self.dst]

    def __str__(self) -> str:
        """The collective in one line, as explain, the runtime's progress and the lowering's segments name it.

        >>> print(Collective("allreduce", "y", "y:P", "y:R", 0, "x", bytes=32.0, time=2e-5))
        allreduce[x] y:P -> y:R
        """
        return f"{self.kind}[{self.mesh_axis_name}] {self.src} -> {self.dst}"


Step = ComputeStep | Collective

# What plan.run() calls: the execution layer's run_plan, which registers itself when egraph_did.runtime is
# imported (as `import egraph_did` does). The plan layer never imports the runtime: the runtime sits below.
_runner: Callable[..., dict] | None = None


def register_runner(fn: Callable[..., dict]) -> None:
    """Make `fn(plan, values, inputs_kind=..., outputs_kind=..., **options)` the function plan.run calls.

    >>> import egraph_did.plan, egraph_did.runtime
    >>> egraph_did.plan._runner is egraph_did.runtime.run_plan  # the runtime registered it on import
    True
    """
    global _runner
    _runner = fn


@dataclass
class Plan:
    """The optimizer's answer for one fusion on one mesh.

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> fd, mesh = row_sum(8, 64), ed.DeviceMesh.arange(4)
    >>> _ = apply_layout(fd["x"], Layout.from_code("S1"), mesh)  # pin x: split along the summed axis
    >>> plan = ed.optimize(fd, mesh)
    >>> [s.kind for s in plan.steps], str(plan.layout_of("y")), plan.loop_domain("y")
    (['compute', 'reduce_scatter'], '[S(0)]', '[DIDx{4}, m/4]')
    >>> ed.Plan.from_json(plan.to_json()).count("reduce_scatter")
    1
    """

    mesh: DeviceMesh
    cost_model: CostModel
    values: dict[str, Value]
    steps: list[Step]
    inputs: dict[str, list[str]]  # fusion input -> values loaded from it
    outputs: dict[str, str]  # fusion output -> value
    memory: float = 0.0
    method: str = ""
    stats: dict[str, float] = field(default_factory=dict)
    pins: dict[str, str] = field(default_factory=dict)  # pinned tensor -> the value holding it in its pin
    # tensor a program rewrite (rewrites/algebra.py) added, computed by the plan -> the rewrite's name
    rewrites: dict[str, str] = field(default_factory=dict)
    buckets: list = field(default_factory=list)  # [a, b] pairs bucket_pair sends in one buffer (optimize(like=) replays them)
    # pinned tensor -> [its loop domain as pinned, that pin's layout code]: a split or a partial over a mesh
    # axis of size 1 is R's data, and loop_domain reports it as pinned
    pinned_loops: dict[str, list] = field(default_factory=dict)
    # input or output -> the pins.PinView it is bound or delivered through (a pin no layout of its own shape
    # names: the plan holds a reshaped view; bind_view / deliver_view reshape the user's tensor to and from it)
    views: dict[str, PinView] = field(default_factory=dict)
    # inputs of the fusion no output reads (Fusion.unread_inputs): the plan loads none of them; simulate and
    # plan.run take them or not and ignore them
    unread: list[str] = field(default_factory=list)
    # pinned inputs and outputs the user holds in DTensor's chunks of their layout (TensorView.chunks, from
    # runtime.pin_placements: nested uneven splits no loop domain cuts so): the plan holds them in the
    # loop domain's chunks; plan.run rechunks such a local input on load and such a local output on delivery
    dtensor_chunks: list[str] = field(default_factory=list)

    # ------------------------------------------------------------ queries
    @property
    def collectives(self) -> list[Collective]:
        """Every communicating collective, in execution order (local slices excluded)."""
        return [s for s in self.steps if isinstance(s, Collective) and not is_local(s.kind)]

    @property
    def rings(self) -> list[ComputeStep]:
        """Every compute step that communicates inside (a collective matmul's ring, rewrites/
        collective_matmul.py), in execution order: plan.collectives does not hold them.

        >>> import egraph_did as ed
        >>> from egraph_did.models import mlp
        >>> ed.optimize(mlp(tokens=8, hidden=16), ed.DeviceMesh.arange(2)).rings  # too small to pay
        []
        """
        return [s for s in self.steps if isinstance(s, ComputeStep) and any(f in RING_FLAGS for f, _ in s.flags)]

    @property
    def compute_steps(self) -> list[ComputeStep]:
        """Every compute step, in execution order."""
        return [s for s in self.steps if isinstance(s, ComputeStep)]

    @property
    def predicted_time(self) -> float:
        """Seconds, summed over steps (no overlap assumed)."""
        return sum(s.time for s in self.steps)

    def move(self, c: Collective) -> Move:
        """What collective c does to its tensor, as the registry's entries take it: the global shape,
        source and destination layouts, mesh axis and pending reduction.

        >>> import egraph_did as ed
        >>> from egraph_did.models import row_sum
        >>> fd, mesh = row_sum(8, 64), ed.DeviceMesh.arange(4)
        >>> _ = fd["x"].set_device_mesh(mesh).outer_split(1, 4).axis(1).parallelize(ed.ParallelType.DIDx)
        >>> plan = ed.optimize(fd, mesh)
        >>> move = plan.move(plan.collectives[0])  # y = sum(x, 1) is a partial sum: reduce-scatter it
        >>> move.shape, str(move.src), str(move.dst), [move.cut(r) for r in range(4)]
        ((8,), '[P]', '[S(0)]', [(0, 2), (2, 4), (4, 6), (6, 8)])
        """
        src, dst = self.values[c.src], self.values[c.dst]
        return Move(self.mesh, src.shape, src.layout, dst.layout, c.mesh_axis, c.reduce)

    def count(self, kind: str) -> int:
        """How many collectives of `kind` (e.g. 'allreduce') the plan runs; PlanError for a kind that does
        not exist (a typo would otherwise count 0).

        >>> import egraph_did as ed
        >>> from egraph_did.models import row_sum
        >>> ed.optimize(row_sum(4, 6), ed.DeviceMesh.arange(2)).count("all_reduce")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        egraph_did.errors.PlanError: count: unknown collective kind 'all_reduce'; kinds are allgather, reduce_scatter, ...
        """
        if kind not in communicating():
            raise PlanError(f"count: unknown collective kind {kind!r}; kinds are {', '.join(communicating())}")
        return sum(1 for c in self.collectives if c.kind == kind)

    def memory_breakdown(self) -> dict[str, float]:
        """Bytes one device holds, by category, summed as the memory model the plan was optimized under
        sums them (the largest shard of each value, views of another value at no bytes), grouped by tensor
        name; "total" is their sum (plan.memory).

        Two models: a training step whose backward reads forward values through ed.grad's `saved` marker
        is priced by StepMemory (what lives across the step: persistent values, and the activations saved
        for the backward; transients not counted, "largest transient" reports the largest, outside the
        total); any other plan holds every value for the whole step (no liveness).

        Categories are recognized from names alone, as ed.training_step makes them:
          weights     an input `p` the plan also outputs as `next.p` (and `next.p` itself), unless a
                      state's: its values in every layout;
          optimizer states  an input `<state>.<p>` (exp_avg.w1, momentum_buffer.w1) output as `next.<state>.<p>`,
                      where `p` is a weight (and the `next.` outputs);
          gradients   the tensors named `grad_<p>` (training_step names each weight's gradient so; ed.grad
                      outputs them so);
          saved activations  (a training step) the values the forward keeps for the backward: `saved` steps
                      the plan runs rather than recomputing them (rewrites/recompute.py);
          activations/other  everything else counted: data, outputs, the `step` counter (and, in the plain
                      model, every activation and temporary).
        A plan of another fusion has weights, states and gradients only where its names say so.

        >>> import torch, egraph_did as ed
        >>> from egraph_did.models import mlp_training_step
        >>> fd = mlp_training_step(tokens=64, hidden=16)  # x [64, 16], w1 [64, 16], w2 [16, 64], AdamW
        >>> mesh = ed.DeviceMesh.arange(4)
        >>> for n in ("x", "target"):
        ...     _ = fd[n].set_device_mesh(mesh).outer_split(0, 4).axis(0).parallelize(ed.ParallelType.DIDx)
        >>> for n in ("w1", "w2", "next.w1", "next.w2"): _ = fd[n].set_device_mesh(mesh)  # replicated
        >>> plan = ed.optimize(fd, mesh)
        >>> mem = plan.memory_breakdown()
        >>> mem["weights"] >= 2 * 2 * 64 * 16 * 4, mem["total"] == plan.memory  # w1, w2, next.w1, next.w2 whole
        (True, True)
        >>> sorted(mem)  # mlp_training_step marks saved activations (recompute on by default): StepMemory's keys
        ['activations/other', 'gradients', 'largest transient', 'optimizer states', 'saved activations', 'total', 'weights']

        A training step with saved markers (ed.training_step's default) is priced by StepMemory:

        >>> with ed.FusionDefinition() as f:
        ...     x, w = f.define_tensor((64, 16), name="x"), f.define_tensor((16,), name="w")
        ...     f.add_output(f.ops.sum(f.ops.exp(f.ops.mul(x, w))), name="loss")  # exp's vjp reads exp(x w)
        >>> step = ed.training_step(f, "loss", ["w"], ed.SGD(lr=0.1), recompute=True)
        >>> mem = ed.optimize(step, ed.DeviceMesh.arange(2)).memory_breakdown()
        >>> mem["saved activations"], mem["total"] - mem["saved activations"] - mem["largest transient"] > 0
        (4096.0, True)
        """
        carried = {n for n in self.inputs if NEXT_PREFIX + n in self.outputs}
        states = {n for n in carried if "." in n and n.split(".", 1)[1] in carried}  # '<state>.<p>': no dot in <state>
        weights = carried - states - {n for n in carried if n == "step"}

        def category(tensor: str) -> str:
            base = tensor[len(NEXT_PREFIX):] if tensor.startswith(NEXT_PREFIX) else tensor
            if base in weights:
                return "weights"
            if base in states:
                return "optimizer states"
            if tensor.startswith(GRAD_PREFIX):
                return "gradients"
            return "activations/other"
        model = self.step_memory()
        out = dict.fromkeys(("weights", "gradients", "optimizer states", "activations/other"), 0.0)
        if model is not None:
            out.update({"saved activations": 0.0})
        transient = 0.0
        made = {v: s for s in self.compute_steps for v in s.outputs}
        for v in self.values.values():
            held = self.held_bytes(v.name)
            s = made.get(v.name)
            if model is None:
                if s is None or not OPS[s.op].metadata_only:  # a view: the memory model prices it at no bytes
                    out[category(v.tensor)] += held
                continue
            operand = self.values[s.reads[0]].tensor if s is not None and s.op == SAVE_OP else None
            if not model.counts(v.tensor, s and s.op, operand):
                transient = max(transient, 0.0 if s is not None and OPS[s.op].metadata_only else held)
            elif operand is not None:
                out["saved activations"] += held
            elif s is None or not OPS[s.op].metadata_only:
                out[category(v.tensor)] += held
        out["total"] = sum(out.values())
        if model is not None:
            out["largest transient"] = transient
        return out

    def held_bytes(self, value: str) -> float:
        """Bytes of the largest shard of a value: what one device holds of it.

        >>> import egraph_did as ed
        >>> from egraph_did.models import row_sum
        >>> plan = ed.optimize(row_sum(8, 64), ed.DeviceMesh.arange(4))
        >>> plan.held_bytes(plan.inputs["x"][0])  # x [8, 64] float32, its rows split over 4
        512
        """
        v = self.values[value]
        return math.prod(local_extents(v.shape, v.layout, self.mesh)) * canonical_dtype(v.dtype).itemsize

    def step_memory(self) -> StepMemory | None:
        """The memory model of a training step (StepMemory) where the plan is one: its backward reads
        forward values through the `saved` marker, kept or recomputed; None for other plans.

        >>> import egraph_did as ed
        >>> from egraph_did.models import row_sum
        >>> ed.optimize(row_sum(8, 64), ed.DeviceMesh.arange(4)).step_memory() is None
        True
        """
        if not any(s.op == SAVE_OP for s in self.compute_steps) and RECOMPUTE not in self.rewrites.values():
            return None
        return StepMemory.of_step(self.inputs, (self.values[v].tensor for v in self.outputs.values()))

    def value_of(self, tensor: str) -> str:
        """The value that holds a tensor as the plan reports it: a pinned tensor's pinned value, an output's
        delivered value, an input's first loaded one, else the first a step produces. It may go by another
        tensor's name: two equal terms of the program share one value (x split, merged and split again is x's
        split), so look a tensor up here, never by Value.tensor.

        >>> import torch, egraph_did as ed
        >>> with ed.FusionDefinition() as fd:
        ...     x = fd.define_tensor((2, 6), name="x")
        ...     fd.add_output(fd.ops.reshape(x, (12,)), name="a")
        ...     fd.add_output(fd.ops.reshape(fd.ops.reshape(x, (12,)), (3, 4)), name="b")
        ...     fd.add_output(fd.ops.reshape(fd["a"], (3, 4)), name="c")  # the same term as b
        >>> plan = ed.optimize(fd, ed.DeviceMesh.arange(2))
        >>> plan.values[plan.value_of("b")].tensor == plan.values[plan.value_of("c")].tensor
        True
        """
        if tensor in self.pins:
            return self.pins[tensor]
        if tensor in self.outputs:
            return self.outputs[tensor]
        if tensor in self.inputs:
            return self.inputs[tensor][0]
        for s in self.compute_steps:
            for v in s.outputs:
                if self.values[v].tensor == tensor:
                    return v
        for v in self.values.values():
            if v.tensor == tensor:
                return v.name
        raise PlanError(f"the plan holds no tensor named {tensor!r}")

    def layout_of(self, tensor: str) -> Layout:
        """The layout a tensor is pinned to, or else produced (or, for an output, delivered) in."""
        return self.values[self.value_of(tensor)].layout

    def check_input_dtype(self, name: str, tensor: torch.Tensor, where: str = "run") -> None:
        """DtypeError unless tensor has the dtype the plan was optimized for (no silent precision change).

        >>> import torch, egraph_did as ed
        >>> from egraph_did.models import row_sum
        >>> plan = ed.optimize(row_sum(8, 64), ed.DeviceMesh.arange(2))
        >>> plan.check_input_dtype("x", torch.zeros(8, 64, dtype=torch.float64))
        Traceback (most recent call last):
        ...
        egraph_did.errors.DtypeError: run: input 'x' is float64, the plan expects float32; cast it
        """
        want = self.values[self.inputs[name][0]].dtype
        got = str(tensor.dtype).replace("torch.", "")
        if got != want and tensor.dtype.is_complex:
            raise DtypeError(f"{where}: input {name!r}: the plan expects {want}, got {complex_message(tensor.dtype)}")
        if got != want:
            raise DtypeError(f"{where}: input {name!r} is {got}, the plan expects {want}; cast it")

    def check_inputs(self, values, where: str = "run", dtensors: bool = False) -> None:
        """ShapeError (DtypeError for a dtype) unless `values` binds every input of the plan and nothing
        else (an input of the fusion no output reads, plan.unread, may be given too: it is ignored), each to a torch.Tensor that holds data (not on the meta device) of the dtype the plan was
        optimized for. With dtensors=True a torch DTensor is taken too. Shapes are checked where the
        inputs are bound (global or local shards).

        >>> import torch, egraph_did as ed
        >>> from egraph_did.models import row_sum
        >>> plan = ed.optimize(row_sum(8, 64), ed.DeviceMesh.arange(2))
        >>> plan.check_inputs({"x": torch.zeros(8, 64), "y": torch.zeros(8)}, "simulate")
        Traceback (most recent call last):
        ...
        egraph_did.errors.ShapeError: simulate: unknown input(s) ['y']; the plan takes ['x'] (the names given to fd.define_tensor); drop the extra key(s) or fix their names
        """
        takes = sorted(self.inputs)
        if not isinstance(values, Mapping):
            raise ShapeError(f"{where}: inputs must be a dict {{input name: tensor}} over {takes}, got a "
                             f"{type(values).__name__}")
        unknown = sorted((k for k in values if k not in self.inputs and k not in self.unread), key=str)
        if unknown:
            also = f" and ignores {sorted(self.unread)}, which no output reads" if self.unread else ""
            raise ShapeError(f"{where}: unknown input(s) {unknown}; the plan takes {takes}{also} (the names given to "
                             f"fd.define_tensor); drop the extra key(s) or fix their names")
        missing = [k for k in takes if k not in values]
        if missing:
            raise ShapeError(f"{where}: missing input(s) {missing}; the plan takes {takes}")
        for name in takes:
            t = values[name]
            if dtensors and _is_dtensor(t):
                self.check_input_dtype(name, t, where)
                continue
            if not isinstance(t, torch.Tensor):
                raise ShapeError(f"{where}: input {name!r} must be a torch.Tensor, got a {type(t).__name__}; "
                                 f"convert it (torch.as_tensor(value, dtype=torch.{self.values[self.inputs[name][0]].dtype}))")
            if t.device.type == "meta":
                raise ShapeError(f"{where}: input {name!r} is on the meta device: it has a shape but no data, so "
                                 f"the outputs would be meta too; pass a tensor with data (on the CPU or a GPU)")
            self.check_input_dtype(name, t, where)

    def value_view(self, value: str) -> TensorView:
        """A free-standing TensorView with the value's loop domain (its loop string, local shapes); which
        elements a rank holds, to shard or reassemble a value, is shards.shard/unshard of its layout.

        >>> import egraph_did as ed
        >>> from egraph_did.models import row_sum
        >>> plan = ed.optimize(row_sum(8, 64), ed.DeviceMesh.arange(2))
        >>> plan.value_view(plan.outputs["y"]).loop_str()
        '[DIDx{2}, m/2]'
        """
        v = self.values[value]
        return layout_view(v.tensor, v.shape, canonical_dtype(v.dtype), v.layout, self.mesh, v.axes)

    def local_shape(self, value: str, rank: int) -> tuple[int, ...]:
        """The shape of `rank`'s shard of a plan value (its allocation: ceil-cut, uneven splits exact).

        >>> import egraph_did as ed
        >>> from egraph_did.models import row_sum
        >>> plan = ed.optimize(row_sum(10, 3), ed.DeviceMesh.arange(4))  # x's 10 rows split over 4 ranks
        >>> [plan.local_shape("x:S0", r) for r in range(4)]
        [(3, 3), (3, 3), (3, 3), (1, 3)]
        """
        v = self.values[value]
        return RankContext(self.mesh, rank).local_shape(Operand(v.shape, v.layout))

    def input_shape(self, name: str, rank: int | None = None, value: str | None = None) -> tuple[int, ...]:
        """The shape plan.run takes for input `name`: global (rank None), or `rank`'s local shard (of the
        layout of `value`, one of plan.inputs[name]; default the first it is loaded in); a viewed input's
        (plan.views) is the user's, not its view's; one pinned in DTensor's chunks (plan.dtensor_chunks), that
        chunk's.

        >>> import egraph_did as ed
        >>> from egraph_did.models import row_sum
        >>> plan = ed.optimize(row_sum(10, 3), ed.DeviceMesh.arange(4))
        >>> plan.input_shape("x"), plan.input_shape("x", 3)  # rows 3, 3, 3, 1
        ((10, 3), (1, 3))
        """
        value = value or self.inputs[name][0]
        if rank is not None and name in self.dtensor_chunks and value == self.inputs[name][0]:
            v = self.values[value]
            return RankContext(self.mesh, rank).local_shape(Operand(v.shape, v.layout), "dtensor")
        local = self.values[value].shape if rank is None else self.local_shape(value, rank)
        if name not in self.views:
            return local
        return self.views[name].shape if rank is None else self.views[name].local_shape(local)

    def bind_view(self, name: str, tensor, rank: int | None = None, value: str | None = None):
        """The tensor the plan loads for input `name` from the user's (global, or `rank`'s local shard of the
        layout of `value`, one of plan.inputs[name]; default the first): itself, or for a viewed input
        (plan.views) the same elements reshaped to its view (every rank's shard holds the pin's elements in
        the pin's order, so a local reshape binds it); deliver_view is the inverse.

        >>> import torch, egraph_did as ed
        >>> mesh = ed.DeviceMesh.arange(2)
        >>> with ed.FusionDefinition() as fd:
        ...     w = fd.define_tensor((4, 2), name="w")
        ...     fd.add_output(fd.ops.relu(w), name="y")
        >>> _ = w.set_device_mesh(mesh).outer_split(0, 2).outer_split(1, 2).parallelize(1, ed.ParallelType.DIDx)
        >>> plan = ed.optimize(fd, mesh)
        >>> W = torch.arange(8.).reshape(4, 2)
        >>> plan.bind_view("w", ed.shard_tensor(W, w, 1), rank=1).shape  # rows 1 and 3: view [2, 1, 2]
        torch.Size([2, 1, 2])
        """
        if name not in self.views:
            return tensor
        value = value or self.inputs[name][0]
        return tensor.reshape(self.values[value].shape if rank is None else self.local_shape(value, rank))

    def deliver_view(self, name: str, tensor, rank: int | None = None):
        """Output `name` as the user pinned it from the plan's value (global, or `rank`'s local shard): itself,
        or for a viewed output (plan.views) reshaped from its view back to the tensor's own shape."""
        if name not in self.views:
            return tensor
        v = self.views[name]
        return tensor.reshape(v.shape if rank is None else v.local_shape(tuple(tensor.shape)))

    def loop_domain(self, tensor: str) -> str:
        """The loop domain of a tensor as the plan lays it out, e.g. '[s, DIDx{4}, h/4]'. A pinned tensor's is
        its pinned value's, which may go by another name (two equal terms of the program share one value), in the
        words of the pin where the plan holds it in the pin's layout; a pinned input no output reads (plan.unread),
        which the plan does not load, reports its pin as given."""
        if tensor in self.pinned_loops and tensor in self.unread:
            return self.pinned_loops[tensor][0]  # a pinned input no output reads: not loaded, its pin as given
        if tensor in self.pinned_loops and self.layout_of(tensor).code() == self.pinned_loops[tensor][1]:
            return self.pinned_loops[tensor][0]
        # the value holding it (value_of): it may be named for an equal term, so never searched by tensor name
        return self.value_view(self.value_of(tensor)).loop_str()

    # ------------------------------------------------------------ run
    def run(self, values, /, inputs: str = "global", outputs: str = "global", *, cuda_graph: bool = True,
            **options):
        """Execute this plan on this rank, inside an initialized default process group (see ed.launch).

        values: {input name: tensor}; inputs="global" (whole tensors, sharded here), "local" (this rank's
        shards) or DTensors; outputs="global", "local" or "dtensor". cuda_graph: on a GPU, the rank's
        program is captured once per input signature and replayed (False: run it call by call).

        Example::

            def work(rank, plan, X):  # module level: launch pickles it
                return plan.run({"x": X}, outputs="local")["y"]

            shards = ed.launch(work, nprocs=4, args=(plan, X))  # rank r's piece of y, for each r
        """
        if _runner is None:
            raise PlanError("plan.run: no runner is registered; import egraph_did (its runtime registers "
                            "run_plan), or call egraph_did.runtime.run_plan(plan, values) directly")
        return _runner(self, values, inputs_kind=inputs, outputs_kind=outputs, cuda_graph=cuda_graph, **options)

    # ------------------------------------------------------------ simplify
    def simplified(self) -> "Plan":
        """A copy with back-to-back collectives that cancel removed (collectives.CANCELLATIONS):
        allgather then slice, slice then allgather, alltoall there and back: readers of the second's
        result read the first's input; reduce_scatter then allgather becomes one allreduce. The extractor
        never picks such pairs (the direct class is cheaper); hand-written or edited plans may hold them.

        >>> import egraph_did as ed
        >>> from egraph_did.models import mlp
        >>> plan = ed.optimize(mlp(8, 16), ed.DeviceMesh.arange(2))
        >>> len(plan.simplified().steps) == len(plan.steps)
        True
        """
        steps = list(self.steps)
        rename: dict[str, str] = {}
        out: list[Step] = []
        producer = {s.dst: s for s in steps if isinstance(s, Collective)}
        readers: dict[str, int] = {}
        for s in steps:
            for v in s.reads:
                readers[v] = readers.get(v, 0) + 1
        dropped: set[int] = set()
        for s in steps:
            first = producer.get(s.src) if isinstance(s, Collective) else None
            pair = cancellation(first.kind, s.kind) if first is not None else None
            if (pair is not None and id(first) not in dropped and first.mesh_axis == s.mesh_axis
                    and readers.get(first.dst) == 1 and first.dst not in self.outputs.values()):
                src, dst = self.values[first.src], self.values[s.dst]
                if pair.becomes is None and dst.layout == src.layout:
                    rename[s.dst] = first.src  # the pair is the identity
                    dropped.update((id(first), id(s)))
                    continue
                if pair.becomes is not None:  # one collective does what the pair did
                    move = Move(self.mesh, src.shape, src.layout, dst.layout, s.mesh_axis)
                    nbytes = KINDS[pair.becomes].moved(move, canonical_dtype(src.dtype).itemsize)
                    dropped.add(id(first))
                    out.append(dataclasses.replace(s, kind=pair.becomes, src=first.src, bytes=nbytes,
                                                   reduce=first.reduce, time=self.cost_model.collective_time(
                                                       pair.becomes, nbytes, self.mesh.shape[s.mesh_axis],
                                                       s.mesh_axis, self.mesh.ndim)))
                    continue
            out.append(s)
        out = [s for s in out if id(s) not in dropped]

        def fix(v: str) -> str:
            while v in rename:
                v = rename[v]
            return v
        fixed: list[Step] = []
        for s in out:
            if isinstance(s, ComputeStep):
                fixed.append(dataclasses.replace(s, args=tuple((k, fix(v) if k in s.tensor_params else v)
                                                               for k, v in s.args)))
            else:
                fixed.append(dataclasses.replace(s, src=fix(s.src)))
        plan = Plan(self.mesh, self.cost_model, dict(self.values), fixed, self.inputs,
                    {k: fix(v) for k, v in self.outputs.items()}, self.memory, self.method, dict(self.stats),
                    {k: fix(v) for k, v in self.pins.items()}, views=dict(self.views), unread=list(self.unread),
                    dtensor_chunks=list(self.dtensor_chunks))
        plan.validate()
        return plan

    # ------------------------------------------------------------ explain
    def explain(self) -> str:
        """A readable account: every tensor's loop domain, every step with its rule, every collective with
        bytes, time and why (egraph_did/explain.py writes it).

        >>> import egraph_did as ed
        >>> from egraph_did.models import row_sum
        >>> print(ed.optimize(row_sum(8, 64), ed.DeviceMesh.arange(2)).explain().splitlines()[-1])
          0  y:S0 = sum(x:S0, dims=1, keepdim=False)                                       4.00  reduce_other_axis
        """
        return explain_plan(self)

    # ------------------------------------------------------------ JSON
    def to_json(self) -> str:
        """Plain JSON (no pickle), format version FORMAT_VERSION ("format": "egraph-did-plan/2").

        >>> import json, egraph_did as ed
        >>> from egraph_did.models import row_sum
        >>> json.loads(ed.optimize(row_sum(8, 64), ed.DeviceMesh.arange(2)).to_json())["format"]
        'egraph-did-plan/2'
        """
        def enc(v):
            if isinstance(v, torch.dtype):
                return {"dtype": str(v).replace("torch.", "")}
            if isinstance(v, tuple):
                return [enc(x) for x in v]
            if isinstance(v, list):
                return [enc(x) for x in v]
            return v
        steps = []
        for s in self.steps:
            if isinstance(s, ComputeStep):
                d = {"step": "compute", "op": s.op, "args": [[k, enc(v)] for k, v in s.args],
                     "tensor_params": list(s.tensor_params), "outputs": list(s.outputs),
                     "flags": [[f, list(m)] for f, m in s.flags], "rules": list(s.rules), "time": s.time,
                     "key": s.key}
            else:  # group_size: the ranks the collective was priced for; a swapped mesh is caught on load
                d = {"step": "collective", **asdict(s), "group_size": self.mesh.shape[s.mesh_axis]}
            steps.append(d)
        return json.dumps({
            "format": FORMAT, "mesh": self.mesh.to_dict(), "cost_model": self.cost_model.to_dict(),
            "values": {k: v.to_dict() for k, v in self.values.items()},
            "steps": steps, "inputs": self.inputs, "outputs": self.outputs, "memory": self.memory,
            "method": self.method, "stats": self.stats, "pins": self.pins, "rewrites": self.rewrites,
            "buckets": self.buckets, "pinned_loops": self.pinned_loops,
            **({"unread": self.unread} if self.unread else {}),
            **({"dtensor_chunks": self.dtensor_chunks} if self.dtensor_chunks else {}),
            **({"views": {k: v.to_dict() for k, v in self.views.items()}} if self.views else {})}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Load and validate a plan written by to_json(): every field present with its type, every value a
        step, an input or an output names exists, every layout fits the mesh, every collective priced for
        the mesh's group size; errors name the field (hand-edited plans are welcome, broken ones are not).
        Reads format versions up to FORMAT_VERSION (a plan without "format" is version 1, as every plan
        written so far); a newer version is a PlanError saying so.

        >>> import json, egraph_did as ed
        >>> from egraph_did.models import row_sum
        >>> d = json.loads(ed.optimize(row_sum(8, 64), ed.DeviceMesh.arange(2)).to_json())
        >>> del d["steps"][0]["op"]
        >>> ed.Plan.from_json(json.dumps(d))
        Traceback (most recent call last):
        ...
        egraph_did.errors.PlanError: plan JSON: steps[0] (compute) lacks the field 'op' (a str); write the plan with plan.to_json(), or add the field
        """
        if not isinstance(text, (str, bytes, bytearray)):
            hint = " (a dict: pass json.dumps(d))" if isinstance(text, dict) else ""
            raise PlanError(f"Plan.from_json takes the JSON text (a str, as plan.to_json() writes it), got a "
                            f"{type(text).__name__}{hint}")
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan JSON does not parse: {e}") from None
        _check_format(d)
        _fields(d, "", _PLAN_FIELDS)

        def dec(v):
            if isinstance(v, dict) and set(v) == {"dtype"}:
                return canonical_dtype(v["dtype"])
            if isinstance(v, list):
                return tuple(dec(x) for x in v)
            return v
        try:
            mesh = DeviceMesh.from_dict(d["mesh"])
            cost_model = CostModel.from_dict(d["cost_model"])
        except EgraphDidError as e:
            raise PlanError(f"plan JSON: {e}") from None
        values = {}
        for k, v in d["values"].items():
            where = f"values[{k!r}]"
            _fields(v, where, _VALUE_FIELDS)
            if v["name"] != k:
                raise PlanError(f"plan JSON: {where} has name {v['name']!r}; a value's name is its key")
            if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in v["shape"]):
                raise PlanError(f"plan JSON: {where}.shape must list non-negative ints, got {v['shape']}")
            try:
                canonical_dtype(v["dtype"])
            except DtypeError as e:
                raise PlanError(f"plan JSON: {where}.dtype: {e}") from None
            axes = v.get("axes", [])
            if not isinstance(axes, list) or (axes and len(axes) != len(v["shape"])):
                raise PlanError(f"plan JSON: {where}.axes must list one name per axis of shape {v['shape']}")
            try:
                lay = Layout.parse(v["layout"])
            except ValueError:
                lay = None
            if lay is None or any(p.is_shard and p.axis >= len(v["shape"]) for p in lay):
                raise PlanError(f"plan JSON: value {k}: bad layout {v['layout']!r} for a {len(v['shape'])}-D tensor; "
                                f"a layout lists one placement per mesh axis, as str(layout) writes it: R, "
                                f"S(tensor axis), P (pending sum) or Pmax (pending max), e.g. '[S(0)]' or '[R, S(1)]' "
                                f"(the code 'S0' / 'R.S1' of format 1 is read too)")
            if len(lay) != mesh.ndim:
                raise PlanError(f"value {k}: layout {v['layout']} does not match the {mesh.ndim}-D mesh")
            values[k] = Value(v["name"], v["tensor"], tuple(v["shape"]), v["dtype"], lay, tuple(axes))
        steps: list[Step] = []
        for i, s in enumerate(d["steps"]):
            if not isinstance(s, dict):
                raise PlanError(f"plan JSON: steps[{i}] must be an object, got {type(s).__name__} {s!r:.40}")
            if s.get("step") == "compute":
                where = f"steps[{i}] (compute)"
                _fields(s, where, _COMPUTE_FIELDS)
                if s["op"] not in OPS:
                    raise PlanError(f"step {i}: unknown op {s['op']!r}")
                if not all(isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) for a in s["args"]):
                    raise PlanError(f"plan JSON: {where}.args must list [parameter, value] pairs")
                if not all(isinstance(f, list) and len(f) == 2 and isinstance(f[1], list) for f in s["flags"]):
                    raise PlanError(f"plan JSON: {where}.flags must list [flag, [mesh axes]] pairs")
                step = ComputeStep(s["op"], tuple((k, dec(v)) for k, v in s["args"]), tuple(s["tensor_params"]),
                                   tuple(s["outputs"]), tuple((f, tuple(m)) for f, m in s["flags"]),
                                   tuple(s["rules"]), s["time"], s.get("key", ""))
                refs = step.reads + step.writes
                if not all(isinstance(r, str) for r in refs):
                    raise PlanError(f"plan JSON: {where}: tensor arguments and outputs are value names (str)")
            elif s.get("step") == "collective":
                where = f"steps[{i}] (collective)"
                _fields(s, where, _COLLECTIVE_FIELDS)
                known = {f.name for f in dataclasses.fields(Collective)} | {"step", "group_size"}
                extra = sorted(set(s) - known)
                if extra:
                    raise PlanError(f"plan JSON: {where} has unknown field(s) {extra}; a collective has "
                                    f"{sorted(known - {'step'})}")
                fields = {k: v for k, v in s.items() if k not in ("step", "group_size")}
                get(fields["kind"], f"plan JSON: {where}")  # a kind the registry knows, named on load
                step = Collective(**fields)
                _check_collective_mesh(i, step, s.get("group_size"), mesh)
                refs = step.reads + step.writes
            else:
                raise PlanError(f"step {i}: unknown step type {s.get('step')!r} (expected 'compute' or "
                                f"'collective')")
            missing = [r for r in refs if r not in values]
            if missing:
                raise PlanError(f"step {i} refers to unknown value(s) {missing}")
            steps.append(step)
        for name, vals in d["inputs"].items():
            if not isinstance(vals, list) or not vals or any(v not in values for v in vals):
                raise PlanError(f"plan JSON: inputs[{name!r}] must list the values loaded from input {name!r} "
                                f"(keys of 'values'), got {vals!r}")
        unread = d.get("unread", [])
        if not isinstance(unread, list) or not all(isinstance(n, str) and n not in d["inputs"] for n in unread):
            raise PlanError(f"plan JSON: unread must list the names of inputs the plan does not load, got {unread!r}")
        for name, v in d["outputs"].items():
            if not isinstance(v, str) or v not in values:
                raise PlanError(f"plan JSON: outputs[{name!r}] must name a value (a key of 'values'), got {v!r}")
        plan = cls(mesh, cost_model, values, steps,
                   {k: list(v) for k, v in d["inputs"].items()}, dict(d["outputs"]), d.get("memory", 0.0),
                   d.get("method", ""), d.get("stats", {}), dict(d.get("pins", {})), dict(d.get("rewrites", {})),
                   [list(p) for p in d.get("buckets", [])],
                   {k: list(v) for k, v in d.get("pinned_loops", {}).items()},
                   _views_of(d.get("views", {}), d["inputs"], d["outputs"], values), list(unread))
        chunked = d.get("dtensor_chunks", [])
        if not isinstance(chunked, list) or not all(n in d["inputs"] or n in d["outputs"] for n in chunked):
            raise PlanError(f"plan JSON: dtensor_chunks must list inputs or outputs of the plan, got {chunked!r}")
        plan.dtensor_chunks = list(chunked)
        for name, v in plan.pins.items():
            if v not in values:
                raise PlanError(f"plan JSON: pins[{name!r}] must name a value (a key of 'values'), got {v!r}")
        plan.validate()
        return plan

    def check_like(self, fd, mesh: DeviceMesh) -> None:
        """PlanError unless this plan can serve as `like=` for optimizing `fd` on `mesh`: a plan of the same
        fusion (the same output names; every input the plan loads an input of the fusion of the same rank, and
        every other input of the fusion one no output reads; shapes and dtypes may differ) on a mesh of the same
        shape and axis names.

        >>> import egraph_did as ed
        >>> from egraph_did.models import mlp, row_sum
        >>> plan = ed.optimize(row_sum(8, 64), ed.DeviceMesh.arange(2))
        >>> plan.check_like(row_sum(4, 6), ed.DeviceMesh.arange(2))  # same fusion at other shapes: fine
        >>> plan.check_like(row_sum(4, 6), ed.DeviceMesh.arange(4))
        Traceback (most recent call last):
        ...
        egraph_did.errors.PlanError: optimize(like=plan): the like plan was optimized for DeviceMesh(x=2), this call is for DeviceMesh(x=4); its layouts are for its own mesh: pass a plan of a mesh shaped like this one, or optimize without like=
        """
        fusion = as_fusion(fd)
        if not mesh.same_shape(self.mesh):
            raise PlanError(f"optimize(like=plan): the like plan was optimized for {self.mesh}, this call is for "
                            f"{mesh}; its layouts are for its own mesh: pass a plan of a mesh shaped like this one, "
                            f"or optimize without like=")
        # only the inputs some output reads count: the plan loads no other (plan.unread)
        unread = set(fusion.unread_inputs())
        ins, outs = sorted(t.name for t in fusion.inputs if t.name not in unread), sorted(fusion.outputs)
        if ins != sorted(self.inputs) or outs != sorted(self.outputs):
            raise PlanError(f"optimize(like=plan): the like plan is of another fusion: it reads inputs "
                            f"{sorted(self.inputs)} and gives outputs {sorted(self.outputs)}, this fusion reads "
                            f"{ins} and gives {outs}; pass a plan of this fusion (at any shapes)")
        for tv in fusion.inputs:
            if tv.name in unread:
                continue
            theirs = self.views[tv.name].shape if tv.name in self.views else self.values[self.inputs[tv.name][0]].shape
            if len(theirs) != len(tv.shape):
                raise PlanError(f"optimize(like=plan): input {tv.name} has {len(tv.shape)} axes {tv.shape} here but "
                                f"{len(theirs)} {theirs} in the like plan; it is of another fusion: pass a plan of "
                                f"this fusion (at any shapes)")

    def validate(self) -> None:
        """Every value a step reads is loaded or produced before it."""
        ready = {v for vs in self.inputs.values() for v in vs}
        for i, s in enumerate(self.steps):
            late = [v for v in s.reads if v not in ready]
            if late:
                raise PlanError(f"step {i} reads {late} before any step produces it")
            ready.update(s.writes)
        for name, v in self.outputs.items():
            if v not in ready:
                raise PlanError(f"output {name} ({v}) is never produced")


# ---------------------------------------------------------------------------- JSON fields

_NUM = (int, float)
_PLAN_FIELDS = {"mesh": dict, "cost_model": dict, "values": dict, "steps": list, "inputs": dict, "outputs": dict}
_VALUE_FIELDS = {"name": str, "tensor": str, "shape": list, "dtype": str, "layout": str}
_COMPUTE_FIELDS = {"op": str, "args": list, "tensor_params": list, "outputs": list, "flags": list, "rules": list,
                   "time": _NUM}
_COLLECTIVE_FIELDS = {"kind": str, "tensor": str, "src": str, "dst": str, "mesh_axis": int, "mesh_axis_name": str,
                      "bytes": _NUM, "time": _NUM}


def format_version(d) -> int:
    """The format version of a parsed plan file: N of its "format": "egraph-did-plan/N", 1 for a plan
    without the field (hand-written, before plans said so); PlanError for JSON that is no plan.

    >>> format_version({"format": "egraph-did-plan/1"}), format_version({"values": {}, "steps": []})
    (1, 1)
    >>> format_version({"format": "other"})
    Traceback (most recent call last):
    ...
    egraph_did.errors.PlanError: not an egraph-did plan (expected format 'egraph-did-plan/2'); it says format 'other'
    """
    if isinstance(d, dict) and "format" not in d and {"values", "steps"} <= set(d):
        return 1
    fmt = d.get("format") if isinstance(d, dict) else None
    name, _, version = fmt.partition("/") if isinstance(fmt, str) else ("", "", "")
    if name != FORMAT_NAME or not version.isdigit() or int(version) < 1:
        got = f"; it says format {fmt!r}" if isinstance(d, dict) and "format" in d else ""
        raise PlanError(f"not an egraph-did plan (expected format {FORMAT!r}){got}")
    return int(version)


def _check_format(d) -> None:
    """PlanError unless this egraph-did reads the plan's format version (every version up to its own)."""
    version = format_version(d)
    if version > FORMAT_VERSION:
        raise PlanError(f"plan JSON of format version {version}: this egraph-did reads versions up to "
                        f"{FORMAT_VERSION} (expected format {FORMAT!r}; it says format {d['format']!r}); the plan "
                        f"was written by a newer egraph-did: upgrade egraph-did, or re-optimize the fusion with "
                        f"this one (ed.optimize(fd, mesh)) and save that plan")


def _fields(d, where: str, want: dict) -> None:
    """PlanError naming the first field of `want` that `d` lacks or holds with the wrong type."""
    at = f"plan JSON: {where}" if where else "plan JSON"
    if not isinstance(d, dict):
        raise PlanError(f"{at} must be an object, got {type(d).__name__} {d!r:.40}")
    for key, kind in want.items():
        name = "number" if kind is _NUM else kind.__name__
        if key not in d:
            raise PlanError(f"{at} lacks the field {key!r} (a {name}); write the plan with plan.to_json(), or add "
                            f"the field")
        v = d[key]
        if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
            raise PlanError(f"{at}: field {key!r} must be a {name}, got {type(v).__name__} {v!r:.40}")


def _check_collective_mesh(i: int, c: Collective, group_size, mesh: DeviceMesh) -> None:
    """A collective names a mesh axis of this mesh, by index and by name, of the size it was priced for."""
    if not 0 <= c.mesh_axis < mesh.ndim:
        raise PlanError(f"plan JSON: steps[{i}] ({c.kind} of {c.tensor}) runs on mesh axis {c.mesh_axis}, but the "
                        f"mesh {mesh} has {mesh.ndim} axis(es); the mesh was edited: re-optimize for it")
    if c.mesh_axis_name != mesh.axis_names[c.mesh_axis]:
        raise PlanError(f"plan JSON: steps[{i}] ({c.kind} of {c.tensor}) runs on mesh axis {c.mesh_axis_name!r}, "
                        f"but axis {c.mesh_axis} of the mesh {mesh} is {mesh.axis_names[c.mesh_axis]!r}; the mesh "
                        f"was swapped after optimizing: re-optimize for this mesh (ed.optimize(fd, mesh))")
    if group_size is not None and group_size != mesh.shape[c.mesh_axis]:
        raise PlanError(f"plan JSON: steps[{i}] ({c.kind} of {c.tensor}) was planned for {group_size} ranks on mesh "
                        f"axis {c.mesh_axis_name!r}, but the mesh {mesh} has {mesh.shape[c.mesh_axis]} there; the "
                        f"mesh was swapped after optimizing: re-optimize for this mesh (ed.optimize(fd, mesh))")


def _views_of(d, inputs, outputs, values) -> dict[str, PinView]:
    """plan JSON's "views": {input or output: pins.PinView}, each of a name the plan binds or delivers whose
    value has the view's shape; PlanError naming the field otherwise."""
    if not isinstance(d, dict):
        raise PlanError(f"plan JSON: views must be an object {{input or output: view}}, got {type(d).__name__}")
    out = {}
    for name, v in d.items():
        if not isinstance(v, dict):
            raise PlanError(f"plan JSON: views[{name!r}] must be an object, as Plan.to_json writes it")
        view = PinView.from_dict(v)
        held = inputs[name][0] if name in inputs else outputs.get(name)
        if held is None or tuple(values[held].shape) != view.view_shape:
            raise PlanError(f"plan JSON: views[{name!r}] reshapes {name} to {list(view.view_shape)}, but the plan "
                            f"{'holds ' + str(list(values[held].shape)) if held else 'takes or gives no ' + repr(name)}")
        out[name] = view
    return out


def _is_dtensor(x) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, DTensor)


EXTRACTORS = ("greedy", "exact")


def check_optimize_args(fd, mesh, cost_model, extractor, like) -> None:
    """The argument checks of optimize(): a fusion with outputs, a DeviceMesh, a cost model that prices
    that mesh, a known extractor, and a like= plan of the same fusion on a mesh of the same shape.

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> check_optimize_args(row_sum(4, 6), ed.DeviceMesh.arange(2), None, "best", None)
    Traceback (most recent call last):
    ...
    egraph_did.errors.PlanError: optimize: unknown extractor 'best'; use 'greedy' (greedy-DAG, the default) or 'exact' (0/1 program over HiGHS)
    """
    fusion = as_fusion(fd, "optimize")
    if not fusion.outputs:
        raise PlanError("optimize: the fusion has no outputs; call fd.add_output(tensor, name=...)")
    check_mesh(mesh, "optimize")
    if cost_model is not None:
        check_cost_model(cost_model, mesh)
    if not isinstance(extractor, str) or extractor not in EXTRACTORS:
        raise PlanError(f"optimize: unknown extractor {extractor!r}; use 'greedy' (greedy-DAG, the default) or "
                        f"'exact' (0/1 program over HiGHS)")
    if like is not None:
        if not isinstance(like, Plan):
            raise PlanError(f"optimize: like= takes a Plan (of this fusion, at other shapes), got the "
                            f"{type(like).__name__} {like!r:.40}; load a saved one with ed.Plan.from_json(text)")
        like.check_like(fusion, mesh)
