"""Golden plans: the collectives the optimizer picks for standard layouts, out of the cost model alone.

Each plan is optimized at shapes where Megatron's layout is optimal on 4 H200s (bf16, 32 tokens,
hidden 8192: reading replicated weights costs more than the communication it saves), counted exactly,
then replayed at small shapes in float64 (`optimize(..., like=plan)` keeps the same layouts and
strategies) and simulated against the single-device reference (rtol 1e-9, atol 1e-10: float64 sums
reassociated across ranks).
"""
import pytest
import torch

import egraph_did as ed
from egraph_did import models
from egraph_did.layout import Layout, R, S
from egraph_did.pins import apply_layout

BF16 = torch.bfloat16
F64 = torch.float64
MESH = ed.DeviceMesh.arange(4)


def pin(fd, name, layout=None, mesh=MESH):
    """Pin a tensor: replicated (layout None) or the given layout, through the loop-domain API."""
    tv = fd[name]
    if layout is None:
        tv.set_device_mesh(mesh)
    else:
        apply_layout(tv, layout, mesh)
    return tv


def kinds(plan):
    return sorted(c.kind for c in plan.collectives)


def check_numerics(plan, small, mesh=MESH, seed=0):
    """Replay plan's layouts on the small fusion and compare simulate with the reference."""
    small_plan = ed.optimize(small, mesh, like=plan)
    assert kinds(small_plan) == kinds(plan)
    g = torch.Generator().manual_seed(seed)
    inputs = {t.name: torch.randn(t.shape, generator=g, dtype=torch.float64) for t in small.fusion.inputs}
    ref = ed.evaluate(small, inputs)
    got = ed.simulate(small_plan, inputs)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-10)
    return small_plan


def both_extractors_agree(fd, mesh=MESH, cost_model=None):
    greedy = ed.optimize(fd, mesh, cost_model)
    exact = ed.optimize(fd, mesh, cost_model, extractor="exact")
    assert greedy.predicted_time == pytest.approx(exact.predicted_time, rel=1e-9)
    return greedy


def test_mlp_is_column_then_row_parallel_with_one_allreduce():
    fd = models.mlp(32, 8192, BF16)
    pin(fd, "x"), pin(fd, "y")
    plan = both_extractors_agree(fd)
    assert kinds(plan) == ["allreduce"]
    assert plan.loop_domain("w1") == "[DIDx{4}, 4h/4, h]"  # column-parallel: out-features split
    assert plan.loop_domain("w2") == "[h, DIDx{4}, 4h/4]"  # row-parallel: in-features split
    assert plan.collectives[0].tensor == "y" and plan.collectives[0].bytes == 32 * 8192 * 2
    small = models.mlp(8, 16, F64)
    pin(small, "x"), pin(small, "y")
    check_numerics(plan, small)


def test_sequence_parallel_mlp_needs_one_allgather_and_one_reduce_scatter():
    fd = models.mlp(32, 8192, BF16)
    pin(fd, "x", Layout((S(0),))), pin(fd, "y", Layout((S(0),)))
    plan = both_extractors_agree(fd)
    assert kinds(plan) == ["allgather", "reduce_scatter"]
    ag, rs = plan.collectives
    assert (ag.tensor, ag.kind, rs.tensor, rs.kind) == ("x", "allgather", "y", "reduce_scatter")
    assert plan.loop_domain("y") == "[DIDx{4}, s/4, h]"
    small = models.mlp(8, 16, F64)
    pin(small, "x", Layout((S(0),))), pin(small, "y", Layout((S(0),)))
    check_numerics(plan, small)


def test_attention_shards_heads_with_one_allreduce():
    fd = models.attention(1, 32, 8192, 64, BF16)
    pin(fd, "x"), pin(fd, "y")
    plan = both_extractors_agree(fd)
    assert kinds(plan) == ["allreduce"]
    sdpa = next(s for s in plan.compute_steps if s.op == "sdpa")
    assert plan.values[sdpa.outputs[0]].layout == "S1"  # [b, heads, s, d]: heads split
    assert sdpa.rules == ("sdpa_batch_or_heads",)
    small = models.attention(1, 8, 32, 4, F64)
    pin(small, "x"), pin(small, "y")
    check_numerics(plan, small)


def test_gpt_layer_tensor_parallel_needs_two_allreduces():
    fd = models.gpt_layer(1, 32, 8192, 64, BF16)
    pin(fd, "x"), pin(fd, "y")
    plan = both_extractors_agree(fd)
    assert kinds(plan) == ["allreduce", "allreduce"]
    small = models.gpt_layer(1, 8, 32, 4, F64)
    pin(small, "x"), pin(small, "y")
    check_numerics(plan, small)


def test_gpt_layer_sequence_parallel_needs_two_allgathers_and_two_reduce_scatters():
    fd = models.gpt_layer(1, 32, 8192, 64, BF16)
    pin(fd, "x", Layout((S(1),))), pin(fd, "y", Layout((S(1),)))
    plan = both_extractors_agree(fd)
    assert kinds(plan) == ["allgather", "allgather", "reduce_scatter", "reduce_scatter"]
    # layer norms and residual adds run on sequence shards, between the collectives
    norms = [s for s in plan.compute_steps if s.op == "layer_norm"]
    assert [plan.values[s.outputs[0]].layout for s in norms] == ["S1", "S1"]
    small = models.gpt_layer(1, 8, 32, 4, F64)
    pin(small, "x", Layout((S(1),))), pin(small, "y", Layout((S(1),)))
    check_numerics(plan, small)


def test_mlp_backward_needs_one_allreduce_for_the_input_gradient():
    fd = models.mlp_with_backward(32, 8192, BF16)
    for name in ("x", "dy", "y", "dx"):
        pin(fd, name)
    written = ed.optimize(fd, MESH, rewrites=())  # Megatron's f and g: one all-reduce forward, one backward
    assert [(c.kind, c.tensor) for c in written.collectives] == [("allreduce", "y"), ("allreduce", "dx")]
    plan = both_extractors_agree(fd)  # y and dx are independent: bucket_pair sends them in one buffer
    assert kinds(plan) == ["allreduce"] and plan.buckets == [["y", "dx"]]
    assert plan.collectives[0].bytes == 2 * 32 * 8192 * 2
    # weight gradients stay sharded like their weights: no communication
    assert plan.layout_of("dw1") == plan.layout_of("w1") == Layout((S(0),))
    assert plan.layout_of("dw2") == plan.layout_of("w2") == Layout((S(1),))
    small = models.mlp_with_backward(8, 16, F64)
    for name in ("x", "dy", "y", "dx"):
        pin(small, name)
    check_numerics(plan, small)


def test_sum_over_a_sharded_axis_is_a_local_sum_then_one_allreduce():
    fd = models.row_sum(64, 65536, BF16)
    pin(fd, "x", Layout((S(1),))), pin(fd, "y")
    plan = both_extractors_agree(fd)
    assert kinds(plan) == ["allreduce"]
    (step,) = plan.compute_steps
    assert (step.op, step.rules, plan.values[step.outputs[0]].layout) == ("sum", ("sum_over_sharded_axis",), "P")
    small = models.row_sum(4, 10, F64)  # 10 columns over 4 ranks: uneven shards 3, 3, 3, 1
    pin(small, "x", Layout((S(1),))), pin(small, "y")
    check_numerics(plan, small)


def test_layer_norm_over_a_sharded_hidden_axis_combines_statistics_across_devices():
    fd = models.layer_norm(1024, 65536, BF16)
    pin(fd, "x", Layout((S(1),))), pin(fd, "y", Layout((S(1),)))
    plan = both_extractors_agree(fd)
    (c,) = plan.collectives
    # one allgather of per-rank Welford statistics (count, mean, M2 per row), not of x
    assert c.kind == "allgather" and c.bytes == 1024 * 4 * 3 * 2
    ops = [s.op for s in plan.compute_steps]
    assert "welford_blocks" in ops and "welford_merge" in ops
    small = models.layer_norm(6, 16, F64)
    pin(small, "x", Layout((S(1),))), pin(small, "y", Layout((S(1),)))
    check_numerics(plan, small)


def test_2d_mesh_mlp_is_data_parallel_on_dp_and_tensor_parallel_on_tp():
    # dp crosses nodes over InfiniBand, tp stays inside a node on NVLink
    mesh = ed.DeviceMesh(torch.arange(8).reshape(2, 4), axis_names=("dp", "tp"))
    fd = models.mlp(64, 8192, BF16)
    dp_only = Layout((S(0), R))
    pin(fd, "x", dp_only, mesh), pin(fd, "y", dp_only, mesh)
    plan = both_extractors_agree(fd, mesh, ed.CostModel.h200_multinode())
    assert [(c.kind, c.mesh_axis_name) for c in plan.collectives] == [("allreduce", "tp")]
    assert plan.loop_domain("w1") == "[DIDx{4}, 4h/4, h]"  # replicated over dp, column-parallel over tp
    small = models.mlp(8, 16, F64)
    pin(small, "x", dp_only, mesh), pin(small, "y", dp_only, mesh)
    check_numerics(plan, small, mesh)


def test_plan_switches_to_data_parallel_when_tokens_dominate_weights():
    fd = models.mlp(65536, 256, BF16)
    pin(fd, "x"), pin(fd, "y")
    plan = both_extractors_agree(fd)
    # activations are 512x the weights: keep weights whole, split tokens, gather the output once
    assert kinds(plan) == ["allgather"]
    assert plan.layout_of("w1").is_replicated and plan.layout_of("w2").is_replicated
    assert "output y is delivered as R (pinned)" in plan.explain()
    few_tokens = models.mlp(32, 8192, BF16)
    pin(few_tokens, "x"), pin(few_tokens, "y")
    assert kinds(ed.optimize(few_tokens, MESH)) == ["allreduce"]


def embedding_lookup(vocab, dim, n, dtype):
    with ed.FusionDefinition() as fd:
        ids = fd.define_tensor((n,), torch.int64, name="ids")
        table = fd.define_tensor((vocab, dim), dtype, name="table", axis_names=("v", "d"))
        fd.add_output(fd.ops.embedding(ids, table), name="y")
    pin(fd, "ids"), pin(fd, "y")
    return fd


def test_memory_bound_forces_a_sharded_embedding_table():
    fd = embedding_lookup(262144, 1024, 1024, BF16)  # a 512 MiB table, 1024 rows looked up
    free = ed.optimize(fd, MESH)
    assert kinds(free) == [] and free.layout_of("table").is_replicated  # a gather reads only its rows
    cm = ed.CostModel.h200(memory_limit=256 * 2**20)
    bounded = both_extractors_agree(fd, cost_model=cm)
    assert bounded.memory <= 256 * 2**20 < free.memory
    # splitting the table's columns costs one allgather of the rows looked up (2 MiB); splitting its
    # rows (vocab-parallel) would cost an allreduce of them, twice the bytes and two latencies
    assert kinds(bounded) == ["allgather"] and bounded.layout_of("table") == Layout((S(1),))
    step = next(s for s in bounded.compute_steps if s.op == "embedding")
    assert step.rules == ("embedding_sharded",)
    small = embedding_lookup(10, 8, 6, F64)  # 10 rows over 4 ranks: 3, 3, 3, 1
    small_plan = ed.optimize(small, MESH, like=bounded)
    ids = torch.tensor([0, 9, 3, 4, 9, 6])
    table = torch.randn(10, 8, dtype=F64)
    torch.testing.assert_close(ed.simulate(small_plan, {"ids": ids, "table": table})["y"], table[ids])
    with pytest.raises(ed.PlanError, match="memory"):
        ed.optimize(fd, MESH, ed.CostModel.h200(memory_limit=1024))


def attention_chunk(heads, queries, keys, dim, dtype):
    """out = sdpa(q, k, v) of `queries` queries against `keys` keys, q, k, v and out split on the sequence."""
    with ed.FusionDefinition() as fd:
        q = fd.define_tensor((1, heads, queries, dim), dtype, name="q")
        k, v = (fd.define_tensor((1, heads, keys, dim), dtype, name=n) for n in "kv")
        fd.add_output(fd.ops.sdpa(q, k, v), name="out")
    for name in ("q", "k", "v", "out"):
        pin(fd, name, Layout((S(2),)))
    return fd


def test_context_parallel_attention_under_a_memory_bound_reduces_over_the_key_blocks():
    """Context parallelism (issue 28 item 2): 2048 queries against 131072 keys, bf16, 2 heads (too few to
    split over 4 ranks), every operand split on the sequence. Gathering k and v (the only plan before the
    key blocks: 2 allgathers, 96 MiB sent per rank) needs 114 MiB per device; under a 64 MiB bound the
    plan runs each rank's block of the keys against the gathered queries and sends the block outputs and
    logsumexps to the queries' split: one allgather and two all-to-alls, 2.26 MiB sent per rank. Replayed at
    7 queries and 10 keys (2, 2, 2, 1 and 3, 3, 3, 1) it simulates to the reference."""
    bound = ed.CostModel.h200(memory_limit=64 << 20)
    plan = both_extractors_agree(attention_chunk(2, 2048, 131072, 128, BF16), cost_model=bound)
    assert plan.memory <= 64 << 20
    assert [(c.kind, c.tensor) for c in plan.collectives] == [
        ("allgather", "q"), ("alltoall", "attention_blocks_1"), ("alltoall", "attention_blocks_2")], plan.explain()
    assert next(s for s in plan.compute_steps if s.op == "attention_blocks").rules == ("attention_blocks_key_blocks",)
    check_numerics(plan, attention_chunk(2, 7, 10, 3, F64))


def test_plan_round_trips_through_json():
    fd = models.gpt_layer(1, 32, 8192, 64, BF16)
    pin(fd, "x", Layout((S(1),))), pin(fd, "y", Layout((S(1),)))
    plan = ed.optimize(fd, MESH)
    again = ed.Plan.from_json(plan.to_json())
    assert again.to_json() == plan.to_json()
    assert kinds(again) == kinds(plan) and again.predicted_time == plan.predicted_time


def test_a_pin_that_cannot_be_honoured_names_the_tensor():
    """A non-outermost DID split plans through a reshaped view where the splits divide the axis
    (tests/program/test_nested_pins.py); 7 rows in 2 halves of 4 and 3 are no reshape: refused, named."""
    with ed.FusionDefinition() as fd:
        w = fd.define_tensor((7, 4), name="gate_up")
        fd.add_output(fd.ops.relu(w), name="y")
    w.set_device_mesh(MESH).outer_split(0, 2).outer_split(1, 4).axis(1).parallelize(ed.ParallelType.DIDx)
    with pytest.raises(ed.PlanError, match="gate_up"):
        ed.optimize(fd, MESH)
