"""Pins: a TensorView's loop domain <-> a Layout. `apply_layout` writes the canonical loop domain of a
layout (outer DID splits, in mesh-axis order: DIDz/DIDy outside DIDx on a shared axis); `layout_of`
reads a pinned tensor's layout back, exactly, by comparing what every rank holds.

A pin that nests its DID splits otherwise (a non-outermost split of a merged gate/up weight; DTensor's
inner-first shard order) is, where the splits divide, a canonical layout of a reshaped view of the
tensor (`pin_view`): every rank holds the same elements in the same order. `view_pins` gives the
optimizer a fusion with such tensors replaced by their views; plans bind the user's tensor to the
view's shard by a local reshape.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import PlanError
from .fusion import Fusion, Ops
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
    left with no elements, or DID splits nested in an order no layout names (a non-outermost split, as
    of a merged gate/up or QKV weight, or the inner mesh axis splitting first): optimize plans those
    through a reshaped view of the tensor (pin_view).

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
    egraph_did.errors.PlanError: w: the loop domain [s, 2, DIDx{4}, h/2/4] binds DIDx inside the serial outer split '2' of axis 1 (a non-outermost DID split, as of a merged gate/up or QKV weight); no layout of w's own shape names it: optimize plans it as the view [8, 2, 8] laid out [S(2)] (pin_view)
    """
    layout = _read_layout(tv, mesh)
    if layout is not None:
        return layout
    what = _nesting(tv)
    view = pin_view(tv, mesh, what)
    raise PlanError(f"{tv.name}: the loop domain {tv.loop_str()} {what}; no layout of {tv.name}'s own shape names "
                    f"it: optimize plans it as the view {list(view.view_shape)} laid out {view.layout} (pin_view)")


def _nesting(tv: TensorView) -> str:
    """How a loop domain no layout names nests its DID splits, in words for an error."""
    inner = _non_outermost(tv)
    if inner is None:
        return "nests its DID splits in an order no layout names (the inner mesh axis splitting first)"
    d, outer = inner
    return (f"binds {d.parallel_type.name} inside the serial outer split '{outer}' of axis "
            f"{next(iter(d.logical_axes))} (a non-outermost DID split, as of a merged gate/up or QKV weight)")


def _read_layout(tv: TensorView, mesh: DeviceMesh) -> Layout | None:
    """The canonical layout whose loop domain holds what tv's does on every rank, or None; PlanError for a
    pin no plan can hold (another mesh, a sum and a max pending together)."""
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
    try:
        probe = layout_view(tv.name, tv.shape, tv.dtype, layout, mesh, [d.name for d in tv.logical_domain])
    except PlanError:
        return None
    probe.chunks = tv.chunks  # a pin in DTensor's chunks is the layout the plan holds, bound by a rechunk
    same = all([i.tolist() for i in local_indices(probe, r)] == [i.tolist() for i in local_indices(tv, r)]
               for r in mesh.ranks)
    return layout if same else None


def pin_of(tv: TensorView, mesh: DeviceMesh) -> "Layout | PinView":
    """What a pin says for the optimizer: its layout where one names it (layout_of), else the reshaped view
    that holds the same elements in the same order on every rank (pin_view); PlanError where neither does.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     w = fd.define_tensor((16, 8), axis_names=("n", "k"))
    >>> mesh = ed.DeviceMesh.arange(4)
    >>> print(pin_of(w.set_device_mesh(mesh).outer_split(0, 2).outer_split(1, 4).parallelize(1, ed.ParallelType.DIDx), mesh))
    [2, DIDx{4}, n/2/4, k] = reshape to [2, 8, 8] laid out [S(1)]
    """
    layout = _read_layout(tv, mesh)
    return layout if layout is not None else pin_view(tv, mesh, _nesting(tv))


@dataclass(frozen=True)
class PinView:
    """A pin no layout of the tensor's own shape names, as a canonical layout of a reshaped view: the
    tensor's axes split at the loop domain's splits (one view axis per DID split, with the serial parts
    inside it; serial parts before the first DID split one more), so every rank holds the same elements
    in the same order as under the pin, and a local reshape binds one to the other.

    >>> v = PinView("w", (16, 8), (2, 8, 8), (2, 1), Layout((S(1),)), ("n.0", "n.1", "k"), "[2, DIDx{4}, n/2/4, k]")
    >>> v.local_shape((2, 2, 8)), v.to_dict()["view_shape"]  # a rank's view shard, as the pin holds it
    ((4, 8), [2, 8, 8])
    """

    tensor: str
    shape: tuple[int, ...]  # the tensor's logical shape
    view_shape: tuple[int, ...]
    groups: tuple[int, ...]  # view axes per logical axis
    layout: Layout  # the view's layout (canonical)
    axes: tuple[str, ...]  # the view's axis names
    loop: str  # the pinned loop domain
    view: str = ""  # the view's tensor in the fusion the optimizer plans (view_pins names it)

    def local_shape(self, view_local: Sequence[int]) -> tuple[int, ...]:
        """The pinned shard's shape from the view shard's (the extents of each group multiplied)."""
        out, k = [], 0
        for g in self.groups:
            out.append(math.prod(view_local[k:k + g]))
            k += g
        return tuple(out)

    def to_dict(self) -> dict:
        """Plain JSON data (Plan.to_json); from_dict reads it back."""
        return {"tensor": self.tensor, "shape": list(self.shape), "view_shape": list(self.view_shape),
                "groups": list(self.groups), "layout": str(self.layout), "axes": list(self.axes), "loop": self.loop,
                "view": self.view}

    @classmethod
    def from_dict(cls, d: dict) -> "PinView":
        """Inverse of to_dict(); PlanError naming the field when one is missing or malformed."""
        try:
            view = cls(str(d["tensor"]), tuple(int(e) for e in d["shape"]), tuple(int(e) for e in d["view_shape"]),
                       tuple(int(g) for g in d["groups"]), Layout.parse(d["layout"]), tuple(map(str, d["axes"])),
                       str(d["loop"]), str(d.get("view", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"plan JSON: a pin view must hold tensor, shape, view_shape, groups, layout, axes and "
                            f"loop as Plan.to_json writes them ({type(e).__name__}: {e})") from None
        if sum(view.groups) != len(view.view_shape) or len(view.groups) != len(view.shape) or \
                math.prod(view.shape) != math.prod(view.view_shape):
            raise PlanError(f"plan JSON: the pin view of {view.tensor} reshapes {list(view.shape)} to "
                            f"{list(view.view_shape)} in groups {list(view.groups)}: not a reshape")
        return view

    def __str__(self) -> str:
        return f"{self.loop} = reshape to {list(self.view_shape)} laid out {self.layout}"


def pin_view(tv: TensorView, mesh: DeviceMesh, what: str = "nests its DID splits in an order no layout names"
             ) -> PinView:
    """The view whose canonical layout holds what tv's loop domain holds on every rank (see PinView);
    PlanError naming the tensor and saying what to do where the nesting is no reshape (a split that does
    not divide the extent it nests in, or a merge).

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((8, 6), axis_names=("s", "h"))
    >>> mesh = ed.DeviceMesh([[0, 1], [2, 3]])  # inner-first: DIDx (mesh axis 1) splits s before DIDy
    >>> print(pin_view(x.set_device_mesh(mesh).outer_split(0, 2).parallelize(0, ed.ParallelType.DIDx)
    ...                .outer_split(1, 2).parallelize(1, ed.ParallelType.DIDy), mesh))
    [DIDx{2}, DIDy{2}, s/2/2, h] = reshape to [2, 4, 6] laid out [S(1), S(0)]
    """
    shape, axes, groups, ps = [], [], [], [R] * mesh.ndim
    for a, d in enumerate(tv.logical_domain):
        parts = _view_parts(tv, a)
        if parts is None or math.prod(e for e, _ in parts) != d.extent:
            raise PlanError(f"{tv.name}: the loop domain {tv.loop_str()} {what}, and its splits of axis {a} (extent "
                            f"{d.extent}) do not divide it, so no reshape of {tv.name} holds what each rank holds: "
                            f"make axis {a}'s extent a multiple of the splits nested in it, pin it as outer_split(axis, "
                            f"mesh size) then parallelize the outer part (outer mesh axis first), or leave it free")
        for j, (e, ptype) in enumerate(parts):
            if ptype is not None:
                ps[ptype.mesh_axis(mesh)] = S(len(shape))
            shape.append(e)
            named = d.name != str(d.extent)  # a name the user gave (else the extent, as define_tensor's default)
            axes.append(d.name if len(parts) == 1 else f"{d.name}.{j}" if named else str(e))
        groups.append(len(parts))
    for d in tv.loop_domain:
        if d.is_device and d.is_reduction:
            ps[d.parallel_type.mesh_axis(mesh)] = PMAX if d.index.reduce == "max" else P
    view = PinView(tv.name, tv.shape, tuple(shape), tuple(groups), canonical_layout(Layout(tuple(ps)), mesh),
                   tuple(axes), tv.loop_str())
    _check_view(tv, view, mesh, what)
    return view


def _view_parts(tv: TensorView, a: int):
    """[(extent, parallel type or None)] of logical axis a's view axes: the loop axes derived from it in
    the order of their digits (outer parts first), cut before every DID axis; None for a merge."""
    leaves = []
    for d in tv.loop_domain:
        if a not in d.logical_axes:
            continue
        path, ix = [], d.index
        while not isinstance(ix, LogicalIndex):
            if not isinstance(ix, (OuterOf, InnerOf)):
                return None  # a merge: no digits of one axis
            path.append(ix)
            ix = ix.of
        leaves.append((tuple(reversed(path)), d))
    leaves.sort(key=lambda pd: tuple(isinstance(ix, InnerOf) for ix in pd[0]))  # digits, most significant first
    runs: list[list] = []
    for path, d in leaves:
        if d.is_device or not runs:
            runs.append([])
        runs[-1].append((path, d))
    extent = tv.shape[a]
    return [(_run_extent(run, leaves, extent), run[0][1].parallel_type if run[0][1].is_device else None)
            for run in runs]


def _run_extent(run, leaves, extent: int) -> int:
    """The extent of a run of digits: its subtree's where the run is a whole subtree of the splits (an
    uneven split inside it is the layout's own, canonical), else the product of its loop extents."""
    paths = [p for p, _ in run]
    common = 0
    while all(len(p) > common for p in paths) and len({p[common] for p in paths}) == 1:
        common += 1
    prefix = paths[0][:common]
    if {p for p, _ in leaves if p[:common] == prefix} == set(paths):  # the subtree holds the run and no more
        return _node_extent(prefix[-1], extent) if prefix else extent
    return math.prod(d.extent for _, d in run)


def _node_extent(ix, extent: int) -> int:
    """The extent of a split's part: an outer part ceil(of / inner), an inner part its inner extent."""
    if isinstance(ix, InnerOf):
        return ix.inner_extent
    if isinstance(ix, OuterOf):
        return -(-_node_extent(ix.of, extent) // ix.inner_extent)
    return extent


def _check_view(tv: TensorView, view: PinView, mesh: DeviceMesh, what: str) -> None:
    """PlanError unless every rank holds, under the view's layout, the elements the pin gives it (the
    flat indices of its view shard, per logical axis, are the pin's, in the same order)."""
    probe = layout_view(view.tensor, view.view_shape, tv.dtype, view.layout, mesh, view.axes) \
        if is_valid(view.layout, view.view_shape, mesh, allow_empty=True) else None
    for r in mesh.ranks:
        held = local_indices(tv, r)
        got = local_indices(probe, r) if probe is not None else None
        k = 0
        for a, g in enumerate(view.groups):
            flat = None
            if got is not None:
                flat = np.zeros(1, dtype=np.int64)
                for j in range(k, k + g):
                    flat = (flat[:, None] * view.view_shape[j] + got[j][None, :]).ravel()
            k += g
            if flat is None or flat.tolist() != held[a].tolist():
                raise PlanError(f"{tv.name}: the loop domain {tv.loop_str()} {what}, and the view "
                                f"{list(view.view_shape)} laid out {view.layout} does not give rank {r} what the pin "
                                f"does along axis {a} (uneven splits nest differently), so no reshape of {tv.name} "
                                f"holds it: make axis {a}'s extent a multiple of the splits nested in it, pin it "
                                f"as outer_split(axis, mesh size) then parallelize the outer part, or leave it free")


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


VIEW_SUFFIX = ".view"


def view_pins(fusion: Fusion, mesh: DeviceMesh) -> tuple[Fusion, dict[str, PinView]]:
    """The fusion the optimizer plans where some pins are views (pin_of): a pinned input becomes an input
    of the view's shape named '<name>.view', pinned canonical, reshaped to its own shape under its own
    name; a pinned output or intermediate is reshaped to the view, '<name>.view', pinned canonical (an
    output's place among the outputs goes to it). A slice of a viewed input along whole view blocks, or a
    reshape of it, reads the view (slice, then reshape; one reshape), so slicing gate and up out of a merged
    weight, or reshaping a QKV weight to [3, heads, head_dim, hidden], stays local where the view rules say. Returns
    (fusion, {tensor: its view}); the fusion itself where no pin is a view.

    >>> import egraph_did as ed
    >>> mesh = ed.DeviceMesh.arange(4)
    >>> with ed.FusionDefinition() as fd:
    ...     w = fd.define_tensor((16, 8), name="w")
    ...     fd.add_output(fd.ops.relu(fd.ops.slice(w, 0, 8, 16)), name="y")
    >>> _ = w.set_device_mesh(mesh).outer_split(0, 2).outer_split(1, 4).parallelize(1, ed.ParallelType.DIDx)
    >>> work, views = view_pins(fd.fusion, mesh)
    >>> print(work)
    inputs: w.view[2, 8, 8]
      slice_0.part = slice(w.view, 0, start=1, end=2)
      slice_0 = reshape(slice_0.part, (8, 8))
      y = relu(slice_0)
    outputs: y
    >>> work["w.view"].loop_str(), list(views)
    ('[2, DIDx{4}, 8/4, 8]', ['w'])
    """
    pins = {tv.name: pin_of(tv, mesh) for tv in fusion.all_tensors() if tv.mesh is not None}
    views = {n: p for n, p in pins.items() if isinstance(p, PinView)}
    if not views:
        return fusion, {}
    for name in views:
        if fusion[name] in fusion.inputs and name in fusion.outputs:
            raise PlanError(f"{name}: an input output as itself cannot be pinned as a view ({views[name]}); pin it "
                            f"as outer_split(axis, mesh size) then parallelize the outer part, or leave it free")
    return _ViewedFusion(fusion, mesh, views).build(), views


class _ViewedFusion:
    """view_pins' work: the user's fusion replayed with viewed tensors replaced by their views. A tensor the
    replay reads through a view (a viewed input; a linear of a viewed weight, held as its blocks) is made
    whole only where an op reads it whole (`operand`)."""

    def __init__(self, fusion: Fusion, mesh: DeviceMesh, views: dict[str, PinView]):
        self.fusion, self.mesh, self.views = fusion, mesh, views
        self.dst = Fusion()
        self.ops = Ops(self.dst)
        self.new: dict[int, TensorView] = {}  # user tensor -> its tensor in the replay
        self.viewed: dict[int, tuple[TensorView, PinView]] = {}  # viewed input -> (its view input, the view)
        self.blocks: dict[int, tuple[list[TensorView], int]] = {}  # linear of a viewed weight -> (blocks, width)
        self.taken = set(fusion.tensors)

    def fresh(self, base: str) -> str:
        """A name no tensor of the user's fusion (nor of the replay) has."""
        out, k = base, 1
        while out in self.taken:
            out, k = f"{base}{k}", k + 1
        self.taken.add(out)
        return out

    def rename(self, tv: TensorView, name: str) -> TensorView:
        self.dst.tensors.pop(tv.name)
        tv.name = name
        self.dst.tensors[name] = tv
        return tv

    def part(self, tv: TensorView, of: str) -> TensorView:
        """A helper tensor of the replay, named after the user tensor it helps compute."""
        return self.rename(tv, self.fresh(f"{of}.part"))

    def pin(self, tv: TensorView, src: TensorView) -> None:  # the user's pin, as written, on the replay's copy
        tv.set_device_mesh(self.mesh)
        tv._loop, tv.chunks = list(src.loop_domain), src.chunks

    def operand(self, tv: TensorView) -> TensorView:
        """The replay's tensor for a user tensor an op reads whole: a viewed input reshaped back, a linear
        held as blocks joined (cat along its last axis)."""
        if id(tv) not in self.new:
            if id(tv) in self.viewed:
                whole = self.ops.reshape(self.viewed[id(tv)][0], tv.shape)
            else:
                parts = self.blocks[id(tv)][0]
                whole = parts[0]
                for p in parts[1:]:
                    whole = self.ops.cat(whole if whole is parts[0] else self.part(whole, tv.name), p, -1)
            self.new[id(tv)] = self.rename(whole, tv.name)
        return self.new[id(tv)]

    def build(self) -> Fusion:
        ops, views = self.ops, self.views
        for tv in self.fusion.inputs:
            if tv.name in views:
                v = views[tv.name] = dataclasses.replace(views[tv.name], view=self.fresh(tv.name + VIEW_SUFFIX))
                vin = self.dst.define_tensor(v.view_shape, tv.dtype, v.view, v.axes)
                self.viewed[id(tv)] = (apply_layout(vin, v.layout, self.mesh), v)
            else:
                self.new[id(tv)] = self.dst.define_tensor(tv.shape, tv.dtype, tv.name, [d.name for d in tv.logical_domain])
                if tv.mesh is not None:
                    self.pin(self.new[id(tv)], tv)
        outputs = {}
        for e in self.fusion.exprs:
            outs = self.through_view(e)
            if outs is None:
                outs = self.dst.emit(e.op.name, **{k: self.operand(v) if isinstance(v, TensorView) else v
                                                   for k, v in e.args})
            elif isinstance(outs, tuple) and not outs:  # held as blocks; made whole only if read whole, pinned or output
                old = e.outputs[0]
                if old.mesh is None and old.name not in self.fusion.outputs:
                    continue
                outs = self.operand(old)
            for old, tv in zip(e.outputs, outs if isinstance(outs, tuple) else (outs,)):
                self.new[id(old)] = self.rename(tv, old.name)
                if old.name in views:
                    v = views[old.name] = dataclasses.replace(views[old.name], view=self.fresh(old.name + VIEW_SUFFIX))
                    outputs[old.name] = apply_layout(self.rename(ops.reshape(tv, v.view_shape), v.view), v.layout,
                                                     self.mesh)
                elif old.mesh is not None:
                    self.pin(tv, old)
        for name, tv in self.fusion.outputs.items():
            out = outputs.get(name, self.new[id(tv)])
            self.dst.outputs[out.name] = out
        return self.dst

    def through_view(self, e):
        """e computed from views and blocks, not whole tensors: its new output(s); () where e is a linear held
        as blocks; None where e reads its operands whole.
          slice(x, a, lo, hi) of a viewed input = reshape(slice(view, view axis, lo / b, hi / b)) where the slice
            takes whole blocks b of the view axis that leads a's group;
          reshape(x, s) of a viewed input = reshape(view, s);
          linear(x, w, bias) of a weight viewed as [k, out / k, ...] (its leading part serial) = the k blocks
            linear(x, reshape(view[i]), bias[i]), joined along the last axis;
          slice(y, -1, lo, hi) of such a linear along whole blocks = those blocks (one: a copy of it)."""
        args = dict(e.args)
        x, name = args.get("x"), e.outputs[0].name
        if e.op.name == "reshape" and id(x) in self.viewed:
            return self.ops.reshape(self.viewed[id(x)][0], e.outputs[0].shape)
        if e.op.name == "slice" and id(x) in self.viewed:
            vin, v = self.viewed[id(x)]
            dim = args["dim"] % x.ndim
            first = sum(v.groups[:dim])
            cut = _whole_blocks(args, x.shape[dim], v.view_shape[first] if v.groups[dim] > 1 else 0)
            if cut is None:
                return None
            (lo, hi), b = cut
            shape = list(x.shape)
            shape[dim] = hi - lo
            return self.ops.reshape(self.part(self.ops.slice(vin, first, lo // b, hi // b), name), tuple(shape))
        if e.op.name == "slice" and id(x) in self.blocks and args["dim"] % x.ndim == x.ndim - 1:
            parts, width = self.blocks[id(x)]
            cut = _whole_blocks(args, x.shape[-1], len(parts))
            if cut is None:
                return None
            (lo, hi), _ = cut
            taken = parts[lo // width:hi // width]
            out = taken[0]
            for p in taken[1:]:
                out = self.part(self.ops.cat(out, p, -1), name)
            return self.ops.reshape(out, tuple(e.outputs[0].shape))  # a tensor of its own, for the slice's name
        w = args.get("weight")
        if e.op.name == "linear" and id(w) in self.viewed:
            vin, v = self.viewed[id(w)]
            k = v.view_shape[0]
            if v.groups[0] < 2 or any(p.is_shard and p.axis == 0 for p in v.layout) or k < 2:
                return None
            width, bias = w.shape[0] // k, args.get("bias")
            parts = []
            for i in range(k):
                wi = self.part(self.ops.reshape(self.part(self.ops.slice(vin, 0, i, i + 1), name), (width, w.shape[1])),
                               name)
                bi = None if bias is None else self.part(
                    self.ops.slice(self.operand(bias), 0, i * width, (i + 1) * width), name)
                parts.append(self.part(self.ops.linear(self.operand(x), wi, bi), name))
            self.blocks[id(e.outputs[0])] = (parts, width)
            return ()
        return None


def _whole_blocks(args: dict, n: int, pieces: int):
    """((lo, hi), block) of slice args over an axis of extent n cut in `pieces` equal blocks, where the slice
    takes whole blocks; None otherwise."""
    block = n // pieces if pieces > 1 and n % pieces == 0 else 0
    lo = min(max(args["start"] + (n if args["start"] < 0 else 0), 0), n)
    hi = n if args["end"] is None else min(max(args["end"] + (n if args["end"] < 0 else 0), 0), n)
    if block == 0 or lo % block or hi % block or hi <= lo:
        return None
    return (lo, hi), block


__all__ = ["apply_layout", "layout_of", "layout_view", "pin_of", "pin_view", "PinView", "view_pins",
           "VIEW_SUFFIX"]
