"""Layouts: per mesh axis, how a tensor sits on it: R (replicated), P (partial sum), Pmax (partial max,
inside max-reductions only) or S(a) (logical axis a split over that mesh axis, the outer part bound).

A layout is the optimizer's compact name for a family of loop domains; `apply_layout` writes the loop
domain (outer DID splits, in mesh-axis order: DIDz/DIDy outside DIDx on a shared axis) and
`layout_of` reads one back, exactly, by comparing what every rank holds.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

from .errors import PlanError
from .ir import ParallelType, TensorView
from .mesh import DeviceMesh


@dataclass(frozen=True, order=True)
class Placement:
    """How a tensor sits on one mesh axis: R (replicated), S(axis) (split), P (partial sum) or Pmax.

    >>> str(R), str(S(1)), str(P), str(PMAX)
    ('R', 'S(1)', 'P', 'Pmax')
    >>> S(1).is_shard, PMAX.is_partial, PMAX.code()
    (True, True, 'M')
    """

    kind: str  # "R", "S", "P"
    axis: int = -1  # tensor axis for S
    reduce: str = "sum"  # for P: "sum" or "max"

    def __post_init__(self):
        assert self.kind in ("R", "S", "P"), self.kind
        assert (self.kind == "S") == (self.axis >= 0), self
        assert self.reduce in ("sum", "max"), self

    @property
    def is_shard(self) -> bool:
        """Whether this placement splits a tensor axis (S)."""
        return self.kind == "S"

    @property
    def is_partial(self) -> bool:
        """Whether every rank holds a summand (P) or a candidate maximum (Pmax)."""
        return self.kind == "P"

    def code(self) -> str:
        """Compact text for layout codes: 'R', 'P', 'M' (Pmax) or 'S<axis>'."""
        return {"R": "R", "P": "P" if self.reduce == "sum" else "M"}.get(self.kind) or f"S{self.axis}"

    def __str__(self) -> str:
        if self.kind == "S":
            return f"S({self.axis})"
        if self.kind == "P":
            return "P" if self.reduce == "sum" else "Pmax"
        return "R"


R = Placement("R")
P = Placement("P")
PMAX = Placement("P", reduce="max")


def S(axis: int) -> Placement:
    """Sharded on tensor axis `axis` (non-negative).

    >>> str(S(0)), S(0).is_shard, S(0).code()
    ('S(0)', True, 'S0')
    """
    return Placement("S", axis)


@dataclass(frozen=True, order=True)
class Layout:
    """One placement per mesh axis (outermost mesh axis first).

    >>> lay = Layout((S(1), R))  # on a 2-D mesh: axis 1 split over the outer mesh axis
    >>> str(lay), lay.code(), Layout.from_code("S1.R") == lay
    ('[S(1), R]', 'S1.R', True)
    >>> lay.sharding_axes(1), lay.replace(1, P).has_partial
    ([0], True)
    """

    placements: tuple[Placement, ...]

    def __iter__(self):
        return iter(self.placements)

    def __getitem__(self, i: int) -> Placement:
        return self.placements[i]

    def __len__(self):
        return len(self.placements)

    def code(self) -> str:
        """Compact text used as the e-graph's layout name, e.g. 'S1.R'."""
        return ".".join(p.code() for p in self.placements)

    @classmethod
    def from_code(cls, code: str) -> "Layout":
        """Inverse of code()."""
        out = []
        for c in code.split("."):
            out.append({"R": R, "P": P, "M": PMAX}.get(c) or S(int(c[1:])))
        return cls(tuple(out))

    @property
    def is_replicated(self) -> bool:
        """Whether every mesh axis holds the whole tensor."""
        return all(p.kind == "R" for p in self.placements)

    @property
    def has_partial(self) -> bool:
        """Whether a reduction over some mesh axis is still pending."""
        return any(p.is_partial for p in self.placements)

    def replace(self, mesh_axis: int, placement: Placement) -> "Layout":
        """A copy with mesh axis `mesh_axis` set to `placement`."""
        ps = list(self.placements)
        ps[mesh_axis] = placement
        return Layout(tuple(ps))

    def sharding_axes(self, tensor_axis: int) -> list[int]:
        """Mesh axes that split tensor axis `tensor_axis`, outermost first."""
        return [m for m, p in enumerate(self.placements) if p.is_shard and p.axis == tensor_axis]

    def __str__(self) -> str:
        return "[" + ", ".join(str(p) for p in self.placements) + "]"


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


def valid_layouts(shape: Sequence[int], mesh: DeviceMesh, partial: bool = False) -> Iterator[Layout]:
    """Every layout of a tensor of `shape`: an axis is sharded only where every rank gets at least one
    element (uneven shards allowed, empty ones not); partials only when asked.

    >>> [str(lay) for lay in valid_layouts((4, 1), DeviceMesh.arange(2))]  # axis 1 is too short to split
    ['[R]', '[S(0)]']
    >>> [str(lay) for lay in valid_layouts((4, 1), DeviceMesh.arange(2), partial=True)]
    ['[R]', '[P]', '[Pmax]', '[S(0)]']
    """
    choices = [R] + ([P, PMAX] if partial else []) + [S(a) for a in range(len(shape))]
    for combo in itertools.product(choices, repeat=mesh.ndim):
        layout = Layout(tuple(combo))
        if is_valid(layout, shape, mesh):
            yield layout


def is_valid(layout: Layout, shape: Sequence[int], mesh: DeviceMesh) -> bool:
    """Whether `layout` fits a tensor of `shape` on `mesh`: one placement per mesh axis, sharded axes
    that exist, and no rank left with an empty shard.

    >>> mesh = DeviceMesh.arange(4)
    >>> is_valid(Layout((S(0),)), (7, 8), mesh)  # rows 2, 2, 2, 1
    True
    >>> is_valid(Layout((S(0),)), (5, 8), mesh)  # rows 2, 2, 1, 0: the last shard is empty
    False
    """
    if len(layout) != mesh.ndim:
        return False
    for a in range(len(shape)):
        ways = math.prod(mesh.shape[m] for m in layout.sharding_axes(a))
        if ways > 1 and -(-shape[a] // ways) * (ways - 1) >= shape[a]:
            return False  # the last shard would be empty
    return all(not p.is_shard or p.axis < len(shape) for p in layout)


def apply_layout(tv: TensorView, layout: Layout, mesh: DeviceMesh) -> TensorView:
    """Set tv's mesh and loop domain to the canonical form of `layout`.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((8, 12), axis_names=("s", "h"))
    >>> mesh = ed.DeviceMesh([[0, 1, 2], [3, 4, 5]])
    >>> apply_layout(x, Layout((S(1), S(1))), mesh).loop_str()
    '[s, DIDy{2}, DIDx{3}, h/2/3]'
    """
    if not is_valid(layout, tv.shape, mesh):
        raise PlanError(f"{tv.name}: layout {layout} does not fit shape {tv.shape} on {mesh}")
    tv.reset_loop_domain().set_device_mesh(mesh)
    for a in reversed(range(tv.ndim)):  # right to left, so earlier positions stay put
        pos = a
        for m in layout.sharding_axes(a):
            tv.outer_split(pos, mesh.shape[m]).parallelize(pos, ParallelType.for_mesh_axis(mesh, m))
            pos += 1
    for m, p in enumerate(layout):
        if p.is_partial:
            tv.add_partial(ParallelType.for_mesh_axis(mesh, m), p.reduce)
    return tv


def layout_of(tv: TensorView, mesh: DeviceMesh) -> Layout:
    """The layout a pinned tensor's loop domain expresses; PlanError when no layout expresses it
    exactly (e.g. a DID split that is not outermost), naming the tensor.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((8, 12), axis_names=("s", "h"))
    >>> mesh = ed.DeviceMesh.arange(4)
    >>> _ = x.set_device_mesh(mesh).outer_split(1, 4).axis(1).parallelize(ed.ParallelType.DIDx)
    >>> str(layout_of(x, mesh))
    '[S(1)]'
    """
    from .fusion import Fusion
    from .sharding import local_indices

    tmesh = tv.mesh or mesh
    if tmesh != mesh:
        raise PlanError(f"{tv.name} is pinned to {tmesh} but the fusion is optimized for {mesh}")
    ps = [R] * mesh.ndim
    for d in tv.loop_domain:
        if d.is_device:
            m = d.parallel_type.mesh_axis(mesh)
            ps[m] = (PMAX if d.index.reduce == "max" else P) if d.is_reduction else S(next(iter(d.logical_axes)))
    layout = Layout(tuple(ps))
    probe = TensorView(tv.name, tv.shape, tv.dtype, [d.name for d in tv.logical_domain], Fusion())
    try:
        apply_layout(probe, layout, mesh)
    except PlanError:
        probe = None
    if probe is None or any(
            [i.tolist() for i in local_indices(probe, r)] != [i.tolist() for i in local_indices(tv, r)]
            for r in mesh.ranks):
        raise PlanError(f"{tv.name}: the loop domain {tv.loop_str()} is not an outer DID split of each sharded "
                        f"axis (the optimizer lays tensors out as R/P/S(axis) per mesh axis); pin it as "
                        f"outer_split(axis, mesh size) then parallelize the outer part, or leave it free")
    return layout


__all__ = ["Placement", "Layout", "R", "P", "PMAX", "S", "local_extents",
           "valid_layouts", "is_valid", "apply_layout", "layout_of"]
