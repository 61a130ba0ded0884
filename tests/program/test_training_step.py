"""A training step is one fusion (forward, backward, optimizer update; egraph_did.grad.training_step): its
parameters after one and three steps equal torch.optim's (SGD, AdamW) in float64, and it optimizes on a
4-rank mesh and simulates to the single-device numbers.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

# torch.optim's first step imports triton (through torch._dynamo); Triton's jit reads TRITON_INTERPRET
# when a function is defined, so on a CPU machine it must be set before that, not when the first kernel
# of a plan compiles (lowering sets it then), or the sharded test's kernels fail to run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import egraph_did as ed
from egraph_did import ShapeError
from egraph_did import models
from egraph_did.models import gpt_layer, mlp

F64 = torch.float64

OPTIMIZERS = {
    "sgd": (ed.SGD(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "sgd-momentum-decay": (ed.SGD(lr=0.05, momentum=0.9, weight_decay=0.01),
                           lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01)),
    "sgd-nesterov": (ed.SGD(lr=0.05, momentum=0.8, nesterov=True),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True)),
    "adamw": (ed.AdamW(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)),
}


def _model(name, dtype=F64):
    """A model with loss = mean(y * y), its parameters (every float input but x)."""
    fd = {"mlp": lambda: mlp(tokens=6, hidden=8, dtype=dtype),
          "gpt_layer": lambda: gpt_layer(batch=2, seq=4, hidden=8, heads=2, dtype=dtype)}[name]()
    fd.add_output(fd.ops.mean(fd.ops.mul(fd["y"], fd["y"])), name="loss")
    return fd, [t.name for t in fd.fusion.inputs if t.name != "x"]


def _values(fusion, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g, dtype=t.dtype) * (0.5 if t.ndim > 1 else 1.0)
            for t in fusion.inputs}


def _initial_state(step_fd, values):
    """The step's inputs before the first step: the model's values, zero states, step 0."""
    return {t.name: values[t.name] if t.name in values else torch.zeros(t.shape, dtype=t.dtype)
            for t in step_fd.fusion.inputs}


def _advance(step_fd, state):
    """One step: the outputs `next.<name>` become the inputs `<name>`; returns (new state, loss)."""
    out = ed.evaluate(step_fd, state)
    new = dict(state)
    new.update({k[len("next."):]: v for k, v in out.items() if k.startswith("next.")})
    return new, out["loss"]


def _torch_steps(fd, params, values, make_opt, steps):
    """Parameters and losses of `steps` torch.optim steps, autograd through the reference evaluator."""
    leaves = {k: torch.nn.Parameter(v.clone()) if k in params else v for k, v in values.items()}
    opt = make_opt([leaves[p] for p in params])
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ed.evaluate(fd, leaves)["loss"]
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return {p: leaves[p].detach() for p in params}, losses


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("model", ["mlp", "gpt_layer"])
def test_training_steps_equal_torch_optim(model, opt, steps):
    fd, params = _model(model)
    ours, make_opt = OPTIMIZERS[opt]
    step_fd = ed.training_step(fd, "loss", params, ours)
    values = _values(fd.fusion)
    state, losses = _initial_state(step_fd, values), []
    for _ in range(steps):
        state, loss = _advance(step_fd, state)
        losses.append(loss)
    want, want_losses = _torch_steps(fd, params, values, make_opt, steps)
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-10, atol=1e-12)
    for p in params:
        torch.testing.assert_close(state[p], want[p], rtol=1e-9, atol=1e-12, msg=lambda m: f"{p}: {m}")
    assert state["step"].item() == steps
    assert not torch.equal(state[params[0]], values[params[0]])  # the step moved the parameters


def test_the_step_names_its_states_and_outputs():
    fd, params = _model("mlp")
    step_fd = ed.training_step(fd, "loss", ["w1"], ed.AdamW())
    assert [t.name for t in step_fd.fusion.inputs] == ["x", "w1", "w2", "step", "exp_avg.w1", "exp_avg_sq.w1"]
    assert list(step_fd.fusion.outputs) == ["loss", "next.w1", "next.exp_avg.w1", "next.exp_avg_sq.w1", "next.step"]


def test_a_taken_state_name_is_refused():
    fd, params = _model("mlp")
    fd.add_output(fd.ops.exp(fd["w1"]), name="exp_avg.w1")
    with pytest.raises(ShapeError, match=r"\['exp_avg.w1'\].*rename"):
        ed.training_step(fd, "loss", params, ed.AdamW())


def test_a_training_step_optimized_on_4_ranks_simulates_to_the_reference():
    fd, params = _model("mlp", torch.float32)
    step_fd = ed.training_step(fd, "loss", params, ed.AdamW(lr=0.01))
    mesh = ed.DeviceMesh.arange(4)
    x = step_fd["x"]
    x.set_device_mesh(mesh)
    x.outer_split(0, mesh.size)
    x.axis(0).parallelize(ed.ParallelType.DIDx)
    plan = ed.optimize(step_fd, mesh)
    state = _initial_state(step_fd, _values(fd.fusion))
    state["exp_avg.w1"] = torch.rand(state["exp_avg.w1"].shape)  # a later step: nonzero moments
    state["exp_avg_sq.w1"] = torch.rand(state["exp_avg_sq.w1"].shape)
    state["step"] = torch.tensor(2.0, dtype=F64)
    got, want = ed.simulate(plan, state), ed.evaluate(step_fd, state)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_the_gpt_training_step_model_lowers_the_loss():
    fd = ed.models.gpt_training_step(batch=2, seq=4, hidden=8, heads=2, dtype=F64, optimizer=ed.AdamW(lr=0.02))
    g = torch.Generator().manual_seed(0)
    state = {t.name: torch.randn(t.shape, generator=g, dtype=F64) * 0.5 if not t.name.startswith(("exp_avg", "step"))
             else torch.zeros(t.shape, dtype=F64) for t in fd.fusion.inputs}
    losses = []
    for _ in range(5):
        state, loss = _advance(fd, state)
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.9, losses


# ---------------------------------------------------------------------- flash attention: no [seq, seq] value

def test_a_gpt_training_step_holds_no_seq_by_seq_tensor_and_its_gradients_are_autograd_s():
    """sdpa runs as sdpa_lse in the step's forward and its backward is one sdpa_backward reading the
    logsumexp, so no value of the fusion or of its 2-rank plan has batch x heads x seq x seq elements (the
    scores and probabilities the backward written in ops held); the gradients (w - next.w under SGD with
    lr 1), simulated, equal torch.autograd through the reference in float64."""
    batch, seq, hidden, heads = 1, 64, 32, 4
    fd = gpt_layer(batch, seq, hidden, heads, F64)
    target = fd.define_tensor((batch, seq, hidden), F64, name="target")
    err = fd.ops.sub(fd["y"], target)
    fd.add_output(fd.ops.mean(fd.ops.mul(err, err)), name="loss")
    weights = [t.name for t in fd.fusion.inputs if t.name not in ("x", "target")]
    step = ed.training_step(fd, "loss", weights, ed.SGD(lr=1.0))
    scores = batch * heads * seq * seq  # the largest value a step without them holds: [1, 64, 128], 8192
    ops = {e.op.name for e in step.fusion.exprs}
    assert {"sdpa_lse", "sdpa_backward"} <= ops and "sdpa" not in ops, ops
    assert all(math.prod(t.shape) < scores for t in step.fusion.tensors.values())
    mesh = ed.DeviceMesh.arange(2)
    plan = ed.optimize(step, mesh)
    assert all(math.prod(v.shape) < scores for v in plan.values.values())
    g = torch.Generator().manual_seed(0)
    inputs = {t.name: torch.randn(t.shape, generator=g, dtype=F64) * (0.3 if t.name in weights else 1.0)
              for t in fd.fusion.inputs}
    state = {t.name: torch.zeros(t.shape, dtype=F64) for t in step.fusion.inputs if t.name not in inputs}
    got = ed.simulate(plan, {**inputs, **state})
    leaves = {k: v.clone().requires_grad_(k in weights) for k, v in inputs.items()}
    want = torch.autograd.grad(ed.evaluate(fd, leaves)["loss"], [leaves[w] for w in weights])
    for w, gw in zip(weights, want):
        torch.testing.assert_close(inputs[w] - got[f"next.{w}"], gw, rtol=1e-9, atol=1e-11, msg=lambda m: f"{w}: {m}")


def test_at_seq_8192_no_value_of_the_gpt_steps_4_rank_plan_is_seq_by_seq():
    """The issue's size: one GPT layer's training step (AdamW) at seq 8192, hidden 32, 4 heads, bf16, on 4
    ranks. Its largest value is [8192, 128] (the MLP's hidden); the scores would be 4 x 8192 x 8192."""
    seq = 8192
    plan = ed.optimize(models.gpt_training_step(1, seq, 32, 4, torch.bfloat16), ed.DeviceMesh.arange(4))
    assert max(math.prod(v.shape) for v in plan.values.values()) == seq * 128
