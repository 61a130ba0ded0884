"""ATen-evaluated ops: linear and matmul (column-, row-, batch- and sequence-parallel), sdpa on batch,
heads, queries or (through its rfactor, attention_blocks) keys, embedding on the vocabulary, gathers on
class-sharded logits."""
from __future__ import annotations

from egglog import i64, ne, var
from egglog import rule as erule

from egraph_did.ops import (ATTENTION_BLOCKS_CAUSAL_OFFSETS, EMBEDDING_VOCAB_PARALLEL, LINEAR_BIAS_ONCE,
                            SDPA_BACKWARD_CAUSAL_OFFSETS, SDPA_LSE_QUERY_OFFSET, SDPA_QUERY_OFFSET, TAKE_ALONG_MASKED)

from .rules import P, R, S, Case, egglog_form, family_ruleset, indices, rule
from .sorts import P as P_, R as R_, S as S_
from .sorts import (AttrI, AttrS, AxisMap, Bcast, Extent, MeshSize, Placement, Rank, Reduced, a, ax, b, d, i, m, n, r, sig, site,
                    sx0, sx1, sy)


def _bias_once(e):
    """A partial's summands add the bias on one rank of the axis only, so that it is added once."""
    return LINEAR_BIAS_ONCE if e.has("bias") else None


@rule("linear", cases=[
    Case("bias", (2,), {"x": (3, 4), "w": (6, 4), "b": (6,)}, lambda o, x, w, b: o.linear(x, w, b)),
    Case("uneven-bias", (3,), {"x": (2, 3, 4), "w": (5, 4), "b": (5,)}, lambda o, x, w, b: o.linear(x, w, b)),
    Case("mesh2x2-bias", (2, 2), {"x": (2, 4), "w": (8, 4), "b": (8,)}, lambda o, x, w, b: o.linear(x, w, b)),
    Case("mesh2x2-nested-uneven", (2, 2), {"x": (2, 3), "w": (13, 3)}, lambda o, x, w: o.linear(x, w)),
])
def linear_column_parallel(e):
    """x @ w[shard of out-features].T = (x @ w.T)[.., shard]: column-parallel, bias sharded alike"""
    yield e.strategy(out=S(e.out.ndim - 1), weight=S(0), **({"bias": S(0)} if e.has("bias") else {}))


@rule("linear", cases=[
    Case("bias", (2,), {"x": (3, 6), "w": (4, 6), "b": (4,)}, lambda o, x, w, b: o.linear(x, w, b)),
    Case("uneven-bias", (3,), {"x": (2, 7), "w": (3, 7), "b": (3,)}, lambda o, x, w, b: o.linear(x, w, b)),
    Case("no-bias", (3,), {"x": (2, 6), "w": (3, 6)}, lambda o, x, w: o.linear(x, w)),
    Case("mesh2x2-bias", (2, 2), {"x": (3, 8), "w": (5, 8), "b": (5,)}, lambda o, x, w, b: o.linear(x, w, b)),
])
def linear_row_parallel(e):
    """x @ w.T = sum_r x[.., shard r] @ w[:, shard r].T: row-parallel, a partial; the bias is added on
    one rank of the axis only, so it is added once"""
    yield e.strategy(out=P, x=S(e["x"].ndim - 1), weight=S(1), local=_bias_once(e))


@rule("linear", cases=[
    Case("uneven-bias", (3,), {"x": (5, 3, 4), "w": (2, 4), "b": (2,)}, lambda o, x, w, b: o.linear(x, w, b)),
    Case("mesh2x2", (2, 2), {"x": (4, 6, 3), "w": (5, 3)}, lambda o, x, w: o.linear(x, w)),
])
def linear_batch_parallel(e):
    """linear acts on the last axis only: a shard of any leading (batch or sequence) axis stays local"""
    for a in range(e["x"].ndim - 1):
        yield e.strategy(out=S(a), x=S(a))


@rule("linear", cases=[
    Case("bias", (2,), {"x": (3, 4), "w": (5, 4), "b": (5,)}, lambda o, x, w, b: o.linear(x, w, b)),
    Case("uneven", (3,), {"x": (5, 4), "w": (7, 4)}, lambda o, x, w: o.linear(x, w)),
    Case("mesh2x2-bias", (2, 2), {"x": (2, 3), "w": (4, 3), "b": (4,)}, lambda o, x, w, b: o.linear(x, w, b)),
])
def linear_of_partial(e):
    """(sum_r x_r) @ w.T = sum_r x_r @ w.T and x @ (sum_r w_r).T alike; a bias is added once"""
    yield e.strategy(out=P, x=P, local=_bias_once(e))
    yield e.strategy(out=P, weight=P, local=_bias_once(e))


def _batch_sources(e, out_axis):
    """For a matmul output batch axis: each operand's matching axis, or None where it broadcasts."""
    out = e.out
    res = {}
    for o in e.operands:
        k = out_axis - (out.ndim - o.ndim)
        res[o.param] = S(k) if k >= 0 and o.shape[k] == out.shape[out_axis] else R
    return res


@rule("matmul", cases=[
    Case("batched-uneven", (3,), {"a": (3, 5, 4), "b": (4, 7)}, lambda o, a, b: o.matmul(a, b)),
    Case("broadcast-batch", (3,), {"a": (2, 1, 5, 4), "b": (3, 4, 7)}, lambda o, a, b: o.matmul(a, b)),
    Case("mesh2x2", (2, 2), {"a": (4, 6, 3), "b": (3, 8)}, lambda o, a, b: o.matmul(a, b)),
])
def matmul_sharded(e):
    """a @ b on a shard of a batch axis, of a's rows or of b's columns is local to the shard"""
    out = e.out
    for i in range(out.ndim - 2):
        yield e.strategy(out=S(i), **_batch_sources(e, i))
    yield e.strategy(out=S(out.ndim - 2), a=S(e["a"].ndim - 2))
    yield e.strategy(out=S(out.ndim - 1), b=S(e["b"].ndim - 1))


@rule("matmul", cases=[
    Case("uneven", (3,), {"a": (3, 7), "b": (7, 2)}, lambda o, a, b: o.matmul(a, b)),
    Case("batched", (2,), {"a": (2, 3, 4), "b": (2, 4, 5)}, lambda o, a, b: o.matmul(a, b)),
    Case("mesh2x2", (2, 2), {"a": (3, 8), "b": (8, 2)}, lambda o, a, b: o.matmul(a, b)),
    Case("mesh2x2-nested-uneven", (2, 2), {"a": (2, 13), "b": (13, 3)}, lambda o, a, b: o.matmul(a, b)),
])
def matmul_contraction_sharded(e):
    """a @ b = sum_r a[.., shard r] @ b[shard r, ..]: a shard of the contracted axis gives a partial"""
    yield e.strategy(out=P, a=S(e["a"].ndim - 1), b=S(e["b"].ndim - 2))


@rule("matmul", cases=[
    Case("2d", (2,), {"a": (3, 4), "b": (4, 5)}, lambda o, a, b: o.matmul(a, b)),
    Case("mesh2x2", (2, 2), {"a": (2, 3), "b": (3, 2)}, lambda o, a, b: o.matmul(a, b)),
])
def matmul_of_partial(e):
    """(sum_r a_r) @ b = sum_r a_r @ b, and a @ (sum_r b_r) alike"""
    yield e.strategy(out=P, a=P)
    yield e.strategy(out=P, b=P)


@rule("sdpa", cases=[
    Case("heads-uneven", (2,), {"q": (2, 3, 4, 5), "k": (2, 3, 6, 5), "v": (2, 3, 6, 3)},
         lambda o, q, k, v: o.sdpa(q, k, v)),
    Case("causal", (3,), {"q": (3, 5, 4, 2), "k": (3, 5, 4, 2), "v": (3, 5, 4, 3)},
         lambda o, q, k, v: o.sdpa(q, k, v, is_causal=True)),
])
def sdpa_batch_or_heads(e):
    """attention is independent per batch element and per head: q, k, v sharded alike on either"""
    for a in (0, 1):
        yield e.strategy(out=S(a), q=S(a), k=S(a), v=S(a))


@rule("sdpa", cases=[
    Case("causal-uneven", (3,), {"q": (1, 2, 5, 4), "k": (1, 2, 5, 4), "v": (1, 2, 5, 3)},
         lambda o, q, k, v: o.sdpa(q, k, v, is_causal=True)),
    Case("noncausal-scale", (2,), {"q": (1, 2, 5, 4), "k": (1, 2, 6, 4), "v": (1, 2, 6, 3)},
         lambda o, q, k, v: o.sdpa(q, k, v, scale=0.3)),
    Case("causal-mesh2x2", (2, 2), {"q": (1, 1, 7, 2), "k": (1, 1, 7, 2), "v": (1, 1, 7, 2)},
         lambda o, q, k, v: o.sdpa(q, k, v, is_causal=True)),
    Case("causal-mesh2x2-nested-uneven", (2, 2), {"q": (1, 1, 13, 2), "k": (1, 1, 13, 2), "v": (1, 1, 13, 2)},
         lambda o, q, k, v: o.sdpa(q, k, v, is_causal=True)),
])
def sdpa_query_sequence(e):
    """each query row attends to all keys: a shard of the queries with k, v replicated is local
    (causal masks are offset by the shard's first position)"""
    yield e.strategy(out=S(2), q=S(2), local=SDPA_QUERY_OFFSET if e.attr("is_causal") else None)


@rule("sdpa", cases=[
    Case("causal", (2,), {"q": (1, 2, 3, 4), "k": (1, 2, 3, 4), "v": (1, 2, 3, 5)},
         lambda o, q, k, v: o.sdpa(q, k, v, is_causal=True)),
    Case("uneven", (3,), {"q": (1, 1, 2, 4), "k": (1, 1, 3, 4), "v": (1, 1, 3, 7)},
         lambda o, q, k, v: o.sdpa(q, k, v)),
])
def sdpa_value_dim(e):
    """attention weights do not depend on v's head_dim: a shard of it passes through"""
    yield e.strategy(out=S(3), v=S(3))


def _with_lse(o, q, k, v, **kw):
    """sdpa_lse's two outputs (out, lse)."""
    return tuple(o.sdpa_lse(q, k, v, **kw))


def _backward(o, g, q, k, v, **kw):
    """sdpa_backward of g from sdpa_lse's outputs: (dq, dk, dv)."""
    return tuple(o.sdpa_backward(g, q, k, v, *o.sdpa_lse(q, k, v, **kw), **kw))


ATTN = {"q": (2, 3, 5, 4), "k": (2, 3, 5, 4), "v": (2, 3, 5, 3)}
ATTN_G = {**ATTN, "g": (2, 3, 5, 3)}


def _blocks(o, q, k, v, blocks, **kw):
    """attention_blocks' two outputs (out, lse) of `blocks` pieces of the keys."""
    return tuple(o.attention_blocks(q, k, v, blocks, **kw))


@rule("sdpa_lse", "sdpa_backward", "attention_blocks", cases=[
    Case("lse-heads-uneven", (2,), ATTN, lambda o, q, k, v: _with_lse(o, q, k, v)),
    Case("blocks-causal-heads-uneven", (2,), ATTN, lambda o, q, k, v: _blocks(o, q, k, v, 2, is_causal=True)),
    Case("lse-causal-batch-mesh2x2", (2, 2), {"q": (4, 2, 3, 2), "k": (4, 2, 3, 2), "v": (4, 2, 3, 2)},
         lambda o, q, k, v: _with_lse(o, q, k, v, is_causal=True)),
    Case("backward-heads-uneven", (2,), ATTN_G, lambda o, q, k, v, g: _backward(o, g, q, k, v, is_causal=True)),
    Case("backward-batch-scale", (3,), {"q": (3, 2, 4, 2), "k": (3, 2, 6, 2), "v": (3, 2, 6, 3), "g": (3, 2, 4, 3)},
         lambda o, q, k, v, g: _backward(o, g, q, k, v, scale=0.3)),
])
def attention_batch_or_heads(e):
    """attention and its backward are independent per batch element and per head: every operand and
    output sharded alike on either"""
    for a in (0, 1):
        yield e.strategy(out=S(a), **{o.param: S(a) for o in e.operands})


@rule("sdpa_lse", cases=[
    Case("causal-uneven", (3,), {"q": (1, 2, 5, 4), "k": (1, 2, 5, 4), "v": (1, 2, 5, 3)},
         lambda o, q, k, v: _with_lse(o, q, k, v, is_causal=True)),
    Case("noncausal-scale", (2,), {"q": (1, 2, 5, 4), "k": (1, 2, 6, 4), "v": (1, 2, 6, 3)},
         lambda o, q, k, v: _with_lse(o, q, k, v, scale=0.3)),
    Case("causal-mesh2x2-nested-uneven", (2, 2), {"q": (1, 1, 13, 2), "k": (1, 1, 13, 2), "v": (1, 1, 13, 2)},
         lambda o, q, k, v: _with_lse(o, q, k, v, is_causal=True)),
])
def sdpa_lse_query_sequence(e):
    """each query row's output and logsumexp read all keys: a shard of the queries with k, v replicated is
    local (causal masks offset by the shard's first position)"""
    yield e.strategy(out=S(2), q=S(2), local=SDPA_LSE_QUERY_OFFSET if e.attr("is_causal") else None)


@rule("attention_blocks", cases=[
    Case("causal-uneven", (3,), {"q": (1, 2, 5, 4), "k": (1, 2, 5, 4), "v": (1, 2, 5, 3)},
         lambda o, q, k, v: _blocks(o, q, k, v, 3, is_causal=True)),
    Case("cross-scale", (2,), {"q": (1, 2, 5, 4), "k": (1, 2, 6, 4), "v": (1, 2, 6, 3)},
         lambda o, q, k, v: _blocks(o, q, k, v, 4, scale=0.3)),
])
def attention_blocks_query_sequence(e):
    """each query row's block outputs and logsumexps read all its keys: a shard of the queries with k, v
    replicated is local (causal masks offset by the shard's first position)"""
    yield e.strategy(out=S(3), q=S(2), local=ATTENTION_BLOCKS_CAUSAL_OFFSETS if e.attr("is_causal") else None)


@rule("attention_blocks", nestable=False, cases=[
    Case("causal-uneven", (3,), {"q": (1, 2, 7, 4), "k": (1, 2, 7, 4), "v": (1, 2, 7, 3)},
         lambda o, q, k, v: _blocks(o, q, k, v, 3, is_causal=True)),
    Case("cross-scale", (2,), {"q": (2, 1, 3, 4), "k": (2, 1, 6, 4), "v": (2, 1, 6, 5)},
         lambda o, q, k, v: _blocks(o, q, k, v, 2, scale=0.3)),
    Case("causal-mesh2x2", (2, 2), {"q": (1, 1, 7, 2), "k": (1, 1, 7, 2), "v": (1, 1, 7, 2)},
         lambda o, q, k, v: _blocks(o, q, k, v, 2, is_causal=True)),
])
def attention_blocks_key_blocks(e):
    """attention against one block of the keys per rank needs no other rank's keys: k and v split on the
    sequence as the blocks are (torch.chunk), q whole, the blocks axis split alike (causal masks offset by
    the block's first key)"""
    if e.attr("blocks") == e.d:
        yield e.strategy(out=S(2), k=S(2), v=S(2),
                         local=ATTENTION_BLOCKS_CAUSAL_OFFSETS if e.attr("is_causal") else None)


@rule("sdpa_lse", cases=[
    Case("causal", (2,), {"q": (1, 2, 3, 4), "k": (1, 2, 3, 4), "v": (1, 2, 3, 5)},
         lambda o, q, k, v: _with_lse(o, q, k, v, is_causal=True)),
])
def sdpa_lse_value_dim(e):
    """the weights and their logsumexp do not depend on v: a shard of v's head_dim passes to the output,
    the logsumexp whole on every rank"""
    yield e.strategy(out=(S(3), R), v=S(3))


# the causal cases of the backward's sequence rules: uneven shards on 3 ranks, nested uneven ones on 2x2
CAUSAL_BACKWARD_CASES = [
    Case("causal-uneven", (3,), ATTN_G, lambda o, q, k, v, g: _backward(o, g, q, k, v, is_causal=True)),
    Case("causal-mesh2x2-nested-uneven", (2, 2), {"q": (1, 1, 13, 2), "k": (1, 1, 13, 2), "v": (1, 1, 13, 2),
                                                 "g": (1, 1, 13, 2)},
         lambda o, q, k, v, g: _backward(o, g, q, k, v, is_causal=True)),
]


@rule("sdpa_backward", cases=[
    *CAUSAL_BACKWARD_CASES,
    Case("noncausal-scale", (2,), {"q": (1, 2, 5, 4), "k": (1, 2, 6, 4), "v": (1, 2, 6, 3), "g": (1, 2, 5, 3)},
         lambda o, q, k, v, g: _backward(o, g, q, k, v, scale=0.3)),
])
def sdpa_backward_query_sequence(e):
    """dq of a shard of the queries needs only those rows; dk = sum_i ds_i^T q_i and dv = sum_i p_i^T g_i
    sum over the queries, so each rank's rows give a summand: dq sharded, dk and dv partial (causal masks
    offset by the shard's first position)"""
    yield e.strategy(out=(S(2), P, P), g=S(2), q=S(2), output=S(2), lse=S(2),
                     local=SDPA_BACKWARD_CAUSAL_OFFSETS if e.attr("is_causal") else None)


@rule("sdpa_backward", cases=[
    *CAUSAL_BACKWARD_CASES,
    Case("cross-scale", (2,), {"q": (1, 2, 3, 4), "k": (1, 2, 6, 4), "v": (1, 2, 6, 3), "g": (1, 2, 3, 3)},
         lambda o, q, k, v, g: _backward(o, g, q, k, v, scale=0.3)),
])
def sdpa_backward_key_sequence(e):
    """p_ij = exp(s_ij - lse_i) from the whole logsumexp is exact for a shard of the keys: dk and dv of
    those keys need only them, and dq = sum_j ds_ij k_j sums over the keys, so each rank's keys give a
    summand: dk and dv sharded, dq partial (causal masks offset by the shard's first key)"""
    yield e.strategy(out=(P, S(2), S(2)), k=S(2), v=S(2),
                     local=SDPA_BACKWARD_CAUSAL_OFFSETS if e.attr("is_causal") else None)


@rule("sdpa_backward", cases=[
    Case("causal-uneven", (3,), {"q": (1, 2, 4, 3), "k": (1, 2, 4, 3), "v": (1, 2, 4, 5), "g": (1, 2, 4, 5)},
         lambda o, q, k, v, g: _backward(o, g, q, k, v, is_causal=True)),
    Case("cross-mesh2x2", (2, 2), {"q": (1, 1, 3, 2), "k": (1, 1, 5, 2), "v": (1, 1, 5, 4), "g": (1, 1, 3, 4)},
         lambda o, q, k, v, g: _backward(o, g, q, k, v)),
])
def sdpa_backward_value_dim(e):
    """the probabilities do not depend on v: dv = p^T g keeps a shard of the head_dim of v, g and out, and
    dp - delta = g v^T - rowsum(g out) sums over it, so dq and dk (linear in it) are partial sums"""
    yield e.strategy(out=(P, P, S(3)), g=S(3), v=S(3), output=S(3))


@rule("embedding", cases=[
    Case("uneven", (3,), {"idx": indices((3, 5), 10), "w": (10, 7)}, lambda o, idx, w: o.embedding(idx, w)),
    Case("mesh2x2", (2, 2), {"idx": indices((2, 4), 6), "w": (6, 4)}, lambda o, idx, w: o.embedding(idx, w)),
])
def embedding_sharded(e):
    """weight[idx[shard]] = weight[idx][shard]; weight[:, cols][idx] = weight[idx][.., cols]"""
    for a in range(e["indices"].ndim):
        yield e.strategy(out=S(a), indices=S(a))
    yield e.strategy(out=S(e.out.ndim - 1), weight=S(1))


@rule("embedding", cases=[
    Case("uneven", (3,), {"idx": indices((2, 6), 7), "w": (7, 3)}, lambda o, idx, w: o.embedding(idx, w)),
    Case("even", (2,), {"idx": indices((2, 3), 8), "w": (8, 3)}, lambda o, idx, w: o.embedding(idx, w)),
    Case("mesh2x2-nested-uneven", (2, 2), {"idx": indices((20,), 13), "w": (13, 2)},
         lambda o, idx, w: o.embedding(idx, w)),
])
def embedding_vocab_parallel(e):
    """weight[idx] = sum_r (weight_r[idx - start_r] where idx in rank r's rows, else 0): vocab-parallel,
    a partial"""
    yield e.strategy(out=P, weight=S(0), local=EMBEDDING_VOCAB_PARALLEL)


@rule("take_along_axis", cases=[
    Case("dim1", (2,), {"x": (4, 6), "i": indices((4, 3), 6)}, lambda o, x, i: o.take_along_axis(x, i, 1)),
    Case("dim0-uneven", (3,), {"x": (4, 5), "i": indices((2, 5), 4)}, lambda o, x, i: o.take_along_axis(x, i, 0)),
    Case("mesh2x2", (2, 2), {"x": (4, 6), "i": indices((4, 3), 6)}, lambda o, x, i: o.take_along_axis(x, i, -1)),
])
def take_along_other_axis(e):
    """gathering along one axis keeps a shard of another, index sharded alike"""
    x, dim = e["x"], e.attr("dim") % e["x"].ndim
    for a in range(x.ndim):
        if a != dim:
            idx = S(a) if e["index"].shape[a] == x.shape[a] else R
            yield e.strategy(out=S(a), x=S(a), index=idx)


@rule("take_along_axis", cases=[
    Case("uneven", (3,), {"x": (3, 7), "i": indices((3, 4), 7)}, lambda o, x, i: o.take_along_axis(x, i, 1)),
    Case("dim0", (2,), {"x": (5, 3), "i": indices((4, 3), 5)}, lambda o, x, i: o.take_along_axis(x, i, 0)),
    Case("mesh2x2", (2, 2), {"x": (2, 8), "i": indices((2, 6), 8)}, lambda o, x, i: o.take_along_axis(x, i, 1)),
    Case("mesh2x2-nested-uneven", (2, 2), {"x": (2, 13), "i": indices((2, 20), 13)},
         lambda o, x, i: o.take_along_axis(x, i, 1)),
])
def take_along_sharded_axis(e):
    """x[.., idx] = sum_r (x_r[.., idx - start_r] where idx in rank r's part, else 0): a partial
    (cross entropy on class-sharded logits picks the target logit this way)"""
    dim = e.attr("dim") % e["x"].ndim
    yield e.strategy(out=P, x=S(dim), local=TAKE_ALONG_MASKED)


# ---------------------------------------------------------------------- the same identities as egglog rules
# Each derives the per-mesh-axis relation Ax (rewrites/sorts.py) for the ops its Python rule covers. Tensor
# operands are positional, in the op's signature order (linear: x, weight[, bias]; sdpa: q, k, v;
# embedding: indices, weight; take_along_axis: x, index).

@egglog_form(linear_column_parallel)
def _linear_column_parallel(spec):
    """x @ w[shard of out-features].T = (x @ w.T)[.., shard]; a bias sharded alike"""
    yield erule(site("linear", 2), Rank(sy, r), MeshSize(d)).then(ax([R_(), S_(0)], [S_(r - 1)]))
    yield erule(site("linear", 3), Rank(sy, r), MeshSize(d)).then(
        ax([R_(), S_(0), S_(0)], [S_(r - 1)]))


@egglog_form(linear_row_parallel)
def _linear_row_parallel(spec):
    """x @ w.T = sum_r x[.., shard r] @ w[:, shard r].T, a partial; a bias added on one rank of the axis"""
    yield erule(site("linear", 2), Rank(sx0, r), MeshSize(d)).then(ax([S_(r - 1), S_(1)], [P_()]))
    yield erule(site("linear", 3), Rank(sx0, r), MeshSize(d)).then(
        ax([S_(r - 1), S_(1), R_()], [P_()], LINEAR_BIAS_ONCE))


@egglog_form(linear_batch_parallel)
def _linear_batch_parallel(spec):
    """linear acts on the last axis only: a shard of a leading axis stays local"""
    for n_in in (2, 3):
        yield erule(site("linear", n_in), Rank(sx0, r), Extent(sx0, a, n), a < r - 1,
                    MeshSize(d)).then(ax([S_(a)] + [R_()] * (n_in - 1), [S_(a)]))


@egglog_form(linear_of_partial)
def _linear_of_partial(spec):
    """(sum_r x_r) @ w.T = sum_r x_r @ w.T, and x @ (sum_r w_r).T alike; a bias added once"""
    yield erule(site("linear", 2), MeshSize(d)).then(ax([P_(), R_()], [P_()]), ax([R_(), P_()], [P_()]))
    yield erule(site("linear", 3), MeshSize(d)).then(ax([P_(), R_(), R_()], [P_()], LINEAR_BIAS_ONCE),
                                                     ax([R_(), P_(), R_()], [P_()], LINEAR_BIAS_ONCE))


@egglog_form(matmul_sharded)
def _matmul_sharded(spec):
    """a @ b on a shard of a batch axis (each operand as it broadcasts), of a's rows or of b's columns"""
    pa, pb = var("pa", Placement), var("pb", Placement)
    yield erule(site("matmul", 2), Rank(sy, r), Extent(sy, i, n), i < r - 2, Bcast(sig, 0, i, pa),
                Bcast(sig, 1, i, pb), MeshSize(d)).then(ax([pa, pb], [S_(i)]))
    ra, rb = var("ra", i64), var("rb", i64)
    yield erule(site("matmul", 2), Rank(sy, r), Rank(sx0, ra), Rank(sx1, rb), MeshSize(d)).then(ax([S_(ra - 2), R_()], [S_(r - 2)]), ax([R_(), S_(rb - 1)], [S_(r - 1)]))


@egglog_form(matmul_contraction_sharded)
def _matmul_contraction_sharded(spec):
    """a @ b = sum_r a[.., shard r] @ b[shard r, ..]: a shard of the contracted axis gives a partial"""
    ra, rb = var("ra", i64), var("rb", i64)
    yield erule(site("matmul", 2), Rank(sx0, ra), Rank(sx1, rb), MeshSize(d)).then(
        ax([S_(ra - 1), S_(rb - 2)], [P_()]))


@egglog_form(matmul_of_partial)
def _matmul_of_partial(spec):
    """(sum_r a_r) @ b = sum_r a_r @ b, and a @ (sum_r b_r) alike"""
    yield erule(site("matmul", 2), MeshSize(d)).then(ax([P_(), R_()], [P_()]), ax([R_(), P_()], [P_()]))


@egglog_form(sdpa_batch_or_heads)
def _sdpa_batch_or_heads(spec):
    """attention is independent per batch element and per head: q, k, v sharded alike on either"""
    yield erule(site("sdpa", 3), MeshSize(d)).then(*[ax([S_(k)] * 3, [S_(k)]) for k in (0, 1)])


@egglog_form(sdpa_query_sequence)
def _sdpa_query_sequence(spec):
    """a shard of the queries attends to replicated keys and values locally (a causal mask offset by the
    shard's first position)"""
    for causal, kernel in (("true", SDPA_QUERY_OFFSET), ("false", None)):
        yield erule(site("sdpa", 3), AttrS(sig, "is_causal", causal), MeshSize(d)).then(
            ax([S_(2), R_(), R_()], [S_(2)], kernel))


@egglog_form(sdpa_value_dim)
def _sdpa_value_dim(spec):
    """attention weights do not depend on v's head_dim: a shard of it passes through"""
    yield erule(site("sdpa", 3), MeshSize(d)).then(ax([R_(), R_(), S_(3)], [S_(3)]))


@egglog_form(attention_batch_or_heads)
def _attention_batch_or_heads(spec):
    """attention and its backward are independent per batch element and per head: all sharded alike"""
    for name, n_in, n_out in (("sdpa_lse", 3, 2), ("sdpa_backward", 6, 3), ("attention_blocks", 3, 2)):
        yield erule(site(name, n_in, n_out), MeshSize(d)).then(*[ax([S_(k)] * n_in, [S_(k)] * n_out) for k in (0, 1)])


@egglog_form(sdpa_lse_query_sequence)
def _sdpa_lse_query_sequence(spec):
    """a shard of the queries attends to replicated keys and values locally, its logsumexp likewise"""
    for causal, kernel in (("true", SDPA_LSE_QUERY_OFFSET), ("false", None)):
        yield erule(site("sdpa_lse", 3, 2), AttrS(sig, "is_causal", causal), MeshSize(d)).then(
            ax([S_(2), R_(), R_()], [S_(2), S_(2)], kernel))


@egglog_form(attention_blocks_query_sequence)
def _attention_blocks_query_sequence(spec):
    """a shard of the queries attends to replicated keys and values locally, block by block"""
    for causal, kernel in (("true", ATTENTION_BLOCKS_CAUSAL_OFFSETS), ("false", None)):
        yield erule(site("attention_blocks", 3, 2), AttrS(sig, "is_causal", causal), MeshSize(d)).then(
            ax([S_(2), R_(), R_()], [S_(3), S_(3)], kernel))


@egglog_form(attention_blocks_key_blocks)
def _attention_blocks_key_blocks(spec):
    """one block of the keys per rank: k, v and the blocks axis split alike, q whole"""
    for causal, kernel in (("true", ATTENTION_BLOCKS_CAUSAL_OFFSETS), ("false", None)):
        yield erule(site("attention_blocks", 3, 2), AttrS(sig, "is_causal", causal), AttrI(sig, "blocks", d),
                    MeshSize(d)).then(ax([R_(), S_(2), S_(2)], [S_(2), S_(2)], kernel, nestable=False))


@egglog_form(sdpa_lse_value_dim)
def _sdpa_lse_value_dim(spec):
    """a shard of v's head_dim passes to the output; the logsumexp whole"""
    yield erule(site("sdpa_lse", 3, 2), MeshSize(d)).then(ax([R_(), R_(), S_(3)], [S_(3), R_()]))


@egglog_form(sdpa_backward_query_sequence)
def _sdpa_backward_query_sequence(spec):
    """dq of a shard of the queries is local; dk and dv are partial sums over the query shards"""
    for causal, kernel in (("true", SDPA_BACKWARD_CAUSAL_OFFSETS), ("false", None)):
        yield erule(site("sdpa_backward", 6, 3), AttrS(sig, "is_causal", causal), MeshSize(d)).then(
            ax([S_(2), S_(2), R_(), R_(), S_(2), S_(2)], [S_(2), P_(), P_()], kernel))


@egglog_form(sdpa_backward_key_sequence)
def _sdpa_backward_key_sequence(spec):
    """dk and dv of a shard of the keys are local; dq is a partial sum over the key shards"""
    for causal, kernel in (("true", SDPA_BACKWARD_CAUSAL_OFFSETS), ("false", None)):
        yield erule(site("sdpa_backward", 6, 3), AttrS(sig, "is_causal", causal), MeshSize(d)).then(
            ax([R_(), R_(), S_(2), S_(2), R_(), R_()], [P_(), S_(2), S_(2)], kernel))


@egglog_form(sdpa_backward_value_dim)
def _sdpa_backward_value_dim(spec):
    """a shard of v's head_dim: dv sharded alike, dq and dk partial sums"""
    yield erule(site("sdpa_backward", 6, 3), MeshSize(d)).then(
        ax([S_(3), R_(), R_(), S_(3), S_(3), R_()], [P_(), P_(), S_(3)]))


@egglog_form(embedding_sharded)
def _embedding_sharded(spec):
    """weight[idx[shard]] = weight[idx][shard]; weight[:, cols][idx] = weight[idx][.., cols]"""
    yield erule(site("embedding", 2), Extent(sx0, a, n), MeshSize(d)).then(ax([S_(a), R_()], [S_(a)]))
    yield erule(site("embedding", 2), Rank(sy, r), MeshSize(d)).then(ax([R_(), S_(1)], [S_(r - 1)]))


@egglog_form(embedding_vocab_parallel)
def _embedding_vocab_parallel(spec):
    """weight[idx] = sum_r (weight_r[idx - start_r] where idx in rank r's rows, else 0): a partial"""
    yield erule(site("embedding", 2), MeshSize(d)).then(ax([R_(), S_(0)], [P_()], EMBEDDING_VOCAB_PARALLEL))


@egglog_form(take_along_other_axis)
def _take_along_other_axis(spec):
    """gathering along one axis keeps a shard of another; the index sharded alike, or replicated where it
    is shorter there"""
    head = [site("take_along_axis", 2), AxisMap(sig, 0, a, b), Extent(sx0, a, n),
            MeshSize(d)]
    yield erule(*head, Extent(sx1, a, n)).then(ax([S_(a), S_(a)], [S_(b)]))
    yield erule(*head, Extent(sx1, a, m), ne(m).to(n)).then(ax([S_(a), R_()], [S_(b)]))


@egglog_form(take_along_sharded_axis)
def _take_along_sharded_axis(spec):
    """x[.., idx] = sum_r (x_r[.., idx - start_r] where idx in rank r's part, else 0): a partial"""
    yield erule(site("take_along_axis", 2), Reduced(sig, a), MeshSize(d)).then(
        ax([S_(a), R_()], [P_()], TAKE_ALONG_MASKED))


aten = family_ruleset("aten")
