"""Pins whose DID splits nest in an order no layout names (issue 12, "Missing semantics users hit"):
a non-outermost split (a merged gate/up weight [2F, H] as [2, DIDx{n}, F/n, H]) and DTensor's inner-first
shard order (an axis split over two mesh axes, the inner mesh axis first). Where the splits divide, each is
a canonical layout of a reshaped view of the tensor, holding the same elements in the same order on every
rank: optimize plans the view, plans bind the user's tensor to it by a local reshape, and report the pin
as the user wrote it. Where they do not divide, a PlanError says what to do.
"""
from __future__ import annotations

import pytest
import torch

import egraph_did as ed
from egraph_did.launcher import launch
from egraph_did.pins import PinView, pin_of
from egraph_did.plan import Plan
from egraph_did.runtime import _dtensor_agrees, _view_placements, dtensor_placements, run_plan
from egraph_did.shards import shard

F64 = torch.float64
DIDx, DIDy = ed.ParallelType.DIDx, ed.ParallelType.DIDy
MESH22 = ed.DeviceMesh(torch.arange(4).reshape(2, 2), axis_names=("dp", "tp"))
T, H = 6, 8


def swiglu(n: int, merged_gemm: bool = False, tokens: int = T, hidden: int = H, f: int | None = None):
    """y = (silu(x w_gate^T) * (x w_up^T)) w_down^T with gate and up one merged weight [2F, H], sliced (or,
    merged_gemm, one GEMM x w^T whose output is sliced, as torch models write it); the merged weight pinned
    non-outermost (each rank a 1/n of gate and of up), w_down row-parallel, x and y replicated: Megatron's
    MLP, whose only collective is the allreduce of y."""
    mesh, f = ed.DeviceMesh.arange(n), f or 4 * n
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((tokens, hidden), F64, name="x")
        w = fd.define_tensor((2 * f, hidden), F64, name="w_gate_up", axis_names=("f2", "h"))
        w2 = fd.define_tensor((hidden, f), F64, name="w_down")
        if merged_gemm:
            h = fd.ops.linear(x, w)
            gate, up = fd.ops.slice(h, -1, 0, f), fd.ops.slice(h, -1, f)
        else:
            gate = fd.ops.linear(x, fd.ops.slice(w, 0, 0, f))
            up = fd.ops.linear(x, fd.ops.slice(w, 0, f, 2 * f))
        fd.add_output(fd.ops.linear(fd.ops.mul(fd.ops.silu(gate), up), w2), name="y")
    w.set_device_mesh(mesh).outer_split(0, 2).outer_split(1, n).parallelize(1, DIDx)
    w2.set_device_mesh(mesh).outer_split(1, n).parallelize(1, DIDx)
    x.set_device_mesh(mesh)
    fd["y"].set_device_mesh(mesh)
    return fd, mesh


def swiglu_inputs(fd, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g, dtype=F64) for t in fd.fusion.inputs}


@pytest.mark.parametrize("merged_gemm", [False, True])
@pytest.mark.parametrize("n", [2, 4])
def test_a_merged_gate_up_weight_pinned_non_outermost_plans_with_no_collective_for_the_weight(n, merged_gemm):
    fd, mesh = swiglu(n, merged_gemm)
    pinned = fd["w_gate_up"].loop_str()
    assert pinned == f"[2, DIDx{{{n}}}, f2/2/{n}, h]"
    plan = ed.optimize(fd, mesh, rewrites=())  # the program as written: Megatron's one allreduce
    assert [(c.kind, c.tensor) for c in plan.collectives] == [("allreduce", "y")]  # gate, up sliced locally
    assert plan.loop_domain("w_gate_up") == pinned
    rewritten = ed.optimize(fd, mesh)  # rewrites (a collective matmul) may move y otherwise, never the weight
    assert {c.tensor for c in rewritten.collectives} == {"y"}
    assert list(plan.inputs) == ["x", "w_gate_up", "w_down"]
    ins = swiglu_inputs(fd)
    ref = ed.evaluate(fd, ins)["y"]
    for p in (plan, rewritten):
        for lowered in (False, True):
            torch.testing.assert_close(ed.simulate(p, ins, lowered=lowered)["y"], ref, rtol=0, atol=1e-12)


def test_the_plan_binds_each_ranks_pinned_shard_to_its_view_shard_by_a_local_reshape():
    """The view holds the pin's elements in the pin's order: the user's shard (shard_tensor of the pinned
    loop domain), reshaped, is the view's shard, and back."""
    fd, mesh = swiglu(4)
    plan = ed.optimize(fd, mesh)
    W = torch.arange(32 * H, dtype=F64).reshape(32, H)
    value = plan.values[plan.inputs["w_gate_up"][0]]
    assert value.shape == (2, 16, H) and str(value.layout) == "[S(1)]"
    for r in mesh.ranks:
        mine = ed.shard_tensor(W, fd["w_gate_up"], r)  # rows 4r..4r+3 of gate and of up
        assert torch.equal(mine, torch.cat([W[4 * r:4 * r + 4], W[16 + 4 * r:16 + 4 * r + 4]]))
        view = plan.bind_view("w_gate_up", mine, r)
        assert torch.equal(view, shard(W.reshape(2, 16, H), value.layout, mesh, r))
        assert torch.equal(plan.deliver_view("w_gate_up", view, r) if "w_gate_up" in plan.outputs else
                           view.reshape(mine.shape), mine)
        assert plan.input_shape("w_gate_up", r) == tuple(mine.shape)


def inner_first(t, mesh=MESH22):
    """Axis 0 split over both mesh axes, the inner one (tp, DIDx) first: DTensor's shard_order (1, 0)."""
    return t.set_device_mesh(mesh).outer_split(0, 2).parallelize(0, DIDx).outer_split(1, 2).parallelize(1, DIDy)


def test_inner_first_nesting_of_an_input_on_a_2x2_mesh_simulates_to_the_reference():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((8, 6), F64, name="x", axis_names=("s", "h"))
        fd.add_output(fd.ops.mul(fd.ops.relu(x), x), name="y")
    inner_first(x)
    assert x.loop_str() == "[DIDx{2}, DIDy{2}, s/2/2, h]"
    view = pin_of(x, MESH22)
    assert isinstance(view, PinView) and view.view_shape == (2, 4, 6) and str(view.layout) == "[S(1), S(0)]"
    plan = ed.optimize(fd, MESH22)
    assert plan.loop_domain("x") == "[DIDx{2}, DIDy{2}, s/2/2, h]"
    # an op reading x whole reads it in x's own shape, where no layout holds the nesting: one alltoall
    # moves the view's rows to a layout the reshape back keeps (locality survives through views only)
    assert [(c.kind, c.tensor) for c in plan.collectives] == [("alltoall", "x.view")]
    X = torch.randn(8, 6, dtype=F64)
    torch.testing.assert_close(ed.simulate(plan, {"x": X})["y"], torch.relu(X) * X, rtol=0, atol=0)
    for r in MESH22.ranks:  # rank (dp, tp) holds rows 4 tp + 2 dp, +1: the inner mesh axis split first
        dp, tp = MESH22.coords(r)
        assert ed.shard_tensor(X, x, r).tolist() == X[4 * tp + 2 * dp:4 * tp + 2 * dp + 2].tolist()


def test_inner_first_nesting_of_an_output_on_a_2x2_mesh_simulates_to_the_reference():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((8, 6), F64, name="x")
        w = fd.define_tensor((6, 6), F64, name="w")
        fd.add_output(fd.ops.linear(x, w), name="y")
    x.set_device_mesh(MESH22).outer_split(0, 2).parallelize(0, DIDy).outer_split(1, 2).parallelize(1, DIDx)
    inner_first(fd["y"])
    plan = ed.optimize(fd, MESH22)
    assert plan.loop_domain("y") == "[DIDx{2}, DIDy{2}, 8/2/2, 6]"
    assert list(plan.outputs) == ["y"] and plan.views["y"].view_shape == (2, 4, 6)
    # rows move from outer-first (x, y computed in place) to inner-first: gather on tp, exchange on dp, slice
    assert [c.kind for c in plan.collectives] == ["allgather", "alltoall"]
    X, W = torch.randn(8, 6, dtype=F64), torch.randn(6, 6, dtype=F64)
    y = ed.simulate(plan, {"x": X, "w": W})["y"]
    torch.testing.assert_close(y, X @ W.T, rtol=0, atol=1e-12)


def test_a_pinned_intermediate_nested_non_outermost_is_held_and_reported_as_pinned():
    mesh = ed.DeviceMesh.arange(2)
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 8), F64, name="x")
        h = fd.ops.gelu(x)
        fd.add_output(fd.ops.relu(h), name="y")
    h.set_device_mesh(mesh).outer_split(1, 2).outer_split(2, 2).parallelize(2, DIDx)
    plan = ed.optimize(fd, mesh)
    assert plan.loop_domain(h.name) == "[4, 2, DIDx{2}, 8/2/2]"
    X = torch.randn(4, 8, dtype=F64)
    torch.testing.assert_close(ed.simulate(plan, {"x": X})["y"], ed.evaluate(fd, {"x": X})["y"], rtol=0, atol=0)


def test_a_plan_with_views_round_trips_through_json_and_simulates_the_same():
    fd, mesh = swiglu(2)
    plan = ed.optimize(fd, mesh)
    again = Plan.from_json(plan.to_json())
    assert again.views == plan.views and again.loop_domain("w_gate_up") == plan.loop_domain("w_gate_up")
    ins = swiglu_inputs(fd, 1)
    assert torch.equal(ed.simulate(again, ins)["y"], ed.simulate(plan, ins)["y"])


def test_a_view_in_plan_json_that_is_no_reshape_is_refused_naming_the_field():
    import json
    fd, mesh = swiglu(2)
    d = json.loads(ed.optimize(fd, mesh).to_json())
    d["views"]["w_gate_up"]["view_shape"] = [2, 8, 9]
    with pytest.raises(ed.PlanError, match=r"pin view of w_gate_up .* not a reshape"):
        Plan.from_json(json.dumps(d))


@pytest.mark.parametrize("pin, extent, mesh", [
    ("non-outermost", 7, ed.DeviceMesh.arange(2)),   # 7 rows cannot be halved first: gate and up are not a reshape
    ("inner-first", 5, MESH22),                      # 5 rows: 3 | 2 over tp, then 2, 1 | 1, 1 over dp
])
def test_nestings_that_are_no_reshape_are_refused_saying_what_to_do(pin, extent, mesh):
    with ed.FusionDefinition() as fd:
        w = fd.define_tensor((extent, 4), F64, name="w")
        fd.add_output(fd.ops.relu(w), name="y")
    if pin == "inner-first":
        inner_first(w, mesh)
    else:
        w.set_device_mesh(mesh).outer_split(0, 2).outer_split(1, 2).parallelize(1, DIDx)
    with pytest.raises(ed.PlanError) as info:
        ed.optimize(fd, mesh)
    msg = str(info.value)
    assert msg.startswith("w: the loop domain ") and "no reshape of w" in msg
    assert f"axis 0 (extent {extent})" in msg and "leave it free" in msg and "outer_split(axis, mesh size)" in msg


def test_uneven_inner_first_nesting_that_is_a_reshape_plans():
    """6 rows inner-first on 2x2: tp takes 3 | 3, dp then 2, 1 of each: the view [2, 3] laid out S(1), S(0)."""
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((6, 4), F64, name="x")
        fd.add_output(fd.ops.neg(x), name="y")
    inner_first(x)
    assert pin_of(x, MESH22).view_shape == (2, 3, 4)
    plan = ed.optimize(fd, MESH22)
    X = torch.randn(6, 4, dtype=F64)
    assert torch.equal(ed.simulate(plan, {"x": X})["y"], -X)


# ---------------------------------------------------------------------- the DTensor boundary

def test_dtensor_strided_shard_placements_map_onto_the_pinned_view():
    """The merged weight's pin is DTensor's _StridedShard(0, split_factor=2); inner-first on 2x2 is
    (_StridedShard(0, split_factor=2), Shard(0)); both hold, on every rank, what the plan's view holds."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    fd, mesh = swiglu(4)
    plan = ed.optimize(fd, mesh)
    v = plan.inputs["w_gate_up"][0]
    assert _dtensor_agrees(plan, "w_gate_up", v, (_StridedShard(0, split_factor=2),))
    assert not _dtensor_agrees(plan, "w_gate_up", v, (Shard(0),))  # plain row shards: another layout
    with ed.FusionDefinition() as fd2:
        x = fd2.define_tensor((8, 6), F64, name="x")
        fd2.add_output(fd2.ops.neg(x), name="y")
    x.set_device_mesh(MESH22).outer_split(0, 2).parallelize(0, DIDy).outer_split(1, 2).parallelize(1, DIDx)
    inner_first(fd2["y"])
    plan2 = ed.optimize(fd2, MESH22)
    placements = _view_placements(plan2, "y", plan2.outputs["y"])
    assert placements == (_StridedShard(0, split_factor=2), Shard(0))
    assert _dtensor_agrees(plan2, "y", plan2.outputs["y"], placements)


class _Spec:  # what dtensor_placements reads of a DTensor with a shard order (torch's DTensorSpec methods)
    def __init__(self, order):
        self.shard_order = order

    from torch.distributed.tensor._dtensor_spec import DTensorSpec as _D
    is_default_device_order = staticmethod(_D.is_default_device_order)
    _convert_shard_order_to_StridedShard = staticmethod(_D._convert_shard_order_to_StridedShard)


def test_a_non_default_dtensor_shard_order_reads_as_strided_shards():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import ShardOrderEntry
    from torch.distributed.tensor.placement_types import _StridedShard

    class FakeMesh:
        def size(self, m):
            return 2

    class DT:
        placements = (Shard(0), Shard(0))
        device_mesh = FakeMesh()
        _spec = _Spec((ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),))
    assert dtensor_placements(DT()) == (_StridedShard(0, split_factor=2), Shard(0))
    DT._spec = _Spec((ShardOrderEntry(tensor_dim=0, mesh_dims=(0, 1)),))
    assert dtensor_placements(DT()) == (Shard(0), Shard(0))


# ---------------------------------------------------------------------- one gloo run

def gloo_work(rank: int, plan_json: str, inputs: dict, pinned_shards: list, out_plan_json: str, out_inputs: dict):
    """The merged gate/up plan from global inputs, from the weight's pinned local shard, and from a DTensor
    with _StridedShard; the inner-first output plan delivered global, local and as a DTensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from egraph_did.runtime import torch_device_mesh
    plan = Plan.from_json(plan_json)
    out = {"global": run_plan(plan, inputs)["y"]}
    w = pinned_shards[rank]
    local_inputs = {n: (w if n == "w_gate_up" else ed.shard_tensor(t, plan.value_view(plan.inputs[n][0]), rank))
                    for n, t in inputs.items()}
    out["local"] = run_plan(plan, local_inputs, inputs_kind="local")["y"]
    full = inputs["w_gate_up"]
    dt = DTensor.from_local(w, torch_device_mesh(plan.mesh, "cpu"), [_StridedShard(0, split_factor=2)],
                            run_check=False, shape=full.shape, stride=full.stride())
    out["dtensor"] = run_plan(plan, {**inputs, "w_gate_up": dt})["y"]
    second = Plan.from_json(out_plan_json)
    y = run_plan(second, out_inputs)["y"]
    ydt = run_plan(second, out_inputs, outputs_kind="dtensor")["y"]
    ylocal = run_plan(second, out_inputs, outputs_kind="local")["y"]
    return out, y, (tuple(map(str, ydt.placements)), ydt.to_local(), ydt.full_tensor()), ylocal


def inner_first_output():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((8, 6), F64, name="x")
        fd.add_output(fd.ops.neg(x), name="y")
    x.set_device_mesh(MESH22).outer_split(0, 2).parallelize(0, DIDy).outer_split(1, 2).parallelize(1, DIDx)
    inner_first(fd["y"])
    return fd


def test_nested_pins_run_on_four_gloo_ranks_from_global_local_and_dtensor_inputs_and_to_dtensor_outputs():
    fd, mesh = swiglu(4, merged_gemm=True)
    plan = ed.optimize(fd, mesh)
    ins = swiglu_inputs(fd, 2)
    ref = ed.evaluate(fd, ins)["y"]
    shards = [ed.shard_tensor(ins["w_gate_up"], fd["w_gate_up"], r) for r in mesh.ranks]
    fd2 = inner_first_output()
    X = torch.randn(8, 6, dtype=F64)
    results = launch(gloo_work, nprocs=4, backend="gloo", timeout=120,
                     args=(plan.to_json(), ins, shards, ed.optimize(fd2, MESH22).to_json(), {"x": X}))
    for rank, (out, y, (placements, ydt_local, ydt_full), ylocal) in enumerate(results):
        for kind, got in out.items():
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-12, msg=f"{kind} inputs on rank {rank}")
        assert torch.equal(y, -X) and torch.equal(ydt_full, -X)
        assert placements == ("_S(0, 2)", "S(0)")  # _StridedShard(0, split_factor=2), Shard(0)
        mine = ed.shard_tensor(-X, fd2["y"], rank)  # the pinned inner-first shard, as DTensor holds it
        assert torch.equal(ydt_local, mine) and torch.equal(ylocal, mine)


def test_a_merged_qkv_weight_reshaped_by_the_user_is_read_through_its_view_with_no_collective():
    """w_qkv [3 * 8, H] pinned [3, DIDx{2}, 8/2, H]: the user's reshape to [3, 8, H] then select-by-slice of
    q, k, v reads the pinned view [3, 8, H] laid out S(1), each rank its half of every head block."""
    mesh = ed.DeviceMesh.arange(2)
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((T, H), F64, name="x")
        w = fd.define_tensor((24, H), F64, name="w_qkv")
        w3 = fd.ops.reshape(w, (3, 8, H))
        q, k, v = (fd.ops.linear(x, fd.ops.reshape(fd.ops.slice(w3, 0, i, i + 1), (8, H))) for i in range(3))
        fd.add_output(fd.ops.add(fd.ops.mul(q, k), v), name="y")
    w.set_device_mesh(mesh).outer_split(0, 3).outer_split(1, 2).parallelize(1, DIDx)
    x.set_device_mesh(mesh)
    plan = ed.optimize(fd, mesh, rewrites=())
    assert plan.collectives == [] and str(plan.layout_of("y")) == "[S(1)]"  # y stays column-split, as q, k, v
    assert plan.loop_domain("w_qkv") == "[3, DIDx{2}, 24/3/2, 8]"
    ins = swiglu_inputs(fd, 3)
    torch.testing.assert_close(ed.simulate(plan, ins)["y"], ed.evaluate(fd, ins)["y"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("mesh_shape, shape, pin", [
    ((4,), (16, 8), lambda t: t.outer_split(0, 2).outer_split(1, 4).parallelize(1, DIDx)),          # gate/up
    ((2, 2), (8, 6), lambda t: inner_first(t)),                                                     # inner-first
    ((2, 2), (8, 12), lambda t: t.outer_split(1, 3).outer_split(2, 2).parallelize(2, DIDy)
     .outer_split(0, 2).parallelize(0, DIDx)),                                                      # QKV-like, 2-D
    ((2, 2), (7, 6), lambda t: t.outer_split(0, 2).parallelize(0, DIDy).outer_split(1, 2).parallelize(1, DIDx)),
])
def test_dtensor_placements_and_loop_domains_map_onto_each_other(mesh_shape, shape, pin):
    """A loop domain -> DTensor placements (as plans deliver outputs) -> a loop domain again (pin_placements):
    the same loop domain, and DTensor's own chunks equal local_indices on every rank."""
    from egraph_did.runtime import _dtensor_indices, _torch_placements, pin_placements
    mesh = MESH22 if len(mesh_shape) == 2 else ed.DeviceMesh.arange(4)
    with ed.FusionDefinition() as fd:
        t = fd.define_tensor(shape, F64, name="t")
        fd.add_output(fd.ops.neg(t), name="y")
    pin(fd["y"].set_device_mesh(mesh))
    pinned = fd["y"].loop_str()
    plan = ed.optimize(fd, mesh)
    v = plan.outputs["y"]
    placements = _view_placements(plan, "y", v) if "y" in plan.views else _torch_placements(plan.values[v].layout)
    assert pin_placements(t, placements, mesh).loop_str() == pinned
    for r in mesh.ranks:
        assert _dtensor_indices(shape, placements, mesh, r) == [i.tolist() for i in t.local_indices(r)]
        assert _dtensor_indices(shape, placements, mesh, r) == [i.tolist() for i in fd["y"].local_indices(r)]


def test_dtensor_placements_no_loop_domain_holds_pin_the_loop_domain_held_in_dtensors_chunks():
    """5 rows over 2x2 as (Shard(0), Shard(0)): DTensor chunks 3 | 2 into 2, 1 | 1, 1; the loop domain
    cuts the ceil extent (3) of each half: 2, 1 | 2, 0. No loop domain is DTensor's here: the pin is the
    loop domain of those placements held in DTensor's chunks (it was refused; issue 29), which the plan
    rechunks at its boundary."""
    from torch.distributed.tensor import Shard
    from egraph_did.runtime import _dtensor_indices, pin_placements
    with ed.FusionDefinition() as fd:
        t = fd.define_tensor((5, 4), F64, name="t")
        fd.add_output(fd.ops.neg(t), name="y")
    pin_placements(t, (Shard(0), Shard(0)), MESH22)
    assert t.loop_str() == "[DIDy{2}, DIDx{2}, 5/2/2, 4]" and t.chunks == "dtensor"
    for r in MESH22.ranks:
        assert [i.tolist() for i in t.local_indices(r)] == _dtensor_indices((5, 4), (Shard(0), Shard(0)), MESH22, r)
    plan = ed.optimize(fd, MESH22)
    assert plan.dtensor_chunks == ["t"] and [plan.input_shape("t", r)[0] for r in MESH22.ranks] == [2, 1, 1, 1]
    X = torch.randn(5, 4, dtype=F64)
    assert torch.equal(ed.simulate(plan, {"t": X})["y"], -X)
    pin_placements(t, (Shard(0), Shard(1)), MESH22)  # pinned again: the loop domain's own chunks
    assert t.chunks == "loop"


@pytest.mark.parametrize("seed", range(12))
def test_every_dividing_nesting_plans_and_simulates_exactly(seed):
    """Random nestings whose splits divide: each sharded axis cut, in a random order of mesh axes, into
    DID splits with a random serial split (1, 2 or 3 pieces) outside each; pinned on the input or the
    output. optimize plans every one (a layout or a view), reports the pin, and simulates exactly."""
    import random
    rng = random.Random(seed)
    mesh = rng.choice([ed.DeviceMesh.arange(2), ed.DeviceMesh.arange(3), MESH22,
                       ed.DeviceMesh(torch.arange(6).reshape(2, 3))])
    shape, plan_of_axis = [rng.randint(1, 3), rng.randint(1, 3)], {0: [], 1: []}
    for m in rng.sample(range(mesh.ndim), mesh.ndim):
        a = rng.randrange(2)
        s = rng.choice([1, 2, 3])
        plan_of_axis[a].append((s, m))
        shape[a] *= s * mesh.shape[m]
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor(tuple(shape), F64, name="x")
        fd.add_output(fd.ops.exp(x), name="y")
    t = x if seed % 2 else fd["y"]
    t.set_device_mesh(mesh)
    for a in (1, 0):
        pos = a
        for s, m in plan_of_axis[a]:
            if s > 1:
                t.outer_split(pos, s)
                pos += 1
            t.outer_split(pos, mesh.shape[m]).parallelize(pos, ed.ParallelType.for_mesh_axis(mesh, m))
            pos += 1
    pinned = t.loop_str()
    plan = ed.optimize(fd, mesh)
    assert plan.loop_domain(t.name) == pinned
    X = torch.randn(tuple(shape), dtype=F64)
    assert torch.equal(ed.simulate(plan, {"x": X})["y"], ed.evaluate(fd, {"x": X})["y"])


def test_a_view_pin_keeps_its_view_through_simplified_and_replays_with_like():
    """Layouts chosen at large shapes (bf16-sized hidden 512), replayed at small ones: the same steps, the
    weight still local, simulated to the reference; a like plan of a fusion pinned otherwise is refused."""
    fd, mesh = swiglu(2, merged_gemm=True)
    plan = ed.optimize(fd, mesh, rewrites=())
    assert plan.simplified().views == plan.views
    big, _ = swiglu(2, merged_gemm=True, tokens=4096, hidden=512, f=2048)
    replayed = ed.optimize(fd, mesh, like=ed.optimize(big, mesh, rewrites=()), rewrites=())
    assert [(c.kind, c.tensor) for c in replayed.collectives] == [("allreduce", "y")]
    assert replayed.loop_domain("w_gate_up") == fd["w_gate_up"].loop_str()
    ins = swiglu_inputs(fd, 4)
    torch.testing.assert_close(ed.simulate(replayed, ins)["y"], ed.evaluate(fd, ins)["y"], rtol=0, atol=1e-12)
    other, _ = swiglu(2, merged_gemm=True)
    other["w_gate_up"].reset_loop_domain().outer_split(0, 2).parallelize(0, DIDx)  # a plain row split
    with pytest.raises(ed.PlanError, match=r"like plan holds \['w_gate_up'\] through a view .* this fusion none"):
        ed.optimize(other, mesh, like=plan)


# ---------------------------------------------------------------------- Partial('avg'): a pending sum with a scale

def avg_work(rank: int, plan_json: str, locals_: list):
    """x given as a DTensor Partial('avg') of every rank's local tensor: bound as a pending sum (each
    rank's local tensor over 2 its summand), no full_tensor."""
    from torch.distributed.tensor import DTensor, Partial
    from egraph_did.runtime import torch_device_mesh
    plan = Plan.from_json(plan_json)
    dt = DTensor.from_local(locals_[rank], torch_device_mesh(plan.mesh, "cpu"), [Partial("avg")], run_check=False)
    agrees = _dtensor_agrees(plan, "x", plan.inputs["x"][0], dtensor_placements(dt))
    return agrees, run_plan(plan, {"x": dt, "w": torch.eye(6, dtype=F64) * 3})["y"]


def test_a_partial_avg_dtensor_input_is_bound_as_a_pending_sum_of_its_local_tensors_over_n():
    mesh = ed.DeviceMesh.arange(2)
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 6), F64, name="x")
        w = fd.define_tensor((6, 6), F64, name="w")
        fd.add_output(fd.ops.linear(x, w), name="y")
    x.set_device_mesh(mesh).add_partial(DIDx)  # a pending sum, as Partial('avg') is one with a scale
    w.set_device_mesh(mesh)
    fd["y"].set_device_mesh(mesh)
    plan = ed.optimize(fd, mesh)
    g = torch.Generator().manual_seed(5)
    locals_ = [torch.randn(4, 6, generator=g, dtype=F64) for _ in range(2)]
    for agrees, y in launch(avg_work, nprocs=2, backend="gloo", timeout=120, args=(plan.to_json(), locals_)):
        assert agrees
        torch.testing.assert_close(y, (locals_[0] + locals_[1]) / 2 * 3, rtol=0, atol=1e-12)


def test_partial_avg_placements_pin_a_pending_sum():
    from torch.distributed.tensor import Partial, Shard
    from egraph_did.runtime import avg_scale, pin_placements
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((8, 6), name="x")
    assert pin_placements(x, (Shard(0), Partial("avg")), MESH22).loop_str() == "[DIDy{2}, 8/2, 6, rDIDx{2}]"
    assert avg_scale((Shard(0), Partial("avg")), MESH22) == 0.5
