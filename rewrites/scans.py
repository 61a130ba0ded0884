"""Sharding rules of scans (cumsum): the ops a model's masks and positions are made of (a causal mask
from cumsum of an attention mask). The reductions with no partial placement (amin, prod, any, all) keep a
shard on an axis they do not reduce by the reduction family's reduce_other_axis, as every reduction over
`dims` does; over a sharded reduced axis they have no local form (there is no pending min, product or or),
so that axis is gathered first (the replicated rule covers it).

cumsum keeps a shard on any axis but the scanned one. Along the scanned axis it is not local (a rank's
running sum needs the totals of the ranks before it), so no rule covers it. cumsum is linear, so the
cumsum of a partial is a partial. Its egglog forms read the axis facts egraph._axis_facts writes for a
scan (AxisMap: every axis but the scanned one, unchanged).

>>> import torch
>>> from egraph_did.rewrites.rules import Operand, OpView, axis_strategies
>>> x, out = Operand("x", (4, 6), torch.float32), Operand("out", (4, 6), torch.float32)
>>> [(s.rule, str(s.inputs[0]), str(s.outputs[0])) for s in axis_strategies(OpView("cumsum", (x,), (("dim", 1),), (out,), d=2))]
[('cumsum_other_axis', 'S(0)', 'S(0)'), ('cumsum_of_partial', 'P', 'P'), ('replicated', 'R', 'R')]
"""
from __future__ import annotations

from egglog import rule as erule

from .rules import P, S, Case, egglog_form, family_ruleset, indices, rule
from .sorts import P as P_, S as S_
from .sorts import AxisMap, FloatSize, MeshSize, a, ax, b, d, n, sig, site, sx0


@rule("cumsum", cases=[
    Case("rows-uneven", (3,), {"x": (5, 4)}, lambda o, x: (o.cumsum(x, 1), o.cumsum(x, -2))),
    Case("positions-of-a-mask", (2,), {"x": (3, 6)}, lambda o, x: o.sub(o.cumsum(o.gt(x, 0.0), -1), 1)),
    Case("mesh2x2", (2, 2), {"x": (4, 3, 6)}, lambda o, x: o.cumsum(x, 1)),
])
def cumsum_other_axis(e):
    """cumsum(x, dim)[shard of axis a != dim] = cumsum(x[shard of a], dim): every rank scans whole rows"""
    dim = e.attr("dim") % max(e["x"].ndim, 1)
    for k in range(e["x"].ndim):
        if k != dim:
            yield e.strategy(out=S(k), x=S(k))


@rule("cumsum", cases=[
    Case("partial", (2,), {"x": (3, 4), "w": (5, 4)}, lambda o, x, w: o.cumsum(o.linear(x, w), 0)),
    Case("partial-mesh2x2", (2, 2), {"x": (3, 4)}, lambda o, x: o.cumsum(o.sum(x, 1, keepdim=True), 0)),
])
def cumsum_of_partial(e):
    """cumsum(sum_r x_r) = sum_r cumsum(x_r): cumsum is linear, so the cumsum of a partial is a partial (of
    floats: a mask or an index is never a pending sum)"""
    if e["x"].dtype.is_floating_point:
        yield e.strategy(out=P, x=P)


@rule("argsort", cases=[
    Case("rows-uneven", (3,), {"x": (5, 4)}, lambda o, x: (o.argsort(x, 1), o.argsort(x, 0, descending=True))),
    Case("ids-mesh2x2", (2, 2), {"ids": indices((4, 6), 3)}, lambda o, ids: o.argsort(ids, -1)),
])
def argsort_other_axis(e):
    """argsort(x, dim)[shard of axis a != dim] = argsort(x[shard of a], dim): every rank sorts whole rows"""
    dim = e.attr("dim") % max(e["x"].ndim, 1)
    for k in range(e["x"].ndim):
        if k != dim:
            yield e.strategy(out=S(k), x=S(k))


# ---------------------------------------------------------------------- the same identities as egglog rules

@egglog_form(cumsum_other_axis)
def _cumsum_other_axis(spec):
    """cumsum(x, dim)[shard of a != dim] = cumsum(x[shard of a], dim)"""
    yield erule(site("cumsum"), AxisMap(sig, 0, a, b), MeshSize(d)).then(ax([S_(a)], [S_(b)]))


@egglog_form(cumsum_of_partial)
def _cumsum_of_partial(spec):
    """cumsum(sum_r x_r) = sum_r cumsum(x_r), of floats"""
    yield erule(site("cumsum"), FloatSize(sx0, n), MeshSize(d)).then(ax([P_()], [P_()]))


@egglog_form(argsort_other_axis)
def _argsort_other_axis(spec):
    """argsort(x, dim)[shard of a != dim] = argsort(x[shard of a], dim)"""
    yield erule(site("argsort"), AxisMap(sig, 0, a, b), MeshSize(d)).then(ax([S_(a)], [S_(b)]))


scans = family_ruleset("scans")
