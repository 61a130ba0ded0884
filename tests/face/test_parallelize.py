"""ed.parallelize on 4 gloo processes: a 2-layer MLP and a GPT-2 block, their parameters DTensors in the
plans' placements, give the unsharded module's forward and, through torch.optim.AdamW on the DTensor
parameters, its losses and parameters after 3 steps (float32, relative 1e-5). One launch runs every
check that needs ranks (each rank's results come back to the test); the errors without a process group
are checked here.
"""
from __future__ import annotations

import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # torch.export imports Triton, whose jit reads this once

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import egraph_did as ed  # noqa: E402

from program.test_frontend import Block  # noqa: E402  the GPT-2-like block of the frontend's tests (tests/ is on the path)

TOL = dict(rtol=1e-5, atol=1e-5)
STEPS, LR = 3, 1e-2
# memory bounds (bytes per device the training step's joint plan holds, as the optimizer sums its values)
# that do not fit every parameter whole: the plans shard them (the MLP's smallest joint plan found holds
# 10 KiB, the replicated one 34 KiB; the block's 46 KiB and 119 KiB)
MLP_LIMIT, BLOCK_LIMIT = 14_000, 60_000


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 8))


def make_block() -> nn.Module:
    """The block with its qkv bias frozen: the key bias's gradient is zero in exact arithmetic (softmax
    does not see a shift of every score of a query), so in float32 it is rounding noise, which AdamW's
    first step (g / sqrt(g^2)) would turn into a full step of either sign. A frozen parameter stays a
    DTensor and gets no gradient."""
    torch.manual_seed(0)
    block = Block(16, 4).eval()
    block.qkv.bias.requires_grad_(False)
    return block


def inputs(shape) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g) for _ in range(STEPS + 1)]


CASES = {"mlp": (make_mlp, (2, 5, 8), MLP_LIMIT), "gpt_block": (make_block, (1, 8, 16), BLOCK_LIMIT)}


def train(module: nn.Module, xs: list[torch.Tensor]) -> dict:
    """The forward at xs[0], then STEPS AdamW steps on loss = mean(module(x)^2) at xs[1:]."""
    out = {"forward": module(xs[0]).detach()}
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    losses = []
    for x in xs[1:]:
        opt.zero_grad()
        loss = module(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    out["losses"] = torch.stack(losses)
    return out


def distributed_parameters(module: nn.Module) -> dict:
    """What the tests check of a parallelized module's parameters on one rank: whether all are DTensors,
    their placements and their gradients' (those that require one), and their whole values."""
    from torch.distributed.tensor import DTensor

    params = dict(module.named_parameters())
    return {"dtensors": all(isinstance(p, DTensor) for p in params.values()),
            "placements": {n: tuple(str(q) for q in p.placements) for n, p in params.items()},
            "grad_placements": {n: tuple(str(q) for q in p.grad.placements) for n, p in params.items()
                                if p.requires_grad},
            "params": {n: p.full_tensor().detach() for n, p in params.items()}}


def work(rank: int) -> dict:
    """Every rank: parallelize both modules, train them, and record what the test checks."""
    mesh = ed.DeviceMesh.arange(4)
    results = {}
    for name, (make, shape, limit) in CASES.items():
        xs = inputs(shape)
        module = ed.parallelize(make(), mesh, (xs[0],), memory_limit=limit)
        if name == "mlp":  # without autograd: the forward-only plan, which saves nothing for a backward
            with torch.no_grad():
                results["no_grad"] = module(xs[0])
            results["no_grad_outputs"] = (sorted(module.inference_plan().outputs), sorted(module.forward_plan.outputs))
        got = train(module, xs)
        got.update(distributed_parameters(module))
        got["class"] = type(module).__name__
        got["collectives"] = ([c.kind for c in module.forward_plan.collectives],
                              [c.kind for c in module.backward_plan().collectives])
        with pytest.raises(ed.ShapeError, match=r"the plans are for the example inputs' shape"):
            module(torch.randn(shape[0] + 1, *shape[1:]))
        with pytest.raises(ed.DtypeError, match="cast it"):
            module(xs[0].double())
        results[name] = got
        if name == "mlp":  # an input that requires grad gets its gradient, whole (another backward plan)
            x = xs[0].clone().requires_grad_()
            module(x).square().sum().backward()
            results["grad_x"] = x.grad
    with pytest.raises(ed.ParallelizeError, match=r"world size 4; run one process per mesh rank"):
        ed.parallelize(make_mlp(), ed.DeviceMesh.arange(2), (x,))
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return ed.launch(work, nprocs=4, backend="gloo", timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_three_adamw_steps_equal_the_unsharded_module(ranks, name):
    make, shape, _ = CASES[name]
    reference = make()
    want = train(reference, inputs(shape))
    for got in ranks:
        r = got[name]
        torch.testing.assert_close(r["forward"], want["forward"], **TOL)
        torch.testing.assert_close(r["losses"], want["losses"], **TOL)
        assert r["params"].keys() == dict(reference.named_parameters()).keys()  # state_dict keys unchanged
        for n, p in reference.named_parameters():
            torch.testing.assert_close(r["params"][n], p.detach(), **TOL)


@pytest.mark.parametrize("name", list(CASES))
def test_parameters_are_dtensors_in_the_plan_placements_and_so_are_their_grads(ranks, name):
    r = ranks[0][name]
    assert r["dtensors"] and r["class"].startswith("Parallel")
    assert r["grad_placements"] == {n: p for n, p in r["placements"].items() if n != "qkv.bias"}
    assert any("S(" in str(p) for p in r["placements"].values()), "the memory bound makes the plan shard"
    assert r["collectives"][0], "the sharded forward moves data between ranks"
    assert all(got[name]["placements"] == r["placements"] for got in ranks)


def test_mlp_plan_is_megatron_column_then_row_parallel(ranks):
    placements = ranks[0]["mlp"]["placements"]
    assert placements["0.weight"] == ("S(0)",) and placements["2.weight"] == ("S(1)",)
    # one allreduce of the output; the weight gradients land in the weights' shards without a collective
    assert ranks[0]["mlp"]["collectives"] == (["allreduce"], [])


def test_without_autograd_the_forward_only_plan_runs_and_saves_nothing(ranks):
    want = make_mlp()(inputs((2, 5, 8))[0])
    for got in ranks:
        torch.testing.assert_close(got["no_grad"], want, **TOL)
    inference, forward = ranks[0]["no_grad_outputs"]
    assert inference == ["out"] and "out" in forward and any(n.startswith("saved.") for n in forward)


def test_an_input_that_requires_grad_gets_its_gradient_whole(ranks):
    module = make_mlp()
    train(module, inputs((2, 5, 8)))  # as the ranks had, before
    x = inputs((2, 5, 8))[0].requires_grad_()
    module(x).square().sum().backward()
    for got in ranks:
        torch.testing.assert_close(got["grad_x"], x.grad, **TOL)


def test_without_a_process_group_parallelize_says_how_to_start_one():
    with pytest.raises(ed.ParallelizeError, match=r"ed.launch\(fn, nprocs=...\) or torchrun"):
        ed.parallelize(make_mlp(), ed.DeviceMesh.arange(4), (torch.randn(2, 5, 8),))
    with pytest.raises(ed.ParallelizeError, match="example_inputs must be a tuple"):
        ed.parallelize(make_mlp(), ed.DeviceMesh.arange(4), torch.randn(2, 5, 8))


def test_recompute_bounds_what_lives_across_the_step_and_is_off_by_default():
    """parallelize(recompute=...) reaches the joint fusion: with markers the joint plan's memory counts what
    lives across the step (parameters, gradients, saved activations), so the bound that shards the MLP's
    parameters without markers (MLP_LIMIT: the replicated plan holds 34 KiB) holds the replicated plan with
    them; the default (False) is the every-value model the bounds here were chosen for."""
    import inspect
    from egraph_did.parallelize import optimize_joint
    assert inspect.signature(ed.parallelize).parameters["recompute"].default is False
    make, shape, limit = CASES["mlp"]
    mesh, x = ed.DeviceMesh.arange(4), torch.randn(*shape)
    placements = {}
    for recompute in (False, True):
        fd = ed.from_torch(make(), (x,))
        for name in fd.fusion.outputs:
            fd[name].set_device_mesh(mesh)
        split = optimize_joint(fd, list(fd.fusion.outputs), list(fd.params), mesh,
                               ed.CostModel.h200(limit), recompute=recompute)
        assert any(s.op == "saved" for s in split.joint.compute_steps) == recompute
        assert split.joint.memory <= limit
        placements[recompute] = {p: str(split.joint.layout_of(p)) for p in fd.params}
    assert set(placements[True].values()) == {"[R]"}
    assert set(placements[False].values()) != {"[R]"}
