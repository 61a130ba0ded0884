"""ed.parallelize: a torch module whose forward and backward run egraph-did plans under torch.distributed.

`parallelize(module, mesh, example_inputs)` exports the module (ed.from_torch) at the example inputs and
optimizes ONE plan for a training step's forward and backward: the joint fusion (`joint_fusion`) holds the
module's outputs and the vector-Jacobian product, built with ed.grad from loss = sum over the outputs of
sum(output * cotangent), the cotangents being extra inputs; it gives `grad_<name>` for the parameters and
inputs that need a gradient. It is optimized once, under the cost model and its memory bound, so the
optimizer sees what the step pays: which activations to keep for the backward, which collectives the
gradients need. Outputs are pinned replicated (they come back whole); parameters are free, and the
layout the plan first loads each one in is where it lives from then on: each parameter and its
gradient are then pinned there (re-optimized if the free plan put a gradient elsewhere), so one sharded
copy of every parameter serves the step and its gradient lands in the same placements.

At run time the joint plan is split (egraph_did/plan_split.py): torch's forward runs the steps that read
no cotangent (the outputs, and what the backward reads of them: the "saved" values, kept in the plan's
own layouts, each rank's local shards, between the calls), backward runs the rest. No step runs twice,
and the two calls move exactly the joint plan's collectives. Without autograd (torch.no_grad(),
inference_mode, or nothing requiring a gradient) a forward-only plan runs instead, its parameters pinned
where the joint plan keeps them, and nothing is saved.

The module is converted in place, as torch's parallelize_module and fully_shard do: its parameters
become DTensors (torch.distributed.tensor) on a torch DeviceMesh of the same ranks, with the plan's
placements (Shard/Replicate), its class becomes a subclass of its own and of ParallelModule, whose
forward runs the plans through a torch.autograd.Function. So torch.optim updates the shards in place,
gradients arrive in `.grad` as DTensors of the same placements, and state_dict() holds the DTensors
torch.distributed.checkpoint saves.

The plans are optimized on rank 0 and broadcast, so that every rank runs the same steps; every rank
exports the module itself (deterministic), and rank 0's parameter values are the ones distributed.

Dropout: a module parallelized in training mode drops out through fd.ops.dropout, whose mask is a hash of
a seed and each element's global index (so every plan and rank draws the mask one device draws). The seed
of call n is a function of n and one base seed drawn from rank 0's torch generator at parallelize time
(torch.manual_seed makes it reproducible), so ranks agree with no communication, every call draws new
masks, and the backward reuses its forward's; `module.dropout_seed(n)` gives it. A call in eval mode runs
the program without its dropouts (optimized on first use); a module parallelized in eval mode whose
dropouts were off refuses a call in training mode rather than silently not dropping out.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from .cost import CostModel
from .errors import DtypeError, EgraphDidError, MemoryBoundError, ShapeError
from .expand import ALL_REWRITES
from .rewrites.algebra import joining_rewrites
from .fusion import Fusion, replay
from .ir import TensorView
from .frontend import TorchFusion, draw_seed, from_torch
from .grad import GRAD_PREFIX, grad
from .layout import Layout
from .mesh import DeviceMesh
from .ops import FLOAT_DTYPES
from .optimize import optimize
from .pins import apply_layout, layout_of as pinned_layout
from .plan import Plan
from .plan_split import HANDOVER_PREFIX, SplitError, SplitPlan, split_plan
from .runtime import torch_device_mesh

COTANGENT = "cotangent."  # the backward fusion's input holding d(loss)/d(output <name>)
LOSS = "parallelize.loss"  # sum over outputs of sum(output * cotangent): differentiated, never computed


class ParallelizeError(EgraphDidError, RuntimeError):
    """parallelize cannot set up here: no default process group, a world size other than the mesh's, or
    a module it cannot convert; the message says what to do.

    >>> import torch, egraph_did as ed
    >>> try:
    ...     ed.parallelize(torch.nn.Linear(4, 2), ed.DeviceMesh.arange(2), (torch.ones(3, 4),))
    ... except ed.ParallelizeError as e:
    ...     print(str(e).split(";")[0])
    parallelize: torch.distributed's default process group is not initialized
    """


def parallelize(module: torch.nn.Module, mesh: DeviceMesh, example_inputs: tuple, cost_model=None,
                memory_limit: float | None = None, *, kwargs: dict | None = None,
                extractor: str = "greedy", recompute: bool = False) -> "ParallelModule":
    """Shard `module` over `mesh`: returns the module itself, converted in place, whose forward and
    backward (under autograd) run egraph-did plans on this process's rank. Every rank of the mesh calls
    it, with torch.distributed's default process group initialized over exactly the mesh's ranks (under
    ed.launch, or torchrun with init_process_group).

    example_inputs: the positional arguments of a call (a tuple; `kwargs` keyword ones), as from_torch
    takes them: the plans are specialized to their shapes and dtypes, and every later call must match.
    cost_model: ed.CostModel (default CostModel.h200()). memory_limit: bytes per device the training
    step's joint plan may hold (replaces the cost model's bound): parameters, gradients, the activations
    kept for the backward and every other value of the forward and backward, as the optimizer's memory
    model sums them (no reuse); it decides where the parameters live, and a tight one makes the plan
    shard them. Under torch.no_grad() at parallelize time (or with no parameter or input requiring grad,
    or no floating-point output) the forward-only plan decides instead, under the same bound.
    extractor: as ed.optimize. recompute: the joint plan's backward reads the forward through ed.grad's
    saved markers, so memory_limit bounds what lives across the step (parameters, gradients and the
    activations kept for the backward, which the backward part may recompute instead) rather than every
    value. Off by default here, unlike ed.grad's: memory_limit is the sum over every value, and bounds
    chosen to make a plan shard its parameters hold the replicated plan under the markers' model (an MLP
    16-64-16 on 4 ranks counts 22,336 B replicated with markers, 54,404 B without: 30,000 B shards it
    only without).

    Calls take the inputs whole (the same tensors on every rank) and return the outputs whole, in the
    structure the module returns. Parameters are DTensors with the plan's placements; buffers are read
    once, at export (re-parallelize after changing one). `module.joint_plan()` is the joint plan with its
    two parts and what the forward saves for the backward (its explain() names them),
    `module.forward_plan` and `module.backward_plan()` the parts, `module.inference_plan()` the
    forward-only plan a call without autograd runs.

    Example (one process per rank; torchrun, or ed.launch of a module-level function)::

        def work(rank):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
            x = torch.randn(8, 16)
            model = ed.parallelize(model, ed.DeviceMesh.arange(4), (x,), memory_limit=30_000)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            loss = model(x).square().mean()         # the joint plan's forward part
            loss.backward()                          # its backward part: .grad DTensors
            opt.step()                               # on each rank's shards
            return model[0].weight.placements        # (Shard(dim=0),): Megatron's column split

        ed.launch(work, nprocs=4)

    Without a process group it says so:

    >>> import torch, egraph_did as ed
    >>> ed.parallelize(torch.nn.Linear(4, 2), ed.DeviceMesh.arange(2), (torch.ones(3, 4),))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    egraph_did.parallelize.ParallelizeError: parallelize: torch.distributed's default process group is not initialized; ...
    """
    _check_world(module, mesh, example_inputs)
    cm = _cost_model(cost_model, memory_limit)
    state = _State.build(module, mesh, example_inputs, kwargs or {}, cm, extractor, recompute)
    _distribute_parameters(module, state)
    cls = type(module)
    if not isinstance(module, ParallelModule):
        module.__class__ = _parallel_class(cls)
    module._egraph_did = state
    return module


# ---------------------------------------------------------------------- checks


def _check_world(module, mesh, example_inputs) -> None:
    if not isinstance(module, torch.nn.Module):
        raise ParallelizeError(f"parallelize: module must be a torch.nn.Module, got a {type(module).__name__}; "
                               f"for a plain function use ed.from_torch and ed.optimize")
    if isinstance(module, ParallelModule):
        raise ParallelizeError("parallelize: this module is parallelized already (its parameters are DTensors); "
                               "parallelize the unsharded module (for other shapes, a fresh copy of it)")
    if not isinstance(mesh, DeviceMesh):
        raise ParallelizeError(f"parallelize: mesh must be an ed.DeviceMesh (e.g. ed.DeviceMesh.arange(4)), got "
                               f"a {type(mesh).__name__}")
    if not isinstance(example_inputs, tuple):
        raise ParallelizeError(f"parallelize: example_inputs must be a tuple of positional arguments, got the "
                               f"{type(example_inputs).__name__}; write (x,) for one argument")
    if not (dist.is_available() and dist.is_initialized()):
        raise ParallelizeError("parallelize: torch.distributed's default process group is not initialized; run "
                               "one process per mesh rank under ed.launch(fn, nprocs=...) or torchrun, and call "
                               "torch.distributed.init_process_group() before parallelize (ed.launch does)")
    world = dist.get_world_size()
    if sorted(mesh.ranks) != list(range(world)):
        raise ParallelizeError(f"parallelize: the mesh {mesh} holds {mesh.size} rank(s) {sorted(mesh.ranks)}, but "
                               f"the process group has world size {world}; run one process per mesh rank "
                               f"(ed.launch(..., nprocs={mesh.size}) or torchrun --nproc-per-node={mesh.size}), or "
                               f"pass a mesh of {world} ranks (ed.DeviceMesh.arange({world}))")


def _cost_model(cost_model, memory_limit):
    if cost_model is None:
        return CostModel.h200(memory_limit)
    if memory_limit is None:
        return cost_model
    if not isinstance(cost_model, CostModel):
        raise ParallelizeError(f"parallelize: memory_limit replaces an ed.CostModel's bound, but cost_model is a "
                               f"{type(cost_model).__name__}; give that model its own bound and pass "
                               f"memory_limit=None")
    return dataclasses.replace(cost_model, memory_limit=memory_limit)


# ---------------------------------------------------------------------- what rank 0 decides for every rank


def _from_rank0(what: str, make: Callable[[], Any]) -> Any:
    """make()'s value on rank 0, on every rank (broadcast, pickled); a failure on rank 0 is raised on every
    rank (the others would otherwise wait in the broadcast), with the same type where it can be."""
    box: list[Any] = [None]
    error = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("value", make())
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
            box[0] = ("error", type(e), str(e))
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "value":
        return box[0][1]
    if error is not None:
        raise error
    kind, msg = box[0][1], box[0][2]
    try:
        err = kind(f"{msg} (on rank 0, {what})")
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        err = ParallelizeError(f"parallelize: rank 0 failed {what}: {kind.__name__}: {msg}")
    raise err


@dataclass
class _Program:
    """What every rank runs, as rank 0 exported and optimized it (plain data: it is broadcast)."""

    params: tuple[str, ...]  # parameters the forward reads, by module path
    user_inputs: tuple[str, ...]
    leaves: list  # per flattened (args, kwargs) leaf: the user input it binds, or None
    constants: dict[str, torch.Tensor]  # folded at export: passed whole on every call
    outputs: tuple[str, ...]
    differentiable: tuple[str, ...]  # outputs with a floating-point dtype: those that take a cotangent
    out_skeleton: Any  # the module's output structure, leaves numbered (None: a dict by output name)
    layouts: dict[str, Layout]  # parameter -> the layout it lives in
    wrt: tuple[str, ...]  # the example call's gradients (parameters and inputs that require grad)
    split: SplitPlan | None  # the joint plan of wrt and its parts; None where the example has no backward
    inference: Plan | None  # the forward-only plan, where it decided the layouts (else made on first use)
    seed_inputs: tuple[str, ...] = ()  # the dropout seed input, where the program drops out
    base_seed: int = 0  # drawn on rank 0 at export: call n's seed is seed_of(base_seed, n) on every rank
    training: bool = False  # the module's mode at export
    dropouts: int = 0  # dropouts of p > 0 the export met (in either mode): the program depends on the mode

    def key(self, wrt: Sequence[str]) -> tuple[str, ...]:
        """The gradients wrt asks for, in the program's order: one joint plan per key."""
        want = set(wrt)
        return tuple(n for n in (*self.params, *self.user_inputs) if n in want)


def _fixed_layouts(fd, plan: Plan, mesh: DeviceMesh) -> dict[str, Layout]:
    """parameter -> the layout the plan first loads it in (replicated: a parameter it never loads)."""
    replicated = Layout.replicated(mesh.ndim)
    return {p: plan.values[plan.inputs[p][0]].layout if p in plan.inputs else replicated for p in fd.params}


def _forward_only(fd, mesh, cm, extractor, layouts: dict[str, Layout] | None) -> Plan:
    """The forward's plan; with `layouts`, each parameter pinned there. Free parameters loaded in several
    layouts are pinned where the plan first loads each, and the plan re-optimized: a parameter lives in
    one layout, and reading it in another is a collective the plan prices, not a gather outside it."""
    for p, layout in (layouts or {}).items():
        apply_layout(fd[p], layout, mesh)
    plan = optimize(fd, mesh, cm, extractor)
    if layouts is None and any(len(plan.inputs.get(p, ())) > 1 for p in fd.params):
        return _forward_only(fd, mesh, cm, extractor, _fixed_layouts(fd, plan, mesh))
    return plan


def optimize_joint(fd: TorchFusion, outputs: Sequence[str], wrt: Sequence[str], mesh: DeviceMesh,
                   cost_model=None, extractor: str = "greedy", layouts: dict[str, Layout] | None = None,
                   recompute: bool = False) -> SplitPlan:
    """The training step's joint plan of an exported module (joint_fusion of `outputs` and the gradients of
    `wrt`, optimized once under cost_model and its memory bound), split at the cotangents into the
    forward and the backward (egraph_did/plan_split.py). With `layouts`, every parameter and its gradient
    is pinned there; without, the parameters are free, then each is pinned where the plan first loads it
    (the plan re-optimized) unless the plan already keeps each one and its gradient in one layout.
    Pins of fd's inputs and outputs carry over (each cotangent pinned as its output). recompute: as
    joint_fusion's.

    >>> import torch, egraph_did as ed
    >>> fd = ed.from_torch(torch.nn.Linear(8, 4), (torch.ones(16, 8),))
    >>> _ = fd["out"].set_device_mesh(ed.DeviceMesh.arange(2))  # delivered whole
    >>> step = optimize_joint(fd, ["out"], ["weight", "bias"], ed.DeviceMesh.arange(2))
    >>> sorted(step.first.outputs)[:1], sorted(step.second.outputs)
    (['out'], ['grad_bias', 'grad_weight'])
    """
    cm = cost_model or CostModel.h200()
    late = [COTANGENT + n for n in outputs]
    if layouts is not None:
        return _splittable(joint_fusion(fd, outputs, wrt, layouts, mesh, recompute=recompute),
                           list(fd.fusion.outputs), late, mesh, cm, extractor)
    # the free step hands the parameters' gradients back whole; where no such step fits the bound, it leaves
    # them free too (whole, each costs a whole copy and its all-reduce, so a bound that sharded parameters
    # and gradients fit refused the step: an MLP 16-64-16 on 4 ranks needs 16.1 KiB pinned, 22.9 KiB free)
    error = None
    for free in ([], [p for p in wrt if p in fd.params]):
        try:
            split = _splittable(joint_fusion(fd, outputs, wrt, {}, mesh, free, recompute),
                                list(fd.fusion.outputs), late, mesh, cm, extractor)
            chosen = _fixed_layouts(fd, split.joint, mesh)
            if all(len(split.joint.inputs.get(p, ())) <= 1 for p in fd.params) and all(
                    split.joint.layout_of(GRAD_PREFIX + p) == chosen[p] for p in wrt if p in chosen):
                return split
            return optimize_joint(fd, outputs, wrt, mesh, cm, extractor, chosen, recompute)
        except MemoryBoundError as e:
            error = error or e
    raise error


def _splittable(fusion, outputs, late, mesh, cm, extractor) -> SplitPlan:
    """The joint plan split at `late`; where the plan joined a forward step with a backward one through a
    program rewrite, re-optimized without the rewrites that can (rewrites.algebra.joining_rewrites: a plan
    that took one cannot deliver the outputs before the cotangents arrive), then without any."""
    error = None
    for rewrites in (None, tuple(r for r in ALL_REWRITES if r not in joining_rewrites()), ()):
        try:
            return split_plan(optimize(fusion, mesh, cm, extractor, rewrites=rewrites), outputs, late)
        except SplitError as e:
            error = e
    raise error


def _export_and_optimize(module, mesh, args, kwargs, cm, extractor, wrt_of, recompute
                         ) -> tuple[TorchFusion, _Program]:
    fd = from_torch(module, args, kwargs)
    outputs = fd.fusion.outputs
    for name in outputs:
        fd[name].set_device_mesh(mesh)  # the outputs come back whole: their gathers are priced
    diff = tuple(n for n, t in outputs.items() if t.dtype in FLOAT_DTYPES)
    prog = _Program(fd.params, fd.user_inputs, list(fd.leaves), fd.constants, tuple(outputs), diff,
                    fd.output_skeleton, {}, (), None, None, fd.seed_inputs, int(draw_seed()), fd.training,
                    fd.dropouts)
    prog.wrt = prog.key(wrt_of(prog))
    if diff and prog.wrt and torch.is_grad_enabled():  # the example's call has a backward: the step decides
        prog.split = optimize_joint(fd, diff, prog.wrt, mesh, cm, extractor, recompute=recompute)
        prog.layouts = _fixed_layouts(fd, prog.split.joint, mesh)
    else:
        prog.inference = _forward_only(fd, mesh, cm, extractor, None)
        prog.layouts = _fixed_layouts(fd, prog.inference, mesh)
    return fd, prog


@dataclass
class _State:
    """A parallelized module's program and plans, with the fusion (rank 0 only: it optimizes) and the
    example call's form."""

    program: _Program
    fd: TorchFusion | None  # on rank 0
    mesh: DeviceMesh
    cost_model: Any
    extractor: str
    example: list  # per flattened (args, kwargs) leaf: (shape, dtype) of a tensor, or the value itself
    in_spec: Any
    splits: dict[tuple[str, ...], SplitPlan] = field(default_factory=dict)
    calls: int = 0  # forward calls so far: the next call's dropout seed is seed_of(base_seed, calls)
    other_mode: "_State | None" = None  # the plans of the program without its dropouts (calls in eval mode)
    recompute: bool = False  # the joint plans' backward reads saved markers (parallelize's recompute)

    def for_mode(self, training: bool) -> "_State":
        """The state whose plans a call in this mode runs: this one, or (a module parallelized in training
        mode, called in eval mode) the program without its dropouts; ParallelizeError where the export in
        eval mode switched dropouts off and the call is in training mode."""
        prog = self.program
        if training == prog.training or not prog.dropouts:
            return self
        if training:
            raise ParallelizeError(
                f"parallelize: the module was parallelized in eval mode, where its {prog.dropouts} dropout(s) "
                f"are off, and is now called in training mode: its plans would not drop out. Call "
                f"module.train() before ed.parallelize to train with dropout (a call in eval mode then runs the "
                f"program without dropout), or call it in eval mode")
        if self.other_mode is None:
            eval_prog = dataclasses.replace(prog, seed_inputs=(), training=False, split=None, inference=None)
            self.other_mode = dataclasses.replace(self, program=eval_prog, splits={}, other_mode=None,
                                                  fd=None if self.fd is None else self.fd.without_dropout())
        return self.other_mode

    def next_seeds(self) -> dict[str, torch.Tensor]:
        """The dropout seed of this call (one per seed input), the same on every rank; counts the call."""
        seed = seed_of(self.program.base_seed, self.calls)
        self.calls += 1
        return {name: seed for name in self.program.seed_inputs}

    @classmethod
    def build(cls, module, mesh, args, kwargs, cm, extractor, recompute=False) -> "_State":
        leaves, in_spec = pytree.tree_flatten((args, kwargs))
        example = [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for v in leaves]
        made: list = []

        def wrt_of(prog: _Program) -> list[str]:
            names = [p for p, t in module.named_parameters(remove_duplicate=False)
                     if p in prog.params and t.requires_grad]
            return names + [n for n, v in zip(prog.leaves, leaves) if n is not None and v.requires_grad]

        def make():
            made[:] = _export_and_optimize(module, mesh, args, kwargs, cm, extractor, wrt_of, recompute)
            return made[1]
        program = _from_rank0("exporting the module and optimizing its plan", make)
        state = cls(program, made[0] if made else None, mesh, cm, extractor, example, in_spec,
                    recompute=recompute)
        if program.split is not None:
            state.splits[program.wrt] = program.split
        return state

    def split(self, wrt: Sequence[str]) -> SplitPlan:
        """The joint plan giving grad_<name> for each name in wrt (parameters and user inputs), split at
        the cotangents; optimized once per set of names (on rank 0, for every rank), every parameter and
        its gradient pinned where the parameter lives."""
        prog = self.program
        key = prog.key(wrt)
        if not key or not prog.differentiable:
            raise ParallelizeError(f"parallelize: no joint plan for gradients of {list(wrt)}: "
                                   + ("the module has no floating-point output" if not prog.differentiable else
                                      f"name parameters or inputs of the module ({list(prog.params)[:4]}, ...)"))
        if key not in self.splits:
            self.splits[key] = _from_rank0("optimizing the joint plan", lambda: optimize_joint(
                self.fd, prog.differentiable, key, self.mesh, self.cost_model, self.extractor, prog.layouts,
                self.recompute))
        return self.splits[key]

    def inference_plan(self) -> Plan:
        """The forward-only plan (parameters pinned where they live), optimized on first use. Where no plan
        within the bound is found, the joint plan's forward part serves (its saved values unused)."""
        prog = self.program
        if prog.inference is None:
            def make():
                try:
                    return _forward_only(self.fd, self.mesh, self.cost_model, self.extractor, prog.layouts)
                except MemoryBoundError:  # the greedy extraction missed; the forward part fits the bound
                    if prog.split is None:  # (the program without dropouts has no joint plan of its own yet)
                        raise
                    return prog.split.first  # (inference is None only where the joint plan decided)
            prog.inference = _from_rank0("optimizing the forward-only plan", make)
        return prog.inference

    # ------------------------------------------------------------ a call's inputs
    def user_inputs(self, args, kwargs) -> dict[str, torch.Tensor]:
        """The call's tensors by input name, after checking them against the example's shapes and dtypes."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise ShapeError(f"parallelized module: called with arguments of another structure than the example "
                             f"inputs ({_describe(spec)} against {_describe(self.in_spec)}); the plans are "
                             f"for the example's; pass the arguments as parallelize's example_inputs were")
        out = {}
        for i, (name, got, want) in enumerate(zip(self.program.leaves, leaves, self.example)):
            what = f"input {name!r}" if name is not None else f"argument leaf {i}"
            if not isinstance(want, tuple) or not isinstance(got, torch.Tensor):
                if isinstance(got, torch.Tensor) or isinstance(want, tuple) or not _same(got, want):
                    raise ShapeError(f"parallelized module: {what} is {got!r:.60}, the example had {want!r:.60}; "
                                     f"the plans were exported with that value: parallelize the unsharded "
                                     f"module again with this value in example_inputs")
                continue
            shape, dtype = want
            if tuple(got.shape) != shape:
                raise ShapeError(f"parallelized module: {what} has shape {tuple(got.shape)}, but the plans are for "
                                 f"the example inputs' shape {shape} (a plan is specialized to its shapes); pad or "
                                 f"split the input to {shape}, or parallelize the unsharded module again with "
                                 f"example inputs of this shape (one parallelized module per shape)")
            if got.dtype != dtype:
                raise DtypeError(f"parallelized module: {what} is {_dt(got.dtype)}, the plans are for the example's "
                                 f"{_dt(dtype)}; cast it (x.to(torch.{_dt(dtype)}))")
            if name is not None:
                out[name] = got
        return out


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a truth value of ==
        return a is b


def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _describe(spec) -> str:
    return str(spec).replace("\n", " ")[:120]


# ---------------------------------------------------------------------- the joint fusion


def joint_fusion(fd, outputs: Sequence[str], wrt: Sequence[str], layouts: dict[str, Layout],
                 mesh: DeviceMesh, free_grads: Sequence[str] = (), recompute: bool = False) -> Fusion:
    """The forward and its vector-Jacobian product in one fusion: inputs fd's and `cotangent.<out>` for each
    output in `outputs`; outputs fd's outputs and `grad_<name>` for each name in wrt, the gradient of sum
    over those outputs of sum(out * cotangent). Each input in `layouts` (the parameters) is pinned to its
    layout, and so is its gradient; the gradients named in `free_grads` are left free (a parameter whose
    layout the plan decides), those of the other inputs pinned replicated (handed back whole). The pins of fd's inputs and outputs carry over, and each cotangent is pinned as its output
    (it arrives laid out as the output leaves). split_plan cuts its plan at the cotangents into the
    forward and the backward. recompute: the backward reads the forward through ed.grad's saved markers
    (parallelize's recompute, off by default).

    >>> import torch, egraph_did as ed
    >>> fd = ed.from_torch(torch.nn.Linear(4, 2, bias=False), (torch.ones(3, 4),))
    >>> mesh = ed.DeviceMesh.arange(2)
    >>> g = joint_fusion(fd, ["out"], ["weight"], {"weight": ed.Layout.from_code("S0")}, mesh)
    >>> [t.name for t in g.inputs], list(g.outputs)
    (['weight', 'input', 'cotangent.out'], ['out', 'grad_weight'])
    >>> g["grad_weight"].loop_str()
    '[DIDx{2}, 2/2, 4]'
    """
    src = fd.fusion if hasattr(fd, "fusion") else fd
    work, ops, new = replay(src, lambda ops, e, args: ops._fusion.emit(e.op.name, **args))
    for name, out in src.outputs.items():
        work.add_output(new[id(out)], name)
    loss = None
    for name in outputs:
        out = new[id(src.outputs[name])]
        cot = work.define_tensor(out.shape, out.dtype, COTANGENT + name, [d.name for d in out.logical_domain])
        term = ops.sum(ops.mul(out, cot))
        loss = term if loss is None else ops.add(loss, term)
    work.add_output(loss, LOSS)
    g = _drop_output(grad(work, LOSS, list(wrt), recompute=recompute).fusion, LOSS)
    pinned = [(t.name, t) for t in src.inputs] + list(src.outputs.items())
    pinned += [(COTANGENT + n, src.outputs[n]) for n in outputs]
    for name, tv in pinned:
        if tv.mesh is not None and name in g.tensors:
            apply_layout(g[name], pinned_layout(tv, tv.mesh), tv.mesh)
    for name, layout in layouts.items():
        if name in g.tensors:
            apply_layout(g[name], layout, mesh)
    for name in wrt:
        gt = g[GRAD_PREFIX + name]
        if name in layouts:
            apply_layout(gt, layouts[name], mesh)
        elif name not in free_grads:
            gt.set_device_mesh(mesh)
    return g


def _drop_output(src: Fusion, drop: str) -> Fusion:
    """src without the output `drop` and the ops only it needs (the loss: its value is never used; grad
    seeds d loss / d loss with a constant, so only the outputs' and the gradients' ops are kept)."""
    keep = {n: t for n, t in src.outputs.items() if n != drop}
    live = {id(t) for t in keep.values()}
    for e in reversed(src.exprs):
        if any(id(o) in live for o in e.outputs):
            live |= {id(t) for t in e.inputs}

    dst = Fusion()
    new = {id(t): dst.define_tensor(t.shape, t.dtype, t.name, [d.name for d in t.logical_domain])
           for t in src.inputs}
    for e in src.exprs:
        if not any(id(o) in live for o in e.outputs):
            continue
        outs = dst.emit(e.op.name, **{k: new[id(v)] if isinstance(v, TensorView) else v for k, v in e.args})
        new |= {id(o): t for o, t in zip(e.outputs, outs if isinstance(outs, tuple) else (outs,))}
    for name, tv in keep.items():
        dst.add_output(new[id(tv)], name)
    return dst


# ---------------------------------------------------------------------- parameters as DTensors


def _distribute_parameters(module: torch.nn.Module, state: _State) -> None:
    """Replace every parameter by a DTensor parameter with its plan layout (rank 0's values; a parameter
    no plan reads is replicated); a parameter tied under several names stays one parameter."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    tmesh = torch_device_mesh(state.mesh, "cuda" if device is not None else "cpu")
    done: dict[int, torch.nn.Parameter] = {}
    params = list(module.named_parameters(remove_duplicate=False))
    layout_of = {id(p): state.program.layouts[name] for name, p in params if name in state.program.layouts}
    for name, p in params:
        if id(p) not in done:
            layout = layout_of.get(id(p))
            placements = ([Shard(q.axis) if q.is_shard else Replicate() for q in layout] if layout is not None
                          else [Replicate()] * state.mesh.ndim)
            data = p.detach() if device is None else p.detach().to(device)
            done[id(p)] = torch.nn.Parameter(distribute_tensor(data, tmesh, placements),
                                             requires_grad=p.requires_grad)
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner).register_parameter(leaf, done[id(p)])


# ---------------------------------------------------------------------- the module


class _Run(torch.autograd.Function):
    """One call. Under autograd, forward runs the joint plan's forward part for the arguments that need a
    gradient and keeps what it saves (each rank's local shards); backward runs the backward part on them.
    Without, forward runs the forward-only plan."""

    @staticmethod
    def forward(ctx, state: _State, names: tuple, grad_on: bool, *tensors):
        prog = state.program
        values = dict(zip(names, tensors)) | prog.constants
        wrt = [n for n, w in zip(names, ctx.needs_input_grad[3:]) if w] if grad_on else []
        split = state.split(wrt) if wrt and prog.differentiable else None
        plan = state.inference_plan() if split is None else split.first
        outs = plan.run({k: v for k, v in values.items() if k in plan.inputs}, inputs="global", outputs="local")
        ctx.state, ctx.names, ctx.split = state, names, split
        if split is not None:
            ctx.save_for_backward(*tensors, *(outs[HANDOVER_PREFIX + v] for v in split.saved))
        result = tuple(_whole(plan, n, outs[n]) for n in prog.outputs)
        ctx.mark_non_differentiable(*(o for n, o in zip(prog.outputs, result) if n not in prog.differentiable))
        return result

    @staticmethod
    def backward(ctx, *cotangents):
        state, names, split = ctx.state, ctx.names, ctx.split
        prog = state.program
        plan = split.second
        held = ctx.saved_tensors
        whole = dict(zip(names, held)) | prog.constants
        whole |= {COTANGENT + n: c.contiguous() for n, c in zip(prog.outputs, cotangents) if n in prog.differentiable}
        values = {k: v if k in prog.layouts else _replicated(state.mesh, v) for k, v in whole.items() if k in plan.inputs}
        values |= {HANDOVER_PREFIX + v: t for v, t in zip(split.saved, held[len(names):])}
        grads = plan.run(values, inputs="local", outputs="dtensor")
        out = []
        for n, w in zip(names, ctx.needs_input_grad[3:]):
            g = grads.get(GRAD_PREFIX + n) if w else None
            out.append(g if g is None or n in prog.layouts else g.to_local())  # a user input's: whole
        return (None, None, None, *out)


def seed_of(base: int, call: int) -> torch.Tensor:
    """Call `call`'s dropout seed: splitmix64 of base + call * golden ratio (Python integers, so every rank
    and every platform computes the same bits), as a 0-d int64.

    >>> seed_of(0, 0).item(), seed_of(0, 1).item() != seed_of(0, 0).item(), seed_of(7, 3).dtype
    (-2152535657050944081, True, torch.int64)
    """
    mask = (1 << 64) - 1
    z = (base + (call + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return torch.tensor(z - (1 << 64) if z >> 63 else z, dtype=torch.int64)


def _whole(plan: Plan, name: str, local: torch.Tensor) -> torch.Tensor:
    """An output's whole tensor from this rank's piece: the outputs are pinned replicated."""
    if not plan.values[plan.outputs[name]].layout.is_replicated:  # pragma: no cover - the pins say otherwise
        raise ParallelizeError(f"parallelize: output {name!r} is laid out {plan.values[plan.outputs[name]].layout}, "
                               f"not replicated as pinned")
    return local


def _replicated(mesh: DeviceMesh, t: torch.Tensor):
    """t (whole, the same on every rank) as a replicated DTensor: the runtime cuts each rank's piece of
    it with no collective, in every layout the plan loads it in (a plain tensor would have to be given
    whole or as the piece of one layout, the same way for every input, and the saved values are pieces)."""
    from torch.distributed.tensor import DTensor, Replicate

    nccl = dist.get_backend() == "nccl"
    if nccl:
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    tmesh = torch_device_mesh(mesh, "cuda" if nccl else "cpu")
    return DTensor.from_local(t, tmesh, [Replicate()] * mesh.ndim, run_check=False)


class ParallelModule(torch.nn.Module):
    """What ed.parallelize makes of a module: its class becomes a subclass of this and of its own, so
    attributes, submodules and state_dict() keys stay the module's; forward runs the plans.

    >>> cls = _parallel_class(torch.nn.Linear)
    >>> cls.__name__, issubclass(cls, ParallelModule) and issubclass(cls, torch.nn.Linear)
    ('ParallelLinear', True)
    """

    _egraph_did: _State

    def forward(self, *args, **kwargs):
        """The module's forward on inputs of the example's shapes, given whole on every rank; the outputs
        whole on every rank, in the module's structure. Under autograd it runs the joint plan's forward
        part and backward its backward part; without (torch.no_grad()), the forward-only plan.

        Example (inside a rank; see ed.parallelize)::

            y = model(x)            # x: the example's shape and dtype, the same on every rank
            y.sum().backward()      # model's parameters get .grad DTensors
        """
        state = self._egraph_did.for_mode(self.training)
        prog = state.program
        user = state.user_inputs(args, kwargs)  # checked against the example; undetached, so that autograd
        params = dict(self.named_parameters(remove_duplicate=False))  # reaches inputs that require grad
        seeds = state.next_seeds()  # an input like the others, so that the backward gets its forward's
        names = (*prog.params, *prog.user_inputs, *seeds)
        # inside apply, grad mode is off and needs_input_grad does not say whether it was on
        outs = _Run.apply(state, names, torch.is_grad_enabled(), *(params[n] for n in prog.params),
                          *(user[n] for n in prog.user_inputs), *seeds.values())
        if prog.out_skeleton is None:
            return dict(zip(prog.outputs, outs))
        return pytree.tree_map(lambda i: outs[i], prog.out_skeleton)

    def dropout_seed(self, call: int = -1) -> torch.Tensor:
        """The seed (a 0-d int64, the same on every rank) the dropouts of forward call number `call` drew
        their masks from (counting from 0; -1: the last call so far). The program's fusion evaluated on one
        device with this seed, `ed.evaluate(fd, fd.bind(x) | {"rng.seed": seed})`, gives that call's outputs.

        Example (inside a rank)::

            y = model(x)
            seed = model.dropout_seed()       # the masks y was computed with
        """
        state = self._egraph_did
        n = state.calls + call if call < 0 else call
        if not state.program.seed_inputs or not 0 <= n < state.calls:
            raise ParallelizeError(f"parallelize: no dropout seed for call {call}: "
                                   + ("the module was parallelized without dropout in training mode"
                                      if not state.program.seed_inputs else f"{state.calls} call(s) so far"))
        return seed_of(state.program.base_seed, n)

    def _wrt(self, wrt: Sequence[str] | None) -> Sequence[str]:
        if wrt is not None:
            return wrt
        return [n for n, p in self.named_parameters(remove_duplicate=False)
                if n in self._egraph_did.program.params and p.requires_grad]

    def joint_plan(self, wrt: Sequence[str] | None = None) -> SplitPlan:
        """The training step's joint plan giving the gradients of `wrt` (names of parameters and inputs;
        None: every parameter that requires grad), with its forward part (`.first`), backward part
        (`.second`) and the values the forward saves for the backward (`.saved`); `.explain()` says all
        three. Optimized on first use; every rank must ask for the same.

        Example (inside a rank)::

            print(model.joint_plan().explain())   # ends with what is saved, and which steps read it
        """
        return self._egraph_did.split(self._wrt(wrt))

    @property
    def forward_plan(self) -> Plan:
        """The plan a forward under autograd runs: the joint plan's forward part for the parameters that
        require grad (the forward-only plan where the module has no backward: no floating-point output,
        nothing requiring grad, or parallelized under torch.no_grad()).

        Example (inside a rank)::

            print(model.forward_plan.explain())
        """
        state = self._egraph_did
        if state.program.split is not None:
            return state.program.split.first
        return state.inference_plan()

    def backward_plan(self, wrt: Sequence[str] | None = None) -> Plan:
        """The joint plan's backward part giving the gradients of `wrt` (names of parameters and inputs;
        None: every parameter that requires grad). Optimized on first use; every rank must ask for the same.

        Example (inside a rank)::

            print(model.backward_plan().collectives)
        """
        return self.joint_plan(wrt).second

    def inference_plan(self) -> Plan:
        """The forward-only plan a call without autograd runs (parameters where they live; nothing saved).
        Optimized on first use; every rank must ask for it.

        Example (inside a rank)::

            with torch.no_grad():
                y = model(x)                          # runs model.inference_plan()
        """
        return self._egraph_did.inference_plan()


_CLASSES: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    """The class `Parallel<Name>(ParallelModule, cls)`, one per module class."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Parallel{cls.__name__}", (ParallelModule, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


__all__ = ["parallelize", "ParallelModule", "ParallelizeError", "joint_fusion", "optimize_joint"]
