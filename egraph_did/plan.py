"""Plan: plain data describing how every rank computes a fusion. JSON in and out, validated on load.

A plan holds values (a logical tensor in one layout), compute steps (an op run locally on every rank,
with the rule that justifies it) and collectives (kind, tensor, mesh axis, bytes, predicted time, and
why: the step that needed it), in execution order.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .cost import CostModel
from .errors import DtypeError, PlanError
from .fusion import Fusion
from .ir import TensorView
from .layout import Layout, apply_layout
from .mesh import DeviceMesh
from .ops import OPS, canonical_dtype

FORMAT = "egraph-did-plan/1"


@dataclass(frozen=True)
class Value:
    """A logical tensor held in one layout; its name is '<tensor>:<layout code>'.

    >>> v = Value("x:S1", "x", (8, 64), "float32", "S1", ("m", "n"))
    >>> str(v.layout_obj)
    '[S(1)]'
    """

    name: str
    tensor: str
    shape: tuple[int, ...]
    dtype: str
    layout: str  # Layout.code()
    axes: tuple[str, ...] = ()

    @functools.cached_property
    def layout_obj(self) -> Layout:
        """The layout as a Layout (stored as its code)."""
        return Layout.from_code(self.layout)


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
    def reads(self) -> list[str]:
        """The values this step reads."""
        return [v for k, v in self.args if k in self.tensor_params]


@dataclass(frozen=True)
class Collective:
    """One collective over one mesh axis: it turns value src into value dst (the same tensor in another
    layout), moving `bytes` per rank in a predicted `time`; `why` names the step that needed it.

    >>> c = Collective("reduce_scatter", "y", "y:P", "y:S0", 0, "x", bytes=32.0, time=1e-5)
    >>> f"{c.kind}[{c.mesh_axis_name}] {c.src} -> {c.dst}"
    'reduce_scatter[x] y:P -> y:S0'
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


Step = ComputeStep | Collective


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

    # ------------------------------------------------------------ queries
    @property
    def collectives(self) -> list[Collective]:
        """Every communicating collective, in execution order (local slices excluded)."""
        return [s for s in self.steps if isinstance(s, Collective) and s.kind != "slice"]

    @property
    def compute_steps(self) -> list[ComputeStep]:
        """Every compute step, in execution order."""
        return [s for s in self.steps if isinstance(s, ComputeStep)]

    @property
    def predicted_time(self) -> float:
        """Seconds, summed over steps (no overlap assumed)."""
        return sum(s.time for s in self.steps)

    def count(self, kind: str) -> int:
        """How many collectives of `kind` (e.g. 'allreduce') the plan runs."""
        return sum(1 for c in self.collectives if c.kind == kind)

    def layout_of(self, tensor: str) -> Layout:
        """The layout a tensor is pinned to, or else produced (or, for an output, delivered) in."""
        if tensor in self.pins:
            return self.values[self.pins[tensor]].layout_obj
        if tensor in self.outputs:
            return self.values[self.outputs[tensor]].layout_obj
        if tensor in self.inputs:
            return self.values[self.inputs[tensor][0]].layout_obj
        for s in self.compute_steps:
            for v in s.outputs:
                if self.values[v].tensor == tensor:
                    return self.values[v].layout_obj
        for v in self.values.values():
            if v.tensor == tensor:
                return v.layout_obj
        raise PlanError(f"the plan holds no tensor named {tensor!r}")

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
        if got != want:
            raise DtypeError(f"{where}: input {name!r} is {got}, the plan expects {want}; cast it")

    def value_view(self, value: str) -> TensorView:
        """A TensorView with the value's loop domain (for shard_tensor and loop-domain strings)."""
        v = self.values[value]
        tv = TensorView(v.tensor, v.shape, canonical_dtype(v.dtype), v.axes or None, Fusion())
        return apply_layout(tv, v.layout_obj, self.mesh)

    def loop_domain(self, tensor: str) -> str:
        """The loop domain of a tensor as the plan lays it out, e.g. '[s, DIDx{4}, h/4]'."""
        layout = self.layout_of(tensor)
        for v in self.values.values():
            if v.tensor == tensor and v.layout == layout.code():
                return self.value_view(v.name).loop_str()
        raise PlanError(f"no value of {tensor!r}")  # pragma: no cover

    # ------------------------------------------------------------ run
    def run(self, values, /, inputs: str = "global", outputs: str = "global", **options):
        """Execute this plan on this rank, inside an initialized default process group (see ed.launch).

        values: {input name: tensor}; inputs="global" (whole tensors, sharded here), "local" (this rank's
        shards) or DTensors; outputs="global", "local" or "dtensor".

        Example::

            def work(rank, plan, X):  # module level: launch pickles it
                return plan.run({"x": X}, outputs="local")["y"]

            shards = ed.launch(work, nprocs=4, args=(plan, X))  # rank r's piece of y, for each r
        """
        from .runtime import run_plan
        return run_plan(self, values, inputs_kind=inputs, outputs_kind=outputs, **options)

    # ------------------------------------------------------------ simplify
    def simplified(self) -> "Plan":
        """A copy with back-to-back collectives that cancel removed (rewrites/resharding.CANCELLATIONS):
        allgather then slice, slice then allgather, alltoall there and back: readers of the second's
        result read the first's input; reduce_scatter then allgather becomes one allreduce. The extractor
        never picks such pairs (the direct class is cheaper); hand-written or edited plans may hold them.

        >>> import egraph_did as ed
        >>> from egraph_did.models import mlp
        >>> plan = ed.optimize(mlp(8, 16), ed.DeviceMesh.arange(2))
        >>> len(plan.simplified().steps) == len(plan.steps)
        True
        """
        from egraph_did.rewrites.resharding import CANCELLATIONS
        pairs = {(a, b) for a, b, _ in CANCELLATIONS}
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
            if (first is not None and id(first) not in dropped and (first.kind, s.kind) in pairs
                    and first.mesh_axis == s.mesh_axis and readers.get(first.dst) == 1
                    and first.dst not in self.outputs.values()):
                if self.values[s.dst].layout == self.values[first.src].layout:
                    rename[s.dst] = first.src  # the pair is the identity
                    dropped.update((id(first), id(s)))
                    continue
                if (first.kind, s.kind) == ("reduce_scatter", "allgather"):
                    dropped.add(id(first))
                    out.append(dataclasses.replace(s, kind="allreduce", src=first.src, bytes=first.bytes,
                                                   time=self.cost_model.collective_time(
                                                       "allreduce", first.bytes, self.mesh.shape[s.mesh_axis],
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
                    {k: fix(v) for k, v in self.pins.items()})
        plan.validate()
        return plan

    # ------------------------------------------------------------ explain
    def explain(self) -> str:
        """A readable account: every step with its rule, every collective with bytes, time and why."""
        lines = [f"plan for {self.mesh} under cost model {self.cost_model.name} ({self.method}): "
                 f"predicted {self.predicted_time * 1e6:.1f} us, {len(self.collectives)} collective(s), "
                 f"{self.memory / 2**20:.1f} MiB per device"]
        lines.append("")
        lines.append("tensor layouts (loop domain):")
        seen = set()
        for v in self.values.values():
            if v.tensor in seen:
                continue
            seen.add(v.tensor)
            pinned = " (pinned)" if v.tensor in self.pins else ""
            lines.append(f"  {v.tensor:<14} {self.loop_domain(v.tensor)}{pinned}")
        lines.append("")
        lines.append(f"{'#':>3}  {'step':<46}{'layout':<18}{'bytes':>12}{'time us':>10}  why / rule")
        for i, s in enumerate(self.steps):
            if isinstance(s, Collective):
                what = f"{s.kind}[{s.mesh_axis_name}] {s.tensor}"
                lines.append(f"{i:>3}  {what:<46}{self._arrow(s):<18}{s.bytes:>12.0f}{s.time * 1e6:>10.2f}  {s.why}")
            else:
                outs = ", ".join(self.values[o].tensor for o in s.outputs)
                ins = ", ".join(self.values[v].tensor if k in s.tensor_params else f"{k}={v}"
                                for k, v in s.args if k in s.tensor_params or v is not None)
                what = f"{outs} = {s.op}({ins})"
                lay = ",".join(self.values[o].layout for o in s.outputs)
                flags = "".join(f" +{f}" for f, _ in s.flags)
                lines.append(f"{i:>3}  {what[:45]:<46}{lay:<18}{'':>12}{s.time * 1e6:>10.2f}  "
                             f"{'/'.join(s.rules)}{flags}")
        return "\n".join(lines)

    def _arrow(self, c: Collective) -> str:
        return f"{self.values[c.src].layout}->{self.values[c.dst].layout}"

    # ------------------------------------------------------------ JSON
    def to_json(self) -> str:
        """Plain JSON (no pickle)."""
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
            else:
                d = {"step": "collective", **asdict(s)}
            steps.append(d)
        return json.dumps({
            "format": FORMAT, "mesh": self.mesh.to_dict(), "cost_model": self.cost_model.to_dict(),
            "values": {k: {**asdict(v), "shape": list(v.shape), "axes": list(v.axes)} for k, v in self.values.items()},
            "steps": steps, "inputs": self.inputs, "outputs": self.outputs, "memory": self.memory,
            "method": self.method, "stats": self.stats, "pins": self.pins}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Load and validate a plan written by to_json()."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan JSON does not parse: {e}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise PlanError(f"not an egraph-did plan (expected format {FORMAT!r})")
        for key in ("mesh", "cost_model", "values", "steps", "inputs", "outputs"):
            if key not in d:
                raise PlanError(f"plan JSON lacks {key!r}")

        def dec(v):
            if isinstance(v, dict) and set(v) == {"dtype"}:
                return canonical_dtype(v["dtype"])
            if isinstance(v, list):
                return tuple(dec(x) for x in v)
            return v
        mesh = DeviceMesh.from_dict(d["mesh"])
        values = {}
        for k, v in d["values"].items():
            values[k] = Value(v["name"], v["tensor"], tuple(v["shape"]), v["dtype"], v["layout"], tuple(v["axes"]))
            try:
                lay = Layout.from_code(v["layout"])
            except (ValueError, KeyError):
                raise PlanError(f"value {k}: bad layout {v['layout']!r}") from None
            if len(lay) != mesh.ndim:
                raise PlanError(f"value {k}: layout {v['layout']} does not match the {mesh.ndim}-D mesh")
        steps: list[Step] = []
        for i, s in enumerate(d["steps"]):
            if s.get("step") == "compute":
                if s["op"] not in OPS:
                    raise PlanError(f"step {i}: unknown op {s['op']!r}")
                step = ComputeStep(s["op"], tuple((k, dec(v)) for k, v in s["args"]), tuple(s["tensor_params"]),
                                   tuple(s["outputs"]), tuple((f, tuple(m)) for f, m in s["flags"]),
                                   tuple(s["rules"]), s["time"], s.get("key", ""))
                refs = [v for k, v in step.args if k in step.tensor_params] + list(step.outputs)
            elif s.get("step") == "collective":
                fields = {k: v for k, v in s.items() if k != "step"}
                step = Collective(**fields)
                refs = [step.src, step.dst]
            else:
                raise PlanError(f"step {i}: unknown step type {s.get('step')!r}")
            missing = [r for r in refs if r not in values]
            if missing:
                raise PlanError(f"step {i} refers to unknown value(s) {missing}")
            steps.append(step)
        plan = cls(mesh, CostModel.from_dict(d["cost_model"]), values, steps,
                   {k: list(v) for k, v in d["inputs"].items()}, dict(d["outputs"]), d.get("memory", 0.0),
                   d.get("method", ""), d.get("stats", {}), dict(d.get("pins", {})))
        for name, v in plan.pins.items():
            if v not in values:
                raise PlanError(f"plan JSON: pins[{name!r}] must name a value (a key of 'values'), got {v!r}")
        plan.validate()
        return plan

    def validate(self) -> None:
        """Every value a step reads is loaded or produced before it."""
        ready = {v for vs in self.inputs.values() for v in vs}
        for i, s in enumerate(self.steps):
            reads = [v for k, v in s.args if k in s.tensor_params] if isinstance(s, ComputeStep) else [s.src]
            late = [v for v in reads if v not in ready]
            if late:
                raise PlanError(f"step {i} reads {late} before any step produces it")
            ready.update(s.outputs if isinstance(s, ComputeStep) else [s.dst])
        for name, v in self.outputs.items():
            if v not in ready:
                raise PlanError(f"output {name} ({v}) is never produced")
