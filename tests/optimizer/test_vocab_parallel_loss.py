"""Vocab-parallel cross entropy (Megatron's and torchtitan's loss_parallel): over logits sharded on the class
axis, cross entropy runs where the logits are and moves per-row statistics only.

No rule of its own: cross_entropy's decomposition (max-shifted log-sum-exp minus the target's logit) is held
beside it, and the reduction and gather rules apply to its parts: the row max over the sharded classes is a
local max then a pending max (amax_over_sharded_axis, one allreduce(max) of [N]), the sum of exp a local
sum then a pending sum (sum_over_sharded_axis), the target's logit a masked local gather then a pending sum
(take_along_sharded_axis: each rank picks it where it holds the target's class, else 0). The backward
(softmax - onehot) is local in the same layout (softmax through the same parts, the onehot scattered into
owned positions only).
"""
import pytest
import torch

import egraph_did as ed
from egraph_did.layout import Layout
from egraph_did.pins import apply_layout

BF16, F64 = torch.bfloat16, torch.float64
MESH = ed.DeviceMesh.arange(4)
ROWS, HIDDEN, VOCAB = 4096, 4096, 128256  # Llama 3's vocabulary


def loss_of_logits(n, c, dtype, reduction="mean", ignore_index=None):
    """loss = cross_entropy(logits, target), logits split on the classes, target and loss whole."""
    with ed.FusionDefinition() as fd:
        logits = fd.define_tensor((n, c), dtype, name="logits")
        target = fd.define_tensor((n,), torch.int64, name="target")
        fd.add_output(fd.ops.cross_entropy(logits, target, reduction, ignore_index=ignore_index), name="loss")
    apply_layout(fd["logits"], Layout.parse("[S(1)]"), MESH)
    for t in ("target", "loss"):
        fd[t].set_device_mesh(MESH)
    return fd


def lm_head_step(n, h, c, dtype, ignore_index=None):
    """The gradient of cross_entropy(linear(x, w), target) in x and w: x, target, loss and grad_x whole,
    w (the lm head, [vocab, hidden]) and its gradient free."""
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((n, h), dtype, name="x")
        w = fd.define_tensor((c, h), dtype, name="w")
        target = fd.define_tensor((n,), torch.int64, name="target")
        fd.add_output(fd.ops.cross_entropy(fd.ops.linear(x, w), target, ignore_index=ignore_index), name="loss")
    g = ed.grad(fd, "loss", ["x", "w"])
    for t in ("x", "target", "loss", "grad_x"):
        g[t].set_device_mesh(MESH)
    return g


def simulate_equals_reference(small, plan, classes, ignored=()):
    """the plan replayed on `small` simulates to the reference; the targets at `ignored` are -100"""
    plan = ed.optimize(small, MESH, like=plan)
    g = torch.Generator().manual_seed(0)
    inputs = {t.name: (torch.randint(0, classes, t.shape, generator=g) if t.dtype == torch.int64 else
                       torch.randn(t.shape, generator=g, dtype=t.dtype)) for t in small.fusion.inputs}
    for t in ignored:
        inputs["target"][t] = -100
    ref, got = ed.evaluate(small, inputs), ed.simulate(plan, inputs)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-10, atol=1e-12)


def test_cross_entropy_of_class_sharded_logits_moves_four_row_statistics():
    plan = ed.optimize(loss_of_logits(ROWS, VOCAB, BF16), MESH)
    row = ROWS * 2  # one bf16 per row
    assert len(plan.collectives) == 4 and all(c.bytes == row for c in plan.collectives), plan.explain()
    assert [(c.kind, c.reduce) for c in plan.collectives if c.reduce == "max"] == [("allreduce", "max")]
    assert sum(c.bytes for c in plan.collectives) < 0.01 * ROWS * VOCAB * 2 / 4  # < 1% of a rank's logits
    assert {s.rules[0] for s in plan.compute_steps} >= {"amax_over_sharded_axis", "sum_over_sharded_axis",
                                                         "take_along_sharded_axis"}
    simulate_equals_reference(loss_of_logits(8, 22, F64), plan, 22)  # 22 classes: shards of 6, 6, 6, 4


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_with_ignore_index_of_class_sharded_logits_moves_the_same_row_statistics(reduction):
    """transformers' loss (ignore_index=-100: prompt and padding tokens left out, the mean over the tokens
    kept): the mask is the target's, which every rank holds, so the same four row statistics move as
    without it; the row-sharded mean's kernel (dividing by the row count) is never used."""
    plan = ed.optimize(loss_of_logits(ROWS, VOCAB, BF16, reduction, ignore_index=-100), MESH)
    assert len(plan.collectives) == 4 and all(c.bytes == ROWS * 2 for c in plan.collectives), plan.explain()
    assert [(c.kind, c.reduce) for c in plan.collectives if c.reduce == "max"] == [("allreduce", "max")]
    assert {s.rules[0] for s in plan.compute_steps} >= {"amax_over_sharded_axis", "sum_over_sharded_axis",
                                                         "take_along_sharded_axis"}
    assert "global_count" not in {f for s in plan.compute_steps for f, _ in s.flags}, plan.explain()
    simulate_equals_reference(loss_of_logits(8, 22, F64, reduction, ignore_index=-100), plan, 22, ignored=[0, 3, 7])


def test_mean_with_ignore_index_of_row_sharded_logits_never_divides_by_the_row_count():
    """The row-sharded mean's kernel divides a rank's summed loss by the row count; with ignore_index the
    mean is over the rows kept, which no rank counts alone: the plan moves per-row losses and the mask
    (the decomposition), never the logits, and simulates to the reference with ignored rows."""
    def rows_sharded(n, c, dtype):
        fd = loss_of_logits(n, c, dtype, ignore_index=-100)
        for t in ("logits", "target"):
            apply_layout(fd[t], Layout.parse("[S(0)]"), MESH)
        return fd

    plan = ed.optimize(rows_sharded(ROWS, 32000, BF16), MESH)
    assert "global_count" not in {f for s in plan.compute_steps for f, _ in s.flags}, plan.explain()
    assert plan.collectives and all(c.bytes <= ROWS * 2 for c in plan.collectives), plan.explain()
    simulate_equals_reference(rows_sharded(8, 6, F64), plan, 6, ignored=[0, 1, 5])


@pytest.mark.parametrize("ignore_index", [None, -100])
def test_lm_head_and_loss_gradient_under_a_1_gib_bound_is_vocab_parallel(ignore_index):
    """The lm head's rows split over the ranks (its logits class-sharded); the loss, its backward and the
    head's gradient never move a [tokens, vocab] tensor: only row statistics and grad_x, the activation
    gradient Megatron's vocab-parallel loss all-reduces too. The same with transformers' ignore_index
    (the backward's rows of ignored tokens zero)."""
    cm = ed.CostModel.h200(memory_limit=1 << 30)
    plan = ed.optimize(lm_head_step(ROWS, HIDDEN, VOCAB, BF16, ignore_index), MESH, cm)
    assert plan.memory <= 1 << 30
    assert str(plan.layout_of("w")) == str(plan.layout_of("grad_w")) == "[S(0)]"
    big = {c.tensor for c in plan.collectives if c.bytes > ROWS * 4}
    assert big <= {"grad_x"}, plan.explain()  # nothing of the logits' [4096, 128256] moves
    logits = ROWS * VOCAB * 2
    assert sum(c.bytes for c in plan.collectives if c.tensor != "grad_x") < 0.01 * logits / 4
    simulate_equals_reference(lm_head_step(8, 8, 22, F64, ignore_index), plan, 22,
                              ignored=[1, 2, 6] if ignore_index is not None else [])
