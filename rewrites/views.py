"""Propagation through views: permutes move the sharded axis; reshapes keep a shard where the DID split
stays outermost in its group of merged or split axes and every rank's flat block is unchanged (any
extent for an axis the reshape leaves alone); otherwise no rule fires and the plan
reshards. Views are linear, so partials pass through."""
from __future__ import annotations

import math

from . import P, S, rule

VIEWS = ("reshape", "permute", "transpose", "unsqueeze", "expand", "broadcast_in_dim")


@rule(*VIEWS)
def view_of_partial(e):
    """view(sum_r x_r) = sum_r view(x_r): a view of a partial is a partial"""
    yield e.strategy(out=P, x=P)


@rule("permute", "transpose")
def permute_sharded(e):
    """permute(x)[.., shard on axis i, ..] = permute(x[shard on axis dims[i]])"""
    x = e["x"]
    if e.op == "permute":
        dims = [d % x.ndim for d in e.attr("dims")]
    else:
        dims = list(range(x.ndim))
        a, b = e.attr("dim0") % x.ndim, e.attr("dim1") % x.ndim
        dims[a], dims[b] = dims[b], dims[a]
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


@rule("reshape")
def reshape_sharded(e):
    """reshape(x)[shard] = reshape(x[shard]) when a rank's flat block is unchanged by the reshape
    (the sharded axis outermost, after extent-1 axes, in its group on both sides, and
    ceil(n_in / d) * inner_in == ceil(n_out / d) * inner_out: any extent, uneven included, for an axis
    the reshape leaves alone)"""
    x, out = e["x"], e.out
    if 0 in x.shape:
        return
    for ins, outs in reshape_groups(x.shape, out.shape):
        a = next((k for k in ins if x.shape[k] > 1), None)
        b = next((k for k in outs if out.shape[k] > 1), None)
        if a is None or b is None:
            continue
        inner_in = math.prod(x.shape[k] for k in ins if k > a)
        inner_out = math.prod(out.shape[k] for k in outs if k > b)
        if -(-x.shape[a] // e.d) * inner_in == -(-out.shape[b] // e.d) * inner_out:
            yield e.strategy(out=S(b), x=S(a))


@rule("unsqueeze")
def unsqueeze_sharded(e):
    """unsqueeze moves axes at or after the new one by one place"""
    d = e.attr("dim") % e.out.ndim
    for a in range(e["x"].ndim):
        yield e.strategy(out=S(a if a < d else a + 1), x=S(a))


@rule("expand", "broadcast_in_dim")
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
