"""ed.parallelize of a module that drops out, on 4 gloo processes: in training mode each call draws new
masks from a seed every rank derives alike (no communication), the outputs and gradients equal the
unsharded arithmetic with those masks (float64, 1e-10), the backward reuses its forward's masks; a call in
eval mode runs the program without its dropouts; a module parallelized in eval mode refuses a call in
training mode instead of silently not dropping out.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # torch.export imports Triton, whose jit reads this once

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import egraph_did as ed  # noqa: E402
from egraph_did.ops import dropout_mask  # noqa: E402
from egraph_did.parallelize import seed_of  # noqa: E402

P = 0.25
TOL = dict(rtol=1e-10, atol=1e-10)
LIMIT = 22_000  # bytes per device for the step: below the replicated plan's, so the weights shard


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(approximate="tanh"), nn.Dropout(P),
                         nn.Linear(32, 8)).double()


def reference(module: nn.Module, x: torch.Tensor, seed: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """The unsharded arithmetic with dropout's mask for `seed` (None: no dropout), its output and the
    gradients of mean(y^2) by parameter name."""
    params = {n: p.detach().clone().requires_grad_() for n, p in module.named_parameters()}
    h = torch.nn.functional.gelu(x @ params["0.weight"].T + params["0.bias"], approximate="tanh")
    if seed is not None:  # the program's one dropout, at offset 0: counters are the flat indices
        h = h * dropout_mask(seed, P, torch.arange(h.numel())).view(h.shape) / (1 - P)
    y = h @ params["3.weight"].T + params["3.bias"]
    y.square().mean().backward()
    return y.detach(), {n: p.grad for n, p in params.items()}


def work(rank: int) -> dict:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    model = ed.parallelize(make_mlp().train(), ed.DeviceMesh.arange(4), (x,), memory_limit=LIMIT)
    out = {"ys": [], "grads": [], "seeds": []}
    for _ in range(2):
        model.zero_grad()
        y = model(x)
        y.square().mean().backward()
        out["ys"].append(y.detach())
        out["grads"].append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        out["seeds"].append(model.dropout_seed())
    out["seed_0"] = model.dropout_seed(0)
    out["placements"] = {n: tuple(str(q) for q in p.placements) for n, p in model.named_parameters()}
    model.eval()
    out["eval"] = model(x).detach()
    model.train()
    out["third"] = model(x).detach()
    frozen = ed.parallelize(make_mlp().eval(), ed.DeviceMesh.arange(4), (x,), memory_limit=LIMIT)
    frozen.train()
    try:
        frozen(x)
        out["refusal"] = None
    except ed.ParallelizeError as e:
        out["refusal"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return ed.launch(work, nprocs=4, backend="gloo", timeout=300)


def test_each_call_equals_the_unsharded_arithmetic_with_its_masks(ranks):
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for r in ranks:
        for y, grads, seed in zip(r["ys"], r["grads"], r["seeds"]):
            want_y, want_grads = reference(make_mlp(), x, seed)
            torch.testing.assert_close(y, want_y, **TOL)
            for name, g in want_grads.items():
                torch.testing.assert_close(grads[name], g, **TOL)
    some_dropped = ranks[0]["ys"][0] - reference(make_mlp(), x, None)[0]
    assert some_dropped.abs().max() > 1e-3  # the masks do drop: the output is not the undropped one


def test_the_weights_are_sharded_so_the_masks_are_drawn_on_shards(ranks):
    assert any(q.startswith(("S(", "Shard")) for pl in ranks[0]["placements"].values() for q in pl), ranks[0]["placements"]


def test_every_rank_draws_the_same_seed_and_every_call_a_new_one(ranks):
    seeds = [tuple(int(s) for s in r["seeds"]) for r in ranks]
    assert len(set(seeds)) == 1 and len(set(seeds[0])) == 2
    assert int(ranks[0]["seed_0"]) == seeds[0][0]
    assert not torch.equal(ranks[0]["ys"][0], ranks[0]["ys"][1])
    assert not torch.equal(ranks[0]["third"], ranks[0]["ys"][0])  # call 3 draws again after the eval call


def test_a_call_in_eval_mode_runs_without_dropout(ranks):
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for r in ranks:
        torch.testing.assert_close(r["eval"], reference(make_mlp(), x, None)[0], **TOL)


def test_a_module_parallelized_in_eval_mode_refuses_a_training_call(ranks):
    for r in ranks:
        assert r["refusal"] is not None and "parallelized in eval mode" in r["refusal"]
        assert "module.train() before ed.parallelize" in r["refusal"]


def test_seeds_are_a_fixed_function_of_the_base_seed_and_the_call():
    assert seed_of(5, 0).item() == seed_of(5, 0).item() != seed_of(5, 1).item() != seed_of(6, 1).item()
    assert seed_of(2 ** 63, 10).dtype == torch.int64
