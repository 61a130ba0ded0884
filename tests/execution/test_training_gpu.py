"""The training step on a GPU (issue 30; skipped without one): a GPT layer's step (forward, loss,
backward, AdamW) prepared once and replayed as a CUDA graph equals the prepared program bit for bit and
the single-device reference over three steps, each step's next weights and moments fed back; rank 0's
program of a 4-way plan (stand-in collectives) replays bit for bit too."""
import os

import pytest
import torch

import egraph_did as ed
from conftest import stand_in
from egraph_did import models
from egraph_did.layout import Layout, R, S
from egraph_did.lowering.graphs import Captured, run_graphed
from egraph_did.lowering.program import prepare, program_inputs
from egraph_did.pins import apply_layout
from egraph_did.shards import Operand, RankContext

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="TRITON_INTERPRET=1 in this session: run this file alone")]
SHAPE = (1, 64, 128, 4)


def state(plan, rank, seed=0):
    """Inputs in program_inputs order: small weights, norms near 1, moments >= 0 where squared, step 10."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ctx, out = RankContext(plan.mesh, rank), []
    for v in program_inputs(plan):
        val = plan.values[v]
        name = val.tensor
        if name == "step":
            out.append(torch.tensor(10.0, dtype=torch.float64, device="cuda"))
            continue
        t = torch.randn(ctx.local_shape(Operand(val.shape, val.layout)), generator=g, device="cuda")
        out.append(t.abs() * 1e-3 if name.startswith("exp_avg_sq.") else t * 1e-2 if name.startswith("exp_avg.")
                   else t * 0.1 + 1 if name.endswith(("ln1_w", "ln2_w")) else t * 0.1)
    return out


def feed_back(plan, ins, outs):
    """The next step's inputs: each `next.<name>` output where `<name>` is an input."""
    by_name = {plan.values[v].tensor: i for i, v in enumerate(program_inputs(plan))}
    new = list(ins)
    for name, o in zip(plan.outputs, outs):
        if name.startswith("next.") and name[5:] in by_name:
            new[by_name[name[5:]]] = o
    return new


def test_one_device_step_graphed_equals_lean_and_reference_over_three_steps():
    fd = models.gpt_training_step(*SHAPE, optimizer=ed.AdamW(lr=1e-2))
    plan = ed.optimize(fd, ed.DeviceMesh.arange(1))
    ins = state(plan, 0)
    lean, graphed = prepare(plan, 0, ins, None), prepare(plan, 0, ins, None)
    names = [plan.values[v].tensor for v in program_inputs(plan)]
    ref_state = {n: t.clone() for n, t in zip(names, ins)}
    a = b = ins
    for step in range(3):
        want = ed.evaluate(fd, ref_state)
        got_lean = lean.run(a)
        got_graph = [t.clone() for t in run_graphed(graphed, b)]
        assert all(torch.equal(x, y) for x, y in zip(got_lean, got_graph)), f"step {step}"
        for name, t in zip(plan.outputs, got_lean):
            err = ((t.double() - want[name].double()).norm() / want[name].double().norm().clamp_min(1e-30)).item()
            assert err < 1e-4, f"step {step} {name}: relative error {err:.2e}"
        a, b = feed_back(plan, a, got_lean), feed_back(plan, b, got_graph)
        ref_state.update({k[5:]: v for k, v in want.items() if k.startswith("next.")})
    assert isinstance(graphed.graph, Captured)


def test_rank_program_of_a_megatron_step_replays_bit_for_bit():
    mesh = ed.DeviceMesh.arange(4)
    fd = models.gpt_training_step(*SHAPE)
    for n in ("x", "target"):
        apply_layout(fd[n], Layout((S(1),)), mesh)
    for t in list(fd.fusion.inputs):
        w = t.name.rsplit(".", 1)[-1]
        if t.name not in ("x", "target", "step"):
            layout = S(0) if w in ("wq", "wk", "wv", "w1") else S(1) if w in ("wo", "w2") else R
            for n in (t.name, "next." + t.name):
                apply_layout(fd[n], Layout((layout,)), mesh)
    plan = ed.optimize(fd, mesh, rewrites=())
    ins = state(plan, 1)
    lean, graphed = prepare(plan, 1, ins, stand_in), prepare(plan, 1, ins, stand_in)
    for _ in range(3):
        want, got = lean.run(ins), run_graphed(graphed, ins)
        assert all(torch.equal(x, y) for x, y in zip(want, got))
    assert isinstance(graphed.graph, Captured)
