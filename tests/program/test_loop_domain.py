"""The loop-domain API of a TensorView: split / outer_split / inner_split / merge / reorder / parallelize /
add_partial, the loop string, the allocation domain derived from the loop, and the ShardingErrors for
transforms and bindings that cannot be honoured."""
import pytest
import torch

import egraph_did as ed
from egraph_did import DeviceMesh, IterType, ParallelType, ShardingError

DIDx, DIDy, DIDz, Serial = ParallelType.DIDx, ParallelType.DIDy, ParallelType.DIDz, ParallelType.Serial


def tensor(shape, names=None, name="t", dtype=torch.float32):
    fd = ed.FusionDefinition()
    return fd.define_tensor(shape, dtype=dtype, name=name, axis_names=names)


def bsh(b=2, s=8, h=6):
    return tensor((b, s, h), ("b", "s", "h"), name="x")


def extents(tv):
    return [d.extent for d in tv.loop_domain]


# ---------------------------------------------------------------- split

def test_split_defaults_to_inner_split_like_nvfuser():
    x = bsh(s=8)
    x.split(1, 4)
    assert x.loop_str() == "[b, s/4, 4, h]"
    assert extents(x) == [2, 2, 4, 6]
    y = bsh(s=8).inner_split(1, 4)
    assert y.loop_str() == x.loop_str() and extents(y) == extents(x)


def test_split_with_inner_split_false_is_outer_split():
    x = bsh(s=8).split(1, 4, inner_split=False)
    y = bsh(s=8).outer_split(1, 4)
    assert x.loop_str() == y.loop_str() == "[b, 4, s/4, h]"
    assert extents(x) == extents(y) == [2, 4, 2, 6]


def test_uneven_outer_split_has_factor_outer_pieces_of_ceil_size():
    t = tensor((10, 4), ("n", "k")).outer_split(0, 4)
    assert t.loop_str() == "[4, n/4, k]"
    assert extents(t) == [4, 3, 4]


def test_uneven_inner_split_has_ceil_many_outer_pieces():
    t = tensor((10, 4), ("n", "k")).inner_split(0, 4)
    assert t.loop_str() == "[n/4, 4, k]"
    assert extents(t) == [3, 4, 4]


def test_split_accepts_negative_axis():
    t = bsh(h=6).outer_split(-1, 3)
    assert t.loop_str() == "[b, s, 3, h/3]"


def test_splits_never_change_the_logical_shape():
    x = bsh()
    x.outer_split(1, 2).inner_split(0, 1).merge(3, 4)
    assert x.shape == (2, 8, 6)
    assert [d.name for d in x.logical_domain] == ["b", "s", "h"]
    assert all(not d.is_device for d in x.logical_domain)


@pytest.mark.parametrize("factor", [0, -2, 1.5, None])
def test_split_by_a_non_positive_or_non_int_factor_raises(factor):
    with pytest.raises(ShardingError):
        bsh().split(1, factor)


def test_split_of_a_broadcast_axis_raises():
    from egraph_did.ir import TensorView
    t = TensorView("bc", (1, 4), torch.float32, ("one", "n"), broadcast_axes=(0,))
    assert t.loop_str() == "[bone, n]"
    with pytest.raises(ShardingError, match="broadcast"):
        t.split(0, 1)


# ---------------------------------------------------------------- merge and reorder

def test_merge_defaults_to_the_next_axis():
    t = tensor((2, 3, 4), ("a", "b", "c")).merge(0)
    assert t.loop_str() == "[a*b, c]"
    assert extents(t) == [6, 4]


def test_merge_of_non_adjacent_axes_lands_at_the_first_place():
    t = tensor((2, 3, 4), ("a", "b", "c")).merge(0, 2)
    assert t.loop_str() == "[a*c, b]"
    assert extents(t) == [8, 3]


def test_merge_with_itself_raises():
    with pytest.raises(ShardingError):
        tensor((2, 3)).merge(1, 1)


def test_merge_then_split_round_trips_through_the_loop_string():
    t = tensor((2, 3, 4), ("a", "b", "c")).merge(1).outer_split(1, 3)
    assert t.loop_str() == "[a, 3, b*c/3]"
    assert extents(t) == [2, 3, 4]


def test_reorder_with_a_dict_moves_only_the_named_axes():
    assert tensor((2, 3, 4), ("a", "b", "c")).reorder({2: 0}).loop_str() == "[c, a, b]"
    assert tensor((2, 3, 4), ("a", "b", "c")).reorder({0: -1}).loop_str() == "[b, c, a]"
    assert tensor((2, 3, 4), ("a", "b", "c")).reorder({0: 2, 2: 0}).loop_str() == "[c, b, a]"


def test_reorder_with_a_permutation_lists_old_positions():
    t = tensor((2, 3, 4), ("a", "b", "c")).reorder([2, 0, 1])
    assert t.loop_str() == "[c, a, b]"
    assert extents(t) == [4, 2, 3]


@pytest.mark.parametrize("order", [[0, 0, 1], [0, 1], [0, 1, 2, 3], {0: 1, 2: 1}, {0: 5}, [0, 1, 3]])
def test_reorder_that_is_not_a_permutation_raises(order):
    with pytest.raises(ShardingError):
        tensor((2, 3, 4)).reorder(order)


def test_reorder_keeps_did_binding_with_its_axis():
    mesh = DeviceMesh.arange(2)
    x = bsh().set_device_mesh(mesh).outer_split(1, 2)
    x.axis(1).parallelize(DIDx)
    x.reorder({1: 0})
    assert x.loop_str() == "[DIDx{2}, b, s/2, h]"
    assert x.local_shape(1) == (2, 4, 6)


def test_reset_loop_domain_drops_every_transform_but_keeps_the_mesh():
    mesh = DeviceMesh.arange(4)
    x = bsh().set_device_mesh(mesh).outer_split(1, 4)
    x.axis(1).parallelize(DIDx)
    x.reset_loop_domain()
    assert x.loop_str() == "[b, s, h]"
    assert not x.is_sharded
    assert x.mesh == mesh


# ---------------------------------------------------------------- parallelize and loop_str

def test_outer_split_and_parallelize_gives_the_design_loop_string():
    x = tensor((2, 16, 6), ("b", "s", "h"), name="x")
    x.set_device_mesh(DeviceMesh.arange(4))
    x.outer_split(1, 4)
    ret = x.axis(1).parallelize(DIDx)
    assert ret is x
    assert x.loop_str() == "[b, DIDx{4}, s/4, h]"
    assert x.is_sharded
    assert x.axis(1).parallel_type is DIDx
    assert x.axis(1).extent == 4
    assert str(x.axis(1)) == "DIDx{4}"
    assert set(x.device_axes()) == {DIDx}
    assert x.local_shape(3) == (2, 4, 6)


def test_parallelize_back_to_serial_unbinds():
    x = bsh().set_device_mesh(DeviceMesh.arange(2)).outer_split(1, 2)
    x.axis(1).parallelize(DIDx)
    x.axis(1).parallelize(Serial)
    assert x.loop_str() == "[b, 2, s/2, h]"
    assert not x.is_sharded


def test_didy_and_didx_on_different_axes_of_a_2d_mesh():
    mesh = DeviceMesh(torch.arange(6).reshape(2, 3))
    x = tensor((4, 9), ("m", "n")).set_device_mesh(mesh)
    x.outer_split(0, 2).axis(0).parallelize(DIDy)
    x.outer_split(2, 3).axis(2).parallelize(DIDx)
    assert x.loop_str() == "[DIDy{2}, m/2, DIDx{3}, n/3]"
    assert ed.placements(x) == ("S(0)", "S(1)")


def test_parallelize_before_mesh_is_checked_when_the_mesh_is_set():
    x = bsh(s=8).outer_split(1, 4)
    x.axis(1).parallelize(DIDx)
    assert x.loop_str() == "[b, DIDx{4}, s/4, h]"
    x.set_device_mesh(DeviceMesh.arange(4))
    assert x.local_shape(0) == (2, 2, 6)


def test_didz_binds_the_outermost_axis_of_a_3d_mesh():
    mesh = DeviceMesh(torch.arange(12).reshape(3, 2, 2))
    x = tensor((6, 4), ("m", "n")).set_device_mesh(mesh)
    x.outer_split(0, 3).axis(0).parallelize(DIDz)
    assert x.loop_str() == "[DIDz{3}, m/3, n]"
    # rank 8 sits at (2, 0, 0): the last third of m
    assert x.local_shape(8) == (2, 4)
    X = torch.arange(24.).reshape(6, 4)
    assert torch.equal(ed.shard_tensor(X, x, 8), X[4:6])


def test_partial_appends_a_reduction_axis_bound_to_the_mesh():
    y = tensor((4, 8), ("m", "n")).set_device_mesh(DeviceMesh.arange(2))
    y.add_partial(DIDx)
    assert y.loop_str() == "[m, n, rDIDx{2}]"
    d = y.loop_domain[-1]
    assert d.iter_type is IterType.Reduction and d.parallel_type is DIDx and d.extent == 2
    assert d.logical_axes == frozenset()
    assert ed.placements(y) == ("P",)


# ---------------------------------------------------------------- allocation

def test_allocation_domain_gives_did_axes_extent_one():
    x = bsh(s=8).set_device_mesh(DeviceMesh.arange(4)).outer_split(1, 4)
    x.axis(1).parallelize(DIDx)
    alloc = x.allocation_domain
    assert [d.extent for d in alloc] == [2, 1, 2, 6]
    assert [d.parallel_type for d in alloc] == [Serial, DIDx, Serial, Serial]
    assert x.allocation_extents() == (2, 2, 6)


def test_allocation_domain_drops_partial_axes():
    y = tensor((4, 8), ("m", "n")).set_device_mesh(DeviceMesh.arange(2)).add_partial(DIDx)
    assert [d.name for d in y.allocation_domain] == ["m", "n"]
    assert y.allocation_extents() == (4, 8)


def test_allocation_extents_of_an_unsharded_tensor_are_its_shape():
    assert bsh().allocation_extents() == (2, 8, 6)
    assert bsh().outer_split(1, 2).inner_split(0, 2).allocation_extents() == (2, 8, 6)


def test_allocation_extents_of_an_uneven_split_bound_every_local_extent():
    mesh = DeviceMesh.arange(4)
    x = tensor((10, 3), ("n", "k")).set_device_mesh(mesh).outer_split(0, 4)
    x.axis(0).parallelize(DIDx)
    assert x.allocation_extents() == (3, 3)
    assert [x.local_shape(r) for r in range(4)] == [(3, 3), (3, 3), (3, 3), (1, 3)]


def test_allocation_extents_of_a_merged_allocated_axis_raise():
    t = tensor((2, 3, 4), ("a", "b", "c")).merge(0)
    with pytest.raises(ShardingError, match="merges"):
        t.allocation_extents()


def test_allocation_of_two_did_splits_of_one_axis():
    mesh = DeviceMesh(torch.arange(6).reshape(2, 3))
    x = tensor((12, 5), ("s", "h")).set_device_mesh(mesh)
    x.outer_split(0, 2).axis(0).parallelize(DIDy)
    x.outer_split(1, 3).axis(1).parallelize(DIDx)
    assert x.loop_str() == "[DIDy{2}, DIDx{3}, s/2/3, h]"
    assert x.allocation_extents() == (2, 5)
    assert all(x.local_shape(r) == (2, 5) for r in range(6))


# ---------------------------------------------------------------- the merged gate/up weight

@pytest.mark.parametrize("I, H, D", [(8, 3, 4), (6, 2, 2), (12, 5, 3), (4, 1, 1)])
def test_non_outermost_did_split_of_merged_gate_up_weight_gives_each_rank_both_halves(I, H, D):
    mesh = DeviceMesh.arange(D)
    w = tensor((2 * I, H), ("gu", "h"), name="w_gate_up").set_device_mesh(mesh)
    w.outer_split(0, 2)          # [2, gu/2, h]: gate rows, then up rows
    w.outer_split(1, D)          # [2, D, gu/2/D, h]
    w.axis(1).parallelize(DIDx)
    assert w.loop_str() == f"[2, DIDx{{{D}}}, gu/2/{D}, h]"
    assert w.allocation_extents() == (2 * I // D, H)
    W = torch.arange(2 * I * H, dtype=torch.float32).reshape(2 * I, H)
    c = I // D
    for r in range(D):
        rows = list(range(r * c, (r + 1) * c)) + list(range(I + r * c, I + (r + 1) * c))
        assert [a.tolist() for a in ed.local_indices(w, r)] == [rows, list(range(H))]
        assert torch.equal(ed.shard_tensor(W, w, r), W[rows])
        assert w.local_shape(r) == (2 * c, H)
    assert torch.equal(ed.unshard_tensor([ed.shard_tensor(W, w, r) for r in range(D)], w), W)


# ---------------------------------------------------------------- errors

def test_did_on_a_merge_of_two_logical_axes_raises():
    t = tensor((4, 6), ("a", "b")).set_device_mesh(DeviceMesh.arange(2))
    t.merge(0).outer_split(0, 2)
    with pytest.raises(ShardingError, match="merges logical axes"):
        t.axis(0).parallelize(DIDx)
    assert not t.is_sharded


def test_did_on_a_merge_of_two_splits_of_one_logical_axis_is_allowed():
    t = tensor((4, 6), ("a", "b")).set_device_mesh(DeviceMesh.arange(2))
    t.outer_split(0, 2).merge(0).outer_split(0, 2)
    t.axis(0).parallelize(DIDx)
    X = torch.arange(24.).reshape(4, 6)
    assert torch.equal(ed.shard_tensor(X, t, 1), X[2:])


def test_binding_the_same_didx_twice_raises():
    mesh = DeviceMesh.arange(2)
    t = tensor((4, 6), ("a", "b")).set_device_mesh(mesh)
    t.outer_split(0, 2).axis(0).parallelize(DIDx)
    t.outer_split(2, 2)
    with pytest.raises(ShardingError, match="DIDx is already bound"):
        t.axis(2).parallelize(DIDx)
    assert [d.parallel_type for d in t.loop_domain].count(DIDx) == 1


def test_partial_on_a_mesh_axis_that_already_shards_raises():
    t = tensor((4, 6)).set_device_mesh(DeviceMesh.arange(2))
    t.outer_split(0, 2).axis(0).parallelize(DIDx)
    with pytest.raises(ShardingError, match="DIDx"):
        t.add_partial(DIDx)


def test_sharding_a_mesh_axis_that_already_holds_a_partial_raises():
    t = tensor((4, 6)).set_device_mesh(DeviceMesh.arange(2)).add_partial(DIDx)
    t.outer_split(0, 2)
    with pytest.raises(ShardingError, match="DIDx"):
        t.axis(0).parallelize(DIDx)


def test_extent_mismatch_with_the_mesh_axis_raises_and_suggests_outer_split():
    mesh = DeviceMesh.arange(4, axis_name="tp")
    t = tensor((8, 6), ("s", "h"), name="acts").set_device_mesh(mesh).outer_split(0, 2)
    with pytest.raises(ShardingError, match=r"outer_split\(axis, 4\)") as info:
        t.axis(0).parallelize(DIDx)
    msg = str(info.value)
    assert "acts" in msg and "'tp'" in msg and "extent 2" in msg  # the tensor, the mesh axis, the mismatch
    assert not t.is_sharded


def test_extent_mismatch_found_when_the_mesh_is_set_later():
    t = tensor((8, 6), ("s", "h")).outer_split(0, 2)
    t.axis(0).parallelize(DIDx)
    with pytest.raises(ShardingError, match=r"outer_split\(axis, 4\)"):
        t.set_device_mesh(DeviceMesh.arange(4))


def test_inner_split_bound_to_did_with_the_wrong_extent_raises():
    # split(0, 4) makes the inner part 4 long; its outer part has extent 3 != mesh size 4
    t = tensor((12,), ("n",)).set_device_mesh(DeviceMesh.arange(4)).split(0, 4)
    with pytest.raises(ShardingError, match="outer_split"):
        t.axis(0).parallelize(DIDx)


def test_split_of_a_did_axis_raises():
    t = bsh().set_device_mesh(DeviceMesh.arange(2)).outer_split(1, 2)
    t.axis(1).parallelize(DIDx)
    with pytest.raises(ShardingError, match="split before parallelizing"):
        t.split(1, 2)
    with pytest.raises(ShardingError):
        t.outer_split(1, 1)
    assert t.loop_str() == "[b, DIDx{2}, s/2, h]"


def test_merge_of_a_did_axis_raises():
    t = bsh().set_device_mesh(DeviceMesh.arange(2)).outer_split(1, 2)
    t.axis(1).parallelize(DIDx)
    with pytest.raises(ShardingError, match="cannot be merged"):
        t.merge(1, 2)
    with pytest.raises(ShardingError, match="cannot be merged"):
        t.merge(0)


def test_merge_of_a_partial_axis_raises():
    t = tensor((4, 6)).set_device_mesh(DeviceMesh.arange(2)).add_partial(DIDx)
    with pytest.raises(ShardingError):
        t.merge(1, 2)


def test_add_partial_without_a_mesh_raises():
    with pytest.raises(ShardingError, match="set_device_mesh"):
        tensor((4, 6)).add_partial(DIDx)


def test_add_partial_with_serial_raises():
    with pytest.raises(ShardingError):
        tensor((4, 6)).set_device_mesh(DeviceMesh.arange(2)).add_partial(Serial)


def test_didy_on_a_1d_mesh_raises():
    t = tensor((4, 6)).set_device_mesh(DeviceMesh.arange(2)).outer_split(0, 2)
    with pytest.raises(ed.EgraphDidError, match="DIDy"):
        t.axis(0).parallelize(DIDy)


def test_parallelize_with_a_non_parallel_type_raises():
    t = tensor((4, 6))
    with pytest.raises(ShardingError):
        t.parallelize(0, "DIDx")


@pytest.mark.parametrize("call", [
    lambda t: t.split(3, 2),
    lambda t: t.split(-4, 2),
    lambda t: t.outer_split(5, 2),
    lambda t: t.inner_split(3, 2),
    lambda t: t.merge(2),          # no next axis
    lambda t: t.merge(0, 3),
    lambda t: t.axis(3),
    lambda t: t.axis(-4),
    lambda t: t.parallelize(7, DIDx),
    lambda t: t.reorder({3: 0}),
    lambda t: t.reorder([0, 1, 5]),
], ids=["split", "split-neg", "outer_split", "inner_split", "merge-last", "merge", "axis", "axis-neg",
        "parallelize", "reorder-dict", "reorder-perm"])
def test_out_of_range_loop_axis_raises_and_names_the_tensor(call):
    t = tensor((2, 8, 6), ("b", "s", "h"), name="acts")
    with pytest.raises(ShardingError, match="out of range") as info:
        call(t)
    assert "acts" in str(info.value)
    assert t.loop_str() == "[b, s, h]"


def test_set_device_mesh_with_a_non_mesh_raises():
    with pytest.raises(ed.MeshError):
        tensor((2,)).set_device_mesh([0, 1])


def test_repr_shows_loop_dtype_and_mesh():
    x = tensor((2, 8), ("b", "s"), name="x", dtype=torch.bfloat16).set_device_mesh(DeviceMesh.arange(2))
    x.outer_split(1, 2).axis(1).parallelize(DIDx)
    assert repr(x) == "TensorView(x: [b, DIDx{2}, s/2] bfloat16 on DeviceMesh(x=2))"


def test_a_pending_max_reads_back_as_pmax_and_unshards_by_maximum():
    from egraph_did.layout import PMAX, Layout, S
    from egraph_did.pins import apply_layout, layout_of
    mesh = ed.DeviceMesh([[0, 1], [2, 3]])
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((5, 3), name="x")
    apply_layout(x, Layout((PMAX, S(0))), mesh)
    assert x.loop_str() == "[DIDx{2}, 5/2, 3, rDIDy{2}(max)]"
    assert layout_of(x, mesh) == Layout((PMAX, S(0))) and ed.placements(x) == ("Pmax", "S(0)")
    X = torch.randn(5, 3)
    shards = [ed.shard_tensor(X, x, r) for r in mesh.ranks]
    assert all(torch.equal(shards[r], shards[r + 2]) for r in (0, 1))  # every copy along y is the value
    shards[2] = shards[2] - 1.0  # a smaller candidate on the other y rank leaves the maximum alone
    assert torch.equal(ed.unshard_tensor(shards, x), X)
    with pytest.raises(ed.ShardingError, match="reduce must be"):
        x.reset_loop_domain().add_partial(ed.ParallelType.DIDx, "min")
