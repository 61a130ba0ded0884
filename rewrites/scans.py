"""Sharding rules of scans (cumsum) and of the reductions that have no partial placement (amin, prod, any,
all): the ops a model's masks and positions are made of (a causal mask from cumsum of an attention mask,
a padding check by any).

- A reduction without a partial keeps a shard on an axis it does not reduce. Over a sharded reduced axis
  it has no local form: there is no pending min, product or or (Pmax is a pending max only), so that
  axis is gathered first (the replicated rule covers it).
- cumsum keeps a shard on any axis but the scanned one. Along the scanned axis it is not local (a rank's
  running sum needs the totals of the ranks before it), so no rule covers it. cumsum is linear, so the
  cumsum of a partial is a partial.

The egglog forms read the axis facts of the reduction family (AxisMap: a kept axis and where it lands;
Reduced). egraph._axis_facts writes them for the ops it names; for these ops, rules here derive them in
the e-graph from the literal attributes of the op's term, `Def(T(y), op_amin(T(x), Lit("[0, -1]"),
Lit("false")))`: an axis is reduced where its position, or its position counted from the end, is in the
dims list (null: every axis), and a kept axis lands after the kept axes before it.

>>> from egraph_did.rewrites.rules import Operand, OpView, axis_strategies
>>> e = OpView("amin", (Operand("x", (4, 6)),), (("dims", 1), ("keepdim", False)), (Operand("out", (4,)),), d=2)
>>> [(s.rule, str(s.inputs[0]), str(s.outputs[0])) for s in axis_strategies(e)]
[('reduce_kept_axis', 'S(0)', 'S(0)'), ('replicated', 'R', 'R')]
"""
from __future__ import annotations

from egglog import String, eq, i64, ne, relation, var
from egglog import rule as erule

from .rules import P, S, Case, egglog_form, family_ruleset, rule
from .sorts import P as P_, S as S_
from .sorts import (OPS_SORT, SIG, SITE, AxisMap, Def, Extent, FloatSize, Lit, MeshSize, Rank, Reduced, Tensor, a, ax,
                    b, d, n, op, r, sig, site, sx0, sy)
from .reduction import _dims, _kept

NO_PARTIAL_REDUCTIONS = ("amin", "prod", "any", "all")


@rule(*NO_PARTIAL_REDUCTIONS, cases=[
    Case("amin-prod-uneven", (3,), {"x": (5, 4), "y": (4, 5)}, lambda o, x, y: (
        o.amin(x, 1), o.prod(y, 0), o.amin(y, -1, keepdim=True), o.prod(x, 1, keepdim=True))),
    Case("any-all-of-a-mask", (2,), {"x": (3, 5, 4)}, lambda o, x: (
        o.any(o.gt(x, 0.0), 1), o.all(o.gt(x, -1.0), (0, -1)), o.any(o.lt(x, 0.0), None, keepdim=True))),
    Case("several-axes-dropped", (3,), {"x": (4, 3, 5, 7)}, lambda o, x: (
        o.prod(x, (1, -2)), o.amin(x, (0, 2), keepdim=True), o.all(o.ne(x, 0.0), (-3, 3)))),
    Case("mesh2x2", (2, 2), {"x": (4, 6, 3)}, lambda o, x: (o.amin(x, 2), o.prod(x, (0,), keepdim=True))),
])
def reduce_kept_axis(e):
    """reducing axes other than the sharded one keeps the shard: amin(x, d)[shard] = amin(x[shard], d)"""
    dims = _dims(e)
    for k in range(e["x"].ndim):
        if k not in dims:
            yield e.strategy(out=S(_kept(e, k, dims)), x=S(k))


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


# ---------------------------------------------------------------------- the same identities as egglog rules
# The axis facts (AxisMap, Reduced) of these ops, from the literal attributes of their terms; then the
# rows, as the reduction family's forms derive them for sum and amax.

# sig, the reduced dims as a list to search (", 0, -1,"; "all" for dims=None), the keepdim literal
ReduceDims = relation("ScanReduceDims", String, String, String, egg_fn="ScanReduceDims")
Kept = relation("ScanKept", String, i64, egg_fn="ScanKept")  # sig, an axis of operand 0 the op keeps
KeptBefore = relation("ScanKeptBefore", String, i64, i64, egg_fn="ScanKeptBefore")  # sig, axis, kept axes before it

t, x = var("t", Tensor), var("x", Tensor)
key, ds, ks, w = (var(v, String) for v in ("key", "ds", "ks", "w"))
c = var("c", i64)


def _entry(k) -> String:
    """How axis position k appears in a ReduceDims list."""
    return String(", ") + k.to_string() + String(",")


def _lists(pos) -> object:
    """The list w holds position pos (replacing it changes w)."""
    return ne(w.replace(_entry(pos), String(""))).to(w)


def _misses(pos) -> object:
    return eq(w.replace(_entry(pos), String(""))).to(w)


def _reduction_axis_facts(names):
    """AxisMap and Reduced of reductions `names`, whose terms are op(x, Lit(dims), Lit(keepdim))."""
    for name in names:
        app = OPS_SORT[name](x, Lit(ds), Lit(ks))
        yield erule(SITE[(1, 1)](key, sig, t, x), Def(t, app), ne(ds).to(String("null"))).then(
            ReduceDims(sig, String(", ") + ds.replace(String("["), String("")).replace(String("]"), String(""))
                       + String(","), ks))
        yield erule(SITE[(1, 1)](key, sig, t, x), Def(t, OPS_SORT[name](x, Lit(String("null")), Lit(ks)))).then(
            ReduceDims(sig, String("all"), ks))
    axes = [SIG[(1, 1)](sig, op, sy, sx0), Rank(sx0, r), Extent(sx0, a, n)]
    yield erule(ReduceDims(sig, String("all"), ks), *axes).then(Reduced(sig, a))
    yield erule(ReduceDims(sig, w, ks), *axes, _lists(a)).then(Reduced(sig, a))
    yield erule(ReduceDims(sig, w, ks), *axes, _lists(a - r)).then(Reduced(sig, a))
    yield erule(ReduceDims(sig, w, ks), ne(w).to(String("all")), *axes, _misses(a), _misses(a - r)).then(Kept(sig, a))
    # where a kept axis lands without keepdim: after the kept axes before it
    yield erule(ReduceDims(sig, w, ks)).then(KeptBefore(sig, 0, 0))
    yield erule(KeptBefore(sig, a, c), Kept(sig, a)).then(KeptBefore(sig, a + 1, c + 1))
    yield erule(KeptBefore(sig, a, c), Reduced(sig, a)).then(KeptBefore(sig, a + 1, c))
    yield erule(Kept(sig, a), ReduceDims(sig, w, String("true"))).then(AxisMap(sig, 0, a, a))
    yield erule(Kept(sig, a), ReduceDims(sig, w, String("false")), KeptBefore(sig, a, c)).then(AxisMap(sig, 0, a, c))


@egglog_form(reduce_kept_axis)
def _reduce_kept_axis(spec):
    """amin(x, d)[shard] = amin(x[shard], d): a kept axis stays sharded, where the reduction moves it"""
    yield from _reduction_axis_facts(spec.ops)
    for name in spec.ops:
        yield erule(site(name), AxisMap(sig, 0, a, b), MeshSize(d)).then(ax([S_(a)], [S_(b)]))


@egglog_form(cumsum_other_axis)
def _cumsum_other_axis(spec):
    """cumsum(x, dim)[shard of a != dim] = cumsum(x[shard of a], dim): axis a is neither dim nor dim - rank"""
    yield erule(SITE[(1, 1)](key, sig, t, x), Def(t, OPS_SORT["cumsum"](x, Lit(ds))), site("cumsum"), Rank(sx0, r),
                Extent(sx0, a, n), ne(ds).to(a.to_string()), ne(ds).to((a - r).to_string())).then(AxisMap(sig, 0, a, a))
    yield erule(site("cumsum"), AxisMap(sig, 0, a, b), MeshSize(d)).then(ax([S_(a)], [S_(b)]))


@egglog_form(cumsum_of_partial)
def _cumsum_of_partial(spec):
    """cumsum(sum_r x_r) = sum_r cumsum(x_r), of floats"""
    yield erule(site("cumsum"), FloatSize(sx0, n), MeshSize(d)).then(ax([P_()], [P_()]))


scans = family_ruleset("scans")
