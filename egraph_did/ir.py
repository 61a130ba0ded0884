"""The loop-domain IR: IterDomain and TensorView, after nvFuser.

A TensorView has three domains:

* logical: the tensor's shape as the user wrote it (single-device semantics). Never carries a device
  axis: sharding lives in the loop domain only.
* loop: the logical axes after splits, merges and reorders; a loop axis may be bound to a mesh axis
  (ParallelType.DIDx/DIDy/DIDz). `x.outer_split(1, 4)` turns [b, s, h] into [b, 4, s/4, h], and
  `x.axis(1).parallelize(ParallelType.DIDx)` binds the outer part to the mesh: [b, DIDx{4}, s/4, h].
* allocation: derived from the loop domain; a DID-parallel axis allocates extent 1 (the local shard),
  a partial (pending-sum) axis allocates nothing.

Each loop IterDomain carries an IndexExpr saying how its coordinate derives from logical indices, so
which elements a rank holds is computed, never guessed (see sharding.py).
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .errors import MeshError, ShardingError
from .mesh import DeviceMesh

if TYPE_CHECKING:  # pragma: no cover
    import torch
    # Fusion is named in annotations as a string only: fusion imports ir, and ir importing fusion (even
    # for type checkers) would make the program layer's module graph a cycle.


class ParallelType(enum.Enum):
    """How a loop axis is executed: serially on one device, or spread over a mesh axis.

    >>> mesh = DeviceMesh([[0, 1], [2, 3]])
    >>> ParallelType.DIDx.mesh_axis(mesh), ParallelType.DIDy.mesh_axis(mesh), ParallelType.Serial.is_device
    (1, 0, False)
    """

    Serial = "Serial"
    DIDx = "DIDx"
    DIDy = "DIDy"
    DIDz = "DIDz"

    @property
    def is_device(self) -> bool:
        """Whether this type binds a mesh axis (DIDx, DIDy or DIDz)."""
        return self is not ParallelType.Serial

    def mesh_axis(self, mesh: DeviceMesh) -> int:
        """The mesh axis this type binds: DIDx the last, DIDy the one before, DIDz the one before that.

        >>> ParallelType.DIDx.mesh_axis(DeviceMesh([[0, 1], [2, 3]]))
        1
        """
        depth = {ParallelType.DIDx: 1, ParallelType.DIDy: 2, ParallelType.DIDz: 3}.get(self)
        if depth is None:
            raise MeshError("Serial is not bound to a mesh axis")
        if depth > mesh.ndim:
            raise MeshError(f"{self.name} needs a mesh of at least {depth} dimensions, got {mesh}")
        return mesh.ndim - depth

    @classmethod
    def for_mesh_axis(cls, mesh: DeviceMesh, axis: int | str) -> "ParallelType":
        """Inverse of mesh_axis().

        >>> ParallelType.for_mesh_axis(DeviceMesh([[0, 1], [2, 3]]), 0)
        <ParallelType.DIDy: 'DIDy'>
        """
        depth = mesh.ndim - mesh.axis_index(axis)
        return (cls.DIDx, cls.DIDy, cls.DIDz)[depth - 1]


class IterType(enum.Enum):
    """What a loop axis iterates over: elements (Iteration), a reduction, or a broadcast axis of extent 1.

    >>> str(IterDomain("k", 8, IterType.Reduction)), str(IterDomain("one", 1, IterType.Broadcast))
    ('rk', 'bone')
    """

    Iteration = "Iteration"
    Reduction = "Reduction"
    Broadcast = "Broadcast"


# ---------------------------------------------------------------- index expressions
# How a loop axis's coordinate derives from logical indices. Evaluated on numpy arrays.

@dataclass(frozen=True)
class LogicalIndex:
    """The index along one logical axis.

    >>> LogicalIndex(1).eval({1: np.arange(4)}), LogicalIndex(1).axes
    (array([0, 1, 2, 3]), frozenset({1}))
    """
    axis: int

    def eval(self, idx: dict[int, np.ndarray]) -> np.ndarray:
        return idx[self.axis]

    @property
    def axes(self) -> frozenset[int]:
        return frozenset({self.axis})


@dataclass(frozen=True)
class OuterOf:
    """Outer part of a split: coordinate // inner_extent.

    >>> OuterOf(LogicalIndex(0), 3).eval({0: np.arange(7)})  # 7 split in pieces of 3
    array([0, 0, 0, 1, 1, 1, 2])
    """
    of: "IndexExpr"
    inner_extent: int

    def eval(self, idx):
        return self.of.eval(idx) // self.inner_extent

    @property
    def axes(self):
        return self.of.axes


@dataclass(frozen=True)
class InnerOf:
    """Inner part of a split: coordinate % inner_extent.

    >>> InnerOf(LogicalIndex(0), 3).eval({0: np.arange(7)})  # 7 split in pieces of 3
    array([0, 1, 2, 0, 1, 2, 0])
    """
    of: "IndexExpr"
    inner_extent: int

    def eval(self, idx):
        return self.of.eval(idx) % self.inner_extent

    @property
    def axes(self):
        return self.of.axes


@dataclass(frozen=True)
class MergeOf:
    """A merge of two axes: outer * inner_extent + inner.

    >>> m = MergeOf(LogicalIndex(0), LogicalIndex(1), 4)  # [2, 4] seen as [8]
    >>> m.eval({0: np.array([0, 1]), 1: np.array([3, 2])}), m.axes
    (array([3, 6]), frozenset({0, 1}))
    """
    outer: "IndexExpr"
    inner: "IndexExpr"
    inner_extent: int

    def eval(self, idx):
        return self.outer.eval(idx) * self.inner_extent + self.inner.eval(idx)

    @property
    def axes(self):
        return self.outer.axes | self.inner.axes


@dataclass(frozen=True)
class PendingSum:
    """A partial: a reduction (sum, or max) over the devices of a mesh axis that has not happened yet.

    >>> from egraph_did import FusionDefinition
    >>> y = FusionDefinition().define_tensor((4, 8)).set_device_mesh(DeviceMesh.arange(2))
    >>> y.add_partial(ParallelType.DIDx).loop_domain[-1].index, y.loop_domain[-1].logical_axes
    (PendingSum(reduce='sum'), frozenset())
    """

    reduce: str = "sum"

    def eval(self, idx):  # pragma: no cover - never asked: a partial holds every logical element
        raise ShardingError("a partial axis has no logical coordinate")

    @property
    def axes(self):
        return frozenset()


IndexExpr = LogicalIndex | OuterOf | InnerOf | MergeOf | PendingSum


@dataclass(frozen=True)
class IterDomain:
    """One axis of a domain. Immutable; TensorView replaces, never mutates, its iter domains.

    >>> str(IterDomain("h", 1024))
    'h'
    """

    name: str
    extent: int
    iter_type: IterType = IterType.Iteration
    parallel_type: ParallelType = ParallelType.Serial
    index: IndexExpr | None = None

    @property
    def is_device(self) -> bool:
        """Whether this axis is bound to a mesh axis."""
        return self.parallel_type.is_device

    @property
    def is_reduction(self) -> bool:
        """Whether this axis is reduced (a DID one: a pending sum over the mesh axis)."""
        return self.iter_type is IterType.Reduction

    @property
    def is_broadcast(self) -> bool:
        """Whether this is a broadcast axis of extent 1."""
        return self.iter_type is IterType.Broadcast

    @property
    def logical_axes(self) -> frozenset[int]:
        """The logical axes this loop axis derives from (empty for a partial axis)."""
        return self.index.axes if self.index is not None else frozenset()

    def __str__(self) -> str:
        prefix = "r" if self.is_reduction else ("b" if self.is_broadcast else "")
        if self.is_device:
            pending_max = isinstance(self.index, PendingSum) and self.index.reduce == "max"
            return f"{prefix}{self.parallel_type.name}{{{self.extent}}}{'(max)' if pending_max else ''}"
        return f"{prefix}{self.name}"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class AxisRef:
    """A handle on one loop axis of a TensorView: `tv.axis(1).parallelize(ParallelType.DIDx)`.

    >>> from egraph_did import FusionDefinition
    >>> x = FusionDefinition().define_tensor((8, 6), axis_names=("s", "h")).outer_split(0, 4)
    >>> a = x.axis(0)
    >>> str(a), a.extent, a.parallelize(ParallelType.DIDx).loop_str()
    ('4', 4, '[DIDx{4}, s/4, h]')
    """

    def __init__(self, tv: "TensorView", pos: int):
        self._tv, self._pos = tv, pos

    def parallelize(self, ptype: ParallelType) -> "TensorView":
        """Bind this loop axis to the mesh axis `ptype` names (or back to Serial)."""
        return self._tv.parallelize(self._pos, ptype)

    @property
    def domain(self) -> IterDomain:
        """The loop IterDomain this handle points at (as it is now)."""
        return self._tv.loop_domain[self._pos]

    @property
    def extent(self) -> int:
        """The loop axis's extent."""
        return self.domain.extent

    @property
    def parallel_type(self) -> ParallelType:
        """How the loop axis is executed."""
        return self.domain.parallel_type

    def __str__(self) -> str:
        return str(self.domain)


class TensorView:
    """A tensor of a Fusion, with its logical, loop and allocation domains.

    >>> from egraph_did import FusionDefinition, DeviceMesh, ParallelType
    >>> with FusionDefinition() as fd:
    ...     x = fd.define_tensor((8, 16, 32), axis_names=("b", "s", "h"), name="x")
    >>> _ = x.set_device_mesh(DeviceMesh.arange(4)).outer_split(1, 4)
    >>> _ = x.axis(1).parallelize(ParallelType.DIDx)
    >>> x.loop_str()
    '[b, DIDx{4}, s/4, h]'
    """

    def __init__(self, name: str, shape: Sequence[int], dtype: "torch.dtype",
                 axis_names: Sequence[str] | None = None, fusion: "Fusion | None" = None,
                 broadcast_axes: Sequence[int] = ()):
        names = list(axis_names) if axis_names is not None else [str(e) for e in shape]
        self.name = name
        self.dtype = dtype
        self.fusion = fusion
        self.mesh: DeviceMesh | None = None
        self.logical_domain: tuple[IterDomain, ...] = tuple(
            IterDomain(n, int(e), IterType.Broadcast if i in broadcast_axes else IterType.Iteration,
                       index=LogicalIndex(i))
            for i, (n, e) in enumerate(zip(names, shape)))
        self._loop: list[IterDomain] = list(self.logical_domain)
        # "dtensor": the outer DID splits of an axis cut as torch DTensor chunks them (each split chunks the
        # extent the one outside it left, where the loop domain cuts that split's allocated ceil extent): the
        # two differ for some nested uneven splits (9 rows on 2x2: 3, 2, 2, 2 against 3, 2, 3, 1), which no
        # loop domain expresses; runtime.pin_placements pins so (see local_indices)
        self.chunks = "loop"

    # ------------------------------------------------------------ shape
    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape (what the user sees on one device)."""
        return tuple(d.extent for d in self.logical_domain)

    @property
    def ndim(self) -> int:
        """The number of logical axes."""
        return len(self.logical_domain)

    @property
    def loop_domain(self) -> tuple[IterDomain, ...]:
        """The loop axes, outermost first (see loop_str())."""
        return tuple(self._loop)

    @property
    def allocation_domain(self) -> tuple[IterDomain, ...]:
        """The loop domain as allocated on one device: DID axes have extent 1; partial axes drop out.

        >>> from egraph_did import FusionDefinition
        >>> x = FusionDefinition().define_tensor((8, 6), axis_names=("s", "h")).set_device_mesh(DeviceMesh.arange(4))
        >>> [str(d) for d in x.outer_split(0, 4).parallelize(0, ParallelType.DIDx).allocation_domain]
        ['DIDx{1}', 's/4', 'h']
        """
        return tuple(dataclasses.replace(d, extent=1) if d.is_device else d
                     for d in self._loop if not (d.is_reduction and d.is_device))

    def allocation_extents(self) -> tuple[int, ...]:
        """Per logical axis, the extent the allocation domain reserves for it (an upper bound on every
        rank's local extent; equal to it when every split divides).

        Only defined when no allocated loop axis mixes several logical axes.

        >>> from egraph_did import FusionDefinition
        >>> x = FusionDefinition().define_tensor((10, 6)).set_device_mesh(DeviceMesh.arange(4))
        >>> x.outer_split(0, 4).parallelize(0, ParallelType.DIDx).allocation_extents()  # rows 3, 3, 3, 1
        (3, 6)
        """
        out = [1] * self.ndim
        for d in self.allocation_domain:
            axes = d.logical_axes
            if len(axes) != 1:
                raise ShardingError(f"{self.name}: loop axis {d} merges logical axes {sorted(axes)}; "
                                    f"its allocation is not a per-axis extent")
            (a,) = axes
            out[a] *= d.extent
        return tuple(out)

    # ------------------------------------------------------------ transforms
    def _pos(self, axis: int, what: str) -> int:
        n = len(self._loop)
        if not isinstance(axis, int) or not -n <= axis < n:
            raise ShardingError(f"{what}: loop axis {axis} out of range for {self.name} with loop domain "
                                f"{self.loop_str()} ({n} axes)")
        return axis % n

    def split(self, axis: int, factor: int, inner_split: bool = True) -> "TensorView":
        """Split loop axis `axis` in two. inner_split=True (nvFuser's default) makes the inner part
        `factor` long; inner_split=False makes the outer part `factor` long. A factor that does not
        divide gives torch.chunk semantics: ceil-sized pieces, the last smaller or empty.

        >>> from egraph_did import FusionDefinition
        >>> with FusionDefinition() as fd:
        ...     w = fd.define_tensor((10, 4), axis_names=("n", "k"))
        >>> w.split(0, 4, inner_split=False).loop_str()
        '[4, n/4, k]'
        """
        pos = self._pos(axis, f"split({axis}, {factor})")
        if not isinstance(factor, int) or factor <= 0:
            raise ShardingError(f"split of {self.name} axis {axis}: factor must be a positive int, got {factor!r}")
        d = self._loop[pos]
        if d.is_device:
            raise ShardingError(f"split of {self.name} axis {axis}: {d} is already bound to a mesh axis; "
                                f"split before parallelizing")
        if d.is_broadcast:
            raise ShardingError(f"split of {self.name} axis {axis}: {d} is a broadcast axis of extent 1")
        if inner_split:
            outer_ext, inner_ext = _ceil_div(d.extent, factor), factor
            outer_name, inner_name = f"{d.name}/{factor}", f"{factor}"
        else:
            outer_ext, inner_ext = factor, _ceil_div(d.extent, factor)
            outer_name, inner_name = f"{factor}", f"{d.name}/{factor}"
        outer = IterDomain(outer_name, outer_ext, d.iter_type, index=OuterOf(d.index, inner_ext))
        inner = IterDomain(inner_name, inner_ext, d.iter_type, index=InnerOf(d.index, inner_ext))
        self._loop[pos:pos + 1] = [outer, inner]
        return self

    def outer_split(self, axis: int, factor: int) -> "TensorView":
        """Split so the outer part has `factor` pieces: the form a DID split takes.

        >>> from egraph_did import FusionDefinition
        >>> with FusionDefinition() as fd:
        ...     x = fd.define_tensor((2, 6), axis_names=("s", "h"))
        >>> x.outer_split(1, 3).loop_str()
        '[s, 3, h/3]'
        """
        return self.split(axis, factor, inner_split=False)

    def inner_split(self, axis: int, factor: int) -> "TensorView":
        """Split so the inner part is `factor` long.

        >>> from egraph_did import FusionDefinition
        >>> FusionDefinition().define_tensor((10, 4), axis_names=("n", "k")).inner_split(0, 4).loop_str()
        '[n/4, 4, k]'
        """
        return self.split(axis, factor, inner_split=True)

    def merge(self, axis_o: int, axis_i: int | None = None) -> "TensorView":
        """Merge loop axes `axis_o` and `axis_i` (default: the next one) into one, at axis_o's place.

        >>> from egraph_did import FusionDefinition
        >>> with FusionDefinition() as fd:
        ...     x = fd.define_tensor((2, 3, 4), axis_names=("a", "b", "c"))
        >>> x.merge(0).loop_str()
        '[a*b, c]'
        """
        po = self._pos(axis_o, f"merge({axis_o}, {axis_i})")
        pi = self._pos(po + 1 if axis_i is None else axis_i, f"merge({axis_o}, {axis_i})")
        if po == pi:
            raise ShardingError(f"merge of {self.name}: cannot merge loop axis {po} with itself")
        o, i = self._loop[po], self._loop[pi]
        for d in (o, i):
            if d.is_device:
                raise ShardingError(f"merge of {self.name}: {d} is bound to a mesh axis and cannot be merged")
        if o.is_reduction != i.is_reduction:
            raise ShardingError(f"merge of {self.name}: cannot merge reduction {o if o.is_reduction else i} "
                                f"with iteration {i if o.is_reduction else o}")
        kind = o.iter_type if not o.is_broadcast else i.iter_type
        merged = IterDomain(f"{o.name}*{i.name}", o.extent * i.extent, kind,
                            index=MergeOf(o.index, i.index, i.extent))
        rest = [d for k, d in enumerate(self._loop) if k not in (po, pi)]
        rest.insert(min(po, pi), merged)
        self._loop = rest
        return self

    def reorder(self, order: dict[int, int] | Sequence[int]) -> "TensorView":
        """Move loop axes: a dict {old position: new position} (others keep their relative order) or a
        full permutation listing the old position of each new axis.

        >>> from egraph_did import FusionDefinition
        >>> with FusionDefinition() as fd:
        ...     x = fd.define_tensor((2, 3, 4), axis_names=("a", "b", "c"))
        >>> x.reorder({2: 0}).loop_str()
        '[c, a, b]'
        """
        n = len(self._loop)
        if isinstance(order, dict):
            old_to_new = {self._pos(k, "reorder"): self._pos(v, "reorder") for k, v in order.items()}
            if len(set(old_to_new.values())) != len(old_to_new):
                raise ShardingError(f"reorder of {self.name}: two axes sent to one place in {order}")
            perm: list[int | None] = [None] * n
            for old, new in old_to_new.items():
                perm[new] = old
            rest = iter(k for k in range(n) if k not in old_to_new)
            perm = [p if p is not None else next(rest) for p in perm]
        else:
            perm = [self._pos(k, "reorder") for k in order]
            if sorted(perm) != list(range(n)):
                raise ShardingError(f"reorder of {self.name}: {list(order)} is not a permutation of {n} loop axes")
        self._loop = [self._loop[p] for p in perm]
        return self

    def axis(self, i: int) -> AxisRef:
        """A handle on loop axis i."""
        return AxisRef(self, self._pos(i, f"axis({i})"))

    def set_device_mesh(self, mesh: DeviceMesh) -> "TensorView":
        """Place this tensor on a mesh. With no DID axis it is pinned replicated there.

        >>> from egraph_did import FusionDefinition
        >>> x = FusionDefinition().define_tensor((8, 6), name="x").set_device_mesh(DeviceMesh.arange(4))
        >>> x
        TensorView(x: [8, 6] float32 on DeviceMesh(x=4))
        """
        if not isinstance(mesh, DeviceMesh):
            raise MeshError(f"{self.name}.set_device_mesh: expected a DeviceMesh, got {type(mesh).__name__}")
        for d in self._loop:
            if d.is_device:
                self._check_binding(d, d.parallel_type, mesh)
        self.mesh = mesh
        return self

    def _mesh_axis(self, ptype: ParallelType, mesh: DeviceMesh) -> int:
        """ptype's mesh axis on mesh; the MeshError names this tensor."""
        try:
            return ptype.mesh_axis(mesh)
        except MeshError as e:
            raise MeshError(f"{self.name}: {e}; bind a parallel type the mesh has (DIDx is its last axis)") from None

    def _check_binding(self, d: IterDomain, ptype: ParallelType, mesh: DeviceMesh) -> None:
        m = self._mesh_axis(ptype, mesh)
        size = mesh.shape[m]
        if d.extent != size:
            raise ShardingError(
                f"{self.name}: loop axis {d.name} has extent {d.extent} but {ptype.name} binds mesh axis "
                f"'{mesh.axis_names[m]}' of size {size}; use outer_split(axis, {size})")

    def parallelize(self, axis: int, ptype: ParallelType) -> "TensorView":
        """Bind loop axis `axis` to a mesh axis (DIDx/DIDy/DIDz) or back to Serial.

        >>> from egraph_did import FusionDefinition
        >>> x = FusionDefinition().define_tensor((8, 6), axis_names=("s", "h")).set_device_mesh(DeviceMesh.arange(2))
        >>> x.outer_split(1, 2).parallelize(1, ParallelType.DIDx).loop_str()
        '[s, DIDx{2}, h/2]'
        """
        pos = self._pos(axis, f"parallelize({axis}, {ptype})")
        if not isinstance(ptype, ParallelType):
            raise ShardingError(f"parallelize: expected a ParallelType, got {ptype!r}")
        d = self._loop[pos]
        if ptype.is_device:
            if d.is_broadcast:
                raise ShardingError(f"{self.name}: loop axis {pos} ({d}) is a broadcast axis; it has nothing to shard")
            if len(d.logical_axes) != 1:
                raise ShardingError(
                    f"{self.name}: loop axis {pos} ({d.name}) merges logical axes {sorted(d.logical_axes)}; "
                    f"a DID split must derive from one logical axis (split that axis instead of a merge)")
            for k, other in enumerate(self._loop):
                if k != pos and other.parallel_type is ptype:
                    raise ShardingError(f"{self.name}: {ptype.name} is already bound to loop axis {k}; "
                                        f"each mesh axis binds at most one loop axis of a tensor")
            if self.mesh is not None:
                self._check_binding(d, ptype, self.mesh)
        self._loop[pos] = dataclasses.replace(d, parallel_type=ptype)
        return self

    def add_partial(self, ptype: ParallelType, reduce: str = "sum") -> "TensorView":
        """Mark this tensor as a pending sum over the mesh axis `ptype` binds: a reduction loop axis
        bound to that mesh axis, as nvFuser's rfactor of a DID reduction leaves it. Each rank then holds
        a summand; the tensor's value is the sum over that mesh axis (reduce="max": the maximum, as an
        amax over a sharded axis leaves it, shown as rDIDx{n}(max)). Needs the mesh set first.

        >>> from egraph_did import FusionDefinition, DeviceMesh, ParallelType
        >>> with FusionDefinition() as fd:
        ...     y = fd.define_tensor((4, 8), axis_names=("m", "n"))
        >>> y.set_device_mesh(DeviceMesh.arange(2)).add_partial(ParallelType.DIDx).loop_str()
        '[m, n, rDIDx{2}]'
        """
        if self.mesh is None:
            raise ShardingError(f"{self.name}.add_partial: set_device_mesh first (the partial's extent is "
                                f"the size of the mesh axis it pends over)")
        if not ptype.is_device:
            raise ShardingError(f"{self.name}.add_partial: a partial needs a DID parallel type, got {ptype.name}")
        if reduce not in ("sum", "max"):
            hint = {"avg": "; a pending average (DTensor's Partial('avg')) is a pending sum of x / n: pin "
                           "reduce='sum' and give each rank its summand divided by n (plan.run takes a DTensor "
                           "with Partial('avg') placements as it is: its local tensor over n is the summand, "
                           "no collective)",
                    "prod": "; a pending product has no sharding rule: pin the tensor replicated "
                            "(set_device_mesh alone) and multiply the factors before"}.get(reduce, "")
            raise ShardingError(f"{self.name}.add_partial: reduce must be 'sum' or 'max', got {reduce!r}{hint}")
        for d in self._loop:
            if d.parallel_type is ptype:
                raise ShardingError(f"{self.name}: {ptype.name} is already bound to loop axis {d}")
        size = self.mesh.shape[self._mesh_axis(ptype, self.mesh)]
        self._loop.append(IterDomain(f"p{ptype.name}", size, IterType.Reduction, ptype, PendingSum(reduce)))
        return self

    def reset_loop_domain(self) -> "TensorView":
        """Drop every split, merge, reorder and DID binding: loop = logical again (mesh kept).

        >>> from egraph_did import FusionDefinition
        >>> x = FusionDefinition().define_tensor((8, 6), axis_names=("s", "h")).set_device_mesh(DeviceMesh.arange(2))
        >>> x.outer_split(0, 2).parallelize(0, ParallelType.DIDx).reset_loop_domain().loop_str(), x.mesh.size
        ('[s, h]', 2)
        """
        self._loop = list(self.logical_domain)
        self.chunks = "loop"
        return self

    # ------------------------------------------------------------ queries
    def device_axes(self) -> dict[ParallelType, IterDomain]:
        """The loop axes bound to mesh axes, by parallel type.

        >>> from egraph_did import FusionDefinition
        >>> x = FusionDefinition().define_tensor((8, 6), axis_names=("s", "h")).set_device_mesh(DeviceMesh.arange(2))
        >>> {p.name: str(d) for p, d in x.outer_split(0, 2).parallelize(0, ParallelType.DIDx).device_axes().items()}
        {'DIDx': 'DIDx{2}'}
        """
        return {d.parallel_type: d for d in self._loop if d.is_device}

    @property
    def is_sharded(self) -> bool:
        """Whether some loop axis is bound to a mesh axis."""
        return any(d.is_device for d in self._loop)

    def loop_str(self) -> str:
        """The loop domain as text, e.g. '[b, DIDx{4}, s/4, h]'."""
        return "[" + ", ".join(str(d) for d in self._loop) + "]"

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of the shard `rank` holds (logical axes, local extents). See sharding.py.

        >>> from egraph_did import FusionDefinition
        >>> x = FusionDefinition().define_tensor((10, 6)).set_device_mesh(DeviceMesh.arange(4))
        >>> _ = x.outer_split(0, 4).parallelize(0, ParallelType.DIDx)
        >>> [x.local_shape(r) for r in range(4)]  # 10 rows in ceil-sized pieces
        [(3, 6), (3, 6), (3, 6), (1, 6)]
        """
        return tuple(len(i) for i in self.local_indices(rank))

    def local_indices(self, rank: int) -> list[np.ndarray]:
        """Per logical axis, the sorted global indices `rank` holds: those whose coordinate on every DID
        loop axis derived from that axis equals the rank's coordinate on the bound mesh axis (the local
        order is the global order). The loop domain is the source of truth, so any split is exact.

        >>> from egraph_did import FusionDefinition
        >>> x = FusionDefinition().define_tensor((5,)).set_device_mesh(DeviceMesh.arange(2))
        >>> [a.tolist() for a in x.outer_split(0, 2).parallelize(0, ParallelType.DIDx).local_indices(1)]
        [[3, 4]]

        Under DTensor's chunks (chunks == "dtensor": outer DID splits only, outer mesh axis first, as
        runtime.pin_placements writes them) each split chunks the extent the one outside it left:

        >>> y = FusionDefinition().define_tensor((9,)).set_device_mesh(DeviceMesh([[0, 1], [2, 3]]))
        >>> _ = y.outer_split(0, 2).parallelize(0, ParallelType.DIDy).outer_split(1, 2).parallelize(1, ParallelType.DIDx)
        >>> [len(y.local_indices(r)[0]) for r in range(4)], setattr(y, "chunks", "dtensor")
        ([3, 2, 3, 1], None)
        >>> [y.local_indices(r)[0].tolist() for r in range(4)]
        [[0, 1, 2], [3, 4], [5, 6], [7, 8]]
        """
        mesh = self.device_mesh()
        coords = mesh.coords(rank)
        if self.chunks == "dtensor":
            return self._dtensor_indices(mesh, coords)
        out = []
        for a, extent in enumerate(self.shape):
            idx = np.arange(extent, dtype=np.int64)
            keep = np.ones(extent, dtype=bool)
            for d in self._loop:
                if d.is_device and not d.is_reduction and a in d.logical_axes:
                    keep &= d.index.eval({a: idx}) == coords[d.parallel_type.mesh_axis(mesh)]
            out.append(idx[keep])
        return out

    def _dtensor_indices(self, mesh: DeviceMesh, coords) -> list[np.ndarray]:
        """local_indices under DTensor's chunks: per axis, its DID splits in loop order (outer first), each
        chunking (ceil-sized pieces) the range the ones before it left."""
        out = []
        for a, extent in enumerate(self.shape):
            lo, size = 0, extent
            for d in self._loop:
                if d.is_device and not d.is_reduction and a in d.logical_axes:
                    n, c = mesh.shape[d.parallel_type.mesh_axis(mesh)], coords[d.parallel_type.mesh_axis(mesh)]
                    chunk = -(-size // n)
                    start = min(chunk * c, size)
                    lo, size = lo + start, min(size, start + chunk) - start
            out.append(np.arange(lo, lo + size, dtype=np.int64))
        return out

    def device_mesh(self) -> DeviceMesh:
        """The mesh this tensor lives on; an unsharded tensor without one lives on one device.

        >>> from egraph_did import FusionDefinition
        >>> FusionDefinition().define_tensor((5,)).device_mesh()
        DeviceMesh(x=1)
        """
        if self.mesh is None:
            if self.is_sharded:
                raise ShardingError(f"{self.name} has DID axes {self.loop_str()} but no mesh; call set_device_mesh")
            return DeviceMesh([0])
        return self.mesh

    def __repr__(self) -> str:
        mesh = f" on {self.mesh}" if self.mesh is not None else ""
        chunks = " in DTensor's chunks" if self.chunks == "dtensor" else ""
        return f"TensorView({self.name}: {self.loop_str()}{chunks} {str(self.dtype).replace('torch.', '')}{mesh})"
