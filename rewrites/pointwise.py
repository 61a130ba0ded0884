"""Pointwise rules: elementwise ops carry shardings through; linear ones carry partials. The elementwise
rule applies to every op of kind pointwise in the op table, so a new pointwise op needs no rule here.

Random ops (kind random: dropout) are elementwise too, but each element's random bits come from its
position in the global tensor: a rank holding a shard runs the op's global-index kernel (its counters
start where its shard starts), so every plan draws the mask one device draws. Given the mask, dropout is
linear: the dropout of a pending sum is a pending sum. A pending max does not pass: its ranks may hold the
max's identity (-inf) where they hold no candidate, and a dropped -inf is 0 * -inf = nan."""
from __future__ import annotations

import torch

from egglog import eq, i64, ne, var
from egglog import rule as erule

from egraph_did.ops import DROPOUT_GLOBAL_INDEX, OPS, ops_where

from .rules import P, PMAX, R, S, Case, Input, egglog_form, family_ruleset, indices, rule
from .sorts import SIG, Bcast, Extent, FloatSize, MeshSize, OpKind, Param, Placement, Rank, a, ax, d, i, m, n, op, r, sig, site
from .sorts import P as P_, Pmax as Pmax_, R as R_, S as S_, sx0, sx1, sx2, sy

F32 = torch.float32


def _every_unary_op(o, x):
    """Every one-operand pointwise op of the op table with no other required argument, on positive
    values (inside every op's domain)."""
    positive = o.exp(x)
    return tuple(getattr(o, name)(positive) for name in ops_where(kind="pointwise", arity=1)
                 if sum(p.default is p.empty for p in OPS[name].signature.parameters.values()) == 1)


@rule("*", cases=[
    Case("exp", (2,), {"x": (3, 4)}, lambda o, x: o.exp(x)),
    Case("var_mean-two-outputs", (3,), {"x": (5, 4)}, lambda o, x: o.var_mean(x, 1)),
    Case("linear-mesh2x2", (2, 2), {"x": (3, 4), "w": (5, 4)}, lambda o, x, w: o.linear(x, w)),
])
def replicated(e):
    """f(x) with every operand replicated is f computed redundantly: replicated"""
    yield e.strategy(out=R)


@rule(*ops_where(kind="pointwise"), cases=[
    Case("add-broadcast-uneven", (3,), {"a": (4, 5), "b": (5,)}, lambda o, a, b: o.add(a, b)),
    Case("every-unary-op-uneven", (3,), {"x": (5, 7)}, _every_unary_op),
    Case("unary-on-all-reals", (3,), {"x": (5, 7)}, lambda o, x: (
        o.neg(x), o.tanh(x), o.sigmoid(x), o.relu(x), o.erf(x), o.abs(x), o.cast(x, F32), o.gelu(x),
        o.gelu(x, approximate="tanh"), o.silu(x))),
    Case("binary", (2,), {"a": (3, 4), "b": (3, 4)}, lambda o, a, b: (
        o.sub(a, b), o.mul(a, b), o.div(a, o.exp(b)), o.maximum(a, b), o.pow(o.exp(a), b))),
    Case("with-numbers", (2,), {"x": (3, 5)}, lambda o, x: (
        o.mul(x, 2.0), o.add(1.5, x), o.sub(x, 1.0), o.div(x, 4.0), o.maximum(x, 0.25))),
    Case("mesh2x2", (2, 2), {"a": (4, 6), "b": (4, 1), "c": (7,), "d": (3, 7)}, lambda o, a, b, c, d: (
        o.add(a, b), o.mul(d, c))),
    Case("mesh2x2-nested-uneven", (2, 2), {"a": (13, 3), "b": (13, 3)}, lambda o, a, b: o.mul(a, b)),
    # a rank holding nothing: 3 over 4 is 1, 1, 1, 0 and 5 is 2, 2, 1, 0; 5 on 2x2 nests 3 | 2 then 2, 1 | 2, 0
    Case("empty-rank", (4,), {"a": (3, 5), "b": (5,)}, lambda o, a, b: (o.add(a, b), o.relu(a), o.where(o.gt(a, 0.0), a, b))),
    Case("mesh2x2-empty-rank", (2, 2), {"a": (5, 1), "b": (5, 2)}, lambda o, a, b: o.mul(a, b)),
])
def elementwise_sharded(e):
    """f(x)[shard] = f(x[shard]) for elementwise f; an operand broadcast along the axis stays replicated"""
    out = e.out
    for a in range(out.ndim):
        ins = {}
        for o in e.operands:
            k = a - (out.ndim - o.ndim)  # numpy broadcasting aligns from the right
            ins[o.param] = S(k) if k >= 0 and o.shape[k] == out.shape[a] else R
        yield e.strategy(out=S(a), **ins)


@rule(*ops_where(kind="mask"), cases=[
    Case("causal_mask", (2,), {"x": (2, 3, 4, 4)}, lambda o, x: o.causal_mask(x)),
    Case("causal_mask-offset-uneven", (3,), {"x": (5, 3, 3)}, lambda o, x: o.causal_mask(x, 1)),
])
def mask_leading_axis(e):
    """a mask depends on positions in the last two axes only: mask(x)[shard of a leading axis] =
    mask(x[shard])"""
    for a in range(e.out.ndim - 2):
        yield e.strategy(out=S(a), x=S(a))


@rule("add", "sub", cases=[
    Case("add-sub", (2,), {"a": (3, 5), "b": (3, 5)}, lambda o, a, b: (o.add(a, b), o.sub(a, b))),
    Case("broadcast", (3,), {"a": (4, 5), "b": (5,)}, lambda o, a, b: o.add(a, b)),
    Case("mesh2x2", (2, 2), {"a": (2, 3), "b": (2, 3)}, lambda o, a, b: o.sub(a, b)),
])
def sum_of_partials(e):
    """sum_r a_r + sum_r b_r = sum_r (a_r + b_r): partial + partial is partial"""
    if len(e.operands) == 2:
        yield e.strategy(out=P, a=P, b=P)


@rule("mul", "div", "silu_backward", cases=[
    Case("mul-div", (3,), {"a": (4, 5), "b": (4, 5), "c": (5,)}, lambda o, a, b, c: (
        o.mul(a, b), o.mul(a, 3.0), o.mul(2.0, a), o.div(a, o.exp(c)), o.div(a, 4.0))),
    Case("mesh2x2", (2, 2), {"a": (2, 3), "b": (2, 3)}, lambda o, a, b: o.mul(a, b)),
    Case("silu_backward", (3,), {"x": (5, 4), "w": (3, 4), "h": (5, 3)},
         lambda o, x, w, h: o.silu_backward(o.linear(x, w), h)),
])
def partial_scaled(e):
    """(sum_r a_r) * b = sum_r (a_r * b) for replicated b (a number included); likewise a / b and silu's
    gradient silu_backward(sum_r dy_r, x) = sum_r dy_r silu'(x)"""
    params = [o.param for o in e.operands]
    for p in params if e.op == "mul" else [p for p in params if p in ("a", "dy")]:
        yield e.strategy(out=P, **{p: P})


@rule("neg", "cast", cases=[
    Case("neg-cast", (2,), {"x": (3, 4), "h": Input((3, 4), F32)}, lambda o, x, h: (
        o.neg(x), o.cast(h, torch.float64), o.cast(x, torch.float64), o.cast(h, "float64"))),
    Case("mesh2x2", (2, 2), {"x": (2, 3)}, lambda o, x: o.neg(x)),
])
def partial_through_linear_unary(e):
    """-(sum_r x_r) = sum_r -x_r; an exact upcast commutes with the sum too"""
    src, dst = e["x"].dtype, e.out.dtype  # the output's dtype: the cast's target, a torch dtype however named
    exact = e.op == "cast" and src.is_floating_point and dst.is_floating_point and src.itemsize <= dst.itemsize
    if e.op == "neg" or exact:
        yield e.strategy(out=P, x=P)


@rule("maximum", cases=[
    Case("of-pending-maxes", (2,), {"x": (3, 4), "y": (3, 4)}, lambda o, x, y: o.maximum(o.amax(x, 1), o.amax(y, 1))),
    Case("of-a-pending-max-and-a-whole", (3,), {"x": (5, 4), "y": (4,)}, lambda o, x, y: (
        o.maximum(o.amax(x, 0), y), o.maximum(0.25, o.amax(x, 0)))),
    Case("mesh2x2", (2, 2), {"x": (4, 6), "y": (4, 6)}, lambda o, x, y: o.maximum(o.amax(x, 1), o.amax(y, 1))),
])
def maximum_of_pending_maxes(e):
    """max(max_r a_r, max_r b_r) = max_r max(a_r, b_r), and max(max_r a_r, b) = max_r max(a_r, b) for a
    whole b: maximum passes a pending max"""
    params = [o.param for o in e.operands]
    yield e.strategy(out=PMAX, **{p: PMAX for p in params})
    if len(params) == 2:
        for p in params:
            yield e.strategy(out=PMAX, **{p: PMAX})


@rule(*ops_where(kind="constant"), cases=[
    Case("full-split-uneven", (3,), {}, lambda o: o.full((5, 4), 2.5)),
    Case("full-mesh2x2", (2, 2), {}, lambda o: o.full((4, 6), -1.0, "float64")),
])
def constant_sharded(e):
    """full(shape, v)[shard] = full(local shape, v): every rank makes its own shard of a constant"""
    for a in range(e.out.ndim):
        yield e.strategy(out=S(a))


SEED = indices((), 2 ** 40)  # a dropout seed with bits above the low 32: both of its words reach the hash


@rule(*ops_where(kind="random"), cases=[
    Case("rows-uneven", (3,), {"x": (5, 7), "seed": SEED}, lambda o, x, seed: o.dropout(x, seed, 0.5)),
    Case("offset-3d", (2,), {"x": (2, 3, 4), "seed": SEED}, lambda o, x, seed: o.dropout(x, seed, 0.3, 17)),
    Case("mesh2x2-nested-uneven", (2, 2), {"x": (13, 3), "seed": SEED}, lambda o, x, seed: o.dropout(x, seed, 0.5)),
    Case("mesh2x3", (2, 3), {"x": (4, 9), "seed": SEED}, lambda o, x, seed: o.dropout(x, seed, 0.25)),
])
def random_sharded(e):
    """dropout(x, seed)[shard] = dropout of x[shard] at the shard's global counters: the mask one device
    draws (the seed, 0-d, replicated)"""
    for k in range(e.out.ndim):
        yield e.strategy(out=S(k), x=S(k), local=DROPOUT_GLOBAL_INDEX)


@rule(*ops_where(kind="random"), cases=[
    Case("of-a-partial", (2,), {"x": (3, 4), "w": (5, 4), "seed": SEED},
         lambda o, x, w, seed: o.dropout(o.linear(x, w), seed, 0.5)),
    Case("of-a-partial-mesh2x2", (2, 2), {"x": (4, 6), "seed": SEED},
         lambda o, x, seed: o.dropout(o.sum(x, 1, keepdim=True), seed, 0.5)),
])
def random_of_partial(e):
    """dropout(sum_r x_r) = sum_r dropout(x_r): one mask scales every summand (not a pending max: 0 * -inf)"""
    yield e.strategy(out=P, x=P)


# ---------------------------------------------------------------------- the same identities as egglog rules
# Each derives the per-mesh-axis relation Ax (rewrites/sorts.py) for the ops its Python rule covers.

def _bcast_rules(n_in: int):
    """Bcast(sig, j, i, p): under elementwise broadcasting, output axis i reads operand j's axis in
    placement p: S(k) where the right-aligned axis k has the same extent, R where it broadcasts."""
    sxs, k, rx = (sx0, sx1, sx2)[:n_in], var("k", i64), var("rx", i64)
    for j in range(n_in):
        head = [site(op, n_in), OpKind(op, "broadcasts"), Rank(sy, r), Rank(sxs[j], rx), Extent(sy, i, n),
                eq(k).to(i - (r - rx))]
        yield erule(*head, Extent(sxs[j], k, n)).then(Bcast(sig, j, i, S_(k)))
        yield erule(*head, Extent(sxs[j], k, m), ne(m).to(n)).then(Bcast(sig, j, i, R_()))
        yield erule(*head, k < 0).then(Bcast(sig, j, i, R_()))


@egglog_form(replicated)
def _replicated(spec):
    """every operand replicated: every output replicated"""
    for (n_in, n_out) in SIG:
        yield erule(site(op, n_in, n_out), MeshSize(d)).then(ax([R_()] * n_in, [R_()] * n_out))


@egglog_form(elementwise_sharded)
def _elementwise_sharded(spec):
    """f(x)[shard] = f(x[shard]): output axis a sharded, each operand as it broadcasts to a (Bcast)"""
    for n_in in (1, 2, 3):
        yield from _bcast_rules(n_in)
        ps = [var(f"p{j}", Placement) for j in range(n_in)]
        yield erule(site(op, n_in), OpKind(op, "pointwise"), MeshSize(d), Extent(sy, a, n),
                    *[Bcast(sig, j, a, ps[j]) for j in range(n_in)]).then(ax(ps, [S_(a)]))


@egglog_form(mask_leading_axis)
def _mask_leading_axis(spec):
    """mask(x)[shard of a leading axis] = mask(x[shard])"""
    yield erule(site(op), OpKind(op, "mask"), MeshSize(d), Rank(sy, r), Extent(sy, a, n),
                a < r - 2).then(ax([S_(a)], [S_(a)]))


@egglog_form(sum_of_partials)
def _sum_of_partials(spec):
    """partial + partial is partial"""
    for name in spec.ops:
        yield erule(site(name, 2), MeshSize(d)).then(ax([P_(), P_()], [P_()]))


@egglog_form(partial_scaled)
def _partial_scaled(spec):
    """(sum_r a_r) * b = sum_r (a_r * b) for replicated b, either operand of mul, the numerator of div, the
    gradient dy of silu_backward"""
    yield erule(site("mul", 2), MeshSize(d)).then(ax([P_(), R_()], [P_()]), ax([R_(), P_()], [P_()]))
    yield erule(site("mul"), MeshSize(d)).then(ax([P_()], [P_()]))  # the other factor a number
    yield erule(site("div", 2), MeshSize(d)).then(ax([P_(), R_()], [P_()]))
    yield erule(site("div"), Param(sig, 0, "a"), MeshSize(d)).then(ax([P_()], [P_()]))
    yield erule(site("silu_backward", 2), MeshSize(d)).then(ax([P_(), R_()], [P_()]))


@egglog_form(partial_through_linear_unary)
def _partial_through_linear_unary(spec):
    """-(sum_r x_r) = sum_r -x_r; an exact float upcast commutes with the sum too"""
    bx, by = var("bx", i64), var("by", i64)
    yield erule(site("neg"), MeshSize(d)).then(ax([P_()], [P_()]))
    yield erule(site("cast"), MeshSize(d), FloatSize(sx0, bx), FloatSize(sy, by), bx <= by).then(ax([P_()], [P_()]))



@egglog_form(maximum_of_pending_maxes)
def _maximum_of_pending_maxes(spec):
    """max(max_r a_r, max_r b_r) = max_r max(a_r, b_r); a whole operand (or a number) joins every rank's"""
    yield erule(site("maximum", 2), MeshSize(d)).then(
        ax([Pmax_(), Pmax_()], [Pmax_()]), ax([Pmax_(), R_()], [Pmax_()]), ax([R_(), Pmax_()], [Pmax_()]))
    yield erule(site("maximum"), MeshSize(d)).then(ax([Pmax_()], [Pmax_()]))


@egglog_form(constant_sharded)
def _constant_sharded(spec):
    """full(shape, v)[shard of axis a] = full(local shape, v)"""
    yield erule(SIG[(0, 1)](sig, op, sy), OpKind(op, "constant"), MeshSize(d), Extent(sy, a, n)).then(ax([], [S_(a)]))


@egglog_form(random_sharded)
def _random_sharded(spec):
    """dropout(x, seed)[shard of axis a] = dropout of x[shard] at the shard's global counters"""
    yield erule(site(op, 2), OpKind(op, "random"), MeshSize(d), Extent(sy, a, n)).then(
        ax([S_(a), R_()], [S_(a)], DROPOUT_GLOBAL_INDEX))


@egglog_form(random_of_partial)
def _random_of_partial(spec):
    """dropout(sum_r x_r) = sum_r dropout(x_r)"""
    yield erule(site(op, 2), OpKind(op, "random"), MeshSize(d)).then(ax([P_(), R_()], [P_()]))


pointwise = family_ruleset("pointwise")
