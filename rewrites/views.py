"""Propagation through views: permutes move the sharded axis; reshapes keep a shard where the DID split
stays outermost in its group of merged or split axes and every rank's flat block is unchanged (any
extent for an axis the reshape leaves alone), or where a split size-1 axis stays one; otherwise no rule
fires and the plan reshards. Views are linear, so partials pass through."""
from __future__ import annotations

import math

from egglog import eq, i64, var
from egglog import rule as erule

from egraph_did.ops import OPS, ops_where

from .rules import P, S, Case, egglog_form, family_ruleset, rule
from .sorts import P as P_, S as S_
from .sorts import AxisMap, Extent, MeshSize, OpKind, ReshapeBlock, a, ax, b, d, m, n, op, sig, site, sx0, sy


@rule(*ops_where(kind="view"), cases=[
    Case("every-view", (2,), {"a": (2, 6), "b": (2, 3, 4), "c": (3, 1), "d": (3,)}, lambda o, a, b, c, d: (
        o.reshape(a, (3, 4)), o.permute(b, (2, 0, 1)), o.transpose(b, 0, 2), o.unsqueeze(d, 0),
        o.expand(c, (3, 4)), o.broadcast_in_dim(d, (2, 3), (1,)))),
    Case("mesh2x2", (2, 2), {"a": (2, 6)}, lambda o, a: (o.reshape(a, (4, 3)), o.unsqueeze(a, 1))),
])
def view_of_partial(e):
    """view(sum_r x_r) = sum_r view(x_r): a view of a partial is a partial"""
    yield e.strategy(out=P, x=P)


@rule(*ops_where(permutes=True), cases=[
    Case("permute-uneven", (3,), {"x": (2, 3, 5)}, lambda o, x: o.permute(x, (2, 0, 1))),
    Case("transpose", (2,), {"x": (5, 3, 4)}, lambda o, x: o.transpose(x, 0, -1)),
    Case("mesh2x2", (2, 2), {"x": (4, 6)}, lambda o, x: o.permute(x, (1, 0))),
])
def permute_sharded(e):
    """permute(x)[.., shard on axis i, ..] = permute(x[shard on axis dims[i]])"""
    dims = OPS[e.op].permutation(dict(e.attrs), e["x"].ndim)
    for out_axis, in_axis in enumerate(dims):
        yield e.strategy(out=S(out_axis), x=S(in_axis))


def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of axes with equal products: ([src axes], [dst axes]) per group.

    >>> reshape_groups((2, 6, 4), (12, 2, 2))
    [([0, 1], [0]), ([2], [1, 2])]
    """
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        ins, outs = ([i] if i < len(src) else []), ([j] if j < len(dst) else [])
        pi = src[i] if ins else 1
        po = dst[j] if outs else 1
        i, j = i + len(ins), j + len(outs)
        while pi != po:
            if (pi < po and i < len(src)) or j >= len(dst):
                if i >= len(src):
                    return []
                ins.append(i)
                pi *= src[i]
                i += 1
            else:
                outs.append(j)
                po *= dst[j]
                j += 1
        groups.append((ins, outs))
    return groups


@rule("reshape", nestable=False, cases=[
    Case("split-merge", (2,), {"x": (2, 6, 4)}, lambda o, x: o.reshape(x, (12, 2, 2))),
    Case("split", (3,), {"x": (6, 4)}, lambda o, x: o.reshape(x, (3, 2, 4))),
    Case("unit-axis", (3,), {"x": (1, 6, 5)}, lambda o, x: o.reshape(x, (6, 5))),
    Case("merge-rows", (2,), {"x": (4, 3)}, lambda o, x: o.reshape(x, (2, 6))),
    Case("mesh2x2", (2, 2), {"x": (4, 6)}, lambda o, x: o.reshape(x, (2, 2, 6))),
    Case("identity-uneven", (3,), {"x": (5, 4)}, lambda o, x: o.reshape(x, (5, 4))),
    Case("sharded-axis-left-alone-uneven", (3,), {"x": (5, 6)}, lambda o, x: o.reshape(x, (5, 2, 3))),
    Case("merge-uneven-same-flat-blocks", (4,), {"x": (7, 2)}, lambda o, x: o.reshape(x, (14,))),
    # a rank holding nothing: 6 over 4 is 2, 2, 2, 0 on both sides; 3 rows of 2 are 1, 1, 1, 0 rows, 2, 2, 2, 0 of 6
    Case("unit-axis-empty-rank", (4,), {"x": (1, 6)}, lambda o, x: o.reshape(x, (6,))),
    Case("merge-empty-rank", (4,), {"x": (3, 2)}, lambda o, x: o.reshape(x, (6,))),
])
def reshape_sharded(e):
    """reshape(x)[shard] = reshape(x[shard]) when a rank's flat block is unchanged by the reshape
    (the sharded axis outermost, after extent-1 axes, in its group on both sides, and
    ceil(n_in / d) * inner_in == ceil(n_out / d) * inner_out: any extent, uneven included, for an axis
    the reshape leaves alone)"""
    x, out = e["x"], e.out
    for a, inner_in, b, inner_out in reshape_blocks(x.shape, out.shape):
        if -(-x.shape[a] // e.d) * inner_in == -(-out.shape[b] // e.d) * inner_out:
            yield e.strategy(out=S(b), x=S(a))


@rule("reshape", nestable=False, cases=[
    Case("unit-to-unit-empty-rank", (2,), {"x": (1, 1, 2)}, lambda o, x: o.reshape(x, (1, 2))),
    Case("unit-axes-moved", (3,), {"x": (1, 4, 1, 3)}, lambda o, x: o.reshape(x, (4, 1, 3, 1))),
    Case("unit-axes-mesh2x2", (2, 2), {"x": (1, 4, 6)}, lambda o, x: o.reshape(x, (4, 1, 6))),
])
def reshape_unit_axis(e):
    """reshape(x)[shard] = reshape(x[shard]) for a split size-1 axis that stays a size-1 axis: on both
    sides the rank at coordinate 0 holds everything and the others nothing (the split of a unit axis leaves
    ranks empty, which only ops of empty_shards, as views, compute on)"""
    x, out = e["x"], e.out
    for a in (k for k, n in enumerate(x.shape) if n == 1):
        for b in (k for k, n in enumerate(out.shape) if n == 1):
            yield e.strategy(out=S(b), x=S(a))


def reshape_blocks(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """Per group of reshape_groups with a non-unit axis on both sides: (the outermost non-unit src axis,
    the product of the group's src extents inside it, the same for dst); none when an extent is 0.

    >>> reshape_blocks((2, 6, 4), (12, 2, 2))
    [(0, 6, 0, 1), (2, 1, 1, 2)]
    """
    if 0 in src:
        return []
    out = []
    for ins, outs in reshape_groups(src, dst):
        a = next((k for k in ins if src[k] > 1), None)
        b = next((k for k in outs if dst[k] > 1), None)
        if a is not None and b is not None:
            out.append((a, math.prod(src[k] for k in ins if k > a), b, math.prod(dst[k] for k in outs if k > b)))
    return out


@rule("unsqueeze", cases=[
    Case("uneven", (3,), {"x": (5, 3)}, lambda o, x: (o.unsqueeze(x, 1), o.unsqueeze(x, -1))),
    Case("front", (2,), {"x": (3, 4)}, lambda o, x: o.unsqueeze(x, 0)),
    Case("empty-rank", (4,), {"x": (3, 5)}, lambda o, x: o.unsqueeze(x, 1)),
])
def unsqueeze_sharded(e):
    """unsqueeze moves axes at or after the new one by one place"""
    d = e.attr("dim") % e.out.ndim
    for a in range(e["x"].ndim):
        yield e.strategy(out=S(a if a < d else a + 1), x=S(a))


@rule("expand", "broadcast_in_dim", cases=[
    Case("expand-uneven", (3,), {"x": (5, 1), "y": (3,)}, lambda o, x, y: (o.expand(x, (5, 4)), o.expand(y, (2, 3)))),
    Case("broadcast_in_dim-uneven", (3,), {"x": (5,)}, lambda o, x: o.broadcast_in_dim(x, (5, 4), (0,))),
    Case("mesh2x2", (2, 2), {"x": (4, 1)}, lambda o, x: o.expand(x, (4, 6))),
    Case("mesh2x2-nested-uneven", (2, 2), {"x": (13, 1)}, lambda o, x: o.expand(x, (13, 2))),
    Case("empty-rank", (4,), {"x": (3, 1)}, lambda o, x: o.expand(x, (3, 4))),
])
def broadcast_sharded(e):
    """broadcasting leaves an axis that is not broadcast sharded as it was"""
    x, out = e["x"], e.out
    if e.op == "expand":
        places = [a + out.ndim - x.ndim for a in range(x.ndim)]
    else:
        places = list(e.attr("broadcast_dims"))
    for a, b in enumerate(places):
        if x.shape[a] == out.shape[b] and x.shape[a] > 1:
            yield e.strategy(out=S(b), x=S(a))


# ---------------------------------------------------------------------- the same identities as egglog rules
# Each derives the per-mesh-axis relation Ax (rewrites/sorts.py) for the ops its Python rule covers, from
# the op's axis facts (AxisMap: output axis b is input axis a; ReshapeBlock: a reshape's groups).

@egglog_form(view_of_partial)
def _view_of_partial(spec):
    """view(sum_r x_r) = sum_r view(x_r)"""
    yield erule(site(op), OpKind(op, "view"), MeshSize(d)).then(ax([P_()], [P_()]))


@egglog_form(permute_sharded)
def _permute_sharded(spec):
    """permute(x)[.., shard on axis b, ..] = permute(x[shard on the axis that lands at b])"""
    for name in spec.ops:
        yield erule(site(name), AxisMap(sig, 0, a, b), MeshSize(d)).then(ax([S_(a)], [S_(b)]))


@egglog_form(reshape_sharded)
def _reshape_sharded(spec):
    """reshape(x)[shard] = reshape(x[shard]) where a rank's flat block is the same on both sides:
    ceil(n_a / d) * inner_a == ceil(n_b / d) * inner_b"""
    inner_a, inner_b = var("inner_a", i64), var("inner_b", i64)
    yield erule(site("reshape"), ReshapeBlock(sig, a, inner_a, b, inner_b), MeshSize(d), Extent(sx0, a, n),
                Extent(sy, b, m),
                eq((n + d - 1) / d * inner_a).to((m + d - 1) / d * inner_b)).then(ax([S_(a)], [S_(b)], nestable=False))


@egglog_form(reshape_unit_axis)
def _reshape_unit_axis(spec):
    """reshape(x)[shard] = reshape(x[shard]) for a split size-1 axis that stays a size-1 axis"""
    yield erule(site("reshape"), MeshSize(d), Extent(sx0, a, 1), Extent(sy, b, 1)).then(ax([S_(a)], [S_(b)], nestable=False))


@egglog_form(unsqueeze_sharded)
def _unsqueeze_sharded(spec):
    """unsqueeze moves the axes at or after the new one by one place"""
    yield erule(site("unsqueeze"), AxisMap(sig, 0, a, b), MeshSize(d)).then(ax([S_(a)], [S_(b)]))


@egglog_form(broadcast_sharded)
def _broadcast_sharded(spec):
    """broadcasting leaves an axis that is not broadcast (same extent, not 1) sharded as it was"""
    for name in spec.ops:
        yield erule(site(name), AxisMap(sig, 0, a, b), MeshSize(d), Extent(sx0, a, n), Extent(sy, b, n), n > 1).then(ax([S_(a)], [S_(b)]))


views = family_ruleset("views")
