"""Local kernels of rank-aware strategies: declared beside their op (egraph_did/ops.py), dispatched by
name by egraph_did/local.py."""
from dataclasses import replace

import pytest
import torch

import egraph_did as ed
from egraph_did.layout import Layout, R, S
from egraph_did.local import run_local
from egraph_did.ops import LINEAR_BIAS_ONCE, OPS, LocalKernel
from egraph_did.pins import apply_layout
from egraph_did.shards import Operand, RankContext

MESH = ed.DeviceMesh.arange(2)


def test_masked_gather_on_class_sharded_logits_keeps_infinite_logits_out_of_other_ranks_summands():
    x = torch.tensor([[0.0, 1.0, -float("inf"), 3.0]])  # -inf: a masked class, as language models pad
    index = torch.tensor([[1]])
    layout = Layout((S(1),))
    operands = {"x": Operand((1, 4), layout), "index": Operand((1, 1), Layout((R,)))}
    outs = [run_local("take_along_axis", {"x": x[:, 2 * r:2 * r + 2], "index": index, "dim": 1}, operands,
                      [Operand((1, 1), Layout((ed.Placement("P"),)))], {"masked_gather": [0]},
                      RankContext(MESH, r))[0] for r in MESH.ranks]
    assert torch.equal(outs[0] + outs[1], torch.tensor([[1.0]]))  # rank 1's lookup lands on -inf: 0, not nan


def test_vocab_parallel_rows_are_summed_once():
    table = torch.arange(12.0).reshape(6, 2)
    ids = torch.tensor([0, 5, 3])
    operands = {"indices": Operand((3,), Layout((R,))), "weight": Operand((6, 2), Layout((S(0),)))}
    outs = [run_local("embedding", {"indices": ids, "weight": table[3 * r:3 * r + 3]}, operands,
                      [Operand((3, 2), Layout((ed.Placement("P"),)))], {"vocab_parallel": [0]},
                      RankContext(MESH, r))[0] for r in MESH.ranks]
    assert torch.equal(outs[0] + outs[1], table[ids])


def _row_parallel_linear_plan():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 6), torch.float64, name="x")
        w = fd.define_tensor((3, 6), torch.float64, name="w")
        b = fd.define_tensor((3,), torch.float64, name="b")
        fd.add_output(fd.ops.linear(x, w, b), name="y")
    apply_layout(fd["x"], Layout((S(1),)), MESH)  # in-features split: row-parallel, a partial
    apply_layout(fd["w"], Layout((S(1),)), MESH)
    return fd, ed.optimize(fd, MESH)


def test_a_plan_stores_the_local_kernel_by_name_and_means_the_same_after_json():
    fd, plan = _row_parallel_linear_plan()
    (step,) = plan.compute_steps
    assert step.flags == (("bias_once", (0,)),)
    again = ed.Plan.from_json(plan.to_json())
    g = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in (("x", (4, 6)), ("w", (3, 6)),
                                                                              ("b", (3,)))}
    torch.testing.assert_close(ed.simulate(again, inputs)["y"], ed.evaluate(fd, inputs)["y"])


def test_a_step_runs_one_local_kernel(monkeypatch):
    """A local kernel computes the whole op: two on one step would each claim it."""
    other = LocalKernel("bias_twice", lambda args, operands, outputs, ctx, axes: None)
    monkeypatch.setitem(OPS, "linear", replace(OPS["linear"], local_kernels=(LINEAR_BIAS_ONCE, other)))
    operands = {"x": Operand((2, 4), Layout((S(1),))), "weight": Operand((3, 4), Layout((S(1),)))}
    args = {"x": torch.ones(2, 2), "weight": torch.ones(3, 2), "bias": torch.ones(3)}
    with pytest.raises(AssertionError, match="cannot combine"):
        run_local("linear", args, operands, [Operand((2, 3), Layout((ed.Placement("P"),)))],
                  {"bias_once": [0], "bias_twice": [0]}, RankContext(MESH, 0))
