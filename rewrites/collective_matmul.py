"""Collective matmuls: a GEMM and the collective beside it run as one ring (issue 9, item 3d).

Each rewrite here is an identity between physical steps, not between programs: it offers, beside a plan's
existing pair (allgather then GEMM, GEMM then reduce_scatter), one fused step with the same inputs and
output in ordinary layouts, whose kernel runs a ring of n = mesh-axis-size steps (collectives.RINGS):
each step computes one row block while the next block travels, so the transfer hides behind compute.
Priced by cost.CostModel.ring_time (per step the longer of a block's GEMM and its transfer, latency
paid per step, one GEMM alone), so extraction takes it only where it wins: large GEMMs on slow-ish links,
never tiny ones, where n latencies cost more than one collective's.

The rules read the saturated physical graph (egraph.saturate runs `offer` after read back, where the
ruleset is on: `optimize(..., rewrites=)` names it "collective_matmul"). A rule takes one priced strategy
of a matmul (2-D weight) or a bias-free linear on one mesh axis m and returns the ring strategy's layouts
on m, or None. The ring cuts x's rows (or y's) in n equal blocks: offered where the axis divides by n and
no other mesh axis splits it.

>>> sorted(RULES)
['allgather_matmul', 'matmul_reduce_scatter']
>>> RULES["allgather_matmul"].__doc__.splitlines()[0]
'allgather_m(x) @ w = ring: a GEMM that reads x whole on m runs from x split on its rows on m'
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from egraph_did.collectives import RINGS, gemm  # noqa: F401  (gemm: what the ring computes per block)
from egraph_did.layout import P, Layout, R, S
from egraph_did.physgraph import Node
from egraph_did.shards import local_extents

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


# ---------------------------------------------------------------------- offering them to extraction

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


def offer(problem, graph) -> int:
    """Add to the saturated physical graph a ring step beside every GEMM strategy a rule applies to: an
    Apply node of a new strategy (appended to problem.strategies) in the class of the output it makes,
    reading x's class in its new layout (allgather_matmul: where the graph holds x so), or making y's
    class in its row split (matmul_reduce_scatter: the class and its Keeps up the levels made where
    missing). Returns how many nodes it added.

    >>> import egraph_did as ed, torch
    >>> from egraph_did.problem import build_problem
    >>> from egraph_did.egraph import saturate
    >>> with ed.FusionDefinition() as fd:
    ...     x, w = fd.define_tensor((64, 32), name="x"), fd.define_tensor((32, 16), name="w")
    ...     fd.add_output(fd.ops.matmul(x, w), name="y")
    >>> problem = build_problem(fd, ed.DeviceMesh.arange(4), rewrites=())
    >>> offer(problem, saturate(problem)) > 0
    True
    """
    if problem.input_layouts or not hasattr(problem.cost_model, "ring_time"):
        return 0  # a replay keeps the plan's steps alone; a cost model without rings prices none
    mesh, levels, added = problem.mesh, problem.mesh.ndim, 0
    made: dict[tuple, int] = {}  # (key, inputs, outputs, flags) -> sid of the ring strategy
    for cls, nodes in list(graph.classes.items()):
        for node in list(nodes):
            if node.op != "Apply" or cls not in graph.ident:
                continue
            e = problem.exprs[node.key]
            if not _eligible(e):
                continue
            s = problem.strategies[node.key][node.sid]
            if any(s.flags):
                continue
            x = next(v for _, v in e.args if hasattr(v, "logical_domain"))
            for m, n in enumerate(mesh.shape):
                if n < 2:
                    continue
                for ring, rule in RULES.items():
                    for lay in rule(x, e.outputs[0], s.inputs[0], s.outputs[0], m, n):
                        lx, ly = (lay, s.outputs[0]) if ring == "allgather_matmul" else (s.inputs[0], lay)
                        added += _add(problem, graph, cls, node, e, s, m, ring, lx, ly, made, levels)
    return added


def _add(problem, graph, cls, node, e, s, m, ring, lx, ly, made, levels) -> int:
    """One ring node (see offer); 0 where the graph holds no class it needs."""
    xc, wc = node.children
    if ring == "allgather_matmul":
        xc = graph.index.get((graph.ident[xc][0], lx.code(), levels))
        if xc is None:
            return 0
        target = cls
    else:
        if ly not in problem.layouts.get(e.outputs[0].name, [ly]):
            return 0
        target = _held(graph, graph.ident[cls][0], ly.code(), levels)
    strat = ring_strategy(problem, e, s, m, ring, lx, ly)
    sig = (node.key, strat.inputs, strat.outputs, strat.flags)
    if sig not in made:
        made[sig] = len(problem.strategies[node.key])
        problem.strategies[node.key].append(replace(strat, sid=made[sig]))
    new = Node("Apply", (xc, wc), node.key, made[sig])
    if any(n.op == "Apply" and n.key == new.key and n.sid == new.sid for n in graph.classes[target]):
        return 0
    graph.classes[target].append(new)
    return 1


def _held(graph, t: str, code: str, levels: int) -> str:
    """The class of t held in layout `code` at level 0, made (with a Keep up each level, into the classes
    there, made where missing) if the graph has none."""
    if (t, code, 0) in graph.index:
        return graph.index[(t, code, 0)]
    below = None
    for k in range(levels + 1):
        c = graph.index.get((t, code, k))
        if c is None:
            c = f"c{len(graph.classes)}:ring"
            graph.classes[c], graph.ident[c], graph.index[(t, code, k)] = [], (t, code, k), c
        if below is not None:
            graph.classes[c].append(Node("Keep", (below,)))
        below = c
    return graph.index[(t, code, 0)]


__all__ = ["NAME", "RULES", "allgather_matmul", "matmul_reduce_scatter", "offer", "ring_rule", "ring_strategy"]
