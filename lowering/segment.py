"""Segmentation: a plan's per-rank program as segments, each with one way to run.

* comm: one collective (lowering/communication.py on a process group; simulate.collective in process);
* aten: one compute step through torch (linear, matmul, sdpa: cuBLAS / flash attention on GPU; gathers;
  steps whose strategy needs the rank's place, e.g. a bias added once or a vocab-parallel lookup);
* fused: a maximal run of consecutive fusible steps (pointwise, reductions, softmax, layer_norm,
  rms_norm, gelu, ...) compiled into one Triton kernel by the scheduler that takes it (pointwise,
  reduction, persistent, transpose). A residual add feeding a layer_norm is one kernel.

Segments are shape-agnostic; a fused segment becomes a KernelSpec on each rank's local shapes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from egraph_did.evaluate import decompose
from egraph_did.fusion import Fusion
from egraph_did.ir import TensorView
from egraph_did.ops import OPS, SAVE_OP, ops_where
from egraph_did.shards import Operand, RankContext
from egraph_did.plan import Collective, ComputeStep, Plan

from . import schedulers
from .compute import compute_on_rank
from .kernel_spec import KernelOp, KernelSpec

# Ops a fused segment may hold: kernel primitives plus composites that decompose into them.
FUSIBLE = set(ops_where(fusible=True))  # kernel primitives and the composites made of them


@dataclass(frozen=True)
class Segment:
    """A piece of a rank's program with one way to run: a collective (comm), one compute step through
    torch (aten), or a run of fusible steps compiled into one kernel (fused).

    >>> c = Collective("allreduce", "y", "y:P", "y:R", 0, "x", bytes=32.0, time=2e-5)
    >>> Segment("comm", (c,)).describe()
    'comm allreduce[x] y:P -> y:R'
    """

    kind: str  # comm | aten | fused | gemm
    steps: tuple  # one Collective, one ComputeStep, or several ComputeSteps
    inputs: tuple[str, ...] = ()  # values a fused segment reads
    outputs: tuple[str, ...] = ()  # values a fused segment hands on
    scheduler: str = ""  # fused: pointwise | reduction | persistent | transpose; gemm: its epilogue

    def describe(self) -> str:
        """One line: the kind, then its one step as the step describes itself (a collective, an ATen
        step), or a fused kernel's scheduler and ops."""
        if self.kind not in ("fused", "gemm"):  # gemm: a linear and its epilogue (lowering/epilogue.py)
            return f"{self.kind} {self.steps[0]}"
        return f"{self.kind}/{self.scheduler} {'+'.join(s.op for s in self.steps)}"


@dataclass
class LoweredPlan:
    """A plan cut into segments, in execution order (see lower()).

    >>> import egraph_did as ed
    >>> from egraph_did.models import mlp
    >>> plan = ed.optimize(mlp(tokens=8, hidden=16), ed.DeviceMesh.arange(2))
    >>> print(LoweredPlan(plan, eager_segments(plan)).summary())  # no kernels: every step through torch
      0  aten linear_0:S0 = linear(x:S0, w1:R)
      1  aten gelu_1:S0 = gelu(linear_0:S0, approximate=none)
      2  aten y:S0 = linear(gelu_1:S0, w2:R)
    """

    plan: Plan
    segments: list[Segment] = field(default_factory=list)

    def summary(self) -> str:
        """One numbered line per segment."""
        return "\n".join(f"{i:>3}  {s.describe()}" for i, s in enumerate(self.segments))


def _fusible(step: ComputeStep) -> bool:
    return step.op in FUSIBLE and not step.flags


# kernel_spec's specs and their schedulers by _run_key: lower grows every run a step at a time and classifies
# each prefix on every rank's shapes, and the layers of a model, the AdamW updates of equal-shaped parameters and
# the ranks of one process repeat the same runs (a 2-layer GPT step's plan: 372 specs asked for, 123 distinct)
_SPECS: dict[tuple, KernelSpec] = {}
_CLASSES: dict[tuple, str | None] = {}
_CACHE_LIMIT = 20000  # entries; past it both start over (a fuzz session lowers thousands of plans)


def kernel_spec(plan: Plan, steps: tuple[ComputeStep, ...], inputs: tuple[str, ...], outputs: tuple[str, ...],
                rank: int) -> KernelSpec:
    """The segment's ops over rank's local shapes, composites decomposed into kernel primitives; built once
    per _run_key (runs equal but for value names share one spec object).

    >>> import egraph_did as ed
    >>> from egraph_did.models import mlp
    >>> plan = ed.optimize(mlp(tokens=8, hidden=16), ed.DeviceMesh.arange(2))
    >>> seg = lower(plan).segments[1]  # fused/pointwise gelu
    >>> spec = kernel_spec(plan, seg.steps, seg.inputs, seg.outputs, rank=1)
    >>> spec.shape(spec.inputs[0]), [op.op for op in spec.ops]  # rank 1's rows; exact gelu through erf
    ((4, 64), ['mul', 'mul', 'erf', 'add', 'mul'])
    """
    return _spec_of(_run_key(plan, steps, inputs, outputs, rank), plan, steps, inputs, outputs, rank)


def _run_key(plan: Plan, steps, inputs: tuple[str, ...], outputs: tuple[str, ...], rank: int) -> tuple:
    """All that kernel_spec's result depends on: each step's op, its literals and where each operand comes from
    (a number per value, in order of first appearance: the inputs, then each step's outputs), the inputs'
    local shapes and dtypes on rank, and the numbers of the values handed on. kernel_spec names its tensors
    by position (in0.., its own fusion's counters, out0..), never by value name, so runs with equal keys
    have equal specs."""
    number: dict[str, int] = {}
    for v in inputs:
        number.setdefault(v, len(number))

    def num(v: str) -> int:
        return number.setdefault(v, len(number))
    body = tuple((s.op, tuple((k, num(v)) if k in s.tensor_params else (k, type(v).__name__, repr(v))
                              for k, v in s.args), tuple(num(v) for v in s.outputs)) for s in steps)
    ctx = RankContext(plan.mesh, rank)
    shapes = tuple((ctx.local_shape(Operand(plan.values[v].shape, plan.values[v].layout)), plan.values[v].dtype)
                   for v in inputs)
    return body, shapes, tuple(num(v) for v in outputs)


def _kept(table: dict, key, make):
    """table[key], made by make() and kept the first time it is asked for (the table starts over past _CACHE_LIMIT).

    >>> table = {}
    >>> _kept(table, "k", lambda: None), _kept(table, "k", lambda: 1)  # a kept None is an answer too
    (None, None)
    """
    if key not in table:
        if len(table) >= _CACHE_LIMIT:
            table.clear()
        table[key] = make()
    return table[key]


def _spec_of(key: tuple, plan: Plan, steps, inputs, outputs, rank: int) -> KernelSpec:
    """The spec of a run whose _run_key is key: cached, or built (_build_spec) and kept."""
    return _kept(_SPECS, key, lambda: _build_spec(plan, steps, inputs, outputs, rank))


def _build_spec(plan: Plan, steps, inputs: tuple[str, ...], outputs: tuple[str, ...], rank: int) -> KernelSpec:
    """kernel_spec without the cache: a fusion of the steps over the inputs' local shapes, decomposed."""
    ctx = RankContext(plan.mesh, rank)
    fusion = Fusion()
    tv: dict[str, TensorView] = {}
    for v in inputs:
        val = plan.values[v]
        local = ctx.local_shape(Operand(val.shape, val.layout))
        tv[v] = fusion.define_tensor(local, val.dtype, name=f"in{len(tv)}")
    for step in steps:
        args = step.bind(tv.__getitem__)
        outs = fusion.emit(step.op, **args)
        for v, t in zip(step.outputs, outs if isinstance(outs, tuple) else (outs,)):
            tv[v] = t
    for i, v in enumerate(outputs):
        fusion.add_output(tv[v], f"out{i}")
    return spec_from_fusion(fusion)


def _classified(plan: Plan, run: tuple, ins: tuple[str, ...], outs: tuple[str, ...], rank: int, classify):
    """classify(kernel_spec(...)) once per (classify, _run_key): a classifier is a function of the spec alone."""
    key = _run_key(plan, run, ins, outs, rank)
    return _kept(_CLASSES, (classify, key), lambda: classify(_spec_of(key, plan, run, ins, outs, rank)))


def spec_from_fusion(fusion: Fusion) -> KernelSpec:
    """A single-device fusion of fusible ops as a KernelSpec (composites decomposed), outputs in order.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((4, 8), name="x")
    ...     fd.add_output(fd.ops.softmax(x), name="y")
    >>> [o.op for o in spec_from_fusion(fd.fusion).ops]
    ['amax', 'sub', 'exp', 'sum', 'div']
    """
    prim, _ = decompose(fusion)
    alias: dict[str, str] = {}  # common subexpressions: decompositions repeat work (x - mean twice)
    seen: dict[tuple, str] = {}
    ops = []
    for e in prim.exprs:
        args = tuple((k, alias.get(a.name, a.name) if isinstance(a, TensorView) else a) for k, a in e.args)
        key = (e.op.name, repr(args))
        out = e.outputs[0].name
        if key in seen and out not in {t.name for t in prim.outputs.values()}:
            alias[out] = seen[key]
            continue
        seen.setdefault(key, out)
        ops.append(KernelOp(out, e.op.name, args))
    tensors = tuple((t.name, t.shape, t.dtype) for t in prim.all_tensors() if t.name not in alias)
    return KernelSpec(tuple(t.name for t in prim.inputs), tuple(ops),
                      tuple(t.name for t in prim.outputs.values()), tensors)


def _handed_on_saves(run: list[ComputeStep], needed) -> list[ComputeStep]:
    """The saved markers of a run whose result leaves it (in `needed`: read later or a plan output). A marker
    is an alias of its input (ops.saved: no kernel); in a kernel it would be an extra output, a copy written
    for the backward, so these run after the kernel as aliases (aten steps that return their input)."""
    _, outs = _segment_io(run, needed)
    read_inside = {v for s in run if s.op != SAVE_OP for v in s.reads}  # a step of the kernel reads it: it stays
    return [s for s in run if s.op == SAVE_OP and s.outputs[0] in outs and s.outputs[0] not in read_inside]


class _ReadFrom:
    """What the rest of the plan needs from a run, as `_segment_io`'s `needed`: the values read by steps[upto:]
    or by the `also` steps, or a plan output. Answers `in` without building that set (lower asks at every
    step of every run it grows: building it from the rest of the plan each time was quadratic, 4.6 s of a
    6-layer GPT step's 17 s lowering on every rank). v is read at or after upto iff its last reader is.

    >>> from egraph_did.plan import ComputeStep
    >>> a = ComputeStep("neg", (("a", "x"),), ("a",), ("y",), (), (), 0.0)
    >>> b = ComputeStep("neg", (("a", "y"),), ("a",), ("z",), (), (), 0.0)
    >>> class P: outputs = {"out": "z"}
    >>> needed = _ReadFrom(P, [a, b])
    >>> "y" in needed.at(1), "y" in needed.at(2), "x" in needed.at(2, also=[a]), "z" in needed.at(2)
    (True, False, True, True)
    """

    def __init__(self, plan: Plan, steps: list):
        self.last = {v: i for i, s in enumerate(steps) for v in s.reads}
        self.outputs = set(plan.outputs.values())
        self.upto, self.also = 0, frozenset()

    def at(self, upto: int, also: list = ()) -> "_ReadFrom":
        """Itself, cut at upto, also counting what the `also` steps read (steps moved after the run)."""
        self.upto = upto
        self.also = frozenset(v for s in also for v in s.reads)
        return self

    def __contains__(self, v) -> bool:
        return v in self.outputs or self.last.get(v, -1) >= self.upto or v in self.also


def _segment_io(steps: list[ComputeStep], needed) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(inputs, outputs) of a run of steps: what it reads from before it; what it makes that is in `needed`
    (what the rest of the plan reads, or a plan output: lower's _ReadFrom).

    >>> from egraph_did.plan import ComputeStep
    >>> a = ComputeStep("neg", (("a", "x"),), ("a",), ("y",), (), (), 0.0)
    >>> b = ComputeStep("neg", (("a", "y"),), ("a",), ("z",), (), (), 0.0)
    >>> _segment_io([a, b], {"z"})
    (('x',), ('z',))
    """
    made = {v for s in steps for v in s.outputs}
    ins: list[str] = []
    for s in steps:
        for v in s.reads:
            if v not in made and v not in ins:
                ins.append(v)
    outs = tuple(v for s in steps for v in s.outputs if v in needed)
    return tuple(ins), outs


def _classify_on_every_rank(plan: Plan, run: list[ComputeStep], ins: tuple[str, ...], outs: tuple[str, ...],
                            classify) -> str | None:
    """The scheduler that takes the run on every rank's local shapes, or None. Uneven shards give ranks
    different kernels: a softmax of a replicated x[3] beside a maximum of a row-sharded y[5] (3 | 2 rows)
    shares one domain on rank 0 but not on rank 1, where a kernel over rank 0's choice would reduce over
    the wrong domain (fuzz issue 12, seed 7 case 4100). Ranks with the same local input shapes are
    classified once."""
    found: dict[tuple, str | None] = {}
    for rank in plan.mesh.ranks:
        ctx = RankContext(plan.mesh, rank)
        key = tuple(ctx.local_shape(Operand(plan.values[v].shape, plan.values[v].layout)) for v in ins + outs)
        if any(0 in shape for shape in key):  # a rank holds no data of one (an empty-rank layout): torch runs
            return None                        # the steps (fuzz seed 38 case 3267: a kernel beside it misread)
        if key not in found:
            found[key] = _classified(plan, tuple(run), ins, outs, rank, classify)
            if found[key] is None:
                return None
    names = set(found.values())
    return names.pop() if len(names) == 1 else None


def lower(plan: Plan, classify=None) -> LoweredPlan:
    """Cut the plan into segments; fused runs are grown while the scheduler still takes them.

    >>> import egraph_did as ed
    >>> from egraph_did.models import mlp
    >>> print(lower(ed.optimize(mlp(tokens=8, hidden=16), ed.DeviceMesh.arange(2))).summary())
      0  aten linear_0:S0 = linear(x:S0, w1:R)
      1  fused/pointwise gelu
      2  aten y:S0 = linear(gelu_1:S0, w2:R)
    """
    classify = classify or schedulers.classify
    low = LoweredPlan(plan)
    steps = sink_fusible(plan.steps)
    group: list[ComputeStep] = []

    memo: dict[tuple, str | None] = {}  # growing a run classifies it; closing it asks again: answer once
    read_from = _ReadFrom(plan, steps)  # read_from.at(upto): what steps[upto:] read, or the plan outputs

    def scheduler_for(run: list[ComputeStep], upto: int) -> str | None:
        key = (len(run), id(run[0]), upto)
        if key not in memo:
            ins, outs = _segment_io(run, read_from.at(upto))
            try:
                memo[key] = _classify_on_every_rank(plan, run, ins, outs, classify) if outs else None
            except (ValueError, KeyError, TypeError, AssertionError, NotImplementedError):
                memo[key] = None
        return memo[key]

    def close(upto: int) -> None:
        if not group:
            return
        handed = _handed_on_saves(group, read_from.at(upto))
        if handed:  # a kernel would write a copy of each: run them after it as aliases instead
            rest = [s for s in group if s not in handed]
            group.clear()
            if rest:
                ins, outs = _segment_io(rest, read_from.at(upto, also=handed))
                sched = _classify_on_every_rank(plan, rest, ins, outs, classify) if outs else None
                if sched is None:
                    low.segments.extend(Segment("aten", (s,)) for s in rest)
                else:
                    low.segments.append(Segment("fused", tuple(rest), ins, outs, sched))
            low.segments.extend(Segment("aten", (s,)) for s in handed)
            return
        sched = scheduler_for(group, upto)
        if sched is None:  # nothing takes it whole: each step through torch
            for s in group:
                low.segments.append(Segment("aten", (s,)))
        else:
            ins, outs = _segment_io(group, read_from.at(upto))
            low.segments.append(Segment("fused", tuple(group), ins, outs, sched))
        group.clear()

    for i, step in enumerate(steps):
        if isinstance(step, Collective):
            close(i)
            low.segments.append(Segment("comm", (step,)))
        elif _fusible(step) and (group or not OPS[step.op].permutes):
            # a permute opening a run is a view for torch; after pointwise ops it is a tiled transpose
            if group and scheduler_for(group + [step], i + 1) is None:
                close(i)
                if OPS[step.op].permutes:  # it opens the next run after all: a view (a weight's transpose
                    low.segments.append(Segment("aten", (step,)))  # for a GEMM would be a copy of the weight)
                    continue
            group.append(step)
        else:
            close(i)
            low.segments.append(Segment("aten", (step,)))
    close(len(steps))
    return low


def sink_fusible(steps) -> list:
    """The steps with each fusible compute step (not a view) moved down to just before its first reader (a valid
    order: it reads what it read, and nothing between reads it). Plans list steps in an order of their
    own: an optimizer update computes p (1 - lr wd) and b1 m of the next parameter beside this one's
    update, so a kernel would write both and the next read them back, four extra passes over each
    parameter; sunk, each joins the kernel of its reader.

    >>> from egraph_did.plan import ComputeStep
    >>> def step(op, a, b, out):
    ...     args = (("a", a), ("b", b))
    ...     return ComputeStep(op, args, tuple(k for k, v in args if isinstance(v, str)), (out,), (), (), 0.0)
    >>> a, b, c = step("mul", "p", 0.5, "q"), step("add", "x", "x", "y"), step("add", "q", "y", "z")
    >>> [s.outputs[0] for s in sink_fusible([a, b, c])]
    ['y', 'q', 'z']
    """
    out = list(steps)
    for i in reversed(range(len(out))):
        s = out[i]
        if not isinstance(s, ComputeStep) or not _fusible(s) or OPS[s.op].metadata_only or OPS[s.op].permutes:
            continue  # views stay where they are: the program folds a view into the view or GEMM beside it
        made = set(s.writes)
        j = next((j for j in range(i + 1, len(out)) if made & set(
            out[j].reads if isinstance(out[j], ComputeStep) else [out[j].src])), None)
        if j is not None and j > i + 1:
            out.insert(j - 1, out.pop(i))
    return out


def lowered_plan(plan: Plan) -> LoweredPlan:
    """lower(plan), once per plan object (segmentation classifies every fused run: not per run)."""
    cached = getattr(plan, "_lowered", None)
    if cached is None or cached.plan is not plan or cached.steps != len(plan.steps):
        cached = lower(plan)
        cached.steps = len(plan.steps)
        plan._lowered = cached
    return cached


def eager_segments(plan: Plan) -> list[Segment]:
    """One segment per step, every compute step through torch (no kernels).

    >>> import egraph_did as ed
    >>> from egraph_did.models import mlp
    >>> plan = ed.optimize(mlp(tokens=8, hidden=16), ed.DeviceMesh.arange(2))
    >>> [seg.kind for seg in eager_segments(plan)]
    ['aten', 'aten', 'aten']
    """
    return [Segment("comm" if isinstance(s, Collective) else "aten", (s,)) for s in plan.steps]


_KERNELS: dict[tuple, tuple] = {}


def run_fused(plan: Plan, seg: Segment, env: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """One rank's fused segment: its kernel on the rank's local shards. The spec and kernel are built once
    per (segment, rank, input values): building a spec decomposes a small fusion, milliseconds of Python
    that a run must not pay per step.

    >>> import torch, egraph_did as ed
    >>> from egraph_did.models import mlp
    >>> plan = ed.optimize(mlp(tokens=8, hidden=16), ed.DeviceMesh.arange(2))
    >>> seg = lower(plan).segments[1]  # fused/pointwise gelu, reading linear_0:S0
    >>> run_fused(plan, seg, {"linear_0:S0": torch.zeros(4, 64)}, rank=0)["gelu_1:S0"].abs().max()
    tensor(0.)
    """
    key = (seg, rank, plan.mesh, tuple(plan.values[v] for v in seg.inputs))
    if key not in _KERNELS:
        spec = kernel_spec(plan, seg.steps, seg.inputs, seg.outputs, rank)
        try:
            _KERNELS[key] = (spec, schedulers.compile_kernel(spec))
        except schedulers.Unsupported:  # this rank's (uneven) local shapes fit no scheduler: torch runs the steps
            _KERNELS[key] = (spec, None)
    spec, kernel = _KERNELS[key]
    if kernel is None:
        local = dict(env)
        for step in seg.steps:
            local.update(compute_on_rank(plan, step, local, rank))
        return {v: local[v] for v in seg.outputs}
    outs = kernel({name: env[v] for name, v in zip(spec.inputs, seg.inputs)})
    return {v: outs[name] for name, v in zip(spec.outputs, seg.outputs)}
