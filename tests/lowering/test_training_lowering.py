"""How a training step lowers (issue 30): the saved markers of the backward are aliases (no kernel
writes a copy), a weight's transpose for a GEMM is a view, each parameter's AdamW update is one kernel
that writes exactly its three results, and a loss (every axis reduced) splits over row chunks."""
import pytest
import torch

import egraph_did as ed
from egraph_did import models
from egraph_did.layout import Layout, R, S
from egraph_did.lowering import schedulers
from egraph_did.lowering.segment import lower, spec_from_fusion
from egraph_did.ops import SAVE_OP
from egraph_did.pins import apply_layout

MESH = ed.DeviceMesh.arange(4)


@pytest.fixture(scope="module")
def lowered():
    fd = models.gpt_training_step(1, 64, 128, 4)
    for n in ("x", "target"):
        apply_layout(fd[n], Layout((S(1),)), MESH)
    for t in list(fd.fusion.inputs):
        w = t.name.rsplit(".", 1)[-1]
        if t.name not in ("x", "target", "step"):
            layout = S(0) if w in ("wq", "wk", "wv", "w1") else S(1) if w in ("wo", "w2") else R
            for n in (t.name, "next." + t.name):
                apply_layout(fd[n], Layout((layout,)), MESH)
    plan = ed.optimize(fd, MESH, rewrites=())
    return plan, lower(plan)


def test_no_kernel_writes_a_saved_marker(lowered):
    plan, low = lowered
    fused = [s for s in low.segments if s.kind == "fused"]
    saved = {s.outputs[0] for s in plan.compute_steps if s.op == SAVE_OP}
    assert saved, "the step reads the forward through saved markers"
    assert not [s.describe() for s in fused if saved & set(s.outputs)]


def test_a_weights_transpose_is_a_view(lowered):
    plan, low = lowered
    inputs = {v for vals in plan.inputs.values() for v in vals}
    assert not [s.describe() for s in low.segments if s.kind == "fused" and s.scheduler == "transpose"
                and set(s.inputs) & inputs]


def test_each_adamw_update_is_one_kernel_writing_its_three_results(lowered):
    plan, low = lowered
    for w in ("wq", "wo", "w1", "w2"):
        nxt = {v for name, vals in plan.outputs.items() for v in [vals] if name in
               (f"next.{w}", f"next.exp_avg.{w}", f"next.exp_avg_sq.{w}")}
        (seg,) = [s for s in low.segments if s.kind == "fused" and nxt & set(s.outputs)]
        assert set(seg.outputs) == nxt, (w, seg.outputs)


def test_a_loss_over_every_axis_splits_over_row_chunks():
    with ed.FusionDefinition() as fd:
        y, t = fd.define_tensor((1, 2048, 12288), torch.bfloat16, name="y"), fd.define_tensor(
            (1, 2048, 12288), torch.bfloat16, name="t")
        e = fd.ops.sub(y, t)
        fd.add_output(fd.ops.mean(fd.ops.mul(e, e)), name="loss")
    s = schedulers.schedule(spec_from_fusion(fd.fusion))
    assert s.kind == "reduction" and s.outer and s.split == 512
