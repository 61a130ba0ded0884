"""DeviceMesh: 1-, 2- and 3-D grids of ranks, their axes, groups, (de)serialization and malformed meshes;
and how DID parallel types bind mesh axes (DIDx innermost, as in nvFuser)."""
import dataclasses
import itertools
import json

import numpy as np
import pytest
import torch

import egraph_did as ed
from egraph_did import DeviceMesh, MeshError, ParallelType

MESH_1D = DeviceMesh.arange(5)
MESH_2D = DeviceMesh(torch.arange(6).reshape(2, 3), axis_names=("dp", "tp"))
MESH_3D = DeviceMesh(torch.arange(24).reshape(2, 3, 4), axis_names=("pp", "dp", "tp"))
ALL_MESHES = [MESH_1D, MESH_2D, MESH_3D]


# ---------------------------------------------------------------- size, shape, names

@pytest.mark.parametrize("mesh, shape, size", [(MESH_1D, (5,), 5), (MESH_2D, (2, 3), 6), (MESH_3D, (2, 3, 4), 24)],
                         ids=["1d", "2d", "3d"])
def test_mesh_size_shape_and_ndim_follow_the_grid(mesh, shape, size):
    assert mesh.shape == shape
    assert mesh.size == size
    assert mesh.ndim == len(shape)
    assert mesh.ranks == tuple(range(size))


@pytest.mark.parametrize("ndim, names", [(1, ("x",)), (2, ("y", "x")), (3, ("z", "y", "x"))])
def test_default_axis_names_end_with_x_innermost(ndim, names):
    mesh = DeviceMesh(torch.arange(2 ** ndim).reshape([2] * ndim))
    assert mesh.axis_names == names


def test_arange_builds_a_1d_mesh_with_the_given_axis_name():
    mesh = DeviceMesh.arange(3, axis_name="tp")
    assert mesh.ranks == (0, 1, 2)
    assert mesh.shape == (3,)
    assert mesh.axis_names == ("tp",)
    assert mesh == DeviceMesh([0, 1, 2], axis_names=("tp",))


@pytest.mark.parametrize("n", [0, -2, 2.0, "4"])
def test_arange_rejects_a_non_positive_or_non_int_count(n):
    with pytest.raises(MeshError):
        DeviceMesh.arange(n)


@pytest.mark.parametrize("devices", [
    [[0, 1, 2], [3, 4, 5]],
    torch.arange(6).reshape(2, 3),
    np.arange(6).reshape(2, 3),
    ((0, 1, 2), (3, 4, 5)),
], ids=["list", "torch", "numpy", "tuple"])
def test_mesh_from_list_tensor_or_array_are_equal(devices):
    mesh = DeviceMesh(devices, axis_names=("dp", "tp"))
    assert mesh == MESH_2D
    assert hash(mesh) == hash(MESH_2D)


def test_meshes_with_different_axis_names_are_not_equal():
    assert DeviceMesh([[0, 1], [2, 3]]) != DeviceMesh([[0, 1], [2, 3]], axis_names=("a", "b"))


def test_axis_size_and_axis_index_by_name_and_position():
    assert [MESH_3D.axis_size(a) for a in ("pp", "dp", "tp")] == [2, 3, 4]
    assert [MESH_3D.axis_size(a) for a in (0, 1, 2, -1, -3)] == [2, 3, 4, 4, 2]
    assert MESH_3D.axis_index("dp") == 1
    assert MESH_3D.axis_index(-1) == 2
    with pytest.raises(MeshError, match="'sp'"):
        MESH_3D.axis_index("sp")
    with pytest.raises(MeshError):
        MESH_3D.axis_index(3)
    with pytest.raises(MeshError):
        MESH_3D.axis_index(-4)


def test_contains_tells_ranks_of_the_mesh():
    mesh = DeviceMesh([[4, 5], [6, 7]])
    assert 6 in mesh
    assert 0 not in mesh


# ---------------------------------------------------------------- coords and rank_at

@pytest.mark.parametrize("mesh", ALL_MESHES, ids=["1d", "2d", "3d"])
def test_coords_and_rank_at_round_trip_for_every_rank(mesh):
    for rank in mesh.ranks:
        assert mesh.rank_at(mesh.coords(rank)) == rank
    for coords in itertools.product(*(range(e) for e in mesh.shape)):
        assert mesh.coords(mesh.rank_at(coords)) == coords


@pytest.mark.parametrize("mesh", ALL_MESHES, ids=["1d", "2d", "3d"])
def test_coords_are_row_major_like_unravel_index(mesh):
    for rank in mesh.ranks:
        assert mesh.coords(rank) == tuple(int(c) for c in np.unravel_index(rank, mesh.shape))


def test_coords_of_a_mesh_with_permuted_ranks_follow_the_grid_not_the_rank_number():
    mesh = DeviceMesh([[5, 2], [7, 0]])
    assert mesh.coords(5) == (0, 0)
    assert mesh.coords(2) == (0, 1)
    assert mesh.coords(7) == (1, 0)
    assert mesh.coords(0) == (1, 1)
    assert mesh.rank_at((1, 0)) == 7


def test_coords_of_a_rank_outside_the_mesh_raises():
    with pytest.raises(MeshError, match="rank 9"):
        MESH_2D.coords(9)


@pytest.mark.parametrize("coords", [(2, 0), (0, 3), (0,), (0, 0, 0), (-1, 0)])
def test_rank_at_outside_the_grid_raises(coords):
    with pytest.raises(MeshError):
        MESH_2D.rank_at(coords)


# ---------------------------------------------------------------- ranks_along and groups

def test_ranks_along_each_axis_of_a_1d_mesh_is_the_whole_mesh():
    for r in MESH_1D.ranks:
        assert MESH_1D.ranks_along("x", r) == (0, 1, 2, 3, 4)
        assert MESH_1D.ranks_along(0, r) == (0, 1, 2, 3, 4)


def test_ranks_along_each_axis_of_a_2d_mesh_by_name_and_index():
    # grid [[0, 1, 2], [3, 4, 5]], axes (dp, tp)
    assert MESH_2D.ranks_along("tp", 4) == (3, 4, 5)
    assert MESH_2D.ranks_along(1, 4) == (3, 4, 5)
    assert MESH_2D.ranks_along(-1, 0) == (0, 1, 2)
    assert MESH_2D.ranks_along("dp", 4) == (1, 4)
    assert MESH_2D.ranks_along(0, 2) == (2, 5)
    assert MESH_2D.ranks_along(-2, 3) == (0, 3)


def test_ranks_along_each_axis_of_a_3d_mesh_by_name_and_index():
    arr = np.arange(24).reshape(2, 3, 4)
    for rank in MESH_3D.ranks:
        i, j, k = np.unravel_index(rank, (2, 3, 4))
        expect = {0: tuple(arr[:, j, k].tolist()), 1: tuple(arr[i, :, k].tolist()), 2: tuple(arr[i, j, :].tolist())}
        for ax, name in enumerate(("pp", "dp", "tp")):
            assert MESH_3D.ranks_along(ax, rank) == expect[ax]
            assert MESH_3D.ranks_along(name, rank) == expect[ax]
    assert MESH_3D.ranks_along("dp", 13) == (13, 17, 21)  # 13 is at (1, 0, 1)


@pytest.mark.parametrize("mesh", ALL_MESHES, ids=["1d", "2d", "3d"])
def test_groups_along_an_axis_partition_the_mesh(mesh):
    for ax in range(mesh.ndim):
        groups = mesh.groups(ax)
        assert len(groups) == mesh.size // mesh.shape[ax]
        assert all(len(g) == mesh.shape[ax] for g in groups)
        assert sorted(r for g in groups for r in g) == sorted(mesh.ranks)
        assert groups == mesh.groups(mesh.axis_names[ax])


def test_groups_of_a_2d_mesh_are_rows_and_columns():
    assert MESH_2D.groups("tp") == ((0, 1, 2), (3, 4, 5))
    assert MESH_2D.groups("dp") == ((0, 3), (1, 4), (2, 5))


def test_groups_of_a_3d_mesh_on_the_middle_axis():
    arr = np.arange(24).reshape(2, 3, 4)
    expect = {tuple(arr[i, :, k].tolist()) for i in range(2) for k in range(4)}
    assert set(MESH_3D.groups("dp")) == expect
    assert len(MESH_3D.groups("dp")) == 8


# ---------------------------------------------------------------- serialization

@pytest.mark.parametrize("mesh", ALL_MESHES + [DeviceMesh([3, 1, 2]), DeviceMesh([[7, 2], [0, 5]], ("a", "b"))],
                         ids=["1d", "2d", "3d", "1d-permuted", "2d-permuted"])
def test_to_dict_from_dict_round_trip_through_json(mesh):
    d = mesh.to_dict()
    back = DeviceMesh.from_dict(json.loads(json.dumps(d)))
    assert back == mesh
    assert back.ranks == mesh.ranks and back.shape == mesh.shape and back.axis_names == mesh.axis_names


def test_to_dict_is_plain_lists():
    assert MESH_2D.to_dict() == {"ranks": [0, 1, 2, 3, 4, 5], "shape": [2, 3], "axis_names": ["dp", "tp"]}


def test_from_dict_with_a_shape_that_does_not_hold_the_ranks_raises():
    with pytest.raises(MeshError):
        DeviceMesh.from_dict({"ranks": [0, 1, 2], "shape": [2, 2], "axis_names": ["y", "x"]})


def test_str_names_every_axis_with_its_size():
    assert str(MESH_3D) == "DeviceMesh(pp=2, dp=3, tp=4)"


# ---------------------------------------------------------------- malformed meshes

def test_duplicate_ranks_raise_and_name_the_rank():
    with pytest.raises(MeshError, match=r"\[1\]"):
        DeviceMesh([[0, 1], [1, 2]])


def test_duplicate_ranks_in_a_1d_mesh_raise():
    with pytest.raises(MeshError):
        DeviceMesh([0, 0])


@pytest.mark.parametrize("devices", [[], [[]], [[], []], torch.empty(0, dtype=torch.int64),
                                     torch.empty(2, 0, dtype=torch.int64)],
                         ids=["[]", "[[]]", "[[],[]]", "torch-0", "torch-2x0"])
def test_empty_mesh_raises(devices):
    with pytest.raises(MeshError):
        DeviceMesh(devices)


@pytest.mark.parametrize("devices", [[[0, 1], [2]], [[0, 1], 2], [0, [1, 2]], [[[0, 1]], [[2, 3], [4, 5]]]],
                         ids=["short-row", "int-row", "list-leaf", "3d-ragged"])
def test_ragged_nesting_raises(devices):
    with pytest.raises(MeshError, match="ragged"):
        DeviceMesh(devices)


def test_more_than_three_axes_raise():
    with pytest.raises(MeshError, match="4-D"):
        DeviceMesh(torch.arange(16).reshape(2, 2, 2, 2))


def test_zero_dimensional_mesh_raises():
    with pytest.raises(MeshError):
        DeviceMesh(torch.tensor(3))


def test_a_bare_int_raises_and_suggests_arange():
    with pytest.raises(MeshError, match="arange"):
        DeviceMesh(4)


def test_negative_rank_raises():
    with pytest.raises(MeshError):
        DeviceMesh([0, -1])


@pytest.mark.parametrize("devices, names", [([[0, 1], [2, 3]], ("a",)), ([0, 1], ("a", "b")),
                                            (torch.arange(8).reshape(2, 2, 2), ("a", "b")),
                                            ([[0, 1], [2, 3]], ("a", "b", "c"))])
def test_wrong_number_of_axis_names_raises(devices, names):
    with pytest.raises(MeshError, match="axis names"):
        DeviceMesh(devices, axis_names=names)


def test_duplicate_axis_names_raise():
    with pytest.raises(MeshError):
        DeviceMesh([[0, 1], [2, 3]], axis_names=("a", "a"))


# ---------------------------------------------------------------- ParallelType.mesh_axis

def test_didx_binds_the_last_mesh_axis():
    assert ParallelType.DIDx.mesh_axis(MESH_1D) == 0
    assert ParallelType.DIDx.mesh_axis(MESH_2D) == 1
    assert ParallelType.DIDx.mesh_axis(MESH_3D) == 2


def test_didy_binds_the_axis_before_the_last():
    assert ParallelType.DIDy.mesh_axis(MESH_2D) == 0
    assert ParallelType.DIDy.mesh_axis(MESH_3D) == 1


def test_didz_binds_the_outermost_axis_of_a_3d_mesh():
    assert ParallelType.DIDz.mesh_axis(MESH_3D) == 0


def test_didy_on_a_1d_mesh_raises():
    with pytest.raises(MeshError, match="DIDy"):
        ParallelType.DIDy.mesh_axis(MESH_1D)


def test_didz_on_a_2d_mesh_raises():
    with pytest.raises(MeshError, match="DIDz"):
        ParallelType.DIDz.mesh_axis(MESH_2D)


def test_serial_binds_no_mesh_axis():
    with pytest.raises(MeshError):
        ParallelType.Serial.mesh_axis(MESH_2D)


@pytest.mark.parametrize("mesh", ALL_MESHES, ids=["1d", "2d", "3d"])
def test_for_mesh_axis_inverts_mesh_axis(mesh):
    for ax in range(mesh.ndim):
        ptype = ParallelType.for_mesh_axis(mesh, ax)
        assert ptype.mesh_axis(mesh) == ax
        assert ParallelType.for_mesh_axis(mesh, mesh.axis_names[ax]) is ptype
    assert ParallelType.for_mesh_axis(mesh, -1) is ParallelType.DIDx


def test_only_did_types_are_device_types():
    assert not ParallelType.Serial.is_device
    assert all(p.is_device for p in (ParallelType.DIDx, ParallelType.DIDy, ParallelType.DIDz))


def test_mesh_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MESH_2D.shape = (3, 2)
    assert MESH_2D.shape == (2, 3)


def test_public_api_exports_mesh_names():
    assert ed.DeviceMesh is DeviceMesh and ed.MeshError is MeshError
    assert issubclass(MeshError, ed.EgraphDidError)
