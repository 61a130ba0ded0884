"""Golden plans of training (issue 10): forward + backward (ed.grad) and whole training steps
(ed.training_step: forward, backward, AdamW), each optimized at bf16 shapes where its layout is the one the
cost model picks on 4 H200s (or 2 x 2: dp over InfiniBand, tp over NVLink), counted exactly, then replayed at
small float64 shapes (`optimize(..., like=plan)`) and simulated against the single-device reference.

A training step is a loop: the next step takes `next.w` where this one took `w`. optimize has no constraint
tying an input's layout to an output's, so left free it takes w replicated and delivers next.w sharded (the
next step's allgather of w unpaid: test_a_free_training_step_is_not_a_loop). Where these tests compare
weight layouts they pin w, next.w and the AdamW moments (in and next) to one layout per family and let the
optimizer lay out everything else; the family with the least predicted time is the one the cost model picks.
"""
import pytest
import torch

import egraph_did as ed
from egraph_did.expand import ALL_REWRITES
from egraph_did import models
from egraph_did.layout import Layout, R, S
from egraph_did.optimize import SCREEN_SLACK
from egraph_did.pins import apply_layout

from test_golden_plans import BF16, F64, MESH, kinds, pin

# every rewrite but collective_matmul: the gradient GEMMs' reduce-scatters as rings (tests/optimizer/test_collective_matmul.py)
NO_RINGS = tuple(r for r in ALL_REWRITES if r != "collective_matmul")
MESH2 = ed.DeviceMesh(torch.arange(4).reshape(2, 2), axis_names=("dp", "tp"))
MULTINODE = ed.CostModel.h200_multinode()
COLUMN, ROW = ("wq", "wk", "wv", "w1"), ("wo", "w2")  # Megatron: out-features split, in-features split


def replay_f64(plan, small, mesh=MESH, seed=0):
    """plan's layouts on the small float64 fusion, simulated against the reference (rtol 1e-9)."""
    small_plan = ed.optimize(small, mesh, like=plan)
    assert kinds(small_plan) == kinds(plan)
    g = torch.Generator().manual_seed(seed)
    inputs = {}
    for t in small.fusion.inputs:
        v = torch.randn(t.shape, generator=g, dtype=F64)
        inputs[t.name] = v.abs() if t.name.startswith("exp_avg_sq.") else v  # a second moment is >= 0
    if "step" in inputs:
        inputs["step"] = torch.tensor(2.0, dtype=F64)  # a later step: the moments are nonzero
    ref, got = ed.evaluate(small, inputs), ed.simulate(small_plan, inputs)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")
    return small_plan


def mse(fd, dtype):
    """loss = mean((y - target)^2), target an input shaped like y."""
    target = fd.define_tensor(fd["y"].shape, dtype, name="target",
                              axis_names=tuple(d.name for d in fd["y"].logical_domain))
    err = fd.ops.sub(fd["y"], target)
    fd.add_output(fd.ops.mean(fd.ops.mul(err, err)), name="loss")
    return fd


def by_kind(plan, axis=None) -> dict[str, list[str]]:
    """{kind: [tensor, ...]} of the plan's collectives (on one mesh axis), in order."""
    out: dict[str, list[str]] = {}
    for c in plan.collectives:
        if axis is None or c.mesh_axis_name == axis:
            out.setdefault(c.kind, []).append(c.tensor)
    return out


def sorted_kinds(plan) -> dict[str, list[str]]:
    """by_kind with each list sorted (independent collectives of one step may come in either order)."""
    return {k: sorted(v) for k, v in by_kind(plan).items()}


# ---------------------------------------------------------------------- tensor-parallel MLP, x requiring grad

def mlp_grad(tokens, hidden, dtype):
    fd = mse(models.mlp(tokens, hidden, dtype), dtype)
    g = ed.grad(fd, "loss", ["x", "w1", "w2"])
    for n in ("x", "target", "y", "loss", "grad_x"):
        pin(g, n)
    return g


def test_tp_mlp_forward_backward_is_megatrons_f_and_g():
    """32 tokens, hidden 8192: column- then row-parallel; one all-reduce of y forward (g), one of grad_x
    backward (f's conjugate). The optimizer keeps two: y and grad_x cannot share a bucket, since grad_x is
    computed from y (d loss / d y = 2 (y - target) / n reads y); bucket_pair's precondition fails and no
    pair is offered. Weight gradients come out sharded like their weights, with no collective."""
    plan = ed.optimize(mlp_grad(32, 8192, BF16), MESH)
    assert [(c.kind, c.tensor) for c in plan.collectives] == [("allreduce", "y"), ("allreduce", "grad_x")]
    assert all(c.bytes == 32 * 8192 * 2 for c in plan.collectives)
    assert plan.stats["bucket_pairs_offered"] == 0 and not plan.buckets and not plan.rewrites
    assert plan.layout_of("w1") == plan.layout_of("grad_w1") == Layout((S(0),))
    assert plan.layout_of("w2") == plan.layout_of("grad_w2") == Layout((S(1),))
    exact = ed.optimize(mlp_grad(32, 8192, BF16), MESH, extractor="exact")
    assert exact.predicted_time == pytest.approx(plan.predicted_time, rel=1e-9)
    replay_f64(plan, mlp_grad(8, 16, F64))


def test_tp_mlp_vjp_with_a_given_dy_shares_one_allreduce():
    """loss = sum(y * dy), dy an input: grad_x no longer depends on y mathematically, and y and grad_x
    could travel in one buffer, as in test_mlp_backward_needs_one_allreduce_for_the_input_gradient."""
    def vjp(tokens, hidden, dtype):
        fd = models.mlp(tokens, hidden, dtype)
        dy = fd.define_tensor((tokens, hidden), dtype, name="dy", axis_names=("s", "h"))
        fd.add_output(fd.ops.sum(fd.ops.mul(fd["y"], dy)), name="loss")
        g = ed.grad(fd, "loss", ["x", "w1", "w2"])
        for n in ("x", "dy", "y", "loss", "grad_x"):
            pin(g, n)
        return g
    plan = ed.optimize(vjp(32, 8192, BF16), MESH)
    assert kinds(plan) == ["allreduce"] and plan.buckets == [["y", "grad_x"]]


# ---------------------------------------------------------------------- tensor + sequence parallel GPT layer

GPT_WEIGHTS = ["ln1_w", "ln1_b", "wq", "wk", "wv", "wo", "ln2_w", "ln2_b", "w1", "w2"]


def gpt_grad(batch, seq, hidden, heads, dtype, recompute=None):
    fd = mse(models.gpt_layer(batch, seq, hidden, heads, dtype), dtype)
    g = ed.grad(fd, "loss", ["x", *GPT_WEIGHTS], recompute=recompute)
    sp = Layout((S(1),))
    for n in ("x", "target", "y", "grad_x"):
        pin(g, n, sp)
    pin(g, "loss")
    return g


def test_tp_sp_gpt_layer_forward_backward_moves_no_more_than_megatron_sp():
    """Sequence-parallel layer (x, y, grad_x split over tokens), 32 tokens, hidden 8192.

    Megatron-SP moves, per layer, forward 2 allgathers (the layer norms' outputs) + 2 reduce_scatters (the
    row-parallel outputs); backward 2 allgathers (the gradients entering the row-parallel linears) + 2
    reduce_scatters (leaving the column-parallel ones) + 2 re-gathers of the layer norms' outputs (not
    saved), each of [s, h]; and an all-reduce of each layer norm's weight and bias gradients. The plan keeps
    the gathered layer-norm outputs (no re-gather) and reduce-scatters the layer-norm gradients (a quarter of
    an all-reduce's bytes). The error y - target is gathered once, for the loss (its mean square computed
    whole costs one latency, 11 us, where the all-reduce of a partial scalar costs two, 20 us) and for the
    backward, which reads it whole."""
    plan = ed.optimize(gpt_grad(1, 32, 8192, 64, BF16), MESH)
    act, ln = 32 * 8192 * 2, 8192 * 2
    assert by_kind(plan) == {
        "allgather": ["layer_norm_0", "layer_norm_16",  # forward: the layer norms' outputs
                      "sub_21",  # the error y - target: the loss, and the gradient entering w2^T's linear
                      "mul_77"],  # backward: the gradient entering wo^T's linear
        "reduce_scatter": ["linear_14", "linear_19",  # forward: attention and MLP outputs
                           "linear_54", "add_122",  # backward: the gradients of the layer norms' outputs
                           "sum_130", "sum_132", "sum_66", "sum_68"],  # layer-norm weight and bias gradients
    }
    assert sum(c.bytes for c in plan.collectives) == 8 * act + 4 * ln
    megatron_sp = (4 + 4 + 2) * act + 4 * ln  # its all-reduces of the ln gradients move ln bytes each
    assert sum(c.bytes for c in plan.collectives) < megatron_sp
    for w in COLUMN + ROW:  # matrix gradients sharded like their weights (layer-norm ones come out split)
        assert plan.layout_of("grad_" + w) == plan.layout_of(w) != Layout((R,))
    replay_f64(plan, gpt_grad(1, 8, 32, 4, F64))


# ---------------------------------------------------------------------- dp x tp GPT training step

def gpt_step_2d(batch, seq, hidden, heads, dtype, dp_sharded: bool):
    """The GPT training step on the 2 x 2 mesh: x and target split over the batch on dp and over tokens on tp;
    weights Megatron on tp; on dp replicated (DDP) or split (FSDP), AdamW moments likewise, in and next."""
    fd = models.gpt_training_step(batch, seq, hidden, heads, dtype)
    for n in ("x", "target"):
        apply_layout(fd[n], Layout((S(0), S(1))), MESH2)
    for t in list(fd.fusion.inputs):
        name = t.name
        if name in ("x", "target", "step"):
            continue
        w = name.split(".", 1)[1] if "." in name else name
        tp = S(0) if w in COLUMN else S(1) if w in ROW else R
        dp = (S(1) if w in COLUMN else S(0)) if dp_sharded else R
        for n in (name, "next." + name):
            apply_layout(fd[n], Layout((dp, tp)), MESH2)
    return fd


# the layer norms' weight and bias gradients as the plans reduce them: sums over (batch, tokens), before the
# reshape that names them grad_ln*
LN_GRAD_SUMS = {"sum_130", "sum_132", "sum_66", "sum_68"}


@pytest.fixture(scope="module")
def plans_2d():
    # rewrites=(): the bucket pass (a second e-graph, 60 s here) found no cheaper plan for either family at
    # this shape when measured (plan.buckets == [] with rewrites on), and halves the time
    shape = (2, 4096, 4096, 32)
    return {k: ed.optimize(gpt_step_2d(*shape, BF16, k == "fsdp"), MESH2, MULTINODE, rewrites=())
            for k in ("ddp", "fsdp")}


def test_dp_tp_gpt_training_step(plans_2d):
    """2 x 2 H200s, dp over InfiniBand, a GPT layer's training step at batch 2, 4096 tokens, hidden 4096.

    On tp every weight-sized tensor stays put: only activations (the layer norms' outputs gathered, the
    row-parallel outputs reduce-scattered, their gradients likewise), small layer-norm gradients and the
    loss move. On dp only gradients, weights, moments and the loss move, and each weight's gradient is
    reduced over dp exactly once: with weights and moments replicated (DDP) by an all-reduce (the AdamW
    update, one fused elementwise kernel, costs too little for updating a half and gathering to pay).
    Sharding weights and moments over dp (FSDP: weights all-gathered before use, gradients
    reduce-scattered) is cheaper still and holds less: that is the family the cost model picks."""
    ddp, fsdp = plans_2d["ddp"], plans_2d["fsdp"]
    weights = set(GPT_WEIGHTS)
    grads = {"grad_" + w for w in COLUMN + ROW} | LN_GRAD_SUMS  # each weight's gradient, as reduced
    states = {f"next.{s}.{w}" for s in ("exp_avg", "exp_avg_sq") for w in weights}
    for plan in (ddp, fsdp):
        dp = by_kind(plan, "dp")
        moved = [t for ts in dp.values() for t in ts]
        assert set(moved) <= grads | weights | {"next." + w for w in weights} | states | {"loss"}, moved
        reduced = dp.get("reduce_scatter", []) + [t for t in dp.get("allreduce", []) if t != "loss"]
        assert sorted(reduced) == sorted(grads)  # every weight gradient reduced over dp once
        tp = [c for c in plan.collectives if c.mesh_axis_name == "tp"]
        matrices = set(COLUMN + ROW)
        assert not {c.tensor for c in tp} & (matrices | {"grad_" + w for w in matrices} | {
            f"next.{s}.{w}" for s in ("exp_avg", "exp_avg_sq") for w in matrices})  # Megatron on tp: no matrix's moves
        assert by_kind(plan, "tp")["reduce_scatter"][:2] == ["linear_14", "linear_19"]
        assert by_kind(plan, "tp")["allgather"][:2] == ["layer_norm_0", "layer_norm_16"]
    dp = by_kind(ddp, "dp")  # DDP: each gradient all-reduced over dp (or reduce-scattered and gathered back)
    whole = set(dp["allreduce"]) | (set(dp.get("reduce_scatter", [])) & set(dp.get("allgather", [])))
    assert whole == {"loss", *LN_GRAD_SUMS} | {"grad_" + w for w in COLUMN + ROW}
    assert sorted(by_kind(fsdp, "dp")["allgather"]) == sorted(weights)  # FSDP: weights gathered before use
    assert fsdp.predicted_time < ddp.predicted_time and fsdp.memory < ddp.memory
    mem_ddp, mem_fsdp = ddp.memory_breakdown(), fsdp.memory_breakdown()
    # FSDP holds each moment's half in and next; DDP holds it whole in and next: twice as much
    assert mem_ddp["optimizer states"] == pytest.approx(2 * mem_fsdp["optimizer states"], rel=1e-3)
    assert mem_ddp["total"] == ddp.memory
    replay_f64(fsdp, gpt_step_2d(4, 8, 16, 4, F64, True), MESH2)


# ---------------------------------------------------------------------- data parallel: DDP, ZeRO, FSDP, bounds

DP_SHAPE = (16384, 1024)  # tokens, hidden: 4 ranks split 16384 tokens; w1, w2 8 MiB each in bf16
STATE_NAMES = [f"{s}.{w}" for s in ("exp_avg", "exp_avg_sq") for w in ("w1", "w2")]


def mlp_step(tokens, hidden, dtype, weights=None, states=None, mesh=MESH):
    """The MLP training step, data parallel (x, target split over tokens); weights (w, next.w) and AdamW
    moments (in and next) pinned to the given layouts, or free (None)."""
    fd = models.mlp_training_step(tokens, hidden, dtype)
    for n in ("x", "target"):
        apply_layout(fd[n], Layout((S(0),)), mesh)
    for names, lay in ((("w1", "w2"), weights), (STATE_NAMES, states)):
        for n in names if lay is not None else ():
            for t in (n, "next." + n):
                apply_layout(fd[t], lay, mesh)
    return fd


@pytest.fixture(scope="module")
def dp_plans():  # NO_RINGS: the claims are DDP's and ZeRO's collectives, not rings that fold them in
    rep, split = Layout((R,)), Layout((S(0),))
    return {"ddp": ed.optimize(mlp_step(*DP_SHAPE, BF16, rep, rep), MESH, rewrites=NO_RINGS),
            "zero": ed.optimize(mlp_step(*DP_SHAPE, BF16, rep, None), MESH, rewrites=NO_RINGS),
            "fsdp": ed.optimize(mlp_step(*DP_SHAPE, BF16, split, split), MESH, rewrites=NO_RINGS)}


def test_data_parallel_ddp_zero_fsdp(dp_plans):
    """Replicated weights and moments (DDP): both gradients all-reduced, the update run whole on every rank.
    Moments left to the optimizer with weights replicated: it shards them (in and next alike), reduce-scatters
    each gradient, updates a quarter and all-gathers the next weights (ZeRO-2): the same collective bytes and
    latencies as the all-reduce, a quarter of the update, and less memory, so it wins without any bound.
    Weights stored sharded too (FSDP: all-gathered before use): less time and memory than ZeRO-2 in this
    memory model, which holds ZeRO-2's gathered next weights and FSDP's gathered weights alike."""
    ddp, zero, fsdp = dp_plans["ddp"], dp_plans["zero"], dp_plans["fsdp"]
    assert sorted_kinds(ddp) == {"allreduce": ["grad_w1", "grad_w2", "loss"]}
    assert sorted_kinds(zero) == {"allreduce": ["loss"], "reduce_scatter": ["grad_w1", "grad_w2"],
                                  "allgather": ["next.w1", "next.w2"]}
    for n in STATE_NAMES:
        assert zero.layout_of(n) == zero.layout_of("next." + n) == Layout((S(0),))  # a loop, by choice
    assert sorted_kinds(fsdp) == {"allgather": ["w1", "w2"], "allreduce": ["loss"],
                                  "reduce_scatter": ["grad_w1", "grad_w2"]}
    assert fsdp.predicted_time < zero.predicted_time < ddp.predicted_time
    assert fsdp.memory < zero.memory < ddp.memory
    w = 2 * 4096 * 1024 * 2  # bytes of w1 + w2
    assert ddp.memory_breakdown()["optimizer states"] == 2 * 2 * w  # two moments, in and next, whole
    assert zero.memory_breakdown()["optimizer states"] == 2 * 2 * w / 4
    assert "optimizer states" in zero.explain()
    for plan in (ddp, zero, fsdp):
        replay_f64(plan, mlp_step(16, 8, F64, *(
            (plan.layout_of("w1"), plan.layout_of("exp_avg.w1")) if plan is not zero else (Layout((R,)), None))))


def test_a_memory_bound_below_ddp_gives_sharded_moments(dp_plans):
    """A bound below DDP's memory (replicated weights, gradients and moments) with the weights replicated:
    the plan fits it by the sharded moments and reduce-scattered gradients of ZeRO-2 (which it picks
    without the bound too)."""
    ddp, zero = dp_plans["ddp"], dp_plans["zero"]
    bound = (ddp.memory + zero.memory) / 2
    plan = ed.optimize(mlp_step(*DP_SHAPE, BF16, Layout((R,)), None), MESH, ed.CostModel.h200(memory_limit=bound), rewrites=NO_RINGS)
    assert plan.memory <= bound < ddp.memory
    assert sorted_kinds(plan)["reduce_scatter"] == ["grad_w1", "grad_w2"]
    assert all(plan.layout_of(n) == Layout((S(0),)) for n in STATE_NAMES)


def test_a_free_training_step_is_the_cheapest_loop(dp_plans):
    """Left free, a plan could take w replicated and deliver next.w sharded, which is no loop (the next step
    would all-gather w first, and nothing pays for it). optimize ties every x to next.x (loop_ties): it
    tries the loops of such a plan (every pair as it takes x, or as it delivers next.x) and keeps the
    cheaper, here FSDP's."""
    free = ed.optimize(mlp_step(*DP_SHAPE, BF16), MESH, rewrites=NO_RINGS)
    for x in ("w1", "w2", *STATE_NAMES):
        assert free.layout_of(x) == free.layout_of("next." + x) == Layout((S(0),)), x
    # three loops (as taken, replicated: DDP, as delivered), each screened on the first pass's graph; the passes of
    # those near the best screen run
    screens = free.stats["loop_screens"]
    assert len(screens) == 3 and free.stats["loops_tried"] == len(free.stats["passes"]) - 1
    assert free.stats["loops_tried"] == sum(c <= min(screens) * (1 + SCREEN_SLACK) for c in screens) < 3
    assert screens[1] > free.predicted_time * (1 + SCREEN_SLACK)  # DDP's screen loses: its pass does not run
    assert free.predicted_time == pytest.approx(dp_plans["fsdp"].predicted_time, rel=1e-9)
    assert sorted_kinds(free) == sorted_kinds(dp_plans["fsdp"])


def test_fsdp_comes_out_of_a_memory_bound(dp_plans):
    """A bound that holds FSDP but not ZeRO-2: the plan stores the weights and moments sharded (a loop) and
    all-gathers the weights before use. (The memory model still sums every value of the step, with no
    liveness: FSDP's gathered copy of w counts in full, so the bound that separates them is narrow.)"""
    bound = dp_plans["fsdp"].memory  # FSDP fits exactly; ZeRO-2 does not
    assert bound < dp_plans["zero"].memory
    plan = ed.optimize(mlp_step(*DP_SHAPE, BF16), MESH, ed.CostModel.h200(memory_limit=bound), rewrites=NO_RINGS)
    assert plan.layout_of("w1") == plan.layout_of("next.w1") == Layout((S(0),))
    assert sorted_kinds(plan)["allgather"] == ["w1", "w2"]


# ---------------------------------------------------------------------- vocab-parallel cross-entropy step

VOCAB_STEP = dict(tokens=4096, vocab=128256, hidden=4096)  # issue 10's LM head: the weight is 1 GiB in bf16
WEIGHT_AND_STATE = ("w", "next.w", "exp_avg.w", "next.exp_avg.w", "exp_avg_sq.w", "next.exp_avg_sq.w")


def cross_entropy_step(tokens, vocab, hidden, dtype, tokens_sharded):
    """One AdamW step of cross_entropy(linear(x, w), target): an LM head and its loss, x and target replicated
    or split over the tokens (data-parallel), the weight and its states left to the optimizer."""
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((tokens, hidden), dtype, name="x")
        w = fd.define_tensor((vocab, hidden), dtype, name="w")
        target = fd.define_tensor((tokens,), torch.int64, name="target")
        fd.add_output(fd.ops.cross_entropy(fd.ops.linear(x, w), target, reduction="mean"), name="loss")
    step = ed.training_step(fd, "loss", ["w"], ed.AdamW(lr=1e-3))
    for n in ("x", "target"):
        pin(step, n, Layout((S(0),)) if tokens_sharded else None)
    return step


@pytest.mark.parametrize("tokens_sharded", [False, True], ids=["x-replicated", "x-token-sharded"])
def test_vocab_parallel_cross_entropy_step_moves_only_per_token_statistics(tokens_sharded):
    """The weight, its gradient and its AdamW moments split over the vocabulary (rows of w); the logits stay
    vocab-sharded; what moves is per-token: the row max, the sum of exponentials, the target's logit (a few
    bytes a token; plus x and target gathered when they come token-sharded). Pinning the weight replicated
    (data-parallel: its gradient all-reduced every step) is predicted slower. Replayed at float64 against
    the single-device step."""
    step = cross_entropy_step(**VOCAB_STEP, dtype=BF16, tokens_sharded=tokens_sharded)
    plan = ed.optimize(step, MESH)
    for n in WEIGHT_AND_STATE + ("grad_w",):
        assert plan.layout_of(n) == Layout((S(0),)), (n, plan.layout_of(n))
    assert plan.layout_of("linear_0") == Layout((S(1),))  # the logits, vocab-sharded
    gathered = {"x", "target"} if tokens_sharded else set()
    moved = {c.tensor for c in plan.collectives if c.tensor not in gathered}
    assert moved and all(c.bytes <= 4 * VOCAB_STEP["tokens"] for c in plan.collectives if c.tensor in moved), \
        [(c.kind, c.tensor, c.bytes) for c in plan.collectives]
    assert {c.tensor for c in plan.collectives} >= gathered

    dp = cross_entropy_step(**VOCAB_STEP, dtype=BF16, tokens_sharded=tokens_sharded)
    for n in WEIGHT_AND_STATE:
        pin(dp, n)
    dp_plan = ed.optimize(dp, MESH)
    assert dp_plan.predicted_time > 1.2 * plan.predicted_time, (dp_plan.predicted_time, plan.predicted_time)

    small = cross_entropy_step(tokens=8, vocab=16, hidden=4, dtype=F64, tokens_sharded=tokens_sharded)
    small_plan = ed.optimize(small, MESH, like=plan)
    assert kinds(small_plan) == kinds(plan)
    g = torch.Generator().manual_seed(0)
    inputs = {t.name: torch.randn(t.shape, generator=g, dtype=F64) for t in small.fusion.inputs}
    inputs["exp_avg_sq.w"] = inputs["exp_avg_sq.w"].abs()
    inputs["target"] = torch.randint(0, 16, (8,), generator=g)
    inputs["step"] = torch.tensor(2.0, dtype=F64)
    ref, got = ed.evaluate(small, inputs), ed.simulate(small_plan, inputs)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")
