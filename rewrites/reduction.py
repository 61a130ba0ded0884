"""Reductions and rfactor: a reduction over a sharded axis becomes a local reduction plus a partial
(pending sum or max) that a collective resolves; over other axes the shard passes through.

Composites that reduce (softmax, layer_norm, rms_norm, var_mean, mean, cross_entropy) keep their
own rules for shards on non-reduced axes; over a sharded reduced axis they go through their
decomposition (the optimizer adds it to the e-graph as an equal logical term), where these rules
for sum, amax, mean and the Welford pair apply: that is nvFuser's rfactor of a DID reduction.
"""
from __future__ import annotations

from . import P, PMAX, S, rule


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


@rule("sum", "mean", "amax", "var_mean")
def reduce_other_axis(e):
    """reducing axes other than the sharded one keeps the shard: sum(x, d)[shard] = sum(x[shard], d)"""
    dims = _dims(e)
    for a in range(e["x"].ndim):
        if a not in dims:
            yield e.strategy(out=S(_kept(e, a, dims)), x=S(a))


@rule("sum")
def sum_over_sharded_axis(e):
    """sum over a sharded axis is a local sum, then a partial: sum(x) = sum_r sum(x_r)"""
    for a in _dims(e):
        yield e.strategy(out=P, x=S(a))


@rule("mean")
def mean_over_sharded_axis(e):
    """mean over a sharded axis: sum_r (sum(x_r) / n), a partial (the local kernel divides by the global n)"""
    for a in _dims(e):
        yield e.strategy(out=P, x=S(a), flags=("global_count",))


@rule("sum", "mean")
def reduce_partial(e):
    """sum(sum_r x_r) = sum_r sum(x_r): a sum of a partial is a partial"""
    yield e.strategy(out=P, x=P)


@rule("amax")
def amax_over_sharded_axis(e):
    """max over a sharded axis is a local max, then a pending max: amax(x) = max_r amax(x_r)"""
    for a in _dims(e):
        yield e.strategy(out=PMAX, x=S(a))
    yield e.strategy(out=PMAX, x=PMAX)


@rule("welford_blocks")
def welford_blocks_sharded(e):
    """Welford statistics of one block per rank need no data from other ranks: blocks sharded as x was"""
    x, dim = e["x"], e.attr("dim") % e["x"].ndim
    for a in range(x.ndim):
        if a != dim:
            yield e.strategy(out=S(a), x=S(a))
        elif e.attr("blocks") == e.d:
            yield e.strategy(out=S(a), x=S(a))


@rule("welford_merge")
def welford_merge_other_axis(e):
    """merging Welford blocks along one axis keeps a shard on another"""
    rank = e["stats"].ndim - 1  # the trailing axis holds (count, mean, M2); dim counts without it
    dim, keep = e.attr("dim") % rank, e.attr("keepdim")
    for a in range(rank):
        if a != dim:
            yield e.strategy(out=S(a if keep or a < dim else a - 1), stats=S(a))


@rule("softmax")
def softmax_other_axis(e):
    """softmax along an unsharded axis is local: softmax(x, d)[shard] = softmax(x[shard], d)"""
    dim = e.attr("dim") % e["x"].ndim
    for a in range(e["x"].ndim):
        if a != dim:
            yield e.strategy(out=S(a), x=S(a))


@rule("layer_norm", "rms_norm")
def norm_batch_axis(e):
    """normalizing the trailing axes is local to a shard of a leading axis; weight and bias replicated"""
    x = e["x"]
    k = len(e["weight"].shape) if e.has("weight") else len(e.attr("normalized_shape") or (1,)) \
        if not isinstance(e.attr("normalized_shape"), int) else 1
    for a in range(x.ndim - k):
        yield e.strategy(out=S(a), x=S(a))


@rule("cross_entropy")
def cross_entropy_batch_sharded(e):
    """cross entropy of a shard of rows: per-row losses sharded, their sum or mean a partial"""
    red = e.attr("reduction")
    out = S(0) if red == "none" else P
    flags = ("global_count",) if red == "mean" else ()
    yield e.strategy(out=out, logits=S(0), target=S(0), flags=flags)
