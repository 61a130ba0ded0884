"""Collective matmuls: a GEMM and the collective beside it run as one ring (issue 9, item 3d).

Each rewrite here is an identity between physical steps, not between programs: it offers, beside a plan's
existing pair (allgather then GEMM, GEMM then reduce_scatter), one fused step with the same inputs and
output in ordinary layouts, whose kernel runs a ring of n = mesh-axis-size steps (collectives.RINGS):
each step computes one row block while the next block travels, so the transfer hides behind compute.
Priced by cost.CostModel.ring_time (per step the longer of a block's GEMM and its transfer, latency
paid per step, one GEMM alone), so extraction takes it only where it wins: large GEMMs on slow-ish links,
never tiny ones, where n latencies cost more than one collective's.

A ring is a strategy of the GEMM with a communicating local kernel (flags ag_ring / rs_ring on its mesh
axis): a rule takes one whole-mesh strategy of a matmul (2-D weight) or a bias-free linear that names no
kernel, and a mesh axis m, and returns the ring's layouts on m. As the sharding rules, each rule has an
executable Python spec (RULES: build_problem prices what they derive, add_ring_strategies) and an egglog
form (egglog_rules: Strat rows the program rules then apply at every site; tests/optimizer/
test_collective_matmul.py holds both equal). `optimize(..., rewrites=)` switches them by the name
"collective_matmul" (RingsOn). The ring cuts x's rows (or y's) in n equal blocks: offered where the axis
divides by n and no other mesh axis splits it.

>>> sorted(RULES)
['allgather_matmul', 'matmul_reduce_scatter']
>>> RULES["allgather_matmul"].__doc__.splitlines()[0]
'allgather_m(x) @ w = ring: a GEMM that reads x whole on m runs from x split on its rows on m'
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from egglog import String, eq, i64, ne, relation, var
from egglog import rule as erule

from egraph_did.collectives import RINGS, gemm  # noqa: F401  (gemm: what the ring computes per block)
from egraph_did.layout import P, Layout, R, S, is_valid
from egraph_did.shards import local_extents

from .sorts import KERNS, LAYOUTS, SIG, STRAT, Extent, Fits, Placement, Rank, Shape
from .sorts import P as P_, R as R_, S as S_

NAME = "collective_matmul"  # the ruleset's name, as optimize(rewrites=...) takes it
RULES: dict[str, Callable] = {}


def ring_rule(fn):
    """Register a ring rule under its collective matmul's name (collectives.RINGS)."""
    assert fn.__name__ in RINGS and fn.__doc__, fn.__name__
    RULES[fn.__name__] = fn
    return fn


def _with(lay: Layout, m: int, p) -> Layout:
    """lay with mesh axis m's placement replaced by p."""
    return Layout(tuple(p if i == m else q for i, q in enumerate(lay)))


def _cuttable(shape, lays, m: int, a: int, n: int) -> bool:
    """Axis a of a tensor cuts in n equal ring blocks: it divides by n, and no mesh axis but m splits it."""
    return shape[a] % n == 0 and not any(q.is_shard and q.axis == a for lay in lays for i, q in enumerate(lay) if i != m)


@ring_rule
def allgather_matmul(x, y, lx: Layout, ly: Layout, m: int, n: int):
    """allgather_m(x) @ w = ring: a GEMM that reads x whole on m runs from x split on its rows on m

    Rank r starts from its row block x_r, multiplies the block it holds while passing it to the next rank
    and receiving the one before: after n steps it holds x_q @ w for every q, its output as the GEMM on
    the gathered x gives it (column-parallel w: its columns of every row). Returns x's layouts on m.
    """
    if lx[m] != R or ly[m] not in (R, S(len(y.shape) - 1)):
        return []
    return [_with(lx, m, S(a)) for a in range(len(x.shape) - 1) if _cuttable(x.shape, [lx], m, a, n)]


@ring_rule
def matmul_reduce_scatter(x, y, lx: Layout, ly: Layout, m: int, n: int):
    """reduce_scatter_m(x @ w) = ring: a GEMM whose output is a pending sum on m gives y split on its rows on m

    Row block b's sum starts at rank b + 1 as its partial x[b] @ w, and each next rank adds its own
    partial as the sum passes by (the GEMM of the next block runs while the sum travels); rank b adds
    last and keeps block b. Returns y's layouts on m.
    """
    if ly[m] != P:
        return []
    return [_with(ly, m, S(a)) for a in range(len(y.shape) - 1) if _cuttable(y.shape, [ly, lx], m, a, n)]


def unringed(ring: str, ins: tuple, outs: tuple, m: int) -> tuple[tuple, tuple]:
    """The (inputs, outputs) layouts of the plain GEMM a ring over mesh axis m replaced (the rule read
    backwards): x whole on m before an allgather_matmul, y pending a sum on m before a matmul_reduce_scatter.
    A replay (like=) at shapes a ring cannot cut keeps that GEMM.

    >>> x, w, y = Layout((S(0),)), Layout((R,)), Layout((R,))  # x split on its rows on mesh axis 0
    >>> [[str(lay) for lay in side] for side in unringed("allgather_matmul", (x, w), (y,), 0)]
    [['[R]', '[R]'], ['[R]']]
    """
    if ring == "allgather_matmul":
        return (ins[0].replace(m, R), *ins[1:]), outs
    return ins, (outs[0].replace(m, P), *outs[1:])


# ---------------------------------------------------------------------- the strategies (Python: the spec, priced)

def _eligible(e) -> bool:
    """A matmul of a 2-D weight or a linear without bias: what the ring's kernels compute (collectives.gemm)."""
    ts = [v for _, v in e.args if hasattr(v, "logical_domain")]
    return e.op.name in ("matmul", "linear") and len(ts) == 2 and len(ts[1].shape) == 2 and len(ts[0].shape) >= 2


def ring_strategy(problem, e, s, m: int, ring: str, lx: Layout, ly: Layout):
    """The Strategy of the ring `ring` on mesh axis m derived from s (x in lx, y in ly), priced as the ring
    runs: n - 1 steps of max(a block's GEMM, a block's transfer) plus one GEMM (CostModel.ring_time), the
    GEMM of a block costed by compute_time at 1/n of the step's flops and bytes."""
    mesh, cm, n = problem.mesh, problem.cost_model, problem.mesh.shape[m]
    x, w = (v for _, v in e.args if hasattr(v, "logical_domain"))
    y = e.outputs[0]
    ins = (lx, s.inputs[1])
    lxl, lwl, lyl = (local_extents(t.shape, lay, mesh) for t, lay in ((x, ins[0]), (w, ins[1]), (y, ly)))
    item = x.dtype.itemsize
    gathers = ring == "allgather_matmul"  # a gather ring reads n blocks of x, a scatter ring writes n of y
    flops = 2 * math.prod(lyl) * lxl[-1] * (1 if gathers else n)
    moved = (math.prod(lxl) * (n if gathers else 1) + math.prod(lwl)) * item + math.prod(lyl) * y.dtype.itemsize * (1 if gathers else n)
    chunk = cm.compute_time(flops / n, moved / n, x.dtype)
    block = math.prod(lxl) * item if gathers else math.prod(lyl) * y.dtype.itemsize
    flags = tuple(frozenset({RINGS[ring].flag}) if i == m else f for i, f in enumerate(s.flags))
    rules = tuple(ring if i == m else r for i, r in enumerate(s.rules))
    time = cm.ring_time(n, chunk, block, m, mesh.ndim)
    return replace(s, sid=-1, inputs=ins, outputs=(ly,), flags=flags, rules=rules, time=time,
                   memory=float(math.prod(lyl) * y.dtype.itemsize))


def add_ring_strategies(problem, alike: Callable | None = None) -> int:
    """Append to every GEMM's strategies the rings the rules derive from them (on each mesh axis of two or
    more ranks, from strategies that name no local kernel, into layouts that fit), priced by
    ring_strategy; the e-graph derives the same rows by `egglog_rules` and read back maps its nodes onto
    these. Returns how many it added (build_problem calls it where the ruleset is on, before a replay
    restricts the strategies to a plan's). `alike`: a key of exprs with the same strategies but for their
    key (problem.signature): their rings are derived once, for the first.

    >>> import egraph_did as ed, torch
    >>> from egraph_did.problem import build_problem
    >>> with ed.FusionDefinition() as fd:
    ...     x, w = fd.define_tensor((64, 32), name="x"), fd.define_tensor((32, 16), name="w")
    ...     fd.add_output(fd.ops.matmul(x, w), name="y")
    >>> problem = build_problem(fd, ed.DeviceMesh.arange(4), rewrites=["collective_matmul"])
    >>> for s in sorted({(str(s.inputs[0]), str(s.inputs[1]), str(s.outputs[0]), s.rules[0])
    ...                  for s in problem.strategies["y"] if any(s.flags)}):
    ...     print(*s)  # x, w, y and the ring: any pending sum reduce-scatters (x or w partial, or the inner axis split)
    [P] [R] [S(0)] matmul_reduce_scatter
    [R] [P] [S(0)] matmul_reduce_scatter
    [S(0)] [R] [R] allgather_matmul
    [S(0)] [S(1)] [S(1)] allgather_matmul
    [S(1)] [S(0)] [S(0)] matmul_reduce_scatter
    """
    if not hasattr(problem.cost_model, "ring_time"):
        return 0  # a cost model without rings prices none
    added = 0
    done: dict = {}  # alike(e) -> its rings (a 2x2 mesh's GEMMs have ~50 each, and a model's layers repeat them)
    for key, e in problem.exprs.items():
        if not _eligible(e):
            continue
        strategies = problem.strategies[key]
        sig = key if alike is None else alike(e)
        if sig not in done:
            done[sig] = _rings(problem, e, strategies)
        strategies.extend([replace(r, key=key, sid=sid) for sid, r in enumerate(done[sig], len(strategies))])
        added += len(done[sig])
    return added


def _rings(problem, e, strategies: list) -> list:
    """The ring strategies add_ring_strategies appends to e's (their sids to be set), in its order."""
    mesh, out = problem.mesh, []
    x, y = next(v for _, v in e.args if hasattr(v, "logical_domain")), e.outputs[0]
    for s in strategies:
        if any(s.flags):
            continue
        for m, n in enumerate(mesh.shape):
            if n < 2:
                continue
            for ring, rule in RULES.items():
                for lay in rule(x, y, s.inputs[0], s.outputs[0], m, n):
                    lx, ly = (lay, s.outputs[0]) if ring == "allgather_matmul" else (s.inputs[0], lay)
                    if is_valid(lay, (x if ring == "allgather_matmul" else y).shape, mesh):
                        out.append(ring_strategy(problem, e, s, m, ring, lx, ly))
    return out


# ---------------------------------------------------------------------- the egglog form (what the e-graph runs)

# RingsOn(1): the e-graph derives ring strategies (egraph.encode writes it where optimize names the ruleset)
RingsOn = relation("RingsOn", i64, egg_fn="RingsOn")


def egglog_rules(shape: tuple[int, ...]):
    """The rules' egglog form for meshes of this shape: from each whole-mesh strategy (Strat row) of a matmul
    or linear signature that names no kernel, the ring strategy on each mesh axis j of two or more ranks,
    as the Python rules derive it (a Strat row the program rules then apply at every site of the
    signature; tests/optimizer/test_collective_matmul.py holds both equal)."""
    m = len(shape)
    L, K = LAYOUTS[m], KERNS[m]
    sig, op = var("sig", String), var("op", String)
    sy, sx, sw = (var(v, Shape) for v in ("sy", "sx", "sw"))
    a, e, r = (var(v, i64) for v in ("a", "e", "r"))
    px, py, pw = ([var(f"{c}{k}", Placement) for k in range(m)] for c in ("px", "py", "pw"))
    lw = L(*pw)
    none = K(*[""] * m)
    for j, n in enumerate(shape):
        if n < 2:
            continue
        ag = K(*["ag_ring" if k == j else "" for k in range(m)])
        rs = K(*["rs_ring" if k == j else "" for k in range(m)])
        at = lambda ps, p: L(*[p if k == j else ps[k] for k in range(m)])  # noqa: E731
        common = [RingsOn(1), SIG[(2, 1)](sig, op, sy, sx, sw), Rank(sw, 2), Rank(sy, r), a >= 0, a < r - 1]
        for name in ("matmul", "linear"):
            gemm_sig = [eq(op).to(String(name))]
            # allgather_matmul: x whole on j, y whole or split on its last axis there
            for yj in (R_(), S_(r - 1)):
                yield erule(*common, *gemm_sig, STRAT[(2, 1)](sig, none, at(py, yj), at(px, R_()), lw),
                            Extent(sx, a, e), eq(e % n).to(i64(0)), *[ne(px[k]).to(S_(a)) for k in range(m) if k != j],
                            Fits(sx, at(px, S_(a)))).then(
                    STRAT[(2, 1)](sig, ag, at(py, yj), at(px, S_(a)), lw))
            # matmul_reduce_scatter: y a pending sum on j
            yield erule(*common, *gemm_sig, STRAT[(2, 1)](sig, none, at(py, P_()), L(*px), lw),
                        Extent(sy, a, e), eq(e % n).to(i64(0)),
                        *[ne(p[k]).to(S_(a)) for p in (px, py) for k in range(m) if k != j],
                        Fits(sy, at(py, S_(a)))).then(
                STRAT[(2, 1)](sig, rs, at(py, S_(a)), L(*px), lw))


__all__ = ["NAME", "RULES", "RingsOn", "add_ring_strategies", "allgather_matmul", "egglog_rules", "matmul_reduce_scatter",
           "ring_rule", "ring_strategy", "unringed"]
