"""Plans at the edges (issue 12): each test states one claim; numerics are checked with ed.simulate
against ed.evaluate in float64."""
import pytest
import torch

import egraph_did as ed
from egraph_did import models
from egraph_did.ir import ParallelType

F64 = torch.float64
DIDx, DIDy = ParallelType.DIDx, ParallelType.DIDy
MESH4 = ed.DeviceMesh.arange(4)


def shard(tv, mesh, axis, ptype=DIDx, ways=None):
    """Pin tv on mesh: logical axis `axis` outer-split by the size of the mesh axis ptype binds."""
    tv.set_device_mesh(mesh)
    ways = ways or mesh.shape[ptype.mesh_axis(mesh)]
    return tv.outer_split(axis, ways).parallelize(axis, ptype)


def random_inputs(fd, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {tv.name: torch.randn(tv.shape, generator=g, dtype=tv.dtype) for tv in fd.fusion.inputs}


def assert_simulates(plan, fd, inputs=None):
    inputs = inputs or random_inputs(fd)
    got, want = ed.simulate(plan, inputs), ed.evaluate(fd, inputs)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-10, msg=k)


# ---------------------------------------------------------------------- 1. welford_merge, negative dim

def test_welford_merge_with_negative_dim_keeps_only_shards_of_unmerged_axes_and_runs():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((12, 8), F64, name="x")
        var, mean = fd.ops.welford_merge(fd.ops.welford_blocks(x, -2, 4), -2)
        fd.add_output(var, name="v")
        fd.add_output(mean, name="m")
    shard(x, MESH4, 0)
    shard(var, MESH4, 0)  # the merged result's only axis is x's axis 1: rows of stats must be gathered
    plan = ed.optimize(fd, MESH4)
    merge = next(s for s in plan.compute_steps if s.op == "welford_merge")
    assert plan.values[dict(merge.args)["stats"]].layout != "S0"  # axis 0 of the stats is the merged one
    assert_simulates(plan, fd)


# ---------------------------------------------------------------------- 2. mesh axes of size 1

def mesh_4x1():
    return ed.DeviceMesh(torch.arange(4).reshape(4, 1), axis_names=("dp", "tp"))


def mesh_1x4():
    return ed.DeviceMesh(torch.arange(4).reshape(1, 4), axis_names=("dp", "tp"))


def pinned_mlp(mesh, big_axis, size1_pins=False):
    """The MLP with x split by rows over the size-4 mesh axis and y replicated; size1_pins adds a split
    of x's columns and a pending sum of y over the size-1 mesh axis (the same data)."""
    fd = models.mlp(32, 4096, torch.bfloat16)
    x, y = fd["x"], fd["y"]
    x.set_device_mesh(mesh).outer_split(0, 4).parallelize(0, big_axis)
    y.set_device_mesh(mesh)
    if size1_pins:
        other = DIDx if big_axis is DIDy else DIDy
        x.outer_split(2, 1).parallelize(2, other)
        y.add_partial(other)
    return fd


def summary(plan):
    return [(c.kind, c.tensor, c.bytes, c.time) for c in plan.collectives], plan.predicted_time


@pytest.mark.parametrize("size1_pins", [False, True], ids=["plain-pins", "pins-on-the-size-1-axis"])
def test_no_collective_runs_on_a_mesh_axis_of_size_1_and_plans_equal_the_1d_plan(size1_pins):
    flat = ed.optimize(pinned_mlp(MESH4, DIDx), MESH4)
    assert flat.collectives  # the comparison means something: the 1-D plan communicates
    for mesh, big in ((mesh_4x1(), DIDy), (mesh_1x4(), DIDx)):
        plan = ed.optimize(pinned_mlp(mesh, big, size1_pins), mesh)
        one = mesh.shape.index(1)
        assert not [s for s in plan.steps if isinstance(s, ed.Collective) and s.mesh_axis == one]
        assert all(v.layout[one].kind == "R" for v in plan.values.values())  # R is the canonical form
        assert summary(plan) == summary(flat)


def test_a_plan_on_a_mesh_with_a_size_1_axis_simulates_exactly():
    mesh = mesh_4x1()
    fd = models.mlp(8, 16, F64)
    fd["x"].set_device_mesh(mesh).outer_split(1, 4).parallelize(1, DIDy)
    fd["x"].outer_split(0, 1).parallelize(0, DIDx)
    fd["y"].set_device_mesh(mesh).add_partial(DIDx)
    plan = ed.optimize(fd, mesh)
    assert all(c.mesh_axis == 0 for c in plan.collectives)
    assert_simulates(plan, fd)


# ---------------------------------------------------------------------- 7. nested uneven splits; empty shards

MESH22 = ed.DeviceMesh([[0, 1], [2, 3]])


@pytest.mark.parametrize("rows", [6, 7, 13])
def test_an_axis_split_unevenly_over_two_mesh_axes_with_no_empty_rank_is_a_valid_pin(rows):
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((rows, 3), F64, name="x")
        w = fd.define_tensor((5, 3), F64, name="w")
        fd.add_output(fd.ops.relu(fd.ops.linear(x, w)), name="y")
    x.set_device_mesh(MESH22).outer_split(0, 2).parallelize(0, DIDy)  # rows: ceil-halves, each halved again
    x.outer_split(1, 2).parallelize(1, DIDx)
    assert all(x.local_shape(r)[0] > 0 for r in MESH22.ranks)
    plan = ed.optimize(fd, MESH22)
    assert plan.layout_of("x") == ed.Layout.from_code("S0.S0")
    assert plan.loop_domain("x") == x.loop_str()
    assert_simulates(plan, fd)


def empty_rank_mlp(rows, mesh, pin_output):
    """x [rows, 3] pinned row-sharded over every mesh axis (a rank holds no rows when rows is short)."""
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((rows, 3), F64, name="acts")
        w = fd.define_tensor((4, 3), F64, name="w")
        fd.add_output(fd.ops.relu(fd.ops.linear(x, w)), name="y")
    x.set_device_mesh(mesh)
    pos = 0
    for m in range(mesh.ndim):  # outer mesh axis first, as DTensor's (Shard(0), Shard(0)) chunks
        x.outer_split(pos, mesh.shape[m]).parallelize(pos, ParallelType.for_mesh_axis(mesh, m))
        pos += 1
    if pin_output:  # row-sharded like x on a 1-D mesh, replicated on a 2-D one
        y = fd["y"].set_device_mesh(mesh)
        if mesh.ndim == 1:
            y.outer_split(0, mesh.size).parallelize(0, DIDx)
    return fd, x


@pytest.mark.parametrize("rows, mesh", [(5, MESH4), (3, MESH4), (1, MESH4), (5, MESH22)])
@pytest.mark.parametrize("pin_output", [False, True])
def test_a_pin_whose_shards_leave_a_rank_empty_is_honoured_and_runs(rows, mesh, pin_output):
    """5 rows over 4 ranks is DTensor's 2, 2, 1, 0: the pin is held as given (the last rank holds none)
    and the plan reshards it before computing; a pinned output with an empty shard is delivered so."""
    fd, x = empty_rank_mlp(rows, mesh, pin_output)
    assert any(x.local_shape(r)[0] == 0 for r in mesh.ranks)
    plan = ed.optimize(fd, mesh)
    assert plan.loop_domain("acts") == x.loop_str()
    if pin_output:
        assert plan.loop_domain("y") == fd["y"].loop_str()
    assert_simulates(plan, fd)
    assert_simulates(ed.Plan.from_json(plan.to_json()), fd)


def _run_empty_rank_plan(rank, plan, inputs):
    return plan.run(inputs, inputs="global", outputs="global")["y"]


def test_a_pin_with_an_empty_shard_runs_on_gloo_processes():
    fd, _ = empty_rank_mlp(5, MESH4, pin_output=True)
    plan = ed.optimize(fd, MESH4)
    inputs = {k: v.float() for k, v in random_inputs(fd).items()}
    plan32 = ed.Plan.from_json(plan.to_json().replace('"float64"', '"float32"'))
    want = ed.evaluate(fd, {k: v.double() for k, v in inputs.items()})["y"]
    for got in ed.launch(_run_empty_rank_plan, nprocs=4, backend="gloo", args=(plan32, inputs), timeout=120):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- 3. reshapes of uneven shards

@pytest.mark.parametrize("new_shape", [(10, 6), (10, 2, 3), (10, 3, 2, 1)], ids=["identity", "split-other", "unit"])
def test_a_reshape_that_leaves_an_unevenly_sharded_axis_alone_needs_no_allgather(new_shape):
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((10, 6), F64, name="x")  # 10 rows over 4 ranks: 3, 3, 3, 1
        fd.add_output(fd.ops.relu(fd.ops.reshape(x, new_shape)), name="y")
    shard(x, MESH4, 0)
    shard(fd["y"], MESH4, 0)
    plan = ed.optimize(fd, MESH4)
    assert plan.collectives == []
    assert_simulates(plan, fd)


# ---------------------------------------------------------------------- 6. a dtype given by name

def test_cast_to_a_dtype_given_by_name_optimizes_and_runs_like_a_torch_dtype():
    def build(dtype):
        with ed.FusionDefinition() as fd:
            x = fd.define_tensor((8, 16), torch.float32, name="x")
            fd.add_output(fd.ops.cast(fd.ops.sum(x, 1), dtype), name="y")
        shard(x, MESH4, 1)
        fd["y"].set_device_mesh(MESH4)
        return fd
    by_name, by_dtype = build("float64"), build(F64)
    plan = ed.optimize(by_name, MESH4)
    assert summary(plan) == summary(ed.optimize(by_dtype, MESH4))
    cast = next(s for s in plan.compute_steps if s.op == "cast")
    assert dict(cast.args)["dtype"] is F64
    X = torch.randint(-8, 8, (8, 16)).to(torch.float32)  # integers: every summation order is exact
    for p in (plan, ed.Plan.from_json(plan.to_json())):
        got = ed.simulate(p, {"x": X})["y"]
        assert got.dtype == F64 and torch.equal(got, ed.evaluate(by_name, {"x": X})["y"])


# ---------------------------------------------------------------------- 5. non-outermost DID splits

def test_a_non_outermost_did_split_pinned_for_the_optimizer_plans_through_a_view():
    """A merged gate/up weight [2 * I, H] split as [2, DIDx{4}, I/4, H]: each rank holds a quarter of the
    gate rows and a quarter of the up rows. No layout of [2 * I, H] names it; the view [2, I, H] laid out
    S(1) holds the same rows in the same order, so optimize plans that and reports the pin as written
    (tests/program/test_nested_pins.py has the rest: SwiGLU, inner-first, DTensor, the refusals)."""
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 8), F64, name="x")
        w = fd.define_tensor((2 * 16, 8), F64, name="w_gate_up")
        fd.add_output(fd.ops.linear(x, w), name="y")
    w.set_device_mesh(MESH4).outer_split(0, 2).outer_split(1, 4).parallelize(1, DIDx)
    W = torch.arange(32 * 8, dtype=F64).reshape(32, 8)
    assert torch.equal(ed.shard_tensor(W, w, 1), torch.cat([W[4:8], W[20:24]]))
    plan = ed.optimize(fd, MESH4)
    assert plan.loop_domain("w_gate_up") == w.loop_str() and str(plan.views["w_gate_up"].layout) == "[S(1)]"
    X = torch.randn(4, 8, dtype=F64)
    torch.testing.assert_close(ed.simulate(plan, {"x": X, "w_gate_up": W})["y"], X @ W.T, rtol=0, atol=1e-9)


# ---------------------------------------------------------------------- 4. pins on intermediates

def pinned_intermediate_fusion():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((16, 8), F64, name="x")
        w = fd.define_tensor((12, 8), F64, name="w")
        h = fd.ops.linear(x, w)
        fd.add_output(fd.ops.relu(h), name="y")
    shard(x, MESH4, 0)
    shard(fd["y"], MESH4, 0)
    return fd, h


@pytest.mark.parametrize("pin", ["R", "S1"])
def test_a_pinned_intermediate_is_reported_exactly_as_pinned(pin):
    fd, h = pinned_intermediate_fusion()  # x and y row-sharded: h is cheapest row-sharded, pinned otherwise
    h.set_device_mesh(MESH4)
    if pin == "S1":
        h.outer_split(1, 4).parallelize(1, DIDx)
    plan = ed.optimize(fd, MESH4)
    assert plan.loop_domain(h.name) == h.loop_str()
    assert plan.layout_of(h.name) == ed.Layout.from_code(pin)
    produced = {v for s in plan.steps for v in s.writes}
    assert plan.pins[h.name] == f"{h.name}:{pin}" and plan.pins[h.name] in produced
    line = next(ln for ln in plan.explain().splitlines() if ln.strip().startswith(h.name + " "))
    assert h.loop_str() in line and line.endswith("(pinned)")
    again = ed.Plan.from_json(plan.to_json())
    assert again.pins == plan.pins and again.loop_domain(h.name) == h.loop_str()
    assert_simulates(plan, fd)
