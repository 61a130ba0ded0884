"""Resharding: the collectives that move a tensor between placements on one mesh axis, and the
cancellations between them. Each entry states the identity the collective implements; the
e-graph offers every entry whose source placement a tensor reaches, at the cost model's price.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from egraph_did.layout import Placement

from . import P, R


@dataclass(frozen=True)
class Reshard:
    kind: str  # allreduce | reduce_scatter | allgather | alltoall | slice
    identity: str
    applies: Callable[[Placement, Placement], bool]


RESHARDS: list[Reshard] = []


def reshard(kind: str):
    """Register a collective; its docstring's first line states the identity."""
    def register(fn):
        RESHARDS.append(Reshard(kind, fn.__doc__.strip().splitlines()[0], fn))
        return fn
    return register


@reshard("allreduce")
def allreduce(src, dst):
    """P -> R: every rank gets sum_r x_r (max_r x_r for a pending max)"""
    return src.is_partial and dst == R


@reshard("reduce_scatter")
def reduce_scatter(src, dst):
    """P -> S(a): rank r gets (sum_q x_q)[shard r]"""
    return src == P and dst.is_shard


@reshard("allgather")
def allgather(src, dst):
    """S(a) -> R: every rank gets the concatenation of all shards along a"""
    return src.is_shard and dst == R


@reshard("alltoall")
def alltoall(src, dst):
    """S(a) -> S(b): rank r sends piece q of its a-shard, cut along b, to rank q"""
    return src.is_shard and dst.is_shard and src.axis != dst.axis


@reshard("slice")
def local_slice(src, dst):
    """R -> S(a): each rank keeps its own shard; no communication"""
    return src == R and dst.is_shard


def reshards(src: Placement, dst: Placement) -> list[Reshard]:
    """The collectives that take a tensor from src to dst on one mesh axis."""
    return [r for r in RESHARDS if r.applies(src, dst)]


# Cancellations: a pair of reshards on one mesh axis that compose to the identity (first, then second).
# The extractor never picks such a pair (the direct class is cheaper); plans loaded from JSON or written
# by hand are cleaned with them (Plan.simplified).
CANCELLATIONS: list[tuple[str, str, str]] = [
    ("allgather", "slice", "slice(allgather(x, a), a) = x: S(a) -> R -> S(a)"),
    ("slice", "allgather", "allgather(slice(x, a), a) = x: R -> S(a) -> R"),
    ("alltoall", "alltoall", "alltoall(alltoall(x, a->b), b->a) = x: S(a) -> S(b) -> S(a)"),
    ("reduce_scatter", "allgather", "allgather(reduce_scatter(x, a), a) = allreduce(x): P -> S(a) -> R"),
]
