"""Sharding rules of the ops models exported from PyTorch need (egraph_did.frontend): slice and cat
(rotary embeddings cut the head dimension in halves and join them again, while the heads are split over
ranks), both along an axis other than the split one. where and the comparisons are pointwise (their
rules come from the pointwise family by query); a slice of a partial is a partial through the views
family (slice is a view)."""
from __future__ import annotations

from egglog import rule as erule

from .rules import P, S, Case, egglog_form, family_ruleset, rule
from .sorts import P as P_, S as S_
from .sorts import AxisMap, MeshSize, a, ax, b, d, sig, site


def _dim(e, param: str) -> int:
    return e.attr("dim") % e[param].ndim


def _rotate_half(o, x):
    """cat(-x[..., h:], x[..., :h]): the rotary embedding's half swap, on the last axis"""
    h = x.shape[-1] // 2
    return o.cat(o.neg(o.slice(x, -1, h)), o.slice(x, -1, 0, h), -1)


@rule("slice", cases=[
    Case("rows-kept-uneven", (3,), {"x": (5, 6)}, lambda o, x: o.slice(x, 1, 1, -2)),
    Case("rows-kept-empty-rank", (4,), {"x": (3, 6)}, lambda o, x: o.slice(x, 1, 2)),
    Case("heads-mesh2x2", (2, 2), {"x": (2, 4, 3, 6)}, lambda o, x: (o.slice(x, -1, 3), o.slice(x, 2, 0, 2))),
])
def slice_other_axis(e):
    """slice(x, dim)[shard of axis a != dim] = slice(x[shard of a], dim): every rank keeps the same range"""
    for a in range(e["x"].ndim):
        if a != _dim(e, "x"):
            yield e.strategy(out=S(a), x=S(a))


@rule("cat", cases=[
    Case("rotate-half-heads", (2,), {"x": (2, 4, 3, 6)}, _rotate_half),
    Case("rows-uneven-mesh2x2", (2, 2), {"a": (5, 2), "b": (5, 3)}, lambda o, a, b: o.cat(a, b, 1)),
])
def cat_other_axis(e):
    """cat(a, b, dim)[shard of axis k != dim] = cat(a[shard of k], b[shard of k], dim)"""
    for k in range(e.out.ndim):
        if k != _dim(e, "a"):
            yield e.strategy(out=S(k), a=S(k), b=S(k))


@rule("cat", cases=[
    Case("partials", (2,), {"a": (3, 2), "b": (3, 4)}, lambda o, a, b: o.cat(a, b, -1)),
    Case("partials-mesh2x2", (2, 2), {"a": (2, 3), "b": (1, 3)}, lambda o, a, b: o.cat(a, b, 0)),
])
def cat_of_partials(e):
    """cat(sum_r a_r, sum_r b_r) = sum_r cat(a_r, b_r): joining two partials is a partial"""
    yield e.strategy(out=P, a=P, b=P)


# ---------------------------------------------------------------------- the same identities as egglog rules
# Each derives the per-mesh-axis relation Ax (rewrites/sorts.py) from the op's axis facts (egraph._axis_facts:
# AxisMap(sig, operand, a, a) for every axis but the sliced or joined one). cat's operands: a, b.

@egglog_form(slice_other_axis)
def _slice_other_axis(spec):
    """slice(x, dim)[shard of axis a != dim] = slice(x[shard of a], dim)"""
    yield erule(site("slice"), AxisMap(sig, 0, a, b), MeshSize(d)).then(ax([S_(a)], [S_(b)]))


@egglog_form(cat_other_axis)
def _cat_other_axis(spec):
    """cat(a, b, dim)[shard of axis k != dim] = cat(a[shard of k], b[shard of k], dim)"""
    yield erule(site("cat", 2), AxisMap(sig, 0, a, b), AxisMap(sig, 1, a, b), MeshSize(d)).then(
        ax([S_(a), S_(a)], [S_(b)]))


@egglog_form(cat_of_partials)
def _cat_of_partials(spec):
    """cat(sum_r a_r, sum_r b_r) = sum_r cat(a_r, b_r)"""
    yield erule(site("cat", 2), MeshSize(d)).then(ax([P_(), P_()], [P_()]))


frontend_ops = family_ruleset("frontend_ops")
