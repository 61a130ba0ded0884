"""Shards: which elements of a tensor each rank holds under a layout. The one place that says so:
ranges along each axis (outer mesh axes split first, each split cutting the allocated ceil extent of
the level above, exactly as the loop domain nests outer DID splits), the cut a collective leaves, local
shapes, and a tensor's shard and its reassembly.

>>> ctx = RankContext(DeviceMesh.arange(4), rank=3)
>>> ctx.shard_range(10, Layout.from_code("S0"), axis=0), local_extents((10, 8), Layout.from_code("S0"), ctx.mesh)
((9, 10), (3, 8))

Partial layouts: under P every rank holds a summand, so `shard` gives the value to the ranks at
coordinate 0 of the P mesh axes and zeros to the others, and `unshard` sums; under Pmax every rank
holds a candidate maximum, so `shard` gives every rank the value and `unshard` takes the maximum.
Replicated copies must agree on `unshard`. (sharding.shard_tensor/unshard_tensor say the same for a
TensorView's loop domain, which may also hold non-outermost splits a Layout cannot name.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .errors import ShapeError, ShardingError
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

    def dtensor_range(self, extent: int, layout: Layout, axis: int) -> tuple[int, int]:
        """[start, stop) torch DTensor gives this rank along `axis`: each Shard chunks the size the mesh
        axes before it left (shard_range cuts their allocated ceil extent instead; the two differ only
        for some nested uneven splits, where DTensor interop must use DTensor's own chunks).

        >>> ctx = RankContext(DeviceMesh([[0, 1], [2, 3]]), rank=2)  # 5 rows: 3 | 2, then DTensor: 1, 1; loop: 2, 0
        >>> ctx.dtensor_range(5, Layout.from_code("S0.S0"), 0), ctx.shard_range(5, Layout.from_code("S0.S0"), 0)
        ((3, 4), (3, 5))
        """
        lo, size = 0, extent
        for m in layout.sharding_axes(axis):
            chunk = -(-size // self.mesh.shape[m])
            start = min(chunk * self.coords[m], size)
            lo, size = lo + start, min(size, start + chunk) - start
        return lo, lo + size

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

    def local_shape(self, o: Operand, chunks: str = "loop") -> tuple[int, ...]:
        """The shape of this rank's shard of `o` (chunks="dtensor": of DTensor's chunks, see dtensor_range).

        >>> o = Operand((9,), Layout.from_code("S0.S0"))  # 5 | 4, then 3, 2 | 3, 1 (loop) or 2, 2 (DTensor)
        >>> [RankContext(DeviceMesh([[0, 1], [2, 3]]), r).local_shape(o, "dtensor") for r in range(4)]
        [(3,), (2,), (2,), (2,)]
        """
        ranges = self.shard_range if chunks == "loop" else self.dtensor_range
        return tuple(hi - lo for lo, hi in (ranges(e, o.layout, a) for a, e in enumerate(o.shape)))

    def on_first(self, mesh_axes) -> bool:
        """Whether this rank sits at coordinate 0 of every given mesh axis."""
        return all(self.coords[m] == 0 for m in mesh_axes)


CHUNKS = ("loop", "dtensor")


def _slices(ctx: RankContext, shape: Sequence[int], layout: Layout, chunks: str = "loop") -> tuple[slice, ...]:
    """The index of this rank's piece in the global tensor: one contiguous range per axis."""
    ranges = ctx.shard_range if chunks == "loop" else ctx.dtensor_range
    return tuple(slice(*ranges(e, layout, a)) for a, e in enumerate(shape))


def dtensor_chunks_agree(shape: Sequence[int], layout: Layout, mesh: DeviceMesh) -> bool:
    """Whether torch DTensor's chunks are the loop domain's for every rank (they differ only for some
    nested uneven splits).

    >>> mesh = DeviceMesh([[0, 1], [2, 3]])
    >>> dtensor_chunks_agree((5,), Layout.from_code("S0.S0"), mesh), dtensor_chunks_agree((8,), Layout.from_code("S0.S0"), mesh)
    (False, True)
    """
    return all(RankContext(mesh, r).dtensor_range(n, layout, a) == RankContext(mesh, r).shard_range(n, layout, a)
               for r in mesh.ranks for a, n in enumerate(shape))


def _partial_axes(layout: Layout, reduce: str) -> list[int]:
    return [m for m, p in enumerate(layout) if p.is_partial and p.reduce == reduce]


def _check_layout(layout: Layout, shape: Sequence[int], mesh: DeviceMesh, where: str) -> None:
    if len(layout) != mesh.ndim or any(p.is_shard and p.axis >= len(shape) for p in layout):
        raise ShardingError(f"{where}: layout {layout} does not fit a tensor of shape {tuple(shape)} on {mesh} "
                            f"(one placement per mesh axis, S(a) only for an axis the tensor has)")


def shard(tensor: torch.Tensor, layout: Layout, mesh: DeviceMesh, rank: int, name: str = "tensor",
          chunks: str = "loop") -> torch.Tensor:
    """The piece of the global `tensor` that `rank` holds under `layout` (a contiguous copy); chunks=
    "dtensor" cuts torch DTensor's chunks instead of the loop domain's (see dtensor_chunks_agree).

    >>> t = torch.arange(10.)
    >>> [shard(t, Layout.from_code("S0"), DeviceMesh.arange(4), r).tolist() for r in (0, 3)]  # ceil-sized
    [[0.0, 1.0, 2.0], [9.0]]
    >>> [shard(t[:2], Layout.from_code("P"), DeviceMesh.arange(2), r).tolist() for r in (0, 1)]  # summands
    [[0.0, 1.0], [0.0, 0.0]]
    """
    if not isinstance(tensor, torch.Tensor):
        raise ShapeError(f"shard: expected a torch.Tensor for {name}, got {type(tensor).__name__}")
    _check_layout(layout, tensor.shape, mesh, f"shard({name})")
    assert chunks in CHUNKS, chunks
    ctx = RankContext(mesh, rank)
    piece = tensor[_slices(ctx, tensor.shape, layout, chunks)]
    if not ctx.on_first(_partial_axes(layout, "sum")):
        return torch.zeros_like(piece)  # a pending max needs no zeros: every copy is the value
    return piece.clone(memory_format=torch.contiguous_format)  # a copy: writing it leaves the global alone


def by_rank_of(pieces, mesh: DeviceMesh, where: str, what: str = "piece") -> dict[int, torch.Tensor]:
    """{rank: piece} from a list in ascending rank order or a dict; ShardingError if one is missing.

    >>> by_rank_of([torch.zeros(1)], DeviceMesh.arange(2), "unshard(y)")
    Traceback (most recent call last):
    ...
    egraph_did.errors.ShardingError: unshard(y): got 1 pieces for the 2 ranks of DeviceMesh(x=2) (pass one per rank, in ascending rank order)
    """
    ranks = sorted(mesh.ranks)
    if isinstance(pieces, Mapping):
        missing = [r for r in ranks if r not in pieces]
        if missing:
            raise ShardingError(f"{where}: no {what} for rank(s) {missing} of {mesh}")
        return dict(pieces)
    pieces = list(pieces)
    if len(pieces) != len(ranks):
        raise ShardingError(f"{where}: got {len(pieces)} {what}s for the {len(ranks)} ranks of {mesh} (pass one "
                            f"per rank, in ascending rank order)")
    return dict(zip(ranks, pieces))


def _global_shape(by_rank: dict[int, torch.Tensor], layout: Layout, mesh: DeviceMesh) -> tuple[int, ...]:
    """The global shape the pieces tile: along each axis, the sizes of the pieces held at every coordinate
    of the mesh axes that split it (coordinate 0 elsewhere) add up to the extent (the ranges are disjoint
    and cover it)."""
    first = by_rank[mesh.rank_at([0] * mesh.ndim)]
    shape = []
    for a in range(first.dim()):
        split = layout.sharding_axes(a)
        shape.append(sum(p.shape[a] for r, p in by_rank.items()
                         if all(c == 0 for m, c in enumerate(mesh.coords(r)) if m not in split)))
    return tuple(shape)


def unshard(pieces: Sequence[torch.Tensor] | Mapping[int, torch.Tensor], layout: Layout, mesh: DeviceMesh,
            shape: Sequence[int] | None = None, name: str = "tensor", chunks: str = "loop") -> torch.Tensor:
    """The global tensor from every rank's piece under `layout` (a list in ascending rank order, or
    {rank: piece}): pieces placed at their ranges, P summed, Pmax maximized; replicated copies must
    agree. `shape` (the global shape) is checked when given, else read off the pieces. chunks="dtensor":
    the pieces are DTensor's chunks (see shard).

    >>> mesh = DeviceMesh.arange(4)
    >>> unshard([torch.tensor([0., 1., 2.]), torch.tensor([3., 4., 5.]), torch.tensor([6., 7., 8.]),
    ...          torch.tensor([9.])], Layout.from_code("S0"), mesh).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    >>> unshard([torch.tensor(float(r)) for r in range(4)], Layout.from_code("P"), mesh)  # a sum
    tensor(6.)
    """
    where = f"unshard({name})"
    by_rank = by_rank_of(pieces, mesh, where)
    shape = _global_shape(by_rank, layout, mesh) if shape is None else tuple(shape)
    _check_layout(layout, shape, mesh, where)
    assert chunks in CHUNKS, chunks
    index = {r: _slices(RankContext(mesh, r), shape, layout, chunks) for r in mesh.ranks}
    for r, idx in index.items():
        want = tuple(s.stop - s.start for s in idx)
        if tuple(by_rank[r].shape) != want:
            raise ShapeError(f"{where}: rank {r}'s piece has shape {tuple(by_rank[r].shape)}, but layout {layout} "
                             f"of {shape} on {mesh} gives it {want}")
    replicated = [m for m, p in enumerate(layout) if p.kind == "R"]
    reduce = {p.reduce for p in layout if p.is_partial}
    return assemble(by_rank, shape, mesh, index, replicated, reduce, where, name)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal copies, a NaN equal to a NaN (a replica of a tensor holding NaN is still a replica)."""
    return a.shape == b.shape and a.dtype == b.dtype and (
        torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point()
        else torch.equal(a, b))


def assemble(by_rank: Mapping[int, torch.Tensor], shape: Sequence[int], mesh: DeviceMesh, index: Mapping[int, Any],
             replicated: Sequence[int], reduce: set[str], where: str, name: str) -> torch.Tensor:
    """The global tensor of `shape` from every rank's piece, piece r at index[r] (slices, or index
    tensors for a general loop domain): ranks that differ only on the `replicated` mesh axes hold copies
    that must agree; the others add up (shards fill disjoint places; P summands sum) or, under a pending
    max (reduce == {"max"}), take the maximum. The one reassembly rule, shared by unshard (a Layout) and
    sharding.unshard_tensor (a loop domain).

    >>> mesh = DeviceMesh.arange(2)
    >>> assemble({0: torch.tensor([1., 5.]), 1: torch.tensor([3., 2.])}, (2,), mesh, {0: (), 1: ()}, [], {"max"}, "u", "t")
    tensor([3., 5.])
    """
    if len(reduce) > 1:
        raise ShardingError(f"{where}: a pending sum and a pending max on one tensor do not commute; resolve "
                            f"one first")
    first = by_rank[min(by_rank)]
    pending_max = reduce == {"max"}
    out = torch.full(tuple(shape), _lowest(first.dtype) if pending_max else 0, dtype=first.dtype, device=first.device)
    for r in sorted(mesh.ranks):
        coords = mesh.coords(r)
        if any(coords[m] for m in replicated):  # a replica: it must equal the copy at coordinate 0
            twin = mesh.rank_at([0 if m in replicated else c for m, c in enumerate(coords)])
            if not _same(by_rank[r], by_rank[twin]):
                axes = [mesh.axis_names[m] for m in replicated]
                raise ShardingError(f"{where}: ranks {twin} and {r} hold different data although {name} is "
                                    f"replicated on mesh axes {axes}")
            continue
        idx = index[r]
        out[idx] = torch.maximum(out[idx], by_rank[r]) if pending_max else out[idx] + by_rank[r]
    return out


def _lowest(dtype: torch.dtype):
    """What a pending max starts from: -inf, an integer type's least value, False (-inf cast to bool is True).

    >>> _lowest(torch.float32), _lowest(torch.int8), _lowest(torch.bool)
    (-inf, -128, False)
    """
    if dtype == torch.bool:
        return False
    return -torch.inf if dtype.is_floating_point else torch.iinfo(dtype).min


__all__ = ["RankContext", "Operand", "local_extents", "shard", "unshard", "assemble", "by_rank_of",
           "dtensor_chunks_agree"]
