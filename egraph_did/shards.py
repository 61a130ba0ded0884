"""Shards: which elements of a tensor each rank holds under a layout. The one place that says so:
ranges along each axis (outer mesh axes split first, each split cutting the allocated ceil extent of
the level above, exactly as the loop domain nests outer DID splits), the cut a collective leaves, local
shapes, and a tensor's shard and its reassembly.

>>> ctx = RankContext(DeviceMesh.arange(4), rank=3)
>>> ctx.shard_range(10, Layout.from_code("S0"), axis=0), local_extents((10, 8), Layout.from_code("S0"), ctx.mesh)
((9, 10), (3, 8))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .layout import Layout, R, S  # noqa: F401  (S: the doctests)
from .mesh import DeviceMesh


def local_extents(shape: Sequence[int], layout: Layout, mesh: DeviceMesh) -> tuple[int, ...]:
    """The largest local shape any rank holds under `layout` (ceil-sized shards).

    >>> local_extents((10, 8), Layout((S(0),)), DeviceMesh.arange(4))  # rows 3, 3, 3, 1
    (3, 8)
    """
    out = list(shape)
    for m, p in enumerate(layout):
        if p.is_shard:
            out[p.axis] = -(-out[p.axis] // mesh.shape[m])
    return tuple(out)


@dataclass(frozen=True)
class Operand:
    """A tensor operand or output as one rank sees it: its global shape and its layout.

    >>> x = Operand((10, 8), Layout.from_code("S0"))
    >>> RankContext(DeviceMesh.arange(4), rank=3).local_shape(x)  # rows 9..10 of 10
    (1, 8)
    """

    shape: tuple[int, ...]  # global
    layout: Layout


@dataclass(frozen=True)
class RankContext:
    """One rank's place on the mesh: which piece of each sharded axis it holds.

    >>> ctx = RankContext(DeviceMesh([[0, 1], [2, 3]]), rank=2)
    >>> ctx.coords, ctx.shard_range(10, Layout.from_code("S0.R"), axis=0), ctx.on_first([1])
    ((1, 0), (5, 10), True)
    """

    mesh: DeviceMesh
    rank: int

    @property
    def coords(self) -> tuple[int, ...]:
        """This rank's coordinate on every mesh axis."""
        return self.mesh.coords(self.rank)

    def shard_range(self, extent: int, layout: Layout, axis: int) -> tuple[int, int]:
        """[start, stop) of the global indices along `axis` this rank holds, as the loop domain says:
        outer mesh axes split first, each split cutting the allocated (ceil) extent of the level above,
        so a nested uneven split matches shard_tensor exactly."""
        lo, hi, alloc = 0, extent, extent
        for m in layout.sharding_axes(axis):
            step = -(-alloc // self.mesh.shape[m])
            start = lo + self.coords[m] * step
            lo, hi, alloc = min(start, hi), min(start + step, hi), step
        return lo, hi

    def cut_range(self, shape, src: Layout, dst: Layout, m: int) -> tuple[int, int]:
        """[start, stop) along dst's split axis, relative to a tensor laid out as src with mesh axis m
        replicated: the piece a collective on m that ends in dst leaves this rank (reduce_scatter, slice,
        alltoall).

        >>> from egraph_did.layout import R, S
        >>> RankContext(DeviceMesh.arange(4), 3).cut_range((10,), Layout((R,)), Layout((S(0),)), 0)
        (9, 10)
        """
        a = dst[m].axis
        held, _ = self.shard_range(shape[a], src.replace(m, R), a)
        lo, hi = self.shard_range(shape[a], dst, a)
        return lo - held, hi - held

    def local_shape(self, o: Operand) -> tuple[int, ...]:
        """The shape of this rank's shard of `o`."""
        return tuple(hi - lo for lo, hi in (self.shard_range(e, o.layout, a) for a, e in enumerate(o.shape)))

    def on_first(self, mesh_axes) -> bool:
        """Whether this rank sits at coordinate 0 of every given mesh axis."""
        return all(self.coords[m] == 0 for m in mesh_axes)
