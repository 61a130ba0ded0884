"""Sharding rules of mixture-of-experts layers (issue 28 item 4): the grouped matmul of tokens sorted by
expert (grouped_mm: rows offsets[e-1]:offsets[e] times expert e's matrix), its weight gradient
(grouped_mm_wgrad) and the count of tokens per expert (histc).

grouped_mm shards as a matmul does on the features: w split on f gives out split on f; x and w split on
d give a pending sum. Along the rows, offsets are global row positions, so a rank that holds a shard of
the rows computes the rows of each expert that fall in its range (the local kernel 'ranged' reads the
rank's first row from the layout). Expert parallelism: w split on the experts, every rank computes the
rows of its own experts and leaves the others zero; each row belongs to exactly one expert, so the sum
over the ranks is exact: a pending sum. The same kernel serves both, and their product on two mesh axes
(a rank's rows of its experts). grouped_mm_wgrad is the transposed family: per-expert x^T g over the
rows, so the rows split give a pending sum and the experts split the output's experts.

histc counts a shard's elements, so x split on any axis gives a pending sum of counts (exact: integers).

>>> import torch
>>> from egraph_did.rewrites.rules import Operand, OpView, axis_strategies
>>> x, w, o = Operand("x", (8, 4), torch.float32), Operand("w", (4, 4, 6), torch.float32), Operand("offsets", (4,), torch.int64)
>>> out = Operand("out", (8, 6), torch.float32)
>>> [(s.rule, [str(p) for p in s.inputs], str(s.outputs[0]), str(s.local)) for s in axis_strategies(OpView("grouped_mm", (x, w, o), (), (out,), d=2))][:4]
[('grouped_mm_features', ['R', 'S(2)', 'R'], 'S(1)', 'None'), ('grouped_mm_features', ['S(1)', 'S(1)', 'R'], 'P', 'None'), ('grouped_mm_rows', ['S(0)', 'R', 'R'], 'S(0)', 'ranged'), ('grouped_mm_experts', ['R', 'S(0)', 'R'], 'P', 'ranged')]
"""
from __future__ import annotations

import torch
from egglog import rule as erule

from egraph_did.ops import GROUPED_MM_RANGED, GROUPED_WGRAD_RANGED

from .rules import P, S, Case, egglog_form, family_ruleset, indices, rule
from .sorts import P as P_, R as R_, S as S_
from .sorts import Extent, FloatSize, MeshSize, a, ax, d, m, n, site, sx0, sy


def offsets(o, ids, experts: int):
    """The offsets of tokens sorted by expert, as transformers computes them: the cumsum of
    histc(ids, experts, 0, experts - 1) (ids >= experts fall outside: rows past offsets[-1])."""
    counts = o.histc(o.cast(ids, torch.float64), experts, 0, experts - 1)
    return o.cast(o.cumsum(counts, 0), torch.int64)


def _mm(experts: int):
    return lambda o, x, w, ids: o.grouped_mm(x, w, offsets(o, ids, experts))


def _wgrad(experts: int):
    return lambda o, x, g, ids: o.grouped_mm_wgrad(x, g, offsets(o, ids, experts))


# rows 9, experts 5 (one rank of 3 holds one expert), ids up to 5: rows of id 5 fall past offsets[-1]
MM = {"x": (9, 4), "w": (5, 4, 6), "ids": indices((9,), 6)}
MM2 = {"x": (8, 4), "w": (4, 4, 6), "ids": indices((8,), 5)}
WG = {"x": (9, 4), "g": (9, 6), "ids": indices((9,), 6)}
WG2 = {"x": (8, 4), "g": (8, 6), "ids": indices((8,), 5)}


@rule("grouped_mm", cases=[
    Case("uneven", (3,), MM, _mm(5)),
    Case("mesh2x2", (2, 2), MM2, _mm(4)),
])
def grouped_mm_features(e):
    """x @ w[e][:, shard of f] = (x @ w[e])[:, shard]; x[:, shard r] @ w[e][shard r] summed over r = x @ w[e]:
    split on f as column-parallel, on d a pending sum"""
    yield e.strategy(out=S(1), w=S(2))
    yield e.strategy(out=P, x=S(1), w=S(1))


@rule("grouped_mm", cases=[
    Case("uneven", (3,), MM, _mm(5)),
    Case("mesh2x2", (2, 2), MM2, _mm(4)),
])
def grouped_mm_rows(e):
    """grouped_mm(x, w, offsets)[shard of rows] = the rows of each expert inside the shard, times its matrix:
    offsets are global row positions, the local kernel reads the rank's first row"""
    yield e.strategy(out=S(0), x=S(0), local=GROUPED_MM_RANGED)


@rule("grouped_mm", cases=[
    Case("uneven-rows-past-the-end", (3,), MM, _mm(5)),
    Case("experts-and-rows-mesh2x2", (2, 2), MM2, _mm(4)),
    Case("nested-experts-mesh2x2", (2, 2), {"x": (6, 3), "w": (8, 3, 2), "ids": indices((6,), 8)}, _mm(8)),
])
def grouped_mm_experts(e):
    """grouped_mm(x, w, offsets) = sum_r (the rows of rank r's experts, times their matrices; other rows 0):
    expert parallelism, w split on the experts gives a pending sum (each row belongs to one expert)"""
    yield e.strategy(out=P, w=S(0), local=GROUPED_MM_RANGED)


@rule("grouped_mm", cases=[
    Case("partials", (2,), MM2, lambda o, x, w, ids: o.grouped_mm(o.linear(x, o.full((4, 4), 0.5, torch.float64)), w,
                                                               offsets(o, ids, 4))),
    Case("partial-weights", (2,), {"x": (6, 4), "w": (4, 4, 2), "ids": indices((6,), 4)},
         lambda o, x, w, ids: o.grouped_mm(x, o.add(w, w), offsets(o, ids, 4))),
])
def grouped_mm_of_partial(e):
    """grouped_mm(sum_r x_r, w) = sum_r grouped_mm(x_r, w), and in w alike: linear in each float operand"""
    yield e.strategy(out=P, x=P)
    yield e.strategy(out=P, w=P)


@rule("grouped_mm_wgrad", cases=[
    Case("uneven", (3,), WG, _wgrad(5)),
    Case("mesh2x2", (2, 2), WG2, _wgrad(4)),
])
def grouped_wgrad_features(e):
    """out[e] = x_e^T g_e: a shard of x's features is a shard of out's axis 1, of g's one of axis 2"""
    yield e.strategy(out=S(1), x=S(1))
    yield e.strategy(out=S(2), g=S(1))


@rule("grouped_mm_wgrad", cases=[
    Case("uneven", (3,), WG, _wgrad(5)),
    Case("mesh2x2", (2, 2), WG2, _wgrad(4)),
])
def grouped_wgrad_rows(e):
    """x_e^T g_e = sum_r (x_e^T g_e over the rows of shard r): x and g split on the rows give a pending sum"""
    yield e.strategy(out=P, x=S(0), g=S(0), local=GROUPED_WGRAD_RANGED)


@rule("grouped_mm_wgrad", cases=[
    Case("uneven", (3,), WG, _wgrad(5)),
    Case("experts-and-rows-mesh2x2", (2, 2), WG2, _wgrad(4)),
])
def grouped_wgrad_experts(e):
    """out[shard of experts] = x_e^T g_e for the rank's experts only: expert parallelism's weight gradient"""
    yield e.strategy(out=S(0), local=GROUPED_WGRAD_RANGED)


@rule("grouped_mm_wgrad", cases=[
    Case("partials", (2,), WG2, lambda o, x, g, ids: o.grouped_mm_wgrad(o.add(x, x), g, offsets(o, ids, 4))),
])
def grouped_wgrad_of_partial(e):
    """out is linear in x and in g: a partial of either gives a partial"""
    yield e.strategy(out=P, x=P)
    yield e.strategy(out=P, g=P)


@rule("histc", cases=[
    Case("ids-uneven", (3,), {"ids": indices((7,), 5)}, lambda o, ids: o.histc(o.cast(ids, torch.float64), 4, 0, 3)),
    Case("mesh2x2", (2, 2), {"x": (4, 6)}, lambda o, x: o.histc(x, 5, -1.0, 1.0)),
])
def histc_of_shards(e):
    """histc(x) = sum_r histc(x[shard r]): each rank counts its elements, a pending sum of counts (of float
    counts: an integer tensor is never a pending sum, so int counts are taken of whole ids)"""
    if e.out.dtype.is_floating_point:
        for k in range(e["x"].ndim):
            yield e.strategy(out=P, x=S(k))


# ---------------------------------------------------------------------- the same identities as egglog rules
# grouped_mm's operands: x, w, offsets; grouped_mm_wgrad's: x, g, offsets

@egglog_form(grouped_mm_features)
def _grouped_mm_features(spec):
    """w split on f: out split on f; x and w split on d: a pending sum"""
    yield erule(site("grouped_mm", 3), MeshSize(d)).then(ax([R_(), S_(2), R_()], [S_(1)]),
                                                          ax([S_(1), S_(1), R_()], [P_()]))


@egglog_form(grouped_mm_rows)
def _grouped_mm_rows(spec):
    """a shard of the rows: each expert's rows inside it (ranged)"""
    yield erule(site("grouped_mm", 3), MeshSize(d)).then(ax([S_(0), R_(), R_()], [S_(0)], GROUPED_MM_RANGED))


@egglog_form(grouped_mm_experts)
def _grouped_mm_experts(spec):
    """w split on the experts: each rank its experts' rows, a pending sum (ranged)"""
    yield erule(site("grouped_mm", 3), MeshSize(d)).then(ax([R_(), S_(0), R_()], [P_()], GROUPED_MM_RANGED))


@egglog_form(grouped_mm_of_partial)
def _grouped_mm_of_partial(spec):
    """linear in x and in w"""
    yield erule(site("grouped_mm", 3), MeshSize(d)).then(ax([P_(), R_(), R_()], [P_()]), ax([R_(), P_(), R_()], [P_()]))


@egglog_form(grouped_wgrad_features)
def _grouped_wgrad_features(spec):
    """x split on d: out on axis 1; g split on f: out on axis 2"""
    yield erule(site("grouped_mm_wgrad", 3), MeshSize(d)).then(ax([S_(1), R_(), R_()], [S_(1)]),
                                                                ax([R_(), S_(1), R_()], [S_(2)]))


@egglog_form(grouped_wgrad_rows)
def _grouped_wgrad_rows(spec):
    """x and g split on the rows: a pending sum (ranged)"""
    yield erule(site("grouped_mm_wgrad", 3), MeshSize(d)).then(
        ax([S_(0), S_(0), R_()], [P_()], GROUPED_WGRAD_RANGED))


@egglog_form(grouped_wgrad_experts)
def _grouped_wgrad_experts(spec):
    """out split on the experts: each rank its experts (ranged)"""
    yield erule(site("grouped_mm_wgrad", 3), MeshSize(d)).then(
        ax([R_(), R_(), R_()], [S_(0)], GROUPED_WGRAD_RANGED))


@egglog_form(grouped_wgrad_of_partial)
def _grouped_wgrad_of_partial(spec):
    """linear in x and in g"""
    yield erule(site("grouped_mm_wgrad", 3), MeshSize(d)).then(ax([P_(), R_(), R_()], [P_()]),
                                                                ax([R_(), P_(), R_()], [P_()]))


@egglog_form(histc_of_shards)
def _histc_of_shards(spec):
    """x split on any axis: a pending sum of counts (float counts)"""
    yield erule(site("histc"), Extent(sx0, a, n), FloatSize(sy, m), MeshSize(d)).then(ax([S_(a)], [P_()]))


experts = family_ruleset("experts")
