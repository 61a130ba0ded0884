"""Correctness at the edges, round two (issue 29): each test states one claim and failed before its fix.
Numerics are checked with ed.simulate against ed.evaluate in float64."""
import pytest
import torch

import egraph_did as ed
from egraph_did.ir import ParallelType

from plan.test_plan_edges import assert_simulates, random_inputs

F64 = torch.float64
DIDx, DIDy = ParallelType.DIDx, ParallelType.DIDy
MESH2, MESH4 = ed.DeviceMesh.arange(2), ed.DeviceMesh.arange(4)
MESH2x2 = ed.DeviceMesh(torch.arange(4).reshape(2, 2), axis_names=("y", "x"))


def shard(tv, mesh, axis, ptype=DIDx):
    """Pin tv on mesh: logical axis `axis` outer-split by the size of the mesh axis ptype binds."""
    tv.set_device_mesh(mesh)
    return tv.outer_split(axis, mesh.shape[ptype.mesh_axis(mesh)]).parallelize(axis, ptype)


# ---------------------------------------------------------------------- items 1 and 2: one input contract

def _with_unread_input():
    """y = relu(x); u is read by no output, and only a dead exp reads it."""
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 6), F64, name="x")
        u = fd.define_tensor((3,), F64, name="u")
        fd.ops.exp(u)
        fd.add_output(fd.ops.relu(x), name="y")
    return fd


def test_the_fusion_and_the_plan_name_the_unread_input():
    fd = _with_unread_input()
    plan = ed.optimize(fd, MESH2)
    assert fd.fusion.unread_inputs() == ["u"] and fd.fusion.needed() == {"x", "y"}
    assert sorted(plan.inputs) == ["x"] and plan.unread == ["u"]
    assert ed.Plan.from_json(plan.to_json()).unread == ["u"]


def test_one_dict_of_inputs_serves_evaluate_and_simulate_with_or_without_the_unread_input():
    fd = _with_unread_input()
    plan = ed.optimize(fd, MESH2)
    full = random_inputs(fd)
    read = {"x": full["x"]}
    for inputs in (full, read):
        assert_simulates(plan, fd, inputs)
    bad = dict(full, z=torch.zeros(2))  # a name the fusion does not have is still an error, naming what is ignored
    with pytest.raises(ed.ShapeError, match=r"unknown input\(s\) \['z'\].*ignores \['u'\]"):
        ed.simulate(plan, bad)
    with pytest.raises(ed.ShapeError, match=r"unknown input\(s\) \['z'\]"):
        ed.evaluate(fd, bad)


def test_plan_run_takes_the_unread_input_too():
    # plan.run checks its inputs with plan.check_inputs before any collective (runtime.run_plan): the same rule
    # as simulate's, without the cost of launching ranks here (tests/execution run plans on gloo)
    fd = _with_unread_input()
    plan = ed.optimize(fd, MESH2)
    plan.check_inputs(random_inputs(fd), "run_plan on rank 0", dtensors=True)
    plan.check_inputs({"x": torch.zeros(4, 6, dtype=F64)}, "run_plan on rank 0", dtensors=True)


def test_like_replays_a_plan_of_a_fusion_with_an_unread_input():
    fd = _with_unread_input()
    shard(fd["x"], MESH2, 1)
    plan = ed.optimize(fd, MESH2)
    again = ed.optimize(fd, MESH2, like=plan)
    assert [str(s) for s in again.steps] == [str(s) for s in plan.steps] and again.unread == ["u"]
    again = ed.optimize(fd, MESH2, like=ed.Plan.from_json(plan.to_json()))
    assert [str(s) for s in again.steps] == [str(s) for s in plan.steps]


def test_a_pinned_unread_input_reports_its_pin():
    # found by the fuzzer's unread inputs (seed 2929): the plan loads none of it, and loop_domain raised
    # "the plan holds no tensor named 'u'"
    fd = _with_unread_input()
    shard(fd["u"], MESH2, 0)
    plan = ed.optimize(fd, MESH2)
    assert plan.unread == ["u"] and plan.loop_domain("u") == "[DIDx{2}, 3/2]"
    assert_simulates(plan, fd)


def test_like_refuses_a_plan_that_reads_an_input_this_fusion_does_not():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 6), F64, name="x")
        u = fd.define_tensor((4, 6), F64, name="u")
        fd.add_output(fd.ops.add(x, u), name="y")
    with ed.FusionDefinition() as other:  # u unread here: a plan of fd is of another fusion
        x = other.define_tensor((4, 6), F64, name="x")
        other.define_tensor((4, 6), F64, name="u")
        other.add_output(other.ops.relu(x), name="y")
    with pytest.raises(ed.PlanError, match=r"reads inputs \['u', 'x'\].*this fusion reads \['x'\]"):
        ed.optimize(other, MESH2, like=ed.optimize(fd, MESH2))


@pytest.mark.parametrize("mesh", [MESH2, MESH2x2], ids=["2", "2x2"])
def test_like_replays_a_plan_that_loads_no_input(mesh):
    # every output a constant's: the like plan loads nothing, and a problem restricted to it was taken for an
    # open one (its input layouts were the only sign of the restriction)
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 6), F64, name="x")
        fd.ops.exp(x)
        fd.add_output(fd.ops.full((3, 4), 2.0, "float64"), name="y")
    plan = ed.optimize(fd, mesh)
    assert plan.inputs == {} and plan.unread == ["x"]
    again = ed.optimize(fd, mesh, like=plan)
    assert [str(s) for s in again.steps] == [str(s) for s in plan.steps]
    assert torch.equal(ed.simulate(again, {})["y"], torch.full((3, 4), 2.0, dtype=F64))


# ---------------------------------------------------------------------- item 3: reshape chains

def test_a_tensor_held_by_an_equal_terms_value_reports_its_loop_domain():
    # c = reshape(a, (3, 4)) is the term b is: the plan delivers both from one value named b; loop_domain('c')
    # searched the values by tensor name and raised "no value of 'c'" from a line marked unreachable
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((2, 6), F64, name="x")
        fd.add_output(fd.ops.reshape(x, (12,)), name="a")
        fd.add_output(fd.ops.reshape(fd.ops.reshape(x, (12,)), (3, 4)), name="b")
        fd.add_output(fd.ops.reshape(fd["a"], (3, 4)), name="c")
    plan = ed.optimize(fd, MESH2)
    assert plan.values[plan.value_of("c")].tensor == "b"
    assert plan.loop_domain("c") == plan.loop_domain("b")
    assert_simulates(plan, fd)


def test_a_split_merge_split_chain_beside_a_viewed_pin_plans_and_reports_every_output():
    # found by the reshape-chain search (issue 29 item 3): x split unevenly (2 rows over 4 ranks) merged into
    # y0, pinned as a view [2, DIDx{4}, 24/2/4] (its view is reshape(y0, (2, 12))), and y1 = the same reshape of
    # the same merge: y1 is delivered from the view's value
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((2, 6, 2), F64, name="x")
        a = fd.ops.reshape(x, (24,))
        fd.add_output(a, name="y0")
        fd.add_output(fd.ops.reshape(a, (2, 12)), name="y1")
    shard(x, MESH4, 0)
    fd["y0"].set_device_mesh(MESH4).outer_split(0, 2).outer_split(1, 4).parallelize(1, DIDx)
    plan = ed.optimize(fd, MESH4)
    assert plan.loop_domain("y0") == "[2, DIDx{4}, 24/2/4]"
    assert plan.layout_of("y1") == plan.values[plan.outputs["y1"]].layout
    plan.loop_domain("y1")
    plan.explain()
    assert_simulates(plan, fd)


# ---------------------------------------------------------------------- item 5: complex dtypes

COMPLEX = "complex64 is a complex dtype, which egraph-did does not take"


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, "complex64"])
def test_a_complex_input_is_refused_at_definition_naming_it_and_the_real_dtype(dtype):
    fd = ed.FusionDefinition()
    with pytest.raises(ed.DtypeError, match=r"define_tensor\(z\): complex(64|128) is a complex dtype.*view_as_real"):
        fd.define_tensor((4, 2), dtype, name="z")


def test_casts_and_constants_to_complex_are_refused_naming_the_op():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 2), name="x")
        with pytest.raises(ed.DtypeError, match=r"cast\(x\): " + COMPLEX):
            fd.ops.cast(x, torch.complex64)
        with pytest.raises(ed.DtypeError, match=r"full\(\(2,\), 1.0\): " + COMPLEX):
            fd.ops.full((2,), 1.0, torch.complex64)


def test_complex_tensors_given_to_evaluate_or_simulate_are_named():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 2), name="x")
        fd.add_output(fd.ops.relu(x), name="y")
    Z = torch.zeros(4, 2, dtype=torch.complex64)
    with pytest.raises(ed.DtypeError, match=r"input 'x': declared dtype torch.float32, got " + COMPLEX):
        ed.evaluate(fd, {"x": Z})
    with pytest.raises(ed.DtypeError, match=r"simulate: input 'x': the plan expects float32, got " + COMPLEX):
        ed.simulate(ed.optimize(fd, MESH2), {"x": Z})


class _ComplexLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 2, dtype=torch.complex64))

    def forward(self, x, y):
        return x @ self.w + y


class _ToComplex(torch.nn.Module):
    def forward(self, x):
        return (x.to(torch.complex64) * 2).real


def test_from_torch_names_every_complex_input_and_parameter_at_once():
    z = torch.zeros(4, 2, dtype=torch.complex64)
    with pytest.raises(ed.DtypeError, match=r"from_torch: w, x, y: " + COMPLEX):
        ed.from_torch(_ComplexLinear(), (z, z))


def test_from_torch_names_the_op_and_line_that_makes_a_complex_tensor():
    with pytest.raises(ed.DtypeError, match=r"from_torch: aten.to.dtype at .*x.to\(torch.complex64\).*: " + COMPLEX):
        ed.from_torch(_ToComplex(), (torch.zeros(4, 2),))


# ---------------------------------------------------------------------- item 4: uneven resharding

def _reshard(shape, src, dst, op="relu"):
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor(shape, F64, name="x")
        fd.add_output(getattr(fd.ops, op)(x) if op == "relu" else fd.ops.reshape(x, dst[0]), name="y")
    shard(x, MESH4, src)
    shard(fd["y"], MESH4, dst if op == "relu" else dst[1])
    return fd


@pytest.mark.parametrize("shape,src,dst", [((5, 8), 0, 1), ((8, 5), 0, 1), ((5, 8), 1, 0), ((5, 7), 0, 1)])
def test_an_uneven_reshard_with_one_side_on_every_rank_is_one_alltoall(shape, src, dst):
    # 5 over 4 ranks is torch.chunk's 2, 2, 1, 0: DTensor's one all-to-all (uneven counts, padded on the wire)
    fd = _reshard(shape, src, dst)
    plan = ed.optimize(fd, MESH4)
    assert [c.kind for c in plan.collectives] == ["alltoall"]
    assert_simulates(plan, fd)


@pytest.mark.parametrize("shape,src,dst", [((6, 5), 0, 1), ((5, 6), 1, 0), ((3, 5), 0, 1), ((6, 2, 5), 0, 2)])
def test_an_uneven_reshard_with_an_empty_rank_on_both_sides_is_one_alltoall(shape, src, dst):
    # 6 over 4 ranks is 2, 2, 2, 0 and 5 is 2, 2, 1, 0: relu runs on the empty-ranked S(0) (an elementwise op
    # is right on an empty shard), then DTensor's one all-to-all; it went through R (an allgather)
    fd = _reshard(shape, src, dst)
    plan = ed.optimize(fd, MESH4)
    assert [c.kind for c in plan.collectives] == ["alltoall"]
    assert_simulates(plan, fd)


@pytest.mark.parametrize("shape,src,dst", [((1, 8, 4), 1, ((8, 4), 0)), ((1, 7), 1, ((7,), 0)), ((7,), 0, ((1, 7), 1))])
def test_a_view_keeping_a_size_one_leading_axis_moves_nothing(shape, src, dst):
    # 7 over 4 ranks (2, 2, 2, 1) too: every rank holds some of it
    fd = _reshard(shape, src, dst, op="reshape")
    plan = ed.optimize(fd, MESH4)
    assert plan.collectives == []
    assert_simulates(plan, fd)


@pytest.mark.parametrize("shape,src,dst", [((1, 6), 1, ((6,), 0)), ((6,), 0, ((1, 6), 1)), ((1, 3, 2), 1, ((3, 2), 0)),
                                           ((1, 5), 1, ((5,), 0))])
def test_a_view_keeping_a_size_one_leading_axis_of_an_uneven_split_moves_nothing(shape, src, dst):
    # 6 over 4 ranks is 2, 2, 2, 0 (5: 2, 2, 1, 0): the reshape runs on rank 3's empty shard (a view is right
    # on one); it allgathered
    fd = _reshard(shape, src, dst, op="reshape")
    plan = ed.optimize(fd, MESH4)
    assert plan.collectives == []
    assert_simulates(plan, fd)


def test_a_reshape_keeping_a_split_size_one_axis_moves_nothing():
    # found by the fuzzer's reshard probe (seed 4141, case 45): [1, 1, 2] split on its axis 1 (1 over 2
    # ranks: 1, 0) viewed as [1, 2] split on its axis 0 (1, 0 too) allgathered: rank 0 holds everything on
    # both sides, rank 1 nothing
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((1, 1, 2), F64, name="x")
        fd.add_output(fd.ops.reshape(x, (1, 2)), name="y")
    shard(x, MESH2, 1)
    shard(fd["y"], MESH2, 0)
    plan = ed.optimize(fd, MESH2)
    assert plan.collectives == []
    assert_simulates(plan, fd)


# ---------------------------------------------------------------------- item 4: DTensor's chunk-of-chunk as a pin

def _dtensor_nested(rows=9):
    """x [rows, 3] and y = relu(x @ w^T) [rows, 4], both pinned from DTensor's (Shard(0), Shard(0)) on 2x2."""
    from torch.distributed.tensor import Shard
    from egraph_did.runtime import pin_placements
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((rows, 3), F64, name="x")
        w = fd.define_tensor((4, 3), F64, name="w")
        fd.add_output(fd.ops.relu(fd.ops.linear(x, w)), name="y")
    pin_placements(x, (Shard(0), Shard(0)), MESH2x2)
    pin_placements(fd["y"], (Shard(0), Shard(0)), MESH2x2)
    return fd


def test_dtensors_chunk_of_chunk_nesting_pins_and_plans():
    # 9 rows on 2x2 as (Shard(0), Shard(0)): DTensor chunks 5 | 4 into 3, 2 | 2, 2; a loop domain cuts the
    # ceil extent 5 of each half (3, 2 | 3, 1), so no loop domain is DTensor's. It was refused; now the pin is
    # the loop domain of those placements held in DTensor's chunks, and the plan rechunks at its boundary
    fd = _dtensor_nested()
    x = fd["x"]
    assert x.chunks == "dtensor" and [x.local_shape(r)[0] for r in MESH2x2.ranks] == [3, 2, 2, 2]
    plan = ed.optimize(fd, MESH2x2)
    assert plan.layout_of("x") == "S0.S0" and plan.loop_domain("x") == x.loop_str() == "[DIDy{2}, DIDx{2}, 9/2/2, 3]"
    assert plan.dtensor_chunks == ["x", "y"] and [plan.input_shape("x", r)[0] for r in MESH2x2.ranks] == [3, 2, 2, 2]
    assert plan.collectives == []  # rows stay where they are inside the plan
    again = ed.Plan.from_json(plan.to_json())
    assert again.dtensor_chunks == ["x", "y"]
    for p in (plan, again):
        assert_simulates(p, fd)
    X = torch.randn(9, 3, dtype=F64)
    assert [ed.shard_tensor(X, x, r).shape[0] for r in MESH2x2.ranks] == [3, 2, 2, 2]
    assert torch.equal(ed.unshard_tensor([ed.shard_tensor(X, x, r) for r in MESH2x2.ranks], x), X)


def _run_dtensor_nested(rank, plan_json, X, W):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from egraph_did.runtime import run_plan, torch_device_mesh
    plan = ed.Plan.from_json(plan_json)
    tmesh = torch_device_mesh(plan.mesh, "cpu")
    xdt = distribute_tensor(X, tmesh, [Shard(0), Shard(0)])  # DTensor's own chunks: 3, 2, 2, 2 rows
    ydt = run_plan(plan, {"x": xdt, "w": W}, outputs_kind="dtensor")["y"]
    local = run_plan(plan, {"x": xdt.to_local(), "w": W}, inputs_kind="local", outputs_kind="local")["y"]
    whole = run_plan(plan, {"x": X, "w": W})["y"]
    return tuple(xdt.to_local().shape), tuple(map(str, ydt.placements)), ydt.to_local(), ydt.full_tensor(), local, whole


def test_dtensors_chunk_of_chunk_nesting_runs_on_gloo_from_dtensor_and_local_inputs():
    fd = _dtensor_nested()
    plan = ed.optimize(fd, MESH2x2)
    X, W = torch.randn(9, 3, dtype=F64), torch.randn(4, 3, dtype=F64)
    want = ed.evaluate(fd, {"x": X, "w": W})["y"]
    out = ed.launch(_run_dtensor_nested, nprocs=4, backend="gloo", args=(plan.to_json(), X, W), timeout=120)
    for r, (xshape, placements, ylocal, yfull, local, whole) in enumerate(out):
        assert xshape[0] == [3, 2, 2, 2][r] and placements == ("S(0)", "S(0)")
        mine = ed.shard_tensor(want, fd["y"], r)  # DTensor's chunk of y, as pinned
        for got in (ylocal, local):
            torch.testing.assert_close(got, mine, rtol=1e-12, atol=1e-12)
        for got in (yfull, whole):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
