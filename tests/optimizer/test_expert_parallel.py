"""Expert parallelism (issue 28 item 4): a mixture-of-experts MLP over tokens sorted by expert,
y = grouped_mm(silu(grouped_mm(x, w1, offsets)), w2, offsets), offsets the cumsum of histc of the expert
ids, with the experts' weights held split on the expert axis (as expert-parallel training stores them).

No pass of its own: grouped_mm's rules (rewrites/experts.py) offer, beside sharding the weights on f or d
as a matmul, grouped_mm_experts: each rank computes the rows of its own experts, the others zero, as expert
rows (Pe: a pending sum of disjoint rows), which silu keeps on their ranks (expert_rows_unary) and the second
grouped matmul reads, running its experts' rows and sending each row to the rank whose block of y holds it
(expert_combine: an all-to-all of counts read from the offsets, inside the step): the hidden rows never
move, y's rows are combined then all-gathered (before the combine y was all-reduced: a reduce-scatter of the
whole zero-padded buffer, where the combine sends a rank's share of the rows). The cost model weighs it
against moving the weights (an all-to-all of each to split them on f) or gathering them. With 256 tokens
expert parallelism moves y alone (0.5 MiB gathered, 70.5 us predicted; 71.4 us with the all-reduce) and
needs 35.1 MiB per device, where sharding on f moves both weights (8 MiB each, 124.5 us) and needs 51 MiB,
and replicating them 99 MiB (217.4 us): under a 38 MiB bound it is the only plan, and unbounded the
cheapest. With 4096 tokens it still wins (107.9 us; 122.1 us with the all-reduce; 161.9 us for the weights
moved to f); before the expert rows, the hidden rows were reduce-scattered and all-gathered between the
grouped matmuls (95.3 us at 256 tokens) and at 4096 tokens the weights moved instead. Replayed at small shapes, the expert-parallel
plan simulates to the reference (float64; uneven counts, an empty expert, rows past offsets[-1]).

With the weights free (the last test: Mixtral 8x7B's experts on two nodes of four GPUs) the cost model
splits the experts over the nodes itself.
"""
import dataclasses

import torch

import egraph_did as ed
from egraph_did.cost import Link
from egraph_did.layout import Layout
from egraph_did.pins import apply_layout

BF16, F64 = torch.bfloat16, torch.float64
MESH = ed.DeviceMesh.arange(4)
D, F, E = 1024, 2048, 8
EXPERT_SHARDED = {"x": "R", "y": "R", "w1": "[S(0)]", "w2": "[S(0)]"}


def moe(s, d, f, e, dtype, pins, weights_used=None, mesh=MESH):
    """y = grouped_mm(silu(grouped_mm(x, w1c)), w2c) at offsets from histc of ids; w1c, w2c: copies of w1 and w2
    (cast to their own dtype), the weights as the matmuls read them, pinned `weights_used` (layout texts) to
    force a way of running them."""
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((s, d), dtype, name="x")
        ids = fd.define_tensor((s,), torch.int64, name="ids")
        w1 = fd.define_tensor((e, d, f), dtype, name="w1")
        w2 = fd.define_tensor((e, f, d), dtype, name="w2")
        used = fd.ops.cast(w1, dtype), fd.ops.cast(w2, dtype)
        counts = fd.ops.histc(fd.ops.cast(ids, torch.float32), e, 0, e - 1)
        offsets = fd.ops.cast(fd.ops.cumsum(counts, 0), torch.int64)
        y = fd.ops.grouped_mm(fd.ops.silu(fd.ops.grouped_mm(x, used[0], offsets)), used[1], offsets)
        fd.add_output(y, name="y")
    for name, text in pins.items():
        apply_layout(fd[name], Layout.parse("[R]" if text == "R" else text), mesh)
    for tv, text in zip(used, weights_used or ()):
        apply_layout(tv, Layout.parse("[R]" if text == "R" else text), mesh)
    return fd


def plan_of(s, bound=None, weights_used=None):
    return ed.optimize(moe(s, D, F, E, BF16, EXPERT_SHARDED, weights_used), MESH,
                       cost_model=ed.CostModel.h200(memory_limit=bound))


def rules_of(plan) -> set[str]:
    return {r for s in plan.compute_steps for r in s.rules}


def collectives(plan) -> list:
    return [(c.kind, c.tensor, c.bytes) for c in plan.collectives]


MIB = 2 ** 20
BOUND = 38 * MIB


def expert_inputs(g, rows, d, f1, f2):
    """Float64 inputs of an experts fusion drawn from g: x [rows, d], ids in 0..E (id E routes a row past
    offsets[-1]), w1 [E, d, f1], w2 [E, f2, d].

    >>> sorted((k, tuple(v.shape)) for k, v in expert_inputs(torch.Generator(), 3, 4, 6, 5).items())
    [('ids', (3,)), ('w1', (8, 4, 6)), ('w2', (8, 5, 4)), ('x', (3, 4))]
    """
    return {"x": torch.randn(rows, d, generator=g, dtype=F64), "ids": torch.randint(0, E + 1, (rows,), generator=g),
            "w1": torch.randn(E, d, f1, generator=g, dtype=F64), "w2": torch.randn(E, f2, d, generator=g, dtype=F64)}


def test_few_tokens_run_expert_parallel_under_a_memory_bound_moving_y_only():
    plan = plan_of(256, BOUND)
    assert {"grouped_mm_experts", "expert_rows_unary", "expert_combine"} <= rules_of(plan), plan.explain()
    assert "grouped_mm_features" not in rules_of(plan), plan.explain()
    assert plan.loop_domain("cast_0") == "[DIDx{4}, 8/4, 1024, 2048]", plan.explain()  # the weights stay put
    assert str(plan.layout_of("silu_7")) == "[Pe]", plan.explain()  # the hidden rows stay on their ranks
    assert collectives(plan) == [("allgather", "y", 256 * D * 2)], plan.explain()
    assert plan.memory <= BOUND


def test_expert_parallelism_beats_sharding_the_weights_on_f_and_replicating_them_on_cost():
    """The same program with the weights as the matmuls read them pinned split on f (w1 on f, w2 on its
    contracted f: Megatron's pair, one all-reduce of y) or replicated: each moves the weights, costs more
    and needs more memory than the 38 MiB bound."""
    ep = plan_of(256)
    f_split = plan_of(256, weights_used=("[S(2)]", "[S(1)]"))
    replicated = plan_of(256, weights_used=("R", "R"))
    weights = E * D * F * 2
    assert collectives(ep) == [("allgather", "y", 256 * D * 2)], ep.explain()
    assert sorted(collectives(f_split)) == [("allgather", "y", 256 * D * 2), ("alltoall", "cast_0", weights // 4),
                                            ("alltoall", "cast_1", weights // 4)]
    assert collectives(replicated) == [("allgather", "cast_0", weights), ("allgather", "cast_1", weights)]
    assert ep.predicted_time < f_split.predicted_time < replicated.predicted_time
    assert ep.memory <= BOUND < f_split.memory < replicated.memory
    assert round(ep.predicted_time * 1e6, 1) == 70.5 and round(f_split.predicted_time * 1e6, 1) == 124.5


def test_many_tokens_keep_the_weights_on_their_experts_as_the_hidden_rows_stay():
    """4096 tokens: the hidden rows (16 MiB) outweigh a rank's weights (8 MiB each), but expert rows never
    move them: y is combined (expert_combine) and gathered once (107.9 us), where moving the weights to split
    them on f costs 161.9 us."""
    plan = plan_of(4096)
    assert collectives(plan) == [("allgather", "y", 4096 * D * 2)], plan.explain()
    assert "expert_combine" in rules_of(plan) and "grouped_mm_features" not in rules_of(plan)
    f_split = plan_of(4096, weights_used=("[S(2)]", "[S(1)]"))
    assert round(plan.predicted_time * 1e6, 1) == 107.9 and round(f_split.predicted_time * 1e6, 1) == 161.9


def test_the_expert_parallel_plan_simulates_to_the_reference_at_small_shapes():
    """10 tokens, d 4, f 6, 8 experts (2 per rank), ids up to 8: uneven counts, likely empty experts, and
    the rows of id 8 past offsets[-1]; the plan replayed (like=) at float64."""
    plan = plan_of(256, BOUND)
    small = moe(10, 4, 6, E, F64, EXPERT_SHARDED)
    small_plan = ed.optimize(small, MESH, like=plan)
    assert collectives(small_plan) == [("allgather", "y", 10 * 4 * 8)] and str(small_plan.layout_of("silu_7")) == "[Pe]"
    g = torch.Generator().manual_seed(28)
    for trial in range(3):
        inputs = expert_inputs(g, 10, 4, 6, 6)
        want = ed.evaluate(small, inputs)["y"]
        got = ed.simulate(small_plan, inputs)["y"]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        past = int((inputs["ids"] == 8).sum())
        assert past == 0 or not want[-past:].any()  # rows from offsets[-1] = 10 - past on: zero


MESH2 = ed.DeviceMesh([[0, 1], [2, 3]], axis_names=("dp", "ep"))
DP_EP = {"x": "[S(0), R]", "y": "[S(0), R]", "w1": "[R, S(0)]", "w2": "[R, S(0)]"}


def test_data_and_expert_parallel_on_a_2x2_mesh_computes_each_ranks_rows_of_its_experts():
    """Tokens split over dp, the experts' weights over ep (mesh 2 x 2): one 'ranged' kernel per grouped_mm
    on both mesh axes (grouped_mm_rows on dp: the rank's rows, offsets being global rows; grouped_mm_experts
    and grouped_mm_of_expert_rows on ep: of its experts), the hidden rows expert rows on ep, one collective:
    y all-reduced on ep over each dp shard's 256 rows (0.5 MiB); at 8192 tokens too (8 MiB; before the
    expert rows, the weights moved over ep there). Replayed at 12 tokens, float64, it simulates to the
    reference."""
    plan = ed.optimize(moe(512, D, F, E, BF16, DP_EP, mesh=MESH2), MESH2)
    steps = [st for st in plan.compute_steps if st.op == "grouped_mm"]
    assert len(steps) == 2 and all(st.flags == (("ranged", (0, 1)),) for st in steps), plan.explain()
    assert {"grouped_mm_rows", "grouped_mm_experts", "grouped_mm_of_expert_rows"} <= rules_of(plan)
    assert str(plan.layout_of("silu_7")) == "[S(0), Pe]", plan.explain()
    assert [(c.kind, c.tensor, c.mesh_axis_name, c.bytes) for c in plan.collectives] == [
        ("allreduce", "y", "ep", 256 * D * 2)], plan.explain()
    big = ed.optimize(moe(8192, D, F, E, BF16, DP_EP, mesh=MESH2), MESH2)
    assert [(c.kind, c.tensor, c.mesh_axis_name) for c in big.collectives] == [("allreduce", "y", "ep")], big.explain()

    small = moe(12, 8, 8, E, F64, DP_EP, mesh=MESH2)
    small_plan = ed.optimize(small, MESH2, like=plan)
    g = torch.Generator().manual_seed(7)
    inputs = expert_inputs(g, 12, 8, 8, 8)
    torch.testing.assert_close(ed.simulate(small_plan, inputs)["y"], ed.evaluate(small, inputs)["y"],
                               rtol=1e-10, atol=1e-12)


NODES = ed.DeviceMesh([[0, 1, 2, 3], [4, 5, 6, 7]], axis_names=("node", "gpu"))
WHOLE = {"x": "[R, R]", "y": "[R, R]"}


def mixtral_experts(rows, d, f, e, dtype, pins, mesh=NODES, x_used=None):
    """Mixtral's experts: gate and up in one weight, y = grouped_mm(silu(gate) * up, w2) over rows sorted by
    expert (transformers' grouped_mm experts), on `mesh`; x_used: a layout text pinning a copy of x that the
    first grouped matmul reads (to force a way of dispatching)."""
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((rows, d), dtype, name="x")
        if x_used is not None:
            x = fd.ops.cast(x, dtype)
            apply_layout(x, Layout.parse(x_used), mesh)
        ids = fd.define_tensor((rows,), torch.int64, name="ids")
        w1 = fd.define_tensor((e, d, 2 * f), dtype, name="w1")
        w2 = fd.define_tensor((e, f, d), dtype, name="w2")
        counts = fd.ops.histc(fd.ops.cast(ids, torch.float32), e, 0, e - 1)
        offsets = fd.ops.cast(fd.ops.cumsum(counts, 0), torch.int64)
        h = fd.ops.grouped_mm(x, w1, offsets)
        hidden = fd.ops.mul(fd.ops.silu(fd.ops.slice(h, 1, 0, f)), fd.ops.slice(h, 1, f, 2 * f))
        fd.add_output(fd.ops.grouped_mm(hidden, w2, offsets), name="y")
    for name, text in pins.items():
        apply_layout(fd[name], Layout.parse(text), mesh)
    return fd


def test_across_two_nodes_the_cost_model_splits_mixtrals_experts_over_the_nodes_itself():
    """Mixtral 8x7B's experts (8, hidden 4096, width 14336, gate and up in one weight), 4096 tokens of top-2
    routing (8192 rows), bf16, on 2 nodes of 4 GPUs (CostModel.h200_multinode: 45 GB/s InfiniBand between
    the nodes, NVLink inside), x and y whole, the weights free: the plan splits the experts over the nodes
    (w1 and w2 [S(0), R]: grouped_mm_experts, the hidden rows expert rows on the node axis, read by
    grouped_mm_of_expert_rows) and the rows over each node's GPUs (grouped_mm_rows); y is all-reduced over
    the nodes (16 MiB) and gathered in the node (64 MiB): 1264.7 us predicted. Megatron's pair in each node
    (w1 split on f, w2 on its contracted f, pinned) moves the gate/up and hidden rows in the node and costs
    1770.9 us; the same with the experts split over the nodes, 2234.9 us. Before the expert rows (main at
    e9e278f) the free plan kept w1 whole and split w2 on f in the node, 1370.5 us. Replayed on 12 rows
    (float64, d 8, f 6) it simulates to the reference."""
    plan = ed.optimize(mixtral_experts(8192, 4096, 14336, E, BF16, WHOLE), NODES, ed.CostModel.h200_multinode())
    assert str(plan.layout_of("w1")) == str(plan.layout_of("w2")) == "[S(0), R]", plan.explain()
    assert {"grouped_mm_experts", "grouped_mm_of_expert_rows", "expert_rows_product"} <= rules_of(plan)
    assert "grouped_mm_features" not in rules_of(plan)
    assert [(c.kind, c.tensor, c.mesh_axis_name, c.bytes) for c in plan.collectives] == [
        ("allreduce", "y", "node", 2048 * 4096 * 2), ("allgather", "y", "gpu", 8192 * 4096 * 2)], plan.explain()
    tp = ed.optimize(mixtral_experts(8192, 4096, 14336, E, BF16, dict(WHOLE, w1="[R, S(2)]", w2="[R, S(1)]")), NODES,
                     ed.CostModel.h200_multinode())
    assert [round(p.predicted_time * 1e6, 1) for p in (plan, tp)] == [1264.7, 1770.9]

    small = mixtral_experts(12, 8, 6, E, F64, WHOLE)
    small_plan = ed.optimize(small, NODES, like=plan)
    assert [(c.kind, c.mesh_axis_name) for c in small_plan.collectives] == [("allreduce", "node"), ("allgather", "gpu")]
    g = torch.Generator().manual_seed(4)
    for trial in range(3):
        inputs = expert_inputs(g, 12, 8, 12, 6)
        torch.testing.assert_close(ed.simulate(small_plan, inputs)["y"], ed.evaluate(small, inputs)["y"],
                                   rtol=1e-10, atol=1e-12)


EP_TOKENS = {"x": "[S(0)]", "y": "[S(0)]", "w1": "[S(0)]", "w2": "[S(0)]"}


def test_tokens_split_over_the_experts_ranks_are_dispatched_and_combined_by_uneven_all_to_alls():
    """Mixtral 8x7B's experts on 4 GPUs (CostModel.h200, bf16, 4096 tokens of top-2 routing: 8192 rows, hidden
    4096, width 14336), the rows split over the ranks (x and y [S(0)], as data or sequence parallelism hands
    them) and the experts' weights held on their ranks (w1, w2 [S(0)], as expert-parallel training stores
    them). The plan dispatches (expert_dispatch: each rank sends every expert's rank the rows of its block
    that expert owns, an all-to-all of counts read from the offsets at run time, inside the first grouped
    matmul's step) and combines (expert_combine: each rank runs its experts' rows and sends each to the rank
    whose block of y holds it): no collective of the plan's own, 1692.4 us predicted (the two all-to-alls
    16 + 16 MiB a rank, 44.0 us each). Gathering x instead (x as the matmuls read it pinned whole: an
    allgather of 64 MiB, then grouped_mm_experts) costs 1806.5 us, Megatron's pair (w1 split on f, w2 on its
    contracted f, pinned) 1894.3 us; before the exchanges (main at aa37c6d) this pinned program gathered x
    and reduce-scattered y's zero-padded rows (64 + 64 MiB): 1896.5 us. Replayed on 10 rows (float64, 4
    ranks, uneven counts, rows past offsets[-1]) it simulates to the reference."""
    cm = ed.CostModel.h200()
    plan = ed.optimize(mixtral_experts(8192, 4096, 14336, E, BF16, EP_TOKENS, MESH), MESH, cm)
    assert {"expert_dispatch", "expert_combine", "expert_rows_product"} <= rules_of(plan), plan.explain()
    assert plan.collectives == [], plan.explain()
    assert [s.flags for s in plan.compute_steps if s.op == "grouped_mm"] == [
        (("ep_dispatch", (0,)),), (("ep_combine", (0,)),)], plan.explain()
    assert str(plan.layout_of("mul_8")) == "[Pe]", plan.explain()  # the hidden rows stay on their experts' ranks
    gathered = ed.optimize(mixtral_experts(8192, 4096, 14336, E, BF16, EP_TOKENS, MESH, x_used="[R]"), MESH, cm)
    assert [(c.kind, c.tensor) for c in gathered.collectives] == [("allgather", "cast_0")], gathered.explain()
    tp = ed.optimize(mixtral_experts(8192, 4096, 14336, E, BF16, dict(EP_TOKENS, w1="[S(2)]", w2="[S(1)]"), MESH), MESH, cm)
    assert [round(p.predicted_time * 1e6, 1) for p in (plan, gathered, tp)] == [1692.4, 1806.5, 1894.3]

    small = mixtral_experts(10, 8, 6, E, F64, EP_TOKENS, MESH)
    small_plan = ed.optimize(small, MESH, like=plan)
    assert small_plan.collectives == [] and "expert_dispatch" in rules_of(small_plan)
    g = torch.Generator().manual_seed(28)
    for trial in range(4):
        inputs = expert_inputs(g, 10, 8, 12, 6)
        torch.testing.assert_close(ed.simulate(small_plan, inputs)["y"], ed.evaluate(small, inputs)["y"],
                                   rtol=1e-12, atol=1e-12)


def mixtral_step(rows, d, f, dtype, pin_weights=True, mesh=MESH):
    """The training step of mixtral_experts with the rows split over the ranks (x, c and grad_x [S(0)]):
    loss = sum(y * c), the gradients of x, w1 and w2; pin_weights: the weights and their gradients held
    split on the experts ([S(0)], as expert-parallel training stores them), else free."""
    fd = mixtral_experts(rows, d, f, E, dtype, {"x": "[S(0)]"}, mesh)
    c = fd.define_tensor((rows, d), dtype, name="c")
    fd.add_output(fd.ops.sum(fd.ops.mul(fd["y"], c)), name="loss")
    g = ed.grad(fd, loss="loss", wrt=["x", "w1", "w2"])
    pins = {"x": "[S(0)]", "c": "[S(0)]", "grad_x": "[S(0)]", "loss": "[R]"}
    pins.update({n: "[S(0)]" for n in ("w1", "w2", "grad_w1", "grad_w2")} if pin_weights else {})
    for name, text in pins.items():
        apply_layout(g[name], Layout.parse(text), mesh)
    return g


def torch_step(inputs: dict, f: int) -> dict:
    """The single-device torch reference of mixtral_step (autograd, float64): rows sorted by expert, each
    expert's rows times its matrices, rows past the last offset zero."""
    x, w1, w2 = (inputs[k].clone().requires_grad_() for k in ("x", "w1", "w2"))
    ends = torch.cumsum(torch.histc(inputs["ids"].float(), E, 0, E - 1), 0).long().tolist()

    def grouped(a, w):
        return torch.cat([a[lo:hi] @ w[e] for e, (lo, hi) in enumerate(zip([0] + ends[:-1], ends))]
                         + [a.new_zeros(a.shape[0] - ends[-1], w.shape[2])])
    h = grouped(x, w1)
    y = grouped(torch.nn.functional.silu(h[:, :f]) * h[:, f:], w2)
    loss = (y * inputs["c"]).sum()
    loss.backward()
    return {"y": y.detach(), "loss": loss.detach(), "grad_x": x.grad, "grad_w1": w1.grad, "grad_w2": w2.grad}


WEIGHTS_AND_GRADIENTS = ("w1", "w2", "grad_w1", "grad_w2")


def test_the_expert_parallel_training_step_never_moves_the_weights_or_their_gradients():
    """Mixtral 8x7B's experts on 4 GPUs (CostModel.h200, bf16, 8192 rows, hidden 4096, width 14336), the rows
    split over the ranks and the weights and their gradients pinned on their experts ([S(0)]): the training
    step is expert parallelism as Megatron's and torchtitan's token dispatchers run it. Forward: x dispatched
    (expert_dispatch), the hidden rows expert rows (Pe), y combined (expert_combine). Backward: y's gradient
    dispatched (expert_dispatch) into expert rows that stay expert rows through silu(gate) * up's backward
    (products, sums and masks of rows sorted by the same offsets: expert_rows_sum, _compare, _mask, _cat;
    silu's gradient one op, silu_backward, of f(0, 0) = 0: expert_rows_sum), grad_x combined (expert_combine), each weight gradient computed on
    its experts' rank from the rows dispatched to it (expert_dispatch_wgrad: grad_w2 from y's gradient, grad_w1
    from x, one uneven all-to-all each). The plan's one collective is the loss's all-reduce: no weight, no
    weight gradient and no hidden row moves; 6249.2 us predicted (6313.4 us at 49bb71d, where silu's vjp was
    written in ten zero-keeping row-wise ops: 51 exprs, now 40, the same plan). Before (main at 1df0c13) the
    same pinned step gathered x, the hidden rows, y's gradient and the hidden rows' gradient (5 collectives,
    784 MiB), 6481.1 us. The hidden rows as whole-size expert rows cost memory (2752 MiB a device, 1976 before) and
    their pointwise kernels run over every row (not only the rank's). Replayed on 10 rows (float64, 4 ranks,
    uneven counts, rows past offsets[-1]) it simulates to the reference and to torch's autograd."""
    plan = ed.optimize(mixtral_step(8192, 4096, 14336, BF16), MESH, ed.CostModel.h200())
    assert {"expert_dispatch", "expert_combine", "expert_dispatch_wgrad", "expert_rows_sum", "expert_rows_cat",
            "expert_rows_mask", "expert_rows_compare"} <= rules_of(plan), plan.explain()
    assert collectives(plan) == [("allreduce", "loss", 2)], plan.explain()
    assert [(s.writes[0].split(":")[0], s.flags) for s in plan.compute_steps if s.op.startswith("grouped_mm")] == [
        ("grouped_mm_4", (("ep_dispatch", (0,)),)), ("y", (("ep_combine", (0,)),)),
        ("grouped_mm_19", (("ep_dispatch", (0,)),)), ("grad_x", (("ep_combine", (0,)),)),
        ("grad_w1", (("ep_wgrad", (0,)),)), ("grad_w2", (("ep_wgrad", (0,)),))], plan.explain()
    assert all(str(plan.layout_of(n)) == "[S(0)]" for n in WEIGHTS_AND_GRADIENTS)
    assert str(plan.layout_of("add_36")) == str(plan.layout_of("mul_8")) == "[Pe]", plan.explain()
    assert str(plan.layout_of("silu_backward_31")) == "[Pe]", plan.explain()
    assert round(plan.predicted_time * 1e6, 1) == 6249.2

    small = mixtral_step(10, 8, 6, F64)
    small_plan = ed.optimize(small, MESH, like=plan)
    assert collectives(small_plan) == [("allreduce", "loss", 8)] and "expert_dispatch_wgrad" in rules_of(small_plan)
    g = torch.Generator().manual_seed(28)
    for trial in range(4):
        inputs = expert_inputs(g, 10, 8, 12, 6)
        inputs["c"] = torch.randn(10, 8, generator=g, dtype=F64)
        got, want, ref = ed.simulate(small_plan, inputs), ed.evaluate(small, inputs), torch_step(inputs, 6)
        for name in ("y", "loss", "grad_x", "grad_w1", "grad_w2"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(got[name], ref[name], rtol=1e-10, atol=1e-10)


def test_over_infiniband_the_free_training_step_chooses_expert_parallelism_itself():
    """The same step with the weights and their gradients free, on 4 ranks one per node (InfiniBand: 45 GB/s,
    as CostModel.h200_multinode's node axis): the plan splits w1 and w2 on the experts itself and runs the
    expert-parallel step of the test above, no collective but the loss's: 7802.9 us (7867.1 us with silu's
    vjp in ten ops, at 49bb71d). Before the backward's
    exchanges (main at 1df0c13) the free step replicated the weights and moved the rows between the grouped
    matmuls (x and y's gradient gathered, the hidden rows and their gradient all-to-all'd): 10560.0 us; the
    pinned one gathered the hidden rows, 21931.9 us. On NVLink (CostModel.h200) the free step still shards the
    weights on the features (5201.5 us against 6249.2 us for expert parallelism; 5220.5 and 6313.4 us at
    49bb71d): there the expert rows'
    whole-size pointwise kernels of the backward cost more than moving the rows."""
    ib = dataclasses.replace(ed.CostModel.h200(), name="h200-infiniband", links=(Link("infiniband", 20e-6, 45e9),))
    free = ed.optimize(mixtral_step(8192, 4096, 14336, BF16, pin_weights=False), MESH, ib)
    assert all(str(free.layout_of(n)) == "[S(0)]" for n in WEIGHTS_AND_GRADIENTS), free.explain()
    assert {"expert_dispatch", "expert_combine", "expert_dispatch_wgrad"} <= rules_of(free), free.explain()
    assert collectives(free) == [("allreduce", "loss", 2)], free.explain()
    pinned = ed.optimize(mixtral_step(8192, 4096, 14336, BF16), MESH, ib)
    assert [round(p.predicted_time * 1e6, 1) for p in (free, pinned)] == [7802.9, 7802.9]
    nvlink = ed.optimize(mixtral_step(8192, 4096, 14336, BF16, pin_weights=False), MESH, ed.CostModel.h200())
    assert "expert_dispatch_wgrad" not in rules_of(nvlink) and round(nvlink.predicted_time * 1e6, 1) == 5201.5
