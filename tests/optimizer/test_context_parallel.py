"""Context parallelism: attention over keys and values sharded on the sequence, as a reduction over the keys.

No pass of its own: sdpa's and sdpa_lse's rfactor (egraph_did/ops.py, _rfactor_attention) is held beside
them in the e-graph, as var_mean's Welford merge is: attention_blocks gives each block of the keys' output
and logsumexp (one block per rank where k and v are split on the sequence: attention_blocks_key_blocks, a
causal mask offset by the block's first key), then the exact online-softmax merge m = max_r l_r,
w_r = exp(l_r - m), out = sum_r w_r o_r / sum_r w_r, lse = m + log(sum_r w_r) is made of ops whose rules
already exist: a pending max (amax_over_sharded_axis) and pending sums (sum_over_sharded_axis), or, where the
output is wanted split on the queries, one all-to-all of the block outputs to the queries' split. The cost
model weighs that against all-gathering k and v (and all-to-all over heads); the backward has its own rule
(sdpa_backward_key_sequence: dk and dv local per block, dq a pending sum).
"""
import pytest
import torch

import egraph_did as ed
from egraph_did.expand import ALL_REWRITES
from egraph_did.layout import Layout
from egraph_did.pins import apply_layout

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
MESH = ed.DeviceMesh.arange(4)
# the strategies here without ring attention (rewrites/ring_attention.py, under the rings' switch), which at
# these lengths a causal step takes where k and v stay split (tests/optimizer/test_ring_attention.py)
NO_RINGS = tuple(r for r in ALL_REWRITES if r != "collective_matmul")


def attention(b, h, sq, sk, d, dtype, pins, causal=False, lse=False, mesh=MESH):
    """out (and lse) = sdpa(q, k, v): q [b, h, sq, d], k and v [b, h, sk, d]; pins: tensor -> layout text
    ("R": replicated) on `mesh`."""
    with ed.FusionDefinition() as fd:
        q = fd.define_tensor((b, h, sq, d), dtype, name="q")
        k = fd.define_tensor((b, h, sk, d), dtype, name="k")
        v = fd.define_tensor((b, h, sk, d), dtype, name="v")
        if lse:
            out, logsumexp = fd.ops.sdpa_lse(q, k, v, is_causal=causal)
            fd.add_output(out, name="out")
            fd.add_output(logsumexp, name="lse")
        else:
            fd.add_output(fd.ops.sdpa(q, k, v, is_causal=causal), name="out")
    for name, text in pins.items():
        apply_layout(fd[name], Layout.parse("[R]" if text == "R" else text), mesh)
    return fd


def simulate_equals_reference(small, plan, seed=0):
    """plan replayed on `small` (the same layouts and strategies) simulates to the float64 reference"""
    small_plan = ed.optimize(small, MESH, like=plan)
    g = torch.Generator().manual_seed(seed)
    inputs = {t.name: torch.randn(t.shape, generator=g, dtype=F64) for t in small.fusion.inputs}
    ref, got = ed.evaluate(small, inputs), ed.simulate(small_plan, inputs)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-10, atol=1e-12)
    return small_plan


def rules_of(plan) -> set[str]:
    return {r for s in plan.compute_steps for r in s.rules}


def moved(plan, *tensors) -> int:
    return sum(c.bytes for c in plan.collectives if c.tensor in tensors)


SEQ_SHARDED = {"q": "[S(2)]", "k": "[S(2)]", "v": "[S(2)]", "out": "[S(2)]"}


def test_a_query_chunk_against_sequence_sharded_keys_moves_the_queries_and_block_outputs_never_the_keys():
    """Chunked prefill against a long context (Meta's pass-Q context parallelism): 512 new queries and
    65536 keys and values, bf16, 16 heads, all split on the sequence over 4 ranks. Without the key blocks
    the plan all-to-alls q, k, v and the output over the heads (96.75 MiB sent per rank; all-gathering k
    and v would send 384 MiB); here it all-gathers q (2 MiB), runs each rank's block of the keys, and sends
    the block outputs and logsumexps to the ranks holding their queries (one all-to-all each), where the
    merge is local: 4.52 MiB sent per rank, under 2% of gathering k and v. Replayed at small uneven shapes
    (7 queries: 2, 2, 2, 1; 10 keys: blocks of 3, 3, 3, 1) it simulates to the reference."""
    b, h, sq, sk, d = 1, 16, 512, 65536, 128
    plan = ed.optimize(attention(b, h, sq, sk, d, BF16, SEQ_SHARDED), MESH)
    assert moved(plan, "k", "v") == 0, plan.explain()
    assert "attention_blocks_key_blocks" in rules_of(plan), plan.explain()
    # (bytes as the cost model charges them: an allgather's whole result, an alltoall's rank buffer; each
    # rank sends 3/4 of them)
    got = sorted((c.kind, c.tensor.split("_")[0], c.bytes) for c in plan.collectives)
    block_out, block_lse = b * h * 1 * sq * d * 4, b * h * 1 * sq * 4  # a rank's block: float32 statistics
    assert got == [("allgather", "q", b * h * sq * d * 2), ("alltoall", "attention", block_lse),
                   ("alltoall", "attention", block_out)], plan.explain()
    kv_gather = 2 * b * h * sk * d * 2  # all-gathering k and v
    assert sum(c.bytes for c in plan.collectives) < 0.02 * kv_gather
    simulate_equals_reference(attention(1, 2, 7, 10, 3, F64, SEQ_SHARDED), plan)


DECODE = {"q": "R", "k": "[S(2)]", "v": "[S(2)]", "out": "R", "lse": "R"}


def test_a_few_whole_queries_against_sequence_sharded_keys_gather_the_block_statistics_not_the_keys():
    """Decoding: 16 whole queries against 65536 keys split on the sequence, the output and its logsumexp
    whole. Two all-gathers of the block outputs and logsumexps (4 x [1, 8, 16, 128] and [1, 8, 16] float32)
    are cheaper than three all-reduces at this size (latency), and far cheaper than gathering k and v;
    every rank merges the four blocks itself."""
    b, h, sq, sk, d = 1, 8, 16, 65536, 128
    plan = ed.optimize(attention(b, h, sq, sk, d, BF16, DECODE, lse=True), MESH)
    assert moved(plan, "q", "k", "v") == 0 and "attention_blocks_key_blocks" in rules_of(plan), plan.explain()
    assert sorted((c.kind, c.bytes) for c in plan.collectives) == [
        ("allgather", b * h * 4 * sq * 4), ("allgather", b * h * 4 * sq * d * 4)], plan.explain()
    simulate_equals_reference(attention(2, 1, 3, 10, 2, F64, DECODE, lse=True), plan)


class DearGathers(ed.CostModel):
    """h200's model with all-gathers and all-to-alls priced 100 times over (a user's calibrated model may
    find them slower than all-reduces), so that the merge runs as pending reductions."""

    def collective_time(self, kind, nbytes, group_size, mesh_axis, mesh_ndim):
        t = super().collective_time(kind, nbytes, group_size, mesh_axis, mesh_ndim)
        return 100 * t if kind in ("allgather", "alltoall") else t


def dear_gathers() -> DearGathers:
    base = ed.CostModel.h200()
    return DearGathers(**{f: getattr(base, f) for f in base.__dataclass_fields__})


@pytest.mark.parametrize("causal", [False, True])
def test_the_merge_as_a_pending_max_and_pending_sums_is_exact(causal):
    """The online-softmax merge through the partial rules: the blocks' logsumexp max as a pending max
    (one allreduce(max) of [b, h, sq]), the weights' sum and the weighted block outputs as pending sums,
    which travel in one bucketed allreduce; replayed on 10 keys (blocks of 3, 3, 3 and 1), causal or not,
    it simulates to the float64 reference."""
    b, h, sq, d = 1, 16, 64, 128
    sk = sq if causal else 65536
    plan = ed.optimize(attention(b, h, sq, sk, d, BF16, DECODE, causal=causal, lse=True), MESH, dear_gathers())
    assert moved(plan, "q", "k", "v") == 0, plan.explain()
    assert {"attention_blocks_key_blocks", "amax_over_sharded_axis", "sum_over_sharded_axis"} <= rules_of(plan)
    assert sorted((c.kind, c.reduce, c.bytes) for c in plan.collectives) == [
        ("allreduce", "max", b * h * sq * 4), ("allreduce", "sum", b * h * sq * (d + 1) * 4)], plan.explain()
    simulate_equals_reference(attention(2, 1, 10 if causal else 3, 10, 2, F64, DECODE, causal=causal, lse=True), plan)


@pytest.mark.parametrize("sk", [12, 10])
def test_causal_attention_over_sequence_sharded_keys_offsets_each_block_by_its_first_key(sk):
    """Causal attention, q whole and k, v and the output split on the sequence, float32, 2 heads on 4 ranks
    (no all-to-all over heads fits): the block outputs move (an all-to-all of [b, h, sq, d] float32) rather
    than k and v, each rank masking its block by the global positions of its keys; a row that sees none of
    a block's keys gives it weight 0. Replayed on 12 and 10 positions (blocks 3, 3, 3, 3 and 3, 3, 3, 1)."""
    pins = {"q": "R", "k": "[S(2)]", "v": "[S(2)]", "out": "[S(2)]"}
    plan = ed.optimize(attention(1, 2, 8192, 8192, 128, F32, pins, causal=True), MESH, rewrites=NO_RINGS)
    assert moved(plan, "k", "v") == 0, plan.explain()
    assert "attention_blocks_key_blocks" in rules_of(plan)
    assert "causal_offsets" in {f for s in plan.compute_steps for f, _ in s.flags}, plan.explain()
    simulate_equals_reference(attention(1, 2, sk, sk, 3, F64, pins, causal=True), plan)


def test_a_key_split_that_leaves_a_rank_empty_is_held_not_computed_on():
    """9 keys on 4 ranks split 3, 3, 3, 0 (torch.chunk): the last rank would hold an empty block, which no
    rule computes on (a layout must leave no rank empty), so even where gathers are dear the plan gathers k
    and v instead of running the key blocks, and equals the reference."""
    fd = attention(1, 2, 3, 9, 2, F64, DECODE, lse=True)
    plan = ed.optimize(fd, MESH, dear_gathers())
    assert "attention_blocks_key_blocks" not in rules_of(plan) and moved(plan, "k", "v") > 0, plan.explain()
    g = torch.Generator().manual_seed(0)
    inputs = {t.name: torch.randn(t.shape, generator=g, dtype=F64) for t in fd.fusion.inputs}
    ref, got = ed.evaluate(fd, inputs), ed.simulate(plan, inputs)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-10, atol=1e-12)


def attention_step(b, h, sq, sk, d, dtype, pins, causal=False):
    """loss = sum(sdpa(q, k, v) * g) and its gradients in q, k and v (the output's gradient is g)."""
    with ed.FusionDefinition() as fd:
        q = fd.define_tensor((b, h, sq, d), dtype, name="q")
        k = fd.define_tensor((b, h, sk, d), dtype, name="k")
        v = fd.define_tensor((b, h, sk, d), dtype, name="v")
        g = fd.define_tensor((b, h, sq, d), dtype, name="g")
        fd.add_output(fd.ops.sum(fd.ops.mul(fd.ops.sdpa(q, k, v, is_causal=causal), g)), name="loss")
    step = ed.grad(fd, "loss", ["q", "k", "v"])
    for name, text in pins.items():
        apply_layout(step[name], Layout.parse("[R]" if text == "R" else text), MESH)
    return step


def test_the_backward_over_sequence_sharded_keys_keeps_dk_and_dv_local_and_reduces_dq():
    """The training step of the query chunk against a long context: the forward as above, the backward by
    sdpa_backward_key_sequence (p from the whole logsumexp is exact per key: dk and dv of each rank's keys
    stay local, dq is a pending sum, reduce-scattered to the queries' split). Nothing of k, v, dk or dv
    moves."""
    b, h, sq, sk, d = 1, 16, 512, 65536, 128
    pins = {**dict.fromkeys(("q", "g", "k", "v", "grad_q", "grad_k", "grad_v"), "[S(2)]"), "loss": "R"}
    plan = ed.optimize(attention_step(b, h, sq, sk, d, BF16, pins), MESH)
    assert moved(plan, "k", "v", "grad_k", "grad_v") == 0, plan.explain()
    assert {"attention_blocks_key_blocks", "sdpa_backward_key_sequence"} <= rules_of(plan), plan.explain()
    assert [(c.kind, c.bytes) for c in plan.collectives if c.tensor == "grad_q"] == [
        ("reduce_scatter", b * h * sq * d * 2)], plan.explain()
    assert sum(c.bytes for c in plan.collectives) < 0.03 * 2 * b * h * sk * d * 2  # < 3% of gathering k and v
    simulate_equals_reference(attention_step(1, 4, 7, 10, 3, F64, pins), plan)


def test_the_causal_backward_over_sequence_sharded_keys_offsets_each_rank_by_its_first_key():
    """Causal, q and g whole, k, v, dk and dv split on the sequence (float32, 2 heads on 4 ranks): dk and
    dv of each rank's keys are computed where they are, under the mask offset by the rank's first key;
    replayed on 10 positions (3, 3, 3, 1)."""
    pins = {"q": "R", "g": "R", "grad_q": "R", "loss": "R",
            **dict.fromkeys(("k", "v", "grad_k", "grad_v"), "[S(2)]")}
    plan = ed.optimize(attention_step(1, 2, 8192, 8192, 128, F32, pins, causal=True), MESH, rewrites=NO_RINGS)
    assert moved(plan, "k", "v", "grad_k", "grad_v") == 0, plan.explain()
    backward = [s for s in plan.compute_steps if s.op == "sdpa_backward"]
    assert [(s.rules, dict(s.flags).keys() == {"causal_offsets"}) for s in backward] == [
        (("sdpa_backward_key_sequence",), True)], plan.explain()
    simulate_equals_reference(attention_step(1, 2, 10, 10, 3, F64, pins, causal=True), plan)


def test_data_and_context_parallel_on_a_2x4_mesh_reduce_over_the_key_blocks_on_the_context_axis():
    """Batch split on dp, the sequence on cp (mesh 2 x 4): the key blocks run on cp alone, per batch shard;
    only cp carries collectives (the gathered queries and the two all-to-alls of the blocks), and the plan
    replayed at 7 queries and 10 keys simulates to the reference."""
    mesh = ed.DeviceMesh([[0, 1, 2, 3], [4, 5, 6, 7]], axis_names=("dp", "cp"))

    def chunk(b, h, sq, sk, d, dtype):
        with ed.FusionDefinition() as fd:
            q = fd.define_tensor((b, h, sq, d), dtype, name="q")
            k, v = (fd.define_tensor((b, h, sk, d), dtype, name=n) for n in "kv")
            fd.add_output(fd.ops.sdpa(q, k, v), name="out")
        for name in ("q", "k", "v", "out"):
            apply_layout(fd[name], Layout.parse("[S(0), S(2)]"), mesh)
        return fd
    plan = ed.optimize(chunk(2, 16, 512, 65536, 128, BF16), mesh)
    assert sorted((c.kind, c.mesh_axis) for c in plan.collectives) == [
        ("allgather", 1), ("alltoall", 1), ("alltoall", 1)], plan.explain()
    step = next(s for s in plan.compute_steps if s.op == "attention_blocks")
    assert step.rules == ("attention_batch_or_heads", "attention_blocks_key_blocks"), plan.explain()
    small = chunk(2, 2, 7, 10, 3, F64)
    g = torch.Generator().manual_seed(0)
    inputs = {t.name: torch.randn(t.shape, generator=g, dtype=F64) for t in small.fusion.inputs}
    got = ed.simulate(ed.optimize(small, mesh, like=plan), inputs)
    torch.testing.assert_close(got["out"], ed.evaluate(small, inputs)["out"], rtol=1e-10, atol=1e-12)
