"""Pins: a TensorView's loop domain <-> a Layout. `apply_layout` writes the canonical loop domain of a
layout (outer DID splits, in mesh-axis order: DIDz/DIDy outside DIDx on a shared axis); `layout_of`
reads a pinned tensor's layout back, exactly, by comparing what every rank holds.
"""
from __future__ import annotations

from .errors import PlanError
from .ir import InnerOf, LogicalIndex, OuterOf, ParallelType, TensorView
from .layout import P, PMAX, Layout, R, S, canonical_layout, is_valid
from .mesh import DeviceMesh
from .sharding import local_indices


def apply_layout(tv: TensorView, layout: Layout, mesh: DeviceMesh) -> TensorView:
    """Set tv's mesh and loop domain to the canonical form of `layout`.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((8, 12), axis_names=("s", "h"))
    >>> mesh = ed.DeviceMesh([[0, 1, 2], [3, 4, 5]])
    >>> apply_layout(x, Layout((S(1), S(1))), mesh).loop_str()
    '[s, DIDy{2}, DIDx{3}, h/2/3]'
    """
    if not is_valid(layout, tv.shape, mesh, allow_empty=True):  # a pin may leave a rank empty, as DTensor's
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


def layout_view(name: str, shape, dtype, layout: Layout, mesh: DeviceMesh, axis_names=None) -> TensorView:
    """A free-standing TensorView (of no fusion) laid out as `layout`: the loop domain a plan's value has.

    >>> import torch, egraph_did as ed
    >>> layout_view("w1", (64, 16), torch.float32, Layout.from_code("S0"), ed.DeviceMesh.arange(4)).loop_str()
    '[DIDx{4}, 64/4, 16]'
    """
    return apply_layout(TensorView(name, shape, dtype, axis_names or None), layout, mesh)


def layout_of(tv: TensorView, mesh: DeviceMesh) -> Layout:
    """The layout a pinned tensor's loop domain expresses, canonical (R on mesh axes of size 1);
    PlanError naming the tensor, and saying what to do, when no layout expresses it exactly: a rank
    left with no elements, or a DID split that is not outermost (a merged gate/up or QKV weight).

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((8, 16), axis_names=("s", "h"))
    >>> mesh = ed.DeviceMesh.arange(4)
    >>> _ = x.set_device_mesh(mesh).outer_split(1, 4).axis(1).parallelize(ed.ParallelType.DIDx)
    >>> str(layout_of(x, mesh))
    '[S(1)]'
    >>> x.name = "w"  # a merged gate/up weight: each rank holds a quarter of either half
    >>> layout_of(x.reset_loop_domain().outer_split(1, 2).outer_split(2, 4).parallelize(2, ed.ParallelType.DIDx), mesh)
    Traceback (most recent call last):
    ...
    egraph_did.errors.PlanError: w: the loop domain [s, 2, DIDx{4}, h/2/4] binds DIDx inside the serial outer split '2' of axis 1 (a non-outermost DID split, as of a merged gate/up or QKV weight); shard_tensor and simulate handle it, the optimizer does not: pin the parts as separate tensors (e.g. gate and up, each outer_split(axis, mesh size) then parallelized) joined by the ops that use them, or leave w free
    """
    tmesh = tv.mesh or mesh
    if tmesh != mesh:
        sub = " (a sub-mesh: a tensor held by some devices and broadcast to the others is not supported)" \
            if set(tmesh.ranks) < set(mesh.ranks) else ""
        raise PlanError(f"{tv.name} is pinned to {tmesh} but the fusion is optimized for {mesh}{sub}; every "
                        f"tensor lives on the fusion's mesh: pin {tv.name} with set_device_mesh(mesh) (replicated: "
                        f"plan.run takes it whole on every rank), or leave it free")
    ps = [R] * mesh.ndim
    for d in tv.loop_domain:
        if d.is_device:
            m = d.parallel_type.mesh_axis(mesh)
            ps[m] = (PMAX if d.index.reduce == "max" else P) if d.is_reduction else S(next(iter(d.logical_axes)))
    layout = canonical_layout(Layout(tuple(ps)), mesh)
    if P in layout and PMAX in layout:
        raise PlanError(f"{tv.name}: the loop domain {tv.loop_str()} pends a sum and a max on one tensor; they do "
                        f"not commute (the sum of maxima is not the maximum of sums), so its value is undefined: "
                        f"pin one partial and leave the other mesh axis replicated or sharded")
    held = {r: local_indices(tv, r) for r in mesh.ranks}
    try:
        probe = layout_view(tv.name, tv.shape, tv.dtype, layout, mesh, [d.name for d in tv.logical_domain])
    except PlanError:
        probe = None
    if probe is None or any([i.tolist() for i in local_indices(probe, r)] != [i.tolist() for i in held[r]]
                            for r in mesh.ranks):
        inner = _non_outermost(tv)
        if inner is not None:
            d, outer = inner
            a = next(iter(d.logical_axes))
            raise PlanError(
                f"{tv.name}: the loop domain {tv.loop_str()} binds {d.parallel_type.name} inside the serial "
                f"outer split '{outer}' of axis {a} (a non-outermost DID split, as of a merged gate/up or QKV "
                f"weight); shard_tensor and simulate handle it, the optimizer does not: pin the parts as "
                f"separate tensors (e.g. gate and up, each outer_split(axis, mesh size) then parallelized) "
                f"joined by the ops that use them, or leave {tv.name} free")
        raise PlanError(f"{tv.name}: the loop domain {tv.loop_str()} is not the canonical DID split of its "
                        f"sharded axes (the optimizer lays tensors out as R/P/S(axis) per mesh axis, an axis "
                        f"split over two mesh axes outer mesh axis first); pin it as outer_split(axis, mesh "
                        f"size) then parallelize the outer part, or leave it free")
    return layout


def _non_outermost(tv: TensorView):
    """(DID loop axis, serial outer part) where a DID axis derives from the inner part of a split whose
    outer part stays serial (extent > 1), or None."""
    def inners(ix):
        while ix is not None and not isinstance(ix, LogicalIndex):
            if isinstance(ix, InnerOf):
                yield ix
            ix = getattr(ix, "of", None)
    siblings = {d.index: d for d in tv.loop_domain if isinstance(d.index, OuterOf)}
    for d in tv.loop_domain:
        if d.is_device and not d.is_reduction:
            for ix in inners(d.index):
                outer = siblings.get(OuterOf(ix.of, ix.inner_extent))
                if outer is not None and not outer.is_device and outer.extent > 1:
                    return d, outer
    return None


__all__ = ["apply_layout", "layout_of", "layout_view"]
