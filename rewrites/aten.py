"""ATen-evaluated ops: linear and matmul (column-, row-, batch- and sequence-parallel), sdpa on batch or
heads, embedding on the vocabulary, gathers on class-sharded logits."""
from __future__ import annotations

from . import P, R, S, rule


@rule("linear")
def linear_column_parallel(e):
    """x @ w[shard of out-features].T = (x @ w.T)[.., shard]: column-parallel, bias sharded alike"""
    yield e.strategy(out=S(e.out.ndim - 1), weight=S(0), **({"bias": S(0)} if e.has("bias") else {}))


@rule("linear")
def linear_row_parallel(e):
    """x @ w.T = sum_r x[.., shard r] @ w[:, shard r].T: row-parallel, a partial; the bias is added on
    one rank of the axis only, so it is added once"""
    flags = ("bias_once",) if e.has("bias") else ()
    yield e.strategy(out=P, x=S(e["x"].ndim - 1), weight=S(1), flags=flags)


@rule("linear")
def linear_batch_parallel(e):
    """linear acts on the last axis only: a shard of any leading (batch or sequence) axis stays local"""
    for a in range(e["x"].ndim - 1):
        yield e.strategy(out=S(a), x=S(a))


@rule("linear")
def linear_of_partial(e):
    """(sum_r x_r) @ w.T = sum_r x_r @ w.T and x @ (sum_r w_r).T alike; a bias is added once"""
    flags = ("bias_once",) if e.has("bias") else ()
    yield e.strategy(out=P, x=P, flags=flags)
    yield e.strategy(out=P, weight=P, flags=flags)


def _batch_sources(e, out_axis):
    """For a matmul output batch axis: each operand's matching axis, or None where it broadcasts."""
    out = e.out
    res = {}
    for o in e.operands:
        k = out_axis - (out.ndim - o.ndim)
        res[o.param] = S(k) if k >= 0 and o.shape[k] == out.shape[out_axis] else R
    return res


@rule("matmul")
def matmul_sharded(e):
    """a @ b on a shard of a batch axis, of a's rows or of b's columns is local to the shard"""
    out = e.out
    for i in range(out.ndim - 2):
        yield e.strategy(out=S(i), **_batch_sources(e, i))
    yield e.strategy(out=S(out.ndim - 2), a=S(e["a"].ndim - 2))
    yield e.strategy(out=S(out.ndim - 1), b=S(e["b"].ndim - 1))


@rule("matmul")
def matmul_contraction_sharded(e):
    """a @ b = sum_r a[.., shard r] @ b[shard r, ..]: a shard of the contracted axis gives a partial"""
    yield e.strategy(out=P, a=S(e["a"].ndim - 1), b=S(e["b"].ndim - 2))


@rule("matmul")
def matmul_of_partial(e):
    """(sum_r a_r) @ b = sum_r a_r @ b, and a @ (sum_r b_r) alike"""
    yield e.strategy(out=P, a=P)
    yield e.strategy(out=P, b=P)


@rule("sdpa")
def sdpa_batch_or_heads(e):
    """attention is independent per batch element and per head: q, k, v sharded alike on either"""
    for a in (0, 1):
        yield e.strategy(out=S(a), q=S(a), k=S(a), v=S(a))


@rule("sdpa")
def sdpa_query_sequence(e):
    """each query row attends to all keys: a shard of the queries with k, v replicated is local
    (causal masks are offset by the shard's first position)"""
    flags = ("q_offset",) if e.attr("is_causal") else ()
    yield e.strategy(out=S(2), q=S(2), flags=flags)


@rule("sdpa")
def sdpa_value_dim(e):
    """attention weights do not depend on v's head_dim: a shard of it passes through"""
    yield e.strategy(out=S(3), v=S(3))


@rule("embedding")
def embedding_sharded(e):
    """weight[idx[shard]] = weight[idx][shard]; weight[:, cols][idx] = weight[idx][.., cols]"""
    for a in range(e["indices"].ndim):
        yield e.strategy(out=S(a), indices=S(a))
    yield e.strategy(out=S(e.out.ndim - 1), weight=S(1))


@rule("embedding")
def embedding_vocab_parallel(e):
    """weight[idx] = sum_r (weight_r[idx - start_r] where idx in rank r's rows, else 0): vocab-parallel,
    a partial"""
    yield e.strategy(out=P, weight=S(0), flags=("vocab_parallel",))


@rule("take_along_axis")
def take_along_other_axis(e):
    """gathering along one axis keeps a shard of another, index sharded alike"""
    x, dim = e["x"], e.attr("dim") % e["x"].ndim
    for a in range(x.ndim):
        if a != dim:
            idx = S(a) if e["index"].shape[a] == x.shape[a] else R
            yield e.strategy(out=S(a), x=S(a), index=idx)


@rule("take_along_axis")
def take_along_sharded_axis(e):
    """x[.., idx] = sum_r (x_r[.., idx - start_r] where idx in rank r's part, else 0): a partial
    (cross entropy on class-sharded logits picks the target logit this way)"""
    dim = e.attr("dim") % e["x"].ndim
    yield e.strategy(out=P, x=S(dim), flags=("masked_gather",))
