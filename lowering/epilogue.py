"""Matmul epilogues: a linear and the pointwise steps right after it as one cuBLASLt call, chosen by bytes.

A linear's output written by the GEMM and read back by a pointwise kernel costs two passes over it; the
GEMM can apply a bias, an activation, or a residual as it writes (cuBLASLt epilogues through ATen):

* bias          linear(x, w) then add(y, b), b one value per out-feature: torch.addmm(b, x, w.T)
* bias+gelu     ... then gelu(approximate="tanh")                          torch._addmm_activation(b, x, w.T)
* bias+relu     ... then relu                                              torch._addmm_activation(..., use_gelu=False)
                (the bias is the linear's own, or such an add)
* residual      linear(x, w) then add(y, r), r the output's shape:         r.addmm_(x, w.T), in place

What does not fuse, and why: exact gelu (cuBLASLt's GELU epilogue is the tanh form; fusing would change
the function); a residual still read later, a program input or a view (ATen's addmm copies a 2-D C into
the result first: a full extra pass, no gain; in place would overwrite a value someone still reads);
a linear whose output is read by anything else; a linear with a rank strategy (bias added once).

Each candidate is taken only where it moves fewer bytes than the GEMM plus the fused segment it cuts
into, and where what is left of that segment still compiles to one kernel on every rank (the epilogue's
steps leave the segment; the rest is re-classified).
"""
from __future__ import annotations

from typing import Callable

import torch

from egraph_did.ops import OPS
from egraph_did.plan import ComputeStep, Plan
from egraph_did.shards import Operand, RankContext

from . import schedulers
from .segment import LoweredPlan, Segment, _classify_on_every_rank, lowered_plan

# ATen steps of these kinds return a new tensor (a cast to its own dtype may return its input: not listed)
FRESH_KINDS = ("pointwise", "matmul", "normalization")
ACTIVATIONS = {"gelu": dict(approximate="tanh"), "relu": {}}  # what cuBLASLt's epilogues compute exactly


def _readers(plan: Plan) -> dict[str, int]:
    """How many steps read each value, plus one for each plan output."""
    n: dict[str, int] = {}
    for s in plan.steps:
        for v in (s.reads if isinstance(s, ComputeStep) else [s.src]):
            n[v] = n.get(v, 0) + 1
    for v in plan.outputs.values():
        n[v] = n.get(v, 0) + 1
    return n


def _local(plan: Plan, value: str, rank: int) -> tuple[int, ...]:
    v = plan.values[value]
    return tuple(RankContext(plan.mesh, rank).local_shape(Operand(v.shape, v.layout)))


def _nbytes(plan: Plan, value: str, rank: int) -> int:
    shape = _local(plan, value, rank)
    size = 1
    for d in shape:
        size *= d
    return size * torch.empty((), dtype=getattr(torch, plan.values[value].dtype)).element_size()


def _fresh(segments: list[Segment], upto: int, value: str) -> bool:
    """Whether value is a tensor of its own (a kernel's or a GEMM's output), so writing into it in place
    touches nothing else: views, saved markers (an ATen step returns its input), collectives' results (a
    slice may be a view) and inputs may alias."""
    for seg in segments[:upto]:
        if seg.kind == "fused" and value in seg.outputs:
            return True
        if seg.kind in ("aten", "gemm") and value in seg.steps[-1].writes:
            op = seg.steps[0].op
            return seg.kind == "gemm" or op != "cast" and not OPS[op].metadata_only and OPS[op].kind in FRESH_KINDS
    return False


def _absorb(plan: Plan, linear: ComputeStep, seg: Segment, readers: dict[str, int], segments: list[Segment],
            upto: int) -> tuple[str, list[ComputeStep], str] | None:
    """(kind, absorbed steps, c) for the steps of fused segment seg that linear's GEMM can apply, or None."""
    y = linear.writes[0]
    by_reader = {v: s for s in seg.steps for v in s.reads}
    bias = linear.operands.get("bias")

    def only_reader(v):
        s = by_reader.get(v)
        return s if s is not None and readers.get(v) == 1 and len(s.writes) == 1 else None
    first = only_reader(y)
    if first is None:
        return None
    steps, kind = [first], None

    def on_every_rank(c, shape_of_y):  # uneven shards: what holds on one rank may not on another
        return all(_local(plan, c, r) == shape_of_y(_local(plan, y, r)) for r in plan.mesh.ranks)
    if first.op == "add" and bias is None:
        (c,) = [v for v in first.reads if v != y] or [None]
        if c is None or plan.values[c].dtype != plan.values[y].dtype:
            return None
        if on_every_rank(c, lambda n: n[-1:]):
            kind, bias = "bias", c
        elif on_every_rank(c, lambda n: n) and readers.get(c) == 1 and _fresh(segments, upto, c):
            return "residual", steps, c
        else:
            return None
        act = only_reader(first.writes[0])
    elif bias is not None:
        act, kind = first, "bias"
        steps = []
    else:
        return None
    if act is not None and act.op in ACTIVATIONS and all(dict(act.args).get(k) == v
                                                          for k, v in ACTIVATIONS[act.op].items()):
        steps.append(act)
        kind = f"bias+{act.op}"
    return (kind, steps, bias) if steps else None


def _cut(plan: Plan, seg: Segment, absorbed: list[ComputeStep], out: str, classify) -> Segment | None | bool:
    """What is left of fused seg once the absorbed steps leave it: a fused segment, None (nothing left),
    or False (the rest fits no kernel on some rank)."""
    gone = {id(s) for s in absorbed}
    rest = [s for s in seg.steps if id(s) not in gone]
    if not rest:
        return None
    made = {v for s in rest for v in s.writes}
    ins = tuple(dict.fromkeys(v for s in rest for v in s.reads if v not in made))
    outs = tuple(v for v in seg.outputs if v in made)
    if not outs:
        return False
    sched = _classify_on_every_rank(plan, rest, ins, outs, classify)
    return False if sched is None else Segment("fused", tuple(rest), ins, outs, sched)


def _traffic(plan: Plan, seg: Segment, rank: int) -> int:
    """Bytes a segment reads and writes (an ATen step: its step's reads and writes)."""
    values = (*seg.inputs, *seg.outputs) if seg.kind == "fused" else (*seg.steps[0].reads, *seg.steps[0].writes)
    return sum(_nbytes(plan, v, rank) for v in dict.fromkeys(values))


def fuse_epilogues(plan: Plan, segments: list[Segment], classify=None) -> list[Segment]:
    """segments with each profitable linear + pointwise epilogue made one 'gemm' segment (steps: the
    linear, then the absorbed steps; inputs: x, weight, c; outputs: the last absorbed value; scheduler:
    the epilogue's kind), followed by what remains of the fused segment it cut.

    >>> import torch, egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x, w, b = fd.define_tensor((8, 16), name="x"), fd.define_tensor((32, 16), name="w"), fd.define_tensor((32,), name="b")
    ...     fd.add_output(fd.ops.gelu(fd.ops.linear(x, w, b), approximate="tanh"), name="y")
    >>> plan = ed.optimize(fd, ed.DeviceMesh.arange(1))
    >>> [s.describe() for s in fuse_epilogues(plan, lowered_plan(plan).segments)]
    ['gemm/bias+gelu linear+gelu']
    """
    classify = classify or schedulers.classify
    readers = _readers(plan)
    out: list[Segment] = []
    i = 0
    while i < len(segments):
        found = _try(plan, segments, i, readers, classify)
        if found is None:
            out.append(segments[i])
            i += 1
            continue
        replaced, used = found
        out += replaced
        i += 1 + used
    return out


def _window(segments: list[Segment], i: int) -> list[Segment]:
    """The segments after a linear whose steps its GEMM may absorb: the fused segment right after it,
    or the single-step ATen segments right after it (pointwise steps no kernel took: float64, say)."""
    if i + 1 < len(segments) and segments[i + 1].kind == "fused":
        return [segments[i + 1]]
    window = []
    for seg in segments[i + 1:i + 3]:
        if seg.kind != "aten" or seg.steps[0].flags or OPS[seg.steps[0].op].kind == "matmul":
            break
        window.append(seg)
    return window


def _try(plan: Plan, segments: list[Segment], i: int, readers: dict[str, int], classify
         ) -> tuple[list[Segment], int] | None:
    """(segments replacing segments[i] and the next `used` ones, used) where linear i takes an epilogue."""
    seg = segments[i]
    if seg.kind != "aten" or seg.steps[0].op != "linear" or seg.steps[0].flags:
        return None
    window = _window(segments, i)
    if not window:
        return None
    linear, rank = seg.steps[0], plan.mesh.ranks[0]
    steps = tuple(s for w in window for s in w.steps)
    found = _absorb(plan, linear, Segment("fused", steps), readers, segments, i + 1 + len(window))
    if found is None:
        return None
    kind, absorbed, c = found
    result = absorbed[-1].writes[0]
    pre: list[Segment] = []
    if window[0].kind == "fused":
        rest = _cut(plan, window[0], absorbed, result, classify)
        if rest is False:
            return None
        rest = [] if rest is None else [rest]
    else:  # ATen steps: the absorbed ones go; the others stay, those before the first absorbed before the GEMM
        gone = {id(s) for s in absorbed}
        first = next(k for k, w in enumerate(window) if id(w.steps[0]) in gone)
        pre = window[:first]
        rest = [w for w in window[first:] if id(w.steps[0]) not in gone]
    if any(c in w.steps[-1].writes for w in segments[i:] if w not in pre):  # c is ready where the GEMM runs
        return None
    x, w = linear.operands["x"], linear.operands["weight"]
    gemm = Segment("gemm", (linear, *absorbed), (x, w, c), (result,), kind)
    # bytes: unfused, the GEMM writes y and the window moves its ins and outs; fused, the GEMM also reads
    # c and writes the result, and what is left moves its own (the result among its inputs)
    y = linear.writes[0]
    before = _nbytes(plan, y, rank) + sum(_traffic(plan, w, rank) for w in window)
    after = _nbytes(plan, c, rank) + _nbytes(plan, result, rank) + sum(_traffic(plan, r, rank) for r in pre + rest)
    return ([*pre, gemm, *rest], len(window)) if after < before else None


def gemm_fn(plan: Plan, seg: Segment, rank: int) -> Callable[..., tuple]:
    """fn(x, weight, c) -> (result,) for a 'gemm' segment on rank's local shapes.

    >>> import torch, egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x, w, b = fd.define_tensor((4, 3), name="x"), fd.define_tensor((2, 3), name="w"), fd.define_tensor((2,), name="b")
    ...     fd.add_output(fd.ops.relu(fd.ops.linear(x, w, b)), name="y")
    >>> plan = ed.optimize(fd, ed.DeviceMesh.arange(1))
    >>> seg = fuse_epilogues(plan, lowered_plan(plan).segments)[0]
    >>> gemm_fn(plan, seg, 0)(torch.ones(4, 3), torch.ones(2, 3), torch.tensor([-5., 1.]))[0][0]
    tensor([0., 4.])
    """
    shape = _local(plan, seg.outputs[0], rank)
    n = shape[-1]
    kind = seg.scheduler

    if kind == "residual":
        def residual(x, w, r):
            x2 = x.reshape(-1, x.shape[-1])
            if r.is_contiguous() and not r.requires_grad:  # dead after this (see _absorb): accumulate into it
                return (r.view(-1, n).addmm_(x2, w.t()).view(shape),)
            return (torch.addmm(r.reshape(-1, n), x2, w.t()).view(shape),)
        return residual
    if kind == "bias":
        def bias(x, w, b):
            return (torch.addmm(b, x.reshape(-1, x.shape[-1]), w.t()).view(shape),)
        return bias
    use_gelu = kind == "bias+gelu"
    activation = torch._addmm_activation
    then = (lambda t: torch.nn.functional.gelu(t, approximate="tanh")) if use_gelu else torch.relu

    def bias_act(x, w, b):
        x2 = x.reshape(-1, x.shape[-1])
        if x2.is_cuda:  # cuBLASLt's GELU_BIAS / RELU_BIAS epilogue (its GELU is the tanh form)
            return (activation(b, x2, w.t(), use_gelu=use_gelu).view(shape),)
        # elsewhere ATen's _addmm_activation applies the exact gelu: keep the tanh form the step asks for
        return (then(torch.addmm(b, x2, w.t())).view(shape),)
    return bias_act


def run_gemm(plan: Plan, seg: Segment, env: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """A 'gemm' segment on one rank (the segment-by-segment executor's entry)."""
    return {seg.outputs[0]: gemm_fn(plan, seg, rank)(*(env[v] for v in seg.inputs))[0]}


def epilogue_plan(plan: Plan) -> LoweredPlan:
    """lowered_plan(plan) with its profitable matmul epilogues fused, once per lowered plan: the program
    the executors run (simulate() runs lowered_plan's, unfused)."""
    low = lowered_plan(plan)
    cached = getattr(low, "_epilogues", None)
    if cached is None:
        cached = low._epilogues = LoweredPlan(plan, fuse_epilogues(plan, low.segments))
    return cached


__all__ = ["fuse_epilogues", "gemm_fn", "run_gemm", "epilogue_plan", "ACTIVATIONS"]
