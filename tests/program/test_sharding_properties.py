"""Which elements each rank holds under a loop domain, and shard_tensor / unshard_tensor being exact inverses.

Property tests draw a logical shape (1-3 axes, extents 1..13, uneven ones included), a 1-D or 2-D mesh and,
per mesh axis, a layout: replicated, sharded on a random logical axis (outer_split by the mesh axis size,
then parallelize; two mesh axes may shard the SAME logical axis, the second splitting the inner part of
the first) or partial; optionally a serial outer_split first, so the DID split is not the outermost.
The expected indices come from a small arithmetic model of nested outer splits, independent of ir.py.
"""
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import egraph_did as ed
from egraph_did import DeviceMesh, ParallelType, ShapeError, ShardingError

DIDx, DIDy = ParallelType.DIDx, ParallelType.DIDy

MESHES = [DeviceMesh.arange(n) for n in range(1, 6)] + [
    DeviceMesh(torch.arange(4).reshape(2, 2)),
    DeviceMesh(torch.arange(6).reshape(2, 3)),
    DeviceMesh(torch.arange(6).reshape(3, 2)),
    DeviceMesh([[5, 0, 3], [1, 4, 2]], axis_names=("dp", "tp")),  # ranks not in grid order
]

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ceil_div(a, b):
    return -(-a // b)


def tensor(shape, names=None, name="t"):
    fd = ed.FusionDefinition()
    return fd.define_tensor(tuple(shape), dtype=torch.float64, name=name, axis_names=names)


def global_value(shape):
    """Distinct, exactly representable values: any misplaced element shows."""
    return (torch.arange(math.prod(shape), dtype=torch.float64) + 1).reshape(shape)


@st.composite
def layouts(draw):
    mesh = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 13)) for _ in range(ndim))
    kinds = []
    for _ in range(mesh.ndim):
        kind = draw(st.sampled_from(["R", "S", "S", "P"]))
        kinds.append((kind, draw(st.integers(0, ndim - 1)) if kind == "S" else None))
    if [k for k, _ in kinds] == ["S", "S"] and draw(st.booleans()):
        kinds[1] = kinds[0]  # both mesh axes shard the same logical axis
    pre = draw(st.none() | st.tuples(st.integers(0, ndim - 1), st.integers(1, 4)))
    # the order in which mesh axes split; outermost (DIDy) first is the common case, both are legal
    order = draw(st.permutations(range(mesh.ndim)))
    return mesh, shape, tuple(kinds), pre, tuple(order)


class Layout:
    """A TensorView built from a drawn layout, plus the arithmetic model of what each rank holds."""

    def __init__(self, mesh, shape, kinds, pre, order):
        self.mesh, self.shape, self.kinds, self.pre, self.order = mesh, shape, kinds, pre, order
        tv = tensor(shape).set_device_mesh(mesh)
        pos = list(range(len(shape)))  # loop position of the part of each logical axis still to split
        # per logical axis, the chain of outer splits applied to it: (pieces, mesh axis or None)
        self.chains = {a: [] for a in range(len(shape))}

        def outer_split(a, pieces):
            p = pos[a]
            tv.outer_split(p, pieces)
            for b in range(len(pos)):
                if pos[b] > p:
                    pos[b] += 1
            pos[a] = p + 1
            return p

        if pre is not None:
            a, k = pre
            outer_split(a, k)
            self.chains[a].append((k, None))
        for ax in order:
            kind, a = kinds[ax]
            if kind == "S":
                p = outer_split(a, mesh.shape[ax])
                tv.axis(p).parallelize(ParallelType.for_mesh_axis(mesh, ax))
                self.chains[a].append((mesh.shape[ax], ax))
        for ax in order:
            if kinds[ax][0] == "P":
                tv.add_partial(ParallelType.for_mesh_axis(mesh, ax))
        self.tv = tv

    def expected_indices(self, rank):
        coords = self.mesh.coords(rank)
        out = []
        for a, n in enumerate(self.shape):
            keep = []
            for i in range(n):
                rest, extent, ok = i, n, True
                for pieces, ax in self.chains[a]:
                    inner = ceil_div(extent, pieces)
                    if ax is not None and rest // inner != coords[ax]:
                        ok = False
                    rest, extent = rest % inner, inner
                if ok:
                    keep.append(i)
            out.append(keep)
        return out

    @property
    def partial_axes(self):
        return [ax for ax, (k, _) in enumerate(self.kinds) if k == "P"]

    @property
    def divides(self):
        for a, n in enumerate(self.shape):
            extent = n
            for pieces, _ in self.chains[a]:
                if extent % pieces:
                    return False
                extent //= pieces
        return True


# ---------------------------------------------------------------- properties

@PROPERTY
@given(layouts())
def test_shard_then_unshard_is_the_identity(layout):
    lay = Layout(*layout)
    X = global_value(lay.shape)
    shards = [ed.shard_tensor(X, lay.tv, r) for r in sorted(lay.mesh.ranks)]
    back = ed.unshard_tensor(shards, lay.tv)
    assert back.dtype == X.dtype
    assert torch.equal(back, X)
    by_dict = ed.unshard_tensor({r: s for r, s in zip(sorted(lay.mesh.ranks), shards)}, lay.tv)
    assert torch.equal(by_dict, X)


@PROPERTY
@given(layouts())
def test_each_rank_holds_the_indices_of_the_nested_outer_split_model(layout):
    lay = Layout(*layout)
    X = global_value(lay.shape)
    for r in lay.mesh.ranks:
        expect = lay.expected_indices(r)
        got = ed.local_indices(lay.tv, r)
        assert [g.tolist() for g in got] == expect
        shard = ed.shard_tensor(X, lay.tv, r)
        if not any(lay.mesh.coords(r)[ax] for ax in lay.partial_axes):
            assert torch.equal(shard, X[np.ix_(*[np.asarray(e, dtype=np.int64) for e in expect])])


@PROPERTY
@given(layouts())
def test_local_shapes_match_local_shape_and_are_bounded_by_the_allocation(layout):
    lay = Layout(*layout)
    X = global_value(lay.shape)
    alloc = lay.tv.allocation_extents()
    assert len(alloc) == len(lay.shape)
    for r in lay.mesh.ranks:
        shard = ed.shard_tensor(X, lay.tv, r)
        assert tuple(shard.shape) == lay.tv.local_shape(r) == ed.local_shape(lay.tv, r)
        assert all(s <= e for s, e in zip(shard.shape, alloc)), (shard.shape, alloc, lay.tv.loop_str())
        if lay.divides:
            assert tuple(shard.shape) == alloc, (shard.shape, alloc, lay.tv.loop_str())


@PROPERTY
@given(layouts())
def test_shards_along_sharding_mesh_axes_partition_each_logical_axis(layout):
    lay = Layout(*layout)
    mesh = lay.mesh
    for a, n in enumerate(lay.shape):
        sharding = sorted({ax for _, ax in lay.chains[a] if ax is not None})
        others = [ax for ax in range(mesh.ndim) if ax not in sharding]
        for fixed in itertools.product(*(range(mesh.shape[ax]) for ax in others)):
            seen = []
            for varying in itertools.product(*(range(mesh.shape[ax]) for ax in sharding)):
                coords = [0] * mesh.ndim
                for ax, c in zip(others, fixed):
                    coords[ax] = c
                for ax, c in zip(sharding, varying):
                    coords[ax] = c
                seen.extend(ed.local_indices(lay.tv, mesh.rank_at(coords))[a].tolist())
            assert sorted(seen) == list(range(n))  # disjoint, and every index held once


@PROPERTY
@given(layouts())
def test_indices_do_not_depend_on_replicated_or_partial_mesh_axes(layout):
    lay = Layout(*layout)
    mesh = lay.mesh
    free = [ax for ax, (k, _) in enumerate(lay.kinds) if k != "S"]
    for r in mesh.ranks:
        c = list(mesh.coords(r))
        base = [0 if ax in free else x for ax, x in enumerate(c)]
        twin = mesh.rank_at(base)
        assert [i.tolist() for i in ed.local_indices(lay.tv, r)] == [i.tolist() for i in ed.local_indices(lay.tv, twin)]


@PROPERTY
@given(layouts())
def test_partial_shards_sum_to_the_global_values(layout):
    lay = Layout(*layout)
    mesh = lay.mesh
    X = global_value(lay.shape)
    for r in mesh.ranks:
        c = mesh.coords(r)
        total = torch.zeros(lay.tv.local_shape(r), dtype=X.dtype)
        for pc in itertools.product(*(range(mesh.shape[ax]) for ax in lay.partial_axes)):
            cc = list(c)
            for ax, v in zip(lay.partial_axes, pc):
                cc[ax] = v
            total += ed.shard_tensor(X, lay.tv, mesh.rank_at(cc))
        idx = [np.asarray(i) for i in ed.local_indices(lay.tv, r)]
        assert torch.equal(total, X[np.ix_(*idx)])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 13), st.integers(1, 5))
def test_single_outer_split_on_a_1d_mesh_follows_torch_chunk(n, d):
    tv = tensor((n,)).set_device_mesh(DeviceMesh.arange(d)).outer_split(0, d)
    tv.axis(0).parallelize(DIDx)
    X = global_value((n,))
    chunks = list(torch.chunk(X, d))
    chunks += [X[:0]] * (d - len(chunks))  # torch.chunk returns fewer pieces; the missing ones are empty
    for r in range(d):
        assert torch.equal(ed.shard_tensor(X, tv, r), chunks[r])
    sizes = [tv.local_shape(r)[0] for r in range(d)]
    assert sum(sizes) == n
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == ceil_div(n, d)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 13), st.integers(1, 4), st.integers(1, 5))
def test_cyclic_did_split_on_an_inner_split_round_trips(n, rows, d):
    # split(0, d) makes the inner part d long; binding it to DIDx deals indices round robin
    tv = tensor((n, rows)).set_device_mesh(DeviceMesh.arange(d)).split(0, d)
    tv.axis(1).parallelize(DIDx)
    X = global_value((n, rows))
    shards = [ed.shard_tensor(X, tv, r) for r in range(d)]
    for r in range(d):
        assert torch.equal(shards[r], X[r::d])
    assert torch.equal(ed.unshard_tensor(shards, tv), X)


# ---------------------------------------------------------------- targeted 2-D layouts

MESH_2x3 = DeviceMesh(torch.arange(6).reshape(2, 3), axis_names=("dp", "tp"))


def test_didy_and_didx_on_different_axes_of_a_2x3_mesh():
    tv = tensor((5, 7), ("m", "n")).set_device_mesh(MESH_2x3)
    tv.outer_split(0, 2).axis(0).parallelize(DIDy)
    tv.outer_split(2, 3).axis(2).parallelize(DIDx)
    assert tv.loop_str() == "[DIDy{2}, m/2, DIDx{3}, n/3]"
    X = global_value((5, 7))
    rows = [[0, 1, 2], [3, 4]]
    cols = [[0, 1, 2], [3, 4, 5], [6]]
    shards = []
    for r in range(6):
        y, x = divmod(r, 3)
        shard = ed.shard_tensor(X, tv, r)
        assert torch.equal(shard, X[rows[y]][:, cols[x]])
        shards.append(shard)
    assert torch.equal(ed.unshard_tensor(shards, tv), X)


def test_didy_then_didx_on_the_same_axis_of_a_2x3_mesh_split_hierarchically():
    tv = tensor((13, 2), ("s", "h")).set_device_mesh(MESH_2x3)
    tv.outer_split(0, 2).axis(0).parallelize(DIDy)    # halves of ceil(13/2) = 7
    tv.outer_split(1, 3).axis(1).parallelize(DIDx)    # thirds of ceil(7/3) = 3 within each half
    assert tv.loop_str() == "[DIDy{2}, DIDx{3}, s/2/3, h]"
    expect = {0: [0, 1, 2], 1: [3, 4, 5], 2: [6], 3: [7, 8, 9], 4: [10, 11, 12], 5: []}
    X = global_value((13, 2))
    shards = []
    for r, rows in expect.items():
        assert ed.local_indices(tv, r)[0].tolist() == rows
        shard = ed.shard_tensor(X, tv, r)
        assert torch.equal(shard, X[rows])
        shards.append(shard)
    assert tv.allocation_extents() == (3, 2)
    assert torch.equal(ed.unshard_tensor(shards, tv), X)


def test_partial_on_didy_with_didx_sharding_a_2x3_mesh():
    tv = tensor((4, 7), ("m", "n")).set_device_mesh(MESH_2x3)
    tv.outer_split(1, 3).axis(1).parallelize(DIDx)
    tv.add_partial(DIDy)
    assert tv.loop_str() == "[m, DIDx{3}, n/3, rDIDy{2}]"
    assert ed.placements(tv) == ("P", "S(1)")
    X = global_value((4, 7))
    cols = [[0, 1, 2], [3, 4, 5], [6]]
    for r in range(6):
        y, x = divmod(r, 3)
        expect = X[:, cols[x]] if y == 0 else torch.zeros(4, len(cols[x]), dtype=X.dtype)
        assert torch.equal(ed.shard_tensor(X, tv, r), expect)
    # any summands, not only the ones shard_tensor makes, unshard to their sum
    g = torch.Generator().manual_seed(0)
    parts = {}
    for x in range(3):
        a = torch.randint(-50, 50, (4, len(cols[x])), generator=g).double()
        parts[x] = a
    shards = [parts[r % 3] if r < 3 else X[:, cols[r % 3]] - parts[r % 3] for r in range(6)]
    assert torch.equal(ed.unshard_tensor(shards, tv), X)


def test_partial_on_didx_with_didy_sharding_the_same_tensor():
    tv = tensor((5, 3)).set_device_mesh(MESH_2x3)
    tv.outer_split(0, 2).axis(0).parallelize(DIDy)
    tv.add_partial(DIDx)
    X = global_value((5, 3))
    for r in range(6):
        y, x = divmod(r, 3)
        rows = [[0, 1, 2], [3, 4]][y]
        assert torch.equal(ed.shard_tensor(X, tv, r), X[rows] if x == 0 else torch.zeros(len(rows), 3, dtype=X.dtype))
    assert torch.equal(ed.unshard_tensor([ed.shard_tensor(X, tv, r) for r in range(6)], tv), X)


def test_partial_on_both_axes_of_a_2d_mesh_sums_all_six_summands():
    tv = tensor((3,)).set_device_mesh(MESH_2x3).add_partial(DIDx).add_partial(DIDy)
    shards = [torch.full((3,), float(r + 1), dtype=torch.float64) for r in range(6)]
    assert torch.equal(ed.unshard_tensor(shards, tv), torch.full((3,), 21.0, dtype=torch.float64))


def test_replicated_tensor_gives_every_rank_the_whole_value():
    tv = tensor((2, 3)).set_device_mesh(MESH_2x3)
    X = global_value((2, 3))
    for r in range(6):
        assert torch.equal(ed.shard_tensor(X, tv, r), X)
    assert ed.placements(tv) == ("R", "R")


def test_zero_dim_partial_round_trips():
    tv = tensor(()).set_device_mesh(DeviceMesh.arange(3)).add_partial(DIDx)
    X = torch.tensor(7.0, dtype=torch.float64)
    shards = [ed.shard_tensor(X, tv, r) for r in range(3)]
    assert [s.item() for s in shards] == [7.0, 0.0, 0.0]
    assert torch.equal(ed.unshard_tensor(shards, tv), X)


def test_shard_is_a_contiguous_copy_not_a_view():
    tv = tensor((4, 6)).set_device_mesh(DeviceMesh.arange(2)).outer_split(1, 2)
    tv.axis(1).parallelize(DIDx)
    X = global_value((4, 6))
    shard = ed.shard_tensor(X, tv, 1)
    assert shard.is_contiguous()
    shard.zero_()
    assert torch.equal(X, global_value((4, 6)))


def test_integer_tensors_round_trip():
    fd = ed.FusionDefinition()
    tv = fd.define_tensor((7,), dtype=torch.int64, name="ids").set_device_mesh(DeviceMesh.arange(3))
    tv.outer_split(0, 3).axis(0).parallelize(DIDx)
    X = torch.arange(7) * 3
    shards = [ed.shard_tensor(X, tv, r) for r in range(3)]
    assert [s.tolist() for s in shards] == [[0, 3, 6], [9, 12, 15], [18]]
    back = ed.unshard_tensor(shards, tv)
    assert back.dtype == torch.int64 and torch.equal(back, X)


# ---------------------------------------------------------------- unshard errors

def _sharded_on_2x3():
    tv = tensor((4, 6), name="acts").set_device_mesh(MESH_2x3)
    tv.outer_split(1, 3).axis(1).parallelize(DIDx)  # replicated on dp
    X = global_value((4, 6))
    return tv, X, [ed.shard_tensor(X, tv, r) for r in range(6)]


def test_unshard_raises_when_replicated_copies_disagree():
    tv, X, shards = _sharded_on_2x3()
    shards[4] = shards[4].clone()
    shards[4][0, 0] += 1
    with pytest.raises(ShardingError, match="ranks 1 and 4 hold different data") as info:
        ed.unshard_tensor(shards, tv)
    assert "acts" in str(info.value) and "dp" in str(info.value)


def test_unshard_raises_when_a_shard_has_the_wrong_shape():
    tv, X, shards = _sharded_on_2x3()
    shards[2] = torch.zeros(4, 3, dtype=X.dtype)
    with pytest.raises(ShapeError, match=r"rank 2's shard has shape \(4, 3\)"):
        ed.unshard_tensor(shards, tv)


def test_unshard_raises_on_the_wrong_number_of_shards():
    tv, X, shards = _sharded_on_2x3()
    with pytest.raises(ShardingError, match="5 shards"):
        ed.unshard_tensor(shards[:5], tv)


def test_unshard_raises_on_a_dict_missing_a_rank():
    tv, X, shards = _sharded_on_2x3()
    with pytest.raises(ShardingError, match=r"\[3\]"):
        ed.unshard_tensor({r: s for r, s in enumerate(shards) if r != 3}, tv)


def test_shard_tensor_raises_on_a_tensor_of_the_wrong_global_shape():
    tv, X, _ = _sharded_on_2x3()
    with pytest.raises(ShapeError, match="acts"):
        ed.shard_tensor(torch.zeros(4, 7), tv, 0)


def test_shard_tensor_raises_for_a_rank_outside_the_mesh():
    tv, X, _ = _sharded_on_2x3()
    with pytest.raises(ed.MeshError):
        ed.shard_tensor(X, tv, 6)


def test_sharded_tensor_without_a_mesh_cannot_be_sharded():
    tv = tensor((4,)).outer_split(0, 2)
    tv.axis(0).parallelize(DIDx)
    with pytest.raises(ShardingError, match="set_device_mesh"):
        ed.shard_tensor(global_value((4,)), tv, 0)


# ---------------------------------------------------------------------------- shards.shard / unshard

from egraph_did import shards as shards_mod  # noqa: E402
from egraph_did.layout import P, PMAX, R, S, is_valid  # noqa: E402
from egraph_did.layout import Layout as Placements  # noqa: E402  (this file's Layout is the drawn loop domain)
from egraph_did.pins import apply_layout  # noqa: E402


@st.composite
def canonical_layouts(draw):
    """A mesh, a shape and a layout of it (uneven and empty shards, nested splits, P and Pmax included)."""
    mesh = draw(st.sampled_from(MESHES))
    shape = tuple(draw(st.integers(1, 13)) for _ in range(draw(st.integers(0, 3))))
    choices = [R, P, PMAX] + [S(a) for a in range(len(shape))]
    layout = Placements(tuple(draw(st.sampled_from(choices)) if n > 1 else R for n in mesh.shape))
    if sum(p.is_partial for p in layout) > 1 and {p.reduce for p in layout if p.is_partial} == {"sum", "max"}:
        layout = Placements(tuple(P if p.is_partial else p for p in layout))  # sum and max do not commute
    assert is_valid(layout, shape, mesh, allow_empty=True)
    return mesh, shape, layout


@PROPERTY
@given(canonical_layouts())
def test_shards_agree_with_shard_tensor_on_the_canonical_loop_domain(case):
    """shards.shard/unshard (ranges from a Layout) and shard_tensor/unshard_tensor (indices from a loop
    domain) say the same where the loop domain is a layout's canonical one."""
    mesh, shape, layout = case
    X = global_value(shape)
    tv = apply_layout(tensor(shape), layout, mesh)
    ranks = sorted(mesh.ranks)
    pieces = [shards_mod.shard(X, layout, mesh, r) for r in ranks]
    for r, piece in zip(ranks, pieces):
        assert torch.equal(piece, ed.shard_tensor(X, tv, r)), (r, str(layout))
    assert torch.equal(shards_mod.unshard(pieces, layout, mesh), X)
    assert torch.equal(shards_mod.unshard(pieces, layout, mesh), ed.unshard_tensor(pieces, tv))


def test_shards_unshard_reads_the_global_shape_off_uneven_nested_pieces():
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))
    layout = Placements((S(0), S(0)))  # 5 rows: 3 | 2, each cut by ceil(3) = 2: 2, 1 | 2, 0
    X = global_value((5, 2))
    pieces = [shards_mod.shard(X, layout, mesh, r) for r in range(4)]
    assert [p.shape[0] for p in pieces] == [2, 1, 2, 0]
    assert torch.equal(shards_mod.unshard(pieces, layout, mesh), X)
    with pytest.raises(ShapeError, match=r"rank 3's piece has shape \(0, 2\).* gives it \(1, 2\)"):
        shards_mod.unshard(pieces, layout, mesh, shape=(6, 2))


def test_shards_unshard_raises_when_replicas_disagree():
    mesh = DeviceMesh.arange(2)
    with pytest.raises(ShardingError, match="replicated on mesh axes"):
        shards_mod.unshard([torch.zeros(3), torch.ones(3)], Placements((R,)), mesh, name="w")
