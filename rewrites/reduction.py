"""Reductions and rfactor: a reduction over a sharded axis becomes a local reduction plus a partial
(pending sum or max) that a collective resolves; over other axes the shard passes through.

Composites that reduce (softmax, layer_norm, rms_norm, var_mean, mean, cross_entropy) keep their
own rules for shards on non-reduced axes; over a sharded reduced axis they go through their
decomposition (the optimizer adds it to the e-graph as an equal logical term), where these rules
for sum, amax, mean and the Welford pair apply: that is nvFuser's rfactor of a DID reduction.
"""
from __future__ import annotations

from egglog import rule as erule

from egraph_did.ops import CROSS_ENTROPY_GLOBAL_COUNT, MEAN_GLOBAL_COUNT, OPS, ops_where

from .rules import P, PMAX, S, Case, egglog_form, family_ruleset, indices, rule
from .sorts import P as P_, Pmax as Pmax_, R as R_, S as S_
from .sorts import AttrI, AttrS, AxisMap, MeshSize, Reduced, a, attr_text, ax, b, d, sig, site


def _dims(e, param="x"):
    x = e[param]
    dims = e.attr("dims")
    if dims is None:
        return tuple(range(x.ndim))
    dims = (dims,) if isinstance(dims, int) else dims
    return tuple(sorted(d % x.ndim for d in dims))


def _kept(e, a: int, dims) -> int:
    """Where input axis a lands in the output of a reduction over dims."""
    return a if e.attr("keepdim") else a - sum(d < a for d in dims)


# every reduction over `dims` (sum, mean, amax, amin, prod, any, all, var_mean): the op table's
REDUCE_OVER_DIMS = tuple(n for n in ops_where(kind="reduction") if "dims" in OPS[n].signature.parameters)


@rule(*REDUCE_OVER_DIMS, cases=[
    Case("sum-mean-amax-uneven", (3,), {"x": (5, 4), "y": (4, 5)}, lambda o, x, y: (
        o.sum(x, 1), o.mean(x, 1, keepdim=True), o.amax(y, 0))),
    # reductions with no partial placement (no pending min, product or or): only a kept axis stays sharded
    Case("amin-prod-uneven", (3,), {"x": (5, 4), "y": (4, 5)}, lambda o, x, y: (
        o.amin(x, 1), o.prod(y, 0, keepdim=True), o.amin(x, -1, keepdim=True))),
    Case("any-all-of-a-mask", (2,), {"x": (3, 5, 4)}, lambda o, x: (
        o.any(o.gt(x, 0.0), 1), o.all(o.gt(x, -1.0), (0, -1)), o.any(o.lt(x, 0.0), None, keepdim=True))),
    Case("several-axes-dropped", (3,), {"x": (4, 3, 5, 7)}, lambda o, x: (
        o.prod(x, (1, -2)), o.amin(x, (0, 2), keepdim=True), o.all(o.ne(x, 0.0), (-3, 3)))),
    Case("mesh2x2-amin-prod", (2, 2), {"x": (4, 6, 3)}, lambda o, x: (o.amin(x, 2), o.prod(x, (0,), keepdim=True))),
    Case("var_mean", (2,), {"x": (5, 6)}, lambda o, x: o.var_mean(x, 1)),
    Case("var_mean-keepdim", (3,), {"x": (5, 6)}, lambda o, x: o.var_mean(x, 1, correction=0, keepdim=True)),
    Case("mesh2x2", (2, 2), {"x": (4, 6, 3)}, lambda o, x: o.sum(x, 2)),
])
def reduce_other_axis(e):
    """reducing axes other than the sharded one keeps the shard: f(x, d)[shard] = f(x[shard], d)"""
    dims = _dims(e)
    for a in range(e["x"].ndim):
        if a not in dims:
            yield e.strategy(out=S(_kept(e, a, dims)), x=S(a))


@rule("sum", cases=[
    Case("uneven", (3,), {"x": (3, 7)}, lambda o, x: o.sum(x, 1)),
    Case("all-axes", (3,), {"x": (5, 4)}, lambda o, x: o.sum(x)),
    Case("mesh2x2", (2, 2), {"x": (4, 6)}, lambda o, x: o.sum(x, (0, 1), keepdim=True)),
    Case("mesh2x2-nested-uneven", (2, 2), {"x": (2, 13)}, lambda o, x: o.sum(x, 1)),
])
def sum_over_sharded_axis(e):
    """sum over a sharded axis is a local sum, then a partial: sum(x) = sum_r sum(x_r)"""
    for a in _dims(e):
        yield e.strategy(out=P, x=S(a))


@rule("mean", cases=[
    Case("uneven", (3,), {"x": (3, 7)}, lambda o, x: o.mean(x, 1)),
    Case("all-axes-keepdim", (3,), {"x": (5, 4)}, lambda o, x: o.mean(x, None, keepdim=True)),
    Case("mesh2x2", (2, 2), {"x": (4, 6)}, lambda o, x: o.mean(x, (0, 1))),
    Case("mesh2x2-nested-uneven", (2, 2), {"x": (2, 13)}, lambda o, x: o.mean(x, 1)),
])
def mean_over_sharded_axis(e):
    """mean over a sharded axis: sum_r (sum(x_r) / n), a partial (the local kernel divides by the global n)"""
    for a in _dims(e):
        yield e.strategy(out=P, x=S(a), local=MEAN_GLOBAL_COUNT)


@rule("sum", "mean", cases=[
    Case("sum-mean", (2,), {"x": (3, 4)}, lambda o, x: (o.sum(x, 0), o.mean(x, 1))),
    Case("mesh2x2", (2, 2), {"x": (2, 3)}, lambda o, x: o.sum(x)),
])
def reduce_partial(e):
    """sum(sum_r x_r) = sum_r sum(x_r): a sum of a partial is a partial"""
    yield e.strategy(out=P, x=P)


@rule("amax", cases=[
    Case("uneven", (3,), {"x": (3, 7)}, lambda o, x: o.amax(x, 1)),
    Case("all-axes", (3,), {"x": (5, 4)}, lambda o, x: o.amax(x)),
    Case("mesh2x2-keepdim", (2, 2), {"x": (4, 6)}, lambda o, x: o.amax(x, (0, 1), keepdim=True)),
])
def amax_over_sharded_axis(e):
    """max over a sharded axis is a local max, then a pending max: amax(x) = max_r amax(x_r)"""
    for a in _dims(e):
        yield e.strategy(out=PMAX, x=S(a))
    yield e.strategy(out=PMAX, x=PMAX)


@rule("welford_blocks", nestable=False, cases=[
    Case("dim-uneven", (2,), {"x": (4, 5)}, lambda o, x: o.welford_blocks(x, 1, 2)),
    Case("dim-uneven-3", (3,), {"x": (2, 7)}, lambda o, x: o.welford_blocks(x, -1, 3)),
    Case("other-axis", (3,), {"x": (5, 6)}, lambda o, x: o.welford_blocks(x, 1, 2)),
    Case("mesh2x2", (2, 2), {"x": (4, 6)}, lambda o, x: o.welford_blocks(x, 1, 2)),
])
def welford_blocks_sharded(e):
    """Welford statistics of one block per rank need no data from other ranks: blocks sharded as x was"""
    x, dim = e["x"], e.attr("dim") % e["x"].ndim
    for a in range(x.ndim):
        if a != dim:
            yield e.strategy(out=S(a), x=S(a))
        elif e.attr("blocks") == e.d:
            yield e.strategy(out=S(a), x=S(a))


@rule("welford_merge", cases=[
    Case("uneven", (3,), {"x": (5, 6)}, lambda o, x: o.welford_merge(o.welford_blocks(x, 1, 2), 1)),
    Case("keepdim", (2,), {"x": (4, 3, 6)}, lambda o, x: o.welford_merge(
        o.welford_blocks(x, 2, 2), 2, correction=0, keepdim=True)),
    Case("negative-dim", (3,), {"x": (6, 5)}, lambda o, x: o.welford_merge(o.welford_blocks(x, -2, 3), -2)),
    Case("negative-dim-keepdim", (2,), {"x": (3, 4, 6)}, lambda o, x: o.welford_merge(
        o.welford_blocks(x, -1, 2), -1, keepdim=True)),
])
def welford_merge_other_axis(e):
    """merging Welford blocks along one axis keeps a shard on another"""
    rank = e["stats"].ndim - 1  # the trailing axis holds (count, mean, M2); dim counts without it
    dim, keep = e.attr("dim") % rank, e.attr("keepdim")
    for a in range(rank):
        if a != dim:
            yield e.strategy(out=S(a if keep or a < dim else a - 1), stats=S(a))


@rule("softmax", cases=[
    Case("uneven", (3,), {"x": (5, 4)}, lambda o, x: o.softmax(x, 1)),
    Case("dim0", (2,), {"x": (3, 5, 4)}, lambda o, x: o.softmax(x, 0)),
])
def softmax_other_axis(e):
    """softmax along an unsharded axis is local: softmax(x, d)[shard] = softmax(x[shard], d)"""
    dim = e.attr("dim") % e["x"].ndim
    for a in range(e["x"].ndim):
        if a != dim:
            yield e.strategy(out=S(a), x=S(a))


@rule("layer_norm", "rms_norm", cases=[
    Case("layer_norm-uneven", (3,), {"x": (5, 3, 4), "w": (4,), "b": (4,)},
         lambda o, x, w, b: o.layer_norm(x, weight=w, bias=b)),
    Case("rms_norm-2d-weight", (2,), {"x": (3, 4, 6), "w": (4, 6)}, lambda o, x, w: o.rms_norm(x, weight=w)),
    Case("layer_norm-normalized_shape", (2,), {"x": (3, 4, 6)}, lambda o, x: o.layer_norm(x, (4, 6))),
    Case("mesh2x2", (2, 2), {"x": (4, 6, 5)}, lambda o, x: o.rms_norm(x, 5)),
])
def norm_batch_axis(e):
    """normalizing the trailing axes is local to a shard of a leading axis; weight and bias replicated"""
    x = e["x"]
    k = len(e["weight"].shape) if e.has("weight") else len(e.attr("normalized_shape") or (1,)) \
        if not isinstance(e.attr("normalized_shape"), int) else 1
    for a in range(x.ndim - k):
        yield e.strategy(out=S(a), x=S(a))


@rule("cross_entropy", cases=[
    Case("uneven", (3,), {"logits": (5, 4), "t": indices((5,), 4)}, lambda o, logits, t: (
        o.cross_entropy(logits, t, "none"), o.cross_entropy(logits, t, "sum"), o.cross_entropy(logits, t))),
    Case("mesh2x2", (2, 2), {"logits": (7, 3), "t": indices((7,), 3)}, lambda o, logits, t: o.cross_entropy(logits, t)),
    Case("ignore_index", (3,), {"logits": (5, 4), "t": indices((5,), 4)}, lambda o, logits, t: (
        o.cross_entropy(logits, t, "none", ignore_index=2), o.cross_entropy(logits, t, "sum", ignore_index=2),
        o.cross_entropy(logits, t, ignore_index=2))),
])
def cross_entropy_batch_sharded(e):
    """cross entropy of a shard of rows: per-row losses sharded, their sum or mean a partial. A mean with
    ignore_index divides by the rows not ignored, which no rank counts alone: it goes through the
    decomposition (a partial sum of the losses over a partial sum of the kept rows)"""
    red = e.attr("reduction")
    if red == "mean" and e.attr("ignore_index") is not None:
        return
    out = S(0) if red == "none" else P
    local = CROSS_ENTROPY_GLOBAL_COUNT if red == "mean" else None
    yield e.strategy(out=out, logits=S(0), target=S(0), local=local)


# ---------------------------------------------------------------------- the same identities as egglog rules
# Each derives the per-mesh-axis relation Ax (rewrites/sorts.py) for the ops its Python rule covers, from
# the op's axis facts (AxisMap: output axis b is input axis a; Reduced: a reduced axis of operand 0).

@egglog_form(reduce_other_axis)
def _reduce_other_axis(spec):
    """sum(x, d)[shard] = sum(x[shard], d): a kept axis stays sharded, where the reduction moves it"""
    for name in spec.ops:
        n_out = 2 if name == "var_mean" else 1
        yield erule(site(name, 1, n_out), AxisMap(sig, 0, a, b), MeshSize(d)).then(ax([S_(a)], [S_(b)] * n_out))


@egglog_form(sum_over_sharded_axis)
def _sum_over_sharded_axis(spec):
    """sum(x) = sum_r sum(x_r): a local sum over a sharded reduced axis, then a partial"""
    yield erule(site("sum"), Reduced(sig, a), MeshSize(d)).then(ax([S_(a)], [P_()]))


@egglog_form(mean_over_sharded_axis)
def _mean_over_sharded_axis(spec):
    """mean(x) = sum_r (sum(x_r) / n): a partial, the local kernel dividing by the global count"""
    yield erule(site("mean"), Reduced(sig, a), MeshSize(d)).then(ax([S_(a)], [P_()], MEAN_GLOBAL_COUNT))


@egglog_form(reduce_partial)
def _reduce_partial(spec):
    """sum(sum_r x_r) = sum_r sum(x_r): a sum of a partial is a partial"""
    for name in spec.ops:
        yield erule(site(name), MeshSize(d)).then(ax([P_()], [P_()]))


@egglog_form(amax_over_sharded_axis)
def _amax_over_sharded_axis(spec):
    """amax(x) = max_r amax(x_r): a local max over a sharded reduced axis, or of a pending max, then a pending max"""
    yield erule(site("amax"), Reduced(sig, a), MeshSize(d)).then(ax([S_(a)], [Pmax_()]))
    yield erule(site("amax"), MeshSize(d)).then(ax([Pmax_()], [Pmax_()]))


@egglog_form(welford_blocks_sharded)
def _welford_blocks_sharded(spec):
    """Welford blocks of a shard need no other rank: any other axis, or the blocked one at one block per rank"""
    yield erule(site("welford_blocks"), AxisMap(sig, 0, a, b), MeshSize(d)).then(ax([S_(a)], [S_(b)], nestable=False))
    yield erule(site("welford_blocks"), Reduced(sig, a), AttrI(sig, "blocks", d), MeshSize(d)).then(
        ax([S_(a)], [S_(a)], nestable=False))


@egglog_form(welford_merge_other_axis)
def _welford_merge_other_axis(spec):
    """merging Welford blocks along one axis keeps a shard on another"""
    yield erule(site("welford_merge", 1, 2), AxisMap(sig, 0, a, b), MeshSize(d)).then(ax([S_(a)], [S_(b)] * 2))


@egglog_form(softmax_other_axis)
def _softmax_other_axis(spec):
    """softmax(x, d)[shard] = softmax(x[shard], d) along an unsharded axis"""
    yield erule(site("softmax"), AxisMap(sig, 0, a, b), MeshSize(d)).then(ax([S_(a)], [S_(b)]))


@egglog_form(norm_batch_axis)
def _norm_batch_axis(spec):
    """normalizing the trailing axes is local to a shard of a leading axis; weight and bias replicated"""
    for name in spec.ops:
        for n_in in (1, 2, 3):
            yield erule(site(name, n_in), AxisMap(sig, 0, a, b), MeshSize(d)).then(
                ax([S_(a)] + [R_()] * (n_in - 1), [S_(b)]))


@egglog_form(cross_entropy_batch_sharded)
def _cross_entropy_batch_sharded(spec):
    """cross entropy of a shard of rows: per-row losses sharded, their sum or mean a partial"""
    for red, out, kernel in (("none", S_(0), None), ("sum", P_(), None)):
        yield erule(site("cross_entropy", 2), AttrS(sig, "reduction", attr_text(red)), MeshSize(d)).then(
            ax([S_(0), S_(0)], [out], kernel))
    yield erule(site("cross_entropy", 2), AttrS(sig, "reduction", attr_text("mean")),
                AttrS(sig, "ignore_index", attr_text(None)), MeshSize(d)).then(
        ax([S_(0), S_(0)], [P_()], CROSS_ENTROPY_GLOBAL_COUNT))


reduction = family_ruleset("reduction")
