"""Regressions of the failure classes the long fuzz campaign (bench/fuzz.py, issue 12) found: one test per
class, each the minimized repro the fuzzer printed, stated as the claim it checks.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import egraph_did as ed  # noqa: E402
from egraph_did.errors import MemoryBoundError  # noqa: E402


def _close(got, ref):
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-6, equal_nan=True, msg=k)


def test_logical_and_or_of_a_broadcast_one_element_operand_run_in_a_kernel():
    """`simulate-lowered-crash: InterpreterError in schedulers.py` (seed 7, case 9523): logical_and of x1[1]
    and x0[2, 1, 1] loads x1 as a scalar; the template `(a != 0) & (b != 0)` could not `&` the scalar's
    comparison with the block's under Triton's interpreter. The truth values now combine as int32."""
    mesh = ed.DeviceMesh.arange(1)
    with ed.FusionDefinition() as fd:
        x0 = fd.define_tensor((2, 1, 1), torch.float32, name="x0")
        x1 = fd.define_tensor((1,), torch.float32, name="x1")
        fd.add_output(fd.ops.logical_and(a=x1, b=x0), name="t_and")
        fd.add_output(fd.ops.logical_or(a=x1, b=x0), name="t_or")
    inputs = {"x0": torch.tensor([1.0, 0.0]).reshape(2, 1, 1), "x1": torch.tensor([0.5])}
    plan = ed.optimize(fd, mesh, extractor="greedy")
    got = ed.simulate(plan, inputs)  # lowered: the Triton kernel
    assert got["t_and"].flatten().tolist() == [True, False]
    assert got["t_or"].flatten().tolist() == [True, True]
    _close(got, ed.evaluate(fd, inputs))


def test_prod_over_a_negative_and_a_positive_dim_reduces_those_axes():
    """`evaluate-crash: AssertionError in evaluate.py` (seed 7, case 9607): prod's reference reduced one
    axis at a time and normalized each dim against the rank left after the last reduction, so
    prod(x[1, 2, 1], dims=(-2, 2)) reduced axes 2 and 0 and gave shape (2,) where the shape rule says (1,)."""
    with ed.FusionDefinition() as fd:
        t0 = fd.define_tensor((2, 3, 4), torch.float64, name="t0")
        fd.add_output(fd.ops.prod(x=t0, dims=(-2, 2)), name="t1")
        fd.add_output(fd.ops.prod(x=t0, dims=(0, -1), keepdim=True), name="t2")
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    out = ed.evaluate(fd, {"t0": x})
    torch.testing.assert_close(out["t1"], x.prod(2).prod(1))
    torch.testing.assert_close(out["t2"], x.prod(2, keepdim=True).prod(0, keepdim=True))


def test_a_pin_over_a_mesh_axis_of_size_1_is_reported_as_pinned():
    """`pins-reported-differently` (seed 7: 14 of 320 cases of 9375..9694, every one on a mesh with an axis
    of size 1): x pinned [DIDy{1}, 7/1] on a (1, 4) mesh is reported by plan.loop_domain as [7]. The data
    is the same (one device holds all of a split or a partial over one device), but a pin must be
    reported exactly as pinned."""
    mesh = ed.DeviceMesh(torch.arange(4).reshape(1, 4))
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((7,), torch.float32, name="x")
        fd.add_output(fd.ops.relu(x), name="y")
    x.set_device_mesh(mesh).outer_split(0, 1).parallelize(0, ed.ParallelType.DIDy)
    plan = ed.optimize(fd, mesh, extractor="greedy")
    assert plan.loop_domain("x") == x.loop_str() == "[DIDy{1}, 7/1]"


def test_broadcast_in_dim_to_a_0d_shape_evaluates():
    """`evaluate-crash: TypeError in ops.py:<lambda>` (seed 7: cases 5623, 6651, 7952, 8048, 9788):
    broadcast_in_dim(x[], shape=()) passed its shape rule, and its reference called x.expand(*()),
    which torch refuses ("missing size")."""
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 5), torch.float64, name="x")
        m = fd.ops.sum(x=x, dims=(0, 1))
        fd.add_output(fd.ops.broadcast_in_dim(x=m, shape=(), broadcast_dims=()), name="y")
    xs = torch.randn(4, 5, dtype=torch.float64)
    out = ed.evaluate(fd, {"x": xs})
    assert out["y"].shape == () and torch.allclose(out["y"], xs.sum())


def test_a_0d_operand_does_not_promote_the_result_dtype_as_torch():
    """`evaluate-crash: AssertionError in evaluate.py` (seed 7, case 4693): pow(t[3, 7] float32,
    e[] float64) is float32 in torch (a 0-D tensor promotes as a number of its category), but the shape
    rule said float64: its dtype probes were 1-D whatever the operand's rank."""
    with ed.FusionDefinition() as fd:
        a = fd.define_tensor((3, 7), torch.float32, name="a")
        e = fd.define_tensor((), torch.float64, name="e")
        i = fd.define_tensor((), torch.int64, name="i")
        p = fd.ops.pow(a=fd.ops.add(a=fd.ops.abs(x=a), b=0.5), b=e)
        fd.add_output(p, name="p")
        fd.add_output(fd.ops.add(a=e, b=i), name="q")  # two 0-D operands: promote as tensors
        fd.add_output(fd.ops.mul(a=fd.ops.cast(a, "int64"), b=e), name="r")  # another category: float64
    assert (p.dtype, fd.fusion.tensors["q"].dtype, fd.fusion.tensors["r"].dtype) == (
        torch.float32, torch.float64, torch.float64)
    ins = {"a": torch.randn(3, 7), "e": torch.tensor(1.5, dtype=torch.float64), "i": torch.tensor(2)}
    out = ed.evaluate(fd, ins)  # evaluate asserts every shape rule against the reference
    assert out["p"].dtype == torch.float32


def test_a_fused_run_is_classified_on_every_ranks_local_shapes():
    """`simulate-lowered-crash: ShardingError in shards.py:assemble` (seed 7, case 4100): softmax of a
    replicated x0[3] beside maximum of a row-sharded x1[5] (3 | 2 rows on 2 ranks). The segmenter asked
    the scheduler about rank 0's shapes only, where both share one 3-element domain, and fused them; on
    rank 1 the kernel ran the softmax over 2 elements, so the replicated t0 differed between ranks.
    A run is fused only where one scheduler takes it on every rank's shapes."""
    mesh = ed.DeviceMesh.arange(2)
    with ed.FusionDefinition() as fd:
        x0 = fd.define_tensor((3,), torch.float32, name="x0")
        x1 = fd.define_tensor((5,), torch.float32, name="x1")
        x2 = fd.define_tensor((1,), torch.float32, name="x2")
        t0 = fd.ops.softmax(x=x0, dim=0)
        t1 = fd.ops.maximum(a=x2, b=x1)
        fd.add_output(t0, name="t0")
        fd.add_output(fd.ops.maximum(a=t1, b=x1), name="t2")
    x1.set_device_mesh(mesh).outer_split(0, 2).parallelize(0, ed.ParallelType.DIDx)
    t1.set_device_mesh(mesh).outer_split(0, 2).parallelize(0, ed.ParallelType.DIDx)
    g = torch.Generator().manual_seed(0)
    inputs = {k: torch.randn(s, generator=g) for k, s in (("x0", (3,)), ("x1", (5,)), ("x2", (1,)))}
    plan = ed.optimize(fd, mesh, extractor="greedy")
    got = ed.simulate(plan, inputs)  # lowered
    ref = ed.evaluate(fd, inputs)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=2e-4, atol=2e-4, msg=k)


def test_greedy_falls_back_to_the_exact_extractor_where_its_bisection_misses_a_memory_bound():
    """`greedy-refuses-where-exact-plans` (seed 7: 13 of 10,000 cases; this repro is seed 11, case 4): greedy
    under a memory bound prices memory by one Lagrangian multiplier and can miss a plan that fits, raising
    MemoryBoundError where the 0/1 program finds one. optimize now asks the exact extractor there (10 s); since
    i29x greedy's own polished pass at the highest price (the local search under it) fits here, at exact's cost."""
    mesh = ed.DeviceMesh(torch.arange(4).reshape(2, 1, 2))
    with ed.FusionDefinition() as fd:
        x0 = fd.define_tensor((1, 3), torch.float32, name="x0")
        t0 = fd.ops.exp(x=x0)
        t1 = fd.ops.cast(x=t0, dtype=torch.float64)
        t2 = fd.ops.sigmoid(x=t0)
        fd.add_output(t1, name="t1")
        fd.add_output(t2, name="t2")
    t0.set_device_mesh(mesh)
    t1.set_device_mesh(mesh).outer_split(1, 2).parallelize(1, ed.ParallelType.DIDx)
    t2.set_device_mesh(mesh)
    bound = 0.9 * ed.optimize(fd, mesh).memory
    plan = ed.optimize(fd, mesh, ed.CostModel.h200(memory_limit=bound))
    best = ed.optimize(fd, mesh, ed.CostModel.h200(memory_limit=bound), extractor="exact")
    assert plan.memory <= bound and plan.predicted_time <= best.predicted_time * (1 + 1e-9)
    x = {"x0": torch.randn(1, 3)}
    _close(ed.simulate(plan, x), ed.evaluate(fd, x))


def _exp_cast_sigmoid():
    mesh = ed.DeviceMesh(torch.arange(4).reshape(2, 1, 2))
    with ed.FusionDefinition() as fd:
        x0 = fd.define_tensor((1, 3), torch.float32, name="x0")
        t0 = fd.ops.exp(x=x0)
        fd.add_output(fd.ops.cast(x=t0, dtype=torch.float64), name="t1")
        fd.add_output(fd.ops.sigmoid(x=t0), name="t2")
    for t in (t0, fd["t2"]):
        t.set_device_mesh(mesh)
    fd["t1"].set_device_mesh(mesh).outer_split(1, 2).parallelize(1, ed.ParallelType.DIDx)
    return fd, mesh


def test_where_no_greedy_pass_fits_a_bound_the_least_memory_plan_is_polished_within_it():
    """`greedy-refuses-where-exact-plans` (seed 48, case 7127: a 2x2x2 attention backward whose greedy passes'
    smallest plan needed 13,032 B over a bound of 12,912 B, where the least memory is 11,880 B): where no pass fits,
    greedy_dag takes the plan of least memory (extract.smallest, exact on bytes) and polishes it within the bound
    (there 124.0 us, the exact extractor's optimum). Here on a class of three nodes: the passes' smallest 4 KiB, the
    least 1 KiB; within 3,000 B the polish takes the 2 KiB node, faster; under 1 KiB the refusal names it, proven."""
    from egraph_did import extract
    from egraph_did.physgraph import Node, PhysGraph
    g = PhysGraph({"x": [Node("Load", (), "x")],
                   "y": [Node("Apply", ("x",), "y", 0, cost=1e-6, memory=4096.0),
                         Node("Apply", ("x",), "y", 1, cost=5e-6, memory=1024.0),
                         Node("Apply", ("x",), "y", 2, cost=3e-6, memory=2048.0)]})
    roots = extract.with_roots(g, {"y": ["y"]})
    sel = extract._least_fitting(g, roots, 3000.0, found=4096.0)
    assert sel.choice["y"].sid == 2 and sel.memory == 2048.0 and sel.cost == pytest.approx(3e-6)
    with pytest.raises(MemoryBoundError, match=r"the smallest plan needs 1 KiB"):
        extract._least_fitting(g, roots, 1000.0, found=4096.0)
    with pytest.raises(MemoryBoundError, match=r"the smallest found needs 4 KiB"):  # not searched: the passes'
        extract._least_fitting(g, roots, 1000.0, found=4096.0, search=False)


def test_greedy_under_a_bound_below_the_least_memory_says_what_the_least_is(monkeypatch):
    """greedy_dag under a bound no plan fits asks for the plan of least memory (not only its passes' smallest),
    and the refusal names that least memory, proven: a user knows which bound would do."""
    from egraph_did import extract
    fd, mesh = _exp_cast_sigmoid()
    asked = []
    real = extract.smallest
    monkeypatch.setattr(extract, "smallest", lambda *a, **k: asked.append(real(*a, **k)) or asked[-1])
    with pytest.raises(MemoryBoundError, match="the smallest plan needs") as err:
        ed.optimize(fd, mesh, ed.CostModel.h200(memory_limit=1.0))
    assert asked and asked[-1].proven and asked[-1].memory > 1.0 and "found" not in str(err.value)
    plan = ed.optimize(fd, mesh, ed.CostModel.h200(memory_limit=asked[-1].memory))
    assert plan.memory <= asked[-1].memory


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.float64])
def test_a_pending_max_of_bools_or_ints_reassembles_to_the_value(dtype):
    """`simulate-eager-mismatch` (seed 12, case 134): an output pinned as a pending max (now honoured by
    to_partial: every rank keeps the value) reassembled from -inf, which is True as a bool (and no int at
    all): the maximum starts from the dtype's least value."""
    mesh = ed.DeviceMesh.arange(8)
    with ed.FusionDefinition() as fd:
        x0 = fd.define_tensor((11, 5), torch.float64, name="x0")
        t = fd.ops.bitwise_and(a=fd.ops.lt(a=x0, b=0.0), b=fd.ops.ne(a=x0, b=0.0))
        t2 = t if dtype == torch.bool else fd.ops.cast(t, dtype)
        fd.add_output(t2, name="t2")
    x0.set_device_mesh(mesh)
    t2.set_device_mesh(mesh).add_partial(ed.ParallelType.DIDx, "max")
    inputs = {"x0": torch.randn((11, 5), generator=torch.Generator().manual_seed(0), dtype=torch.float64)}
    plan = ed.optimize(fd, mesh)
    assert plan.loop_domain("t2") == "[11, 5, rDIDx{8}(max)]"
    ref = ed.evaluate(fd, inputs)
    assert ref["t2"].any() and not ref["t2"].all()
    for lowered in (True, False):
        assert torch.equal(ed.simulate(plan, inputs, lowered=lowered)["t2"], ref["t2"])


def test_attention_of_rows_with_no_finite_score_is_the_same_whole_and_on_a_slice_of_v():
    """`simulate-eager-mismatch` (seed 13, case 36): queries holding -inf (a causal mask of a 1-row tensor)
    make every score nan. torch's fused CPU attention gives 0 for the whole v, its math path nan for the
    rank's two columns of v (sdpa_value_dim); ops.attention takes the math path on the CPU for both."""
    mesh = ed.DeviceMesh.arange(2)
    with ed.FusionDefinition() as fd:
        x2 = fd.define_tensor((3, 1, 1, 3), torch.float64, name="x2")
        x5 = fd.define_tensor((3, 1, 3, 3), torch.float64, name="x5")
        x6 = fd.define_tensor((3, 1, 3, 3), torch.float64, name="x6")
        t1 = fd.ops.causal_mask(x=x2)
        fd.add_output(fd.ops.sdpa(q=t1, k=x5, v=x6, scale=0.5), name="t5")
    t1.set_device_mesh(mesh)
    g = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(s, generator=g, dtype=torch.float64)
              for n, s in (("x2", (3, 1, 1, 3)), ("x5", (3, 1, 3, 3)), ("x6", (3, 1, 3, 3)))}
    plan = ed.optimize(fd, mesh)
    assert "sdpa_value_dim" in plan.explain()  # v split on its last axis: each rank attends with 2 columns
    ref = ed.evaluate(fd, inputs)["t5"]
    assert ref.isnan().any()  # the case's point: rows with no finite score
    for lowered in (True, False):
        torch.testing.assert_close(ed.simulate(plan, inputs, lowered=lowered)["t5"], ref, equal_nan=True)


def test_a_pin_on_a_saved_marker_that_the_keep_everything_graph_cannot_honour_leaves_the_choice_to_the_whole_graph():
    """`optimize-error-unnamed: PlanError` with `greedy-refuses-where-exact-plans` (seed 30: 14 of 7,450
    device cases, e.g. 1482): a marked step is also extracted keeping every saved value (optimize.keeping_everything),
    where saved(t) can only be t's own layouts; a partial pin on the marker is not one of them, and that
    extraction's PlanError ("a pin cannot be honoured") aborted optimize although the whole graph plans it
    (recomputing t into the pinned layout). The keep-everything candidate now drops out instead."""
    mesh = ed.DeviceMesh.arange(2)
    with ed.FusionDefinition() as fd:
        x0 = fd.define_tensor((6, 1), torch.float64, name="x0")
        t0 = fd.ops.neg(x=x0)
        t1 = fd.ops.saved(x=t0)
        fd.add_output(t1, name="t1")
    t1.set_device_mesh(mesh).add_partial(ed.ParallelType.DIDx)
    PINNED = "[6, 1, rDIDx{2}]"  # partial over DIDx: a reduction loop bound to the mesh axis
    for extractor in ("greedy", "exact"):
        plan = ed.optimize(fd, mesh, extractor=extractor)
        assert plan.loop_domain("t1") == PINNED, (extractor, plan.loop_domain("t1"))
        x = {"x0": torch.randn(6, 1, dtype=torch.float64)}
        _close(ed.simulate(plan, x), ed.evaluate(fd, x))


def test_an_unread_input_pinned_as_a_view_reports_its_pin_as_given():
    """`pins-missing-from-plan` (seed 37, cases 2339, 8911 and 8 more): an input no output reads, pinned so that
    no layout names it (a non-outermost split: held as a reshaped view), had no loop domain: "the plan holds no
    tensor named 'u0'". Like a layout pin's, its loop domain is the pin as given (the plan loads nothing)."""
    mesh = ed.DeviceMesh.arange(4)
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 4), torch.float64, name="x")
        u0 = fd.define_tensor((3, 4), torch.float64, name="u0")
        fd.add_output(fd.ops.relu(x), name="y")
    u0.set_device_mesh(mesh).outer_split(1, 2).outer_split(2, 4).axis(2).parallelize(ed.ParallelType.DIDx)
    plan = ed.optimize(fd, mesh)
    assert plan.unread == ["u0"]
    assert plan.loop_domain("u0") == u0.loop_str()
    assert ed.Plan.from_json(plan.to_json()).loop_domain("u0") == u0.loop_str()


def test_a_fused_run_beside_a_rank_holding_nothing_runs_each_step_through_torch():
    """`simulate-lowered-crash: ShardingError in shards.py:assemble` (seed 38, case 3267): tanh of x2 [3, 1] split
    over tp beside abs/add/sqrt of x0 split over pp then tp, where rank (pp 1, tp 1) holds no row of x0: the one
    fused kernel of the four left that rank's tanh different from rank (pp 0, tp 1)'s. A run where some rank holds
    nothing of a tensor is not fused."""
    mesh = ed.DeviceMesh(torch.arange(4).reshape(2, 1, 2), axis_names=("pp", "dp", "tp"))
    with ed.FusionDefinition() as fd:
        x0, x1, x2 = (fd.define_tensor((3, 1), torch.float32, name=n) for n in ("x0", "x1", "x2"))
        t0 = fd.ops.layer_norm(x=x0, normalized_shape=(3, 1), weight=x1, bias=x2)
        t1 = fd.ops.tanh(x=x2)
        fd.add_output(t0, name="t0")
        fd.add_output(t1, name="t1")
        fd.add_output(fd.ops.sqrt(x=fd.ops.add(a=fd.ops.abs(x=x0), b=0.5)), name="t4")
    t0.set_device_mesh(mesh)
    t1.set_device_mesh(mesh).outer_split(0, 2).parallelize(0, ed.ParallelType.DIDx)
    g = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn((3, 1), generator=g) for n in ("x0", "x1", "x2")}
    plan = ed.optimize(fd, mesh)
    _close(ed.simulate(plan, inputs), ed.evaluate(fd, inputs))  # lowered: kernels where every rank holds data


def _attention_backward_on_a_2x2x2_mesh():
    """The attention part of fuzz seed 38 case 7070: sdpa_lse and its backward on a 2x2x2 mesh, k pinned split
    over all three mesh axes and three of the outputs pinned in other layouts (10,812 classes of 22 tensors)."""
    mesh = ed.DeviceMesh(torch.arange(8).reshape(2, 2, 2))
    DIDx, DIDy, DIDz = ed.ParallelType.DIDx, ed.ParallelType.DIDy, ed.ParallelType.DIDz
    with ed.FusionDefinition() as fd:
        x2 = fd.define_tensor((2, 4, 6, 5), torch.float64, name="x2")
        x3 = fd.define_tensor((2, 4, 3, 5), torch.float64, name="x3")
        x4 = fd.define_tensor((2, 4, 3, 2), torch.float64, name="x4")
        x5 = fd.define_tensor((2, 4, 6, 2), torch.float64, name="x5")
        t4, t5 = fd.ops.sdpa_lse(q=x2, k=x3, v=x4, scale=0.5)
        t6, t7, t8 = fd.ops.sdpa_backward(g=x5, q=x2, k=x3, v=x4, output=t4, lse=t5, scale=0.5)
        for name, t in (("t6", t6), ("t7", t7), ("t8", t8)):
            fd.add_output(t, name=name)
    x3.set_device_mesh(mesh).outer_split(3, 2).parallelize(3, DIDy).outer_split(1, 2).parallelize(1, DIDx) \
        .outer_split(0, 2).parallelize(0, DIDz)
    t5.set_device_mesh(mesh).outer_split(0, 2).parallelize(0, DIDx)
    t6.set_device_mesh(mesh).outer_split(2, 2).parallelize(2, DIDx)
    t7.set_device_mesh(mesh).outer_split(2, 2).parallelize(2, DIDz).outer_split(0, 2).parallelize(0, DIDy)
    return fd, mesh


def test_greedy_relinks_layout_plans_on_a_large_graph_of_few_tensors():
    """`exact-hit-time-limit` (seed 38, case 7070; greedy 36.84% over exact): on a graph over RELINK_MAX_CLASSES
    greedy skipped the layout plans' regions, so it gathered k once, computed the attention split and resharded
    each output (alltoalls and allgathers, 82 us) where gathering k fully, computing replicated and slicing each
    output costs 54 us. A graph of few tensors is relinked whatever its classes; greedy's optimum lets the exact
    DP prove it (it gave up, and the 0/1 program ran out its 60 s)."""
    fd, mesh = _attention_backward_on_a_2x2x2_mesh()
    plan = ed.optimize(fd, mesh)
    assert plan.predicted_time == pytest.approx(54.00628e-6, rel=1e-6)
    assert [c.kind for c in plan.collectives] == ["allgather"] * 3  # k gathered; each output a local slice


def test_greedy_moves_a_free_output_to_a_layout_it_holds_at_no_cost_where_that_frees_a_computation():
    """`greedy 7.14% worse than exact` (seed 38, case 7056): the free output t5 read the second attention
    backward (computed for t4, which a slice then took to its pinned layout), so that backward could not be
    computed in t4's layout directly: t5 held it. Moving t5 to the replicated backward the plan holds costs
    nothing, so the local search never took it; only after it does computing t4 in its pinned layout drop the
    slice (60 -> 56 us, the exact extractor's optimum)."""
    mesh = ed.DeviceMesh(torch.arange(4).reshape(1, 2, 2))
    DIDx, DIDy = ed.ParallelType.DIDx, ed.ParallelType.DIDy
    with ed.FusionDefinition() as fd:
        x1 = fd.define_tensor((2, 4, 2, 4), torch.float64, name="x1")
        x2 = fd.define_tensor((2, 4, 2, 4), torch.float64, name="x2")
        x3 = fd.define_tensor((2, 4, 2, 6), torch.float64, name="x3")
        x4 = fd.define_tensor((2, 4, 2, 6), torch.float64, name="x4")
        t1, t2 = fd.ops.sdpa_lse(q=x1, k=x2, v=x3, is_causal=True)
        t3, t4, t5 = fd.ops.sdpa_backward(g=x4, q=x1, k=x2, v=x3, output=t1, lse=t2, is_causal=True)
        for name, t in (("t3", t3), ("t4", t4), ("t5", t5), ("t2", t2)):
            fd.add_output(t, name=name)
    x1.set_device_mesh(mesh).outer_split(2, 2).parallelize(2, DIDx).outer_split(0, 2).parallelize(0, DIDy)
    x2.set_device_mesh(mesh).outer_split(2, 2).parallelize(2, DIDy).outer_split(1, 2).parallelize(1, DIDx)
    t2.set_device_mesh(mesh)
    t3.set_device_mesh(mesh)
    t4.set_device_mesh(mesh).outer_split(2, 2).parallelize(2, DIDy).add_partial(DIDx)
    plan = ed.optimize(fd, mesh)
    assert plan.predicted_time == pytest.approx(56.00483e-6, rel=1e-6)  # the exact extractor's optimum


def test_greedy_polishes_each_layout_plan_before_relinking_its_regions():
    """`greedy 18.6% worse than exact` (seed 38, case 711): the attention backward computed with q split by rows
    leaves dk and dv (free outputs) partial, each reduce-scattered (20 us apiece on the multinode model). The
    layout plan of the head-split layout computed the backward there for dk and dv and once more split for the
    pinned dq: its region cost more than the plan's, so relinking refused it. Polished by the local search first
    (dq sliced from the head-split backward), the region pays: 102.02 -> 86.02 us (the exact optimum 86.020)."""
    mesh = ed.DeviceMesh(torch.arange(4).reshape(2, 2), axis_names=("dp", "tp"))
    DIDx, DIDy = ed.ParallelType.DIDx, ed.ParallelType.DIDy
    with ed.FusionDefinition() as fd:
        x1 = fd.define_tensor((3, 3, 3, 6), torch.float64, name="x1")
        x2 = fd.define_tensor((3, 3, 3, 6), torch.float64, name="x2")
        x3 = fd.define_tensor((3, 3, 3, 4), torch.float64, name="x3")
        x4 = fd.define_tensor((3, 3, 3, 4), torch.float64, name="x4")
        t1, t2 = fd.ops.sdpa_lse(q=x1, k=x2, v=x3, is_causal=True)
        t3, t4, t5 = fd.ops.sdpa_backward(g=x4, q=x1, k=x2, v=x3, output=t1, lse=t2, is_causal=True)
        for name, t in (("t3", t3), ("t4", t4), ("t5", t5)):
            fd.add_output(t, name=name)
    x1.set_device_mesh(mesh).outer_split(2, 2).parallelize(2, DIDy).outer_split(0, 2).parallelize(0, DIDx)
    x2.set_device_mesh(mesh).outer_split(3, 2).parallelize(3, DIDx)
    x4.set_device_mesh(mesh).outer_split(3, 2).parallelize(3, DIDx).outer_split(0, 2).parallelize(0, DIDy)
    t3.set_device_mesh(mesh).outer_split(2, 2).parallelize(2, DIDy)
    plan = ed.optimize(fd, mesh, cost_model=ed.CostModel.h200_multinode())
    assert plan.predicted_time <= 86.0197e-6 * 1.001
    assert "reduce_scatter" not in [c.kind for c in plan.collectives]


def test_greedy_polishes_the_layout_plans_with_the_routes_they_already_hold():
    """`greedy 11.6% worse than exact` (seed 39, case 1395): the attention backward and an elementwise chain on
    its dv, on a 2x2x2 mesh. A layout plan computed the backward where the pins favour it and once more for an
    output no plan of the fallback holds in that layout, so its local search (completing only from the fallback)
    could not drop the second computation, and no region of it paid. Polished also from the cheapest routes
    given each layout plan (_completions, as the final plan is), the region pays: greedy equals exact."""
    mesh = ed.DeviceMesh(torch.arange(8).reshape(2, 2, 2), axis_names=("pp", "dp", "tp"))
    DIDx, DIDy, DIDz = ed.ParallelType.DIDx, ed.ParallelType.DIDy, ed.ParallelType.DIDz
    with ed.FusionDefinition() as fd:
        x2, x3 = (fd.define_tensor((5, 4, 5, 5), torch.float32, name=n) for n in ("x2", "x3"))
        x4, x5 = (fd.define_tensor((5, 4, 5, 2), torch.float32, name=n) for n in ("x4", "x5"))
        t1, t2 = fd.ops.sdpa_lse(q=x2, k=x3, v=x4)
        t3, t4, t5 = fd.ops.sdpa_backward(g=x5, q=x2, k=x3, v=x4, output=t1, lse=t2)
        fd.add_output(t4, name="t4")
        fd.add_output(fd.ops.lt(a=2.0, b=t5), name="t6")
        fd.add_output(fd.ops.rsqrt(x=fd.ops.add(a=fd.ops.abs(x=t5), b=0.5)), name="t10")
    x2.set_device_mesh(mesh).outer_split(1, 2).parallelize(1, DIDx)
    x4.set_device_mesh(mesh).outer_split(3, 2).parallelize(3, DIDy).outer_split(0, 2).parallelize(0, DIDz)
    t1.set_device_mesh(mesh).outer_split(0, 2).parallelize(0, DIDx)
    fd["t4"].set_device_mesh(mesh).outer_split(0, 2).parallelize(0, DIDy).add_partial(DIDx)
    fd["t6"].set_device_mesh(mesh).outer_split(3, 2).parallelize(3, DIDy).outer_split(1, 2).parallelize(1, DIDz)
    fd["t10"].set_device_mesh(mesh).outer_split(0, 2).parallelize(0, DIDx)
    greedy = ed.optimize(fd, mesh)
    exact = ed.optimize(fd, mesh, extractor="exact")
    assert greedy.predicted_time <= exact.predicted_time * 1.001, (greedy.predicted_time, exact.predicted_time)


def test_greedy_tries_its_most_promising_shared_value_on_a_graph_over_its_seed_budget():
    """`greedy 30.4% worse than exact` (seed 38, case 164): the attention backward on a 2x2x2 mesh (10,643
    classes) computed in k's pinned layout, every output gathered or resharded from there. Buying k gathered
    whole up front (greedy's most promising shared value) finds the plan that computes where the pinned dq is
    held, but that try recomputes 9,682 classes, more than the seed budget of 5,637: no value was tried.
    Each search now tries its first value whatever the budget: 60.00 -> 46.01 us (the exact optimum 46.003)."""
    mesh = ed.DeviceMesh(torch.arange(8).reshape(2, 2, 2))
    DIDx, DIDy, DIDz = ed.ParallelType.DIDx, ed.ParallelType.DIDy, ed.ParallelType.DIDz
    with ed.FusionDefinition() as fd:
        x0 = fd.define_tensor((6, 4, 3, 4), torch.float64, name="x0")
        x1 = fd.define_tensor((6, 4, 3, 4), torch.float64, name="x1")
        x2 = fd.define_tensor((6, 4, 3, 1), torch.float64, name="x2")
        x3 = fd.define_tensor((6, 4, 3, 1), torch.float64, name="x3")
        t0, t1 = fd.ops.sdpa_lse(q=x0, k=x1, v=x2)
        t2, t3, t4 = fd.ops.sdpa_backward(g=x3, q=x0, k=x1, v=x2, output=t0, lse=t1)
        c0 = fd.ops.reshape(x=t4, shape=(72,))
        c3 = fd.ops.reshape(x=fd.ops.reshape(x=fd.ops.reshape(x=c0, shape=(9, 8)), shape=(72,)), shape=(8, 1, 9))
        for name, t in (("t2", t2), ("t3", t3), ("t4", t4), ("c0", c0), ("c3", c3)):
            fd.add_output(t, name=name)
    x1.set_device_mesh(mesh).outer_split(1, 2).parallelize(1, DIDz).outer_split(2, 2).parallelize(2, DIDy) \
        .outer_split(0, 2).parallelize(0, DIDx)
    x3.set_device_mesh(mesh)
    t3.set_device_mesh(mesh).outer_split(1, 2).parallelize(1, DIDz).outer_split(2, 2).parallelize(2, DIDy)
    plan = ed.optimize(fd, mesh)
    assert plan.predicted_time <= 46.0033e-6 * 1.001


def test_greedy_under_a_bound_ends_where_the_unbounded_plan_costs_nothing():
    """`timeout in optimize` (seed 39, case 8714): two broadcasts of inputs (views: the unbounded plan costs no
    time) under 0.9 x its memory on 6 ranks. The ladder of polished prices started at LADDER_START x cost / memory
    = 0 and multiplying 0 never reached the bisection's price: greedy ran until the fuzzer's 150 s. It starts at
    LADDER_START of the bisection's price at least; an alarm fails the test instead of hanging it."""
    import signal

    def hung(*_):
        raise TimeoutError
    mesh = ed.DeviceMesh.arange(6)
    with ed.FusionDefinition() as fd:
        x0 = fd.define_tensor((2, 3), torch.float64, name="x0")
        x1 = fd.define_tensor((1, 3), torch.float64, name="x1")
        fd.add_output(fd.ops.broadcast_in_dim(x=x0, shape=(5, 5, 2, 3), broadcast_dims=(2, 3)), name="t0")
        fd.add_output(fd.ops.broadcast_in_dim(x=x1, shape=(1, 5, 3), broadcast_dims=(0, 2)), name="t1")
    x1.set_device_mesh(mesh)
    free = ed.optimize(fd, mesh)
    assert free.predicted_time == 0.0
    bound = ed.CostModel.h200(memory_limit=int(free.memory * 0.9))
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    plan = None
    try:
        plan = ed.optimize(fd, mesh, cost_model=bound)
    except TimeoutError:
        pass  # asserted below, outside the interrupted frames (pytest cannot render their traceback)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert plan is not None, "greedy under the bound did not end within 60 s"
    assert plan.memory <= bound.memory_limit


def test_greedy_under_a_bound_tries_the_layout_plans_before_refusing(monkeypatch):
    """`greedy-refuses-where-exact-plans` (seed 39, case 481): attention and an rms_norm branch on a 2x2x2 mesh
    under 0.9 x the unbounded plan's memory. Every greedy pass at every price computed the attention twice, in
    two layouts (one for the pinned output, one for the lse), the smallest plan 5796 B over a bound of 4871 B;
    the replicated layout's plan, polished, computes it once and fits. Greedy now tries the layout plans (and
    their regions) before refusing, and reaches the exact extractor's optimum (42.002 us, 4836 B). greedy_dag's
    last resort, the plan of least memory (extract.smallest), is turned off here: the claim is of its passes."""
    from egraph_did import extract

    def no_fallback(*_, **__):
        raise ed.PlanError("the least-memory fallback is off in this test")
    monkeypatch.setattr(extract, "smallest", no_fallback)
    mesh = ed.DeviceMesh(torch.arange(8).reshape(2, 2, 2), axis_names=("pp", "dp", "tp"))
    DIDx, DIDy, DIDz = ed.ParallelType.DIDx, ed.ParallelType.DIDy, ed.ParallelType.DIDz
    with ed.FusionDefinition() as fd:
        x0 = fd.define_tensor((5, 3), torch.float32, name="x0")
        x2 = fd.define_tensor((3,), torch.float32, name="x2")
        x3 = fd.define_tensor((6, 4, 6, 1), torch.float32, name="x3")
        x4 = fd.define_tensor((6, 4, 3, 1), torch.float32, name="x4")
        x5 = fd.define_tensor((6, 4, 3, 3), torch.float32, name="x5")
        t0 = fd.ops.rms_norm(x=x0, eps=0.001)
        t3, t4 = fd.ops.sdpa_lse(q=x3, k=x4, v=x5)
        t5 = fd.ops.le(a=t0, b=0.0)
        t6 = fd.ops.where(cond=t5, a=x2, b=-1.5)
        for name, t in (("t3", t3), ("t4", t4), ("t6", t6), ("t5", t5)):
            fd.add_output(t, name=name)
    for t in (x2, x3, x5, t5):
        t.set_device_mesh(mesh)
    t3.set_device_mesh(mesh).outer_split(3, 2).parallelize(3, DIDz).outer_split(2, 2).parallelize(2, DIDx)
    t4.set_device_mesh(mesh).add_partial(DIDx)
    t6.set_device_mesh(mesh).outer_split(0, 2).parallelize(0, DIDy).add_partial(DIDx, "max")
    bound = 0.9 * ed.optimize(fd, mesh).memory
    plan = ed.optimize(fd, mesh, ed.CostModel.h200(memory_limit=bound))
    assert plan.memory <= bound
    assert plan.predicted_time == pytest.approx(42.002e-6, rel=1e-4)


def test_greedy_buys_the_attention_backward_in_the_layout_its_gradients_are_pinned_in():
    """`greedy 8% worse than exact` (seed 39, case 590, and the recurring sdpa_lse/sdpa_backward gaps of that
    campaign): two of the backward's gradients pinned head-split on a 2x2 mesh. Each gradient alone prefers to
    slice its layout from the backward computed replicated (x5 and x6 gathered whole), so greedy computed it
    there and sliced twice; only together do they drop the replicated backward. Greedy now also buys each
    multi-output computation the plan does not hold at its cheapest route given the plan, then polishes: the
    backward head-split (x6 by one alltoall), 50.001 -> 46.001 us, the exact extractor's optimum."""
    mesh = ed.DeviceMesh(torch.arange(4).reshape(2, 2))
    DIDx, DIDy = ed.ParallelType.DIDx, ed.ParallelType.DIDy
    with ed.FusionDefinition() as fd:
        x3, x4, x5, x6 = (fd.define_tensor((5, 2, 1, 2), torch.float64, name=f"x{i}") for i in (3, 4, 5, 6))
        t3, t4 = fd.ops.sdpa_lse(q=x3, k=x4, v=x5, is_causal=True, scale=0.5)
        t5, t6, t7 = fd.ops.sdpa_backward(g=x6, q=x3, k=x4, v=x5, output=t3, lse=t4, is_causal=True, scale=0.5)
        for name, t in (("t5", t5), ("t6", t6), ("t7", t7)):
            fd.add_output(t, name=name)
    x5.set_device_mesh(mesh).outer_split(0, 2).parallelize(0, DIDy)
    x6.set_device_mesh(mesh).outer_split(3, 2).parallelize(3, DIDx).outer_split(1, 2).parallelize(1, DIDy)
    t6.set_device_mesh(mesh).outer_split(1, 2).parallelize(1, DIDx)
    t7.set_device_mesh(mesh).outer_split(1, 2).parallelize(1, DIDx).add_partial(DIDy)
    plan = ed.optimize(fd, mesh)
    assert plan.predicted_time == pytest.approx(46.00063e-6, rel=1e-6)  # the exact extractor's optimum
    assert sorted(c.kind for c in plan.collectives) == ["allgather", "allgather", "alltoall"]
    g = torch.Generator().manual_seed(0)
    x = {f"x{i}": torch.randn((5, 2, 1, 2), generator=g, dtype=torch.float64) for i in (3, 4, 5, 6)}
    _close(ed.simulate(plan, x), ed.evaluate(fd, x))


def test_exact_refuses_a_bound_no_plan_fits_without_the_0_1_program():
    """`timeout in optimize` at stage optimize-exact (seed 44, case 8976, on the device; `worker-died` here): an
    sdpa_lse on a 2x2x2 mesh with lse pinned [R, S(0), S(1)] under a bound of half the unbounded plan's
    324 B. Greedy refuses (its smallest plan needs 252 B); the exact program's relaxation is infeasible, but
    the MIP ran anyway and HiGHS's presolve went past its time limit, growing to 18 GB. The exact DP's memory floor
    (extract_dp.memory_floor: 252 B) is the proof now, before its Lagrangian dual or any 0/1 program runs."""
    mesh = ed.DeviceMesh(torch.arange(8).reshape(2, 2, 2))
    DIDx, DIDy = ed.ParallelType.DIDx, ed.ParallelType.DIDy
    with ed.FusionDefinition() as fd:
        x0 = fd.define_tensor((6, 2, 6, 2), torch.float32, name="x0")
        x1 = fd.define_tensor((6, 2, 1, 2), torch.float32, name="x1")
        x2 = fd.define_tensor((6, 2, 1, 1), torch.float32, name="x2")
        t0, t1 = fd.ops.sdpa_lse(q=x0, k=x1, v=x2)
        fd.add_output(t0, name="t0")
        fd.add_output(t1, name="t1")
    t1.set_device_mesh(mesh).outer_split(1, 2).parallelize(1, DIDx).outer_split(0, 2).parallelize(0, DIDy)
    with pytest.raises(MemoryBoundError, match=r"every plan needs at least 252 B"):  # the DP's memory floor
        ed.optimize(fd, mesh, cost_model=ed.CostModel.h200(memory_limit=162.0), extractor="exact", time_limit=60)
