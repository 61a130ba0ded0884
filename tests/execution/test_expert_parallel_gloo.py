"""Expert parallelism on four gloo processes (issue 28 item 4): the mixture-of-experts MLP of
tests/optimizer/test_expert_parallel.py with its weights split on the expert axis, forward and training
step, equals the single-device run on every rank. The plans are chosen at 256 tokens in bf16 (each rank
computes the rows of its own experts: grouped_mm_experts, or expert_combine, which then sends each row to the
rank whose block holds it by an all-to-all of uneven counts; the weight gradients per expert on the rank that
holds it: grouped_wgrad_experts, or expert_dispatch_wgrad from the rows dispatched to it) and replayed at small float32 shapes with uneven counts (12 tokens, d and f 8, 8
experts, ids up to 8: rows past offsets[-1]). One launch runs every replay of the module (its `runs`)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import egraph_did as ed
from egraph_did.collectives import exchange_run, exchange_simulate
from egraph_did.launcher import launch
from egraph_did.layout import Layout
from egraph_did.pins import apply_layout

from gloo_replay import assert_ranks_equal, random_inputs, replay, run_on_gloo

sys.path.insert(0, str(Path(__file__).parents[1] / "optimizer"))
from test_expert_parallel import (BF16, BOUND, D, E, EP_TOKENS, EXPERT_SHARDED, F, MESH, WEIGHTS_AND_GRADIENTS,  # noqa: E402
                                  mixtral_experts, mixtral_step, moe, torch_step)

F32 = torch.float32


def step(s, d, f, dtype):
    """The training step of moe(): loss = sum(y * c), gradients of x, w1 and w2; the weights and their
    gradients split on the experts."""
    fd = moe(s, d, f, E, dtype, EXPERT_SHARDED)
    c = fd.define_tensor((s, d), dtype, name="c")
    fd.add_output(fd.ops.sum(fd.ops.mul(fd["y"], c)), name="loss")
    g = ed.grad(fd, loss="loss", wrt=["x", "w1", "w2"])
    for name in ("w1", "w2", "grad_w1", "grad_w2"):
        apply_layout(g[name], Layout.parse("[S(0)]"), MESH)
    for name in ("x", "c", "grad_x", "loss"):
        apply_layout(g[name], Layout.parse("[R]"), MESH)
    return g


# every replay's tolerance: float32 replays 1e-5 (gloo_replay's default), the float64 ones of Mixtral's experts tighter
TOLS = {"forward": 1e-5, "training_step": 1e-5, "experts": 1e-12, "step": 1e-10}


@pytest.fixture(scope="module")
def runs():
    """The four replays of the tests below (gloo_replay.replay: each plan chosen at its big shapes, replayed at
    small ones), their inputs (each test's own seeded stream, as it drew them) and ed.evaluate's outputs, all run
    on four gloo ranks in one launch (a launch's start-up, four processes importing torch, is seconds of the
    module's time): (plans, small fusions, inputs, want, per-rank results), each by replay name. Each test checks
    its plans for their strategies and its ranks against want."""
    specs = {"forward": (moe(256, D, F, E, BF16, EXPERT_SHARDED), ed.CostModel.h200(memory_limit=BOUND),
                         moe(12, 8, 8, E, F32, EXPERT_SHARDED)),
             "training_step": (step(256, D, F, BF16), ed.CostModel.h200(), step(12, 8, 8, F32)),
             "experts": (mixtral_experts(8192, 4096, 14336, E, BF16, EP_TOKENS, MESH), ed.CostModel.h200(),
                         mixtral_experts(10, 8, 6, E, torch.float64, EP_TOKENS, MESH)),
             "step": (mixtral_step(8192, 4096, 14336, BF16), ed.CostModel.h200(), mixtral_step(10, 8, 6, torch.float64))}
    g4, g28, g6 = (torch.Generator().manual_seed(seed) for seed in (4, 28, 6))
    draw = {"forward": lambda small: random_inputs(small, g4, F32, index_high=E + 1),
            "training_step": lambda small: random_inputs(small, g4, F32, index_high=E + 1),
            "experts": lambda small: random_inputs(small, g28, torch.float64, index_high=E + 1),
            "step": lambda small: random_inputs(small, g6, torch.float64, index_high=E + 1)}
    plans, smalls, inputs, want = {}, {}, {}, {}
    for name, (big, cm, small) in specs.items():
        plans[name], smalls[name] = replay(big, small, cm), small
        inputs[name] = draw[name](small)
        want[name] = ed.evaluate(small, inputs[name])
    return plans, smalls, inputs, want, run_on_gloo(plans, inputs)


def _ranks_equal(runs, names) -> None:
    *_, want, results = runs
    for name in names:
        assert_ranks_equal([{name: got[name]} for got in results], {name: want[name]}, rtol=TOLS[name],
                           atol=TOLS[name])


def test_expert_parallel_forward_and_training_step_on_four_gloo_ranks_equal_one_device(runs):
    def experts_stay(name, plan):
        rules = {r for s in plan.compute_steps for r in s.rules}
        assert rules & {"grouped_mm_experts", "expert_combine"}, plan.explain()  # each rank its experts' rows
        if name == "training_step":  # the hidden rows' gradient is expert rows: x's rows dispatched to it
            assert rules & {"grouped_wgrad_experts", "expert_dispatch_wgrad"}, plan.explain()
        assert not any(c.tensor in ("w1", "w2", "grad_w1", "grad_w2") for c in plan.collectives), plan.explain()
    for name in ("forward", "training_step"):
        experts_stay(name, runs[0][name])
    _ranks_equal(runs, ("forward", "training_step"))


def test_token_dispatch_and_combine_as_uneven_all_to_alls_on_four_gloo_ranks_equal_one_device(runs):
    """Mixtral's experts with the rows split over 4 ranks and the experts' weights on their ranks
    (test_expert_parallel's EP_TOKENS): the plan chosen at Mixtral 8x7B's sizes (expert_dispatch and
    expert_combine: one all_to_all_single each, split sizes read from the offsets on every rank) replayed on
    10 rows, float64 (d 8, f 6, 8 experts, ids up to 8: uneven counts, likely empty experts, rows past
    offsets[-1], row blocks 3, 3, 3, 1), equals the single-device reference on every rank to 1e-12."""
    plan = runs[0]["experts"]
    assert [s.flags for s in plan.compute_steps if s.op == "grouped_mm"] == [
        (("ep_dispatch", (0,)),), (("ep_combine", (0,)),)], plan.explain()
    assert plan.collectives == [], plan.explain()
    _ranks_equal(runs, ("experts",))


def test_the_expert_parallel_training_step_on_four_gloo_ranks_equals_one_device_and_autograd(runs):
    """Mixtral's experts' training step with the rows split over 4 ranks and the weights and their gradients
    on their experts (test_expert_parallel's mixtral_step): the plan chosen at Mixtral 8x7B's sizes (tokens
    dispatched and combined forward and backward, the weight gradients from rows dispatched to their
    experts' ranks: six uneven all_to_all_singles inside the grouped steps, the loss's all-reduce the only
    collective) replayed on 10 rows, float64 (d 8, f 6, 8 experts, ids up to 8: uneven counts, likely empty
    experts, rows past offsets[-1]), equals on every rank the single-device reference, y, the loss, grad_x,
    grad_w1 and grad_w2, to 1e-10; the reference equals torch's autograd of the same step."""
    plans, _, inputs, want, _ = runs
    plan = plans["step"]
    assert [s.flags[0][0] for s in plan.compute_steps if s.op.startswith("grouped_mm")] == [
        "ep_dispatch", "ep_combine", "ep_dispatch", "ep_combine", "ep_wgrad", "ep_wgrad"], plan.explain()
    assert [c.tensor for c in plan.collectives] == ["loss"], plan.explain()
    assert all(str(plan.layout_of(n)) == "[S(0)]" for n in WEIGHTS_AND_GRADIENTS)
    for k, v in torch_step(inputs["step"], 6).items():
        torch.testing.assert_close(want["step"][k], v, rtol=1e-10, atol=1e-10)
    _ranks_equal(runs, ("step",))


# two groups of two ranks each, in mesh order unlike the global ranks' (as on mesh axis 0 of [[2, 0], [3, 1]])
GROUPS = ((2, 0), (3, 1))
EXCHANGE_CASES = {  # name: (row blocks, expert spans) of 7 rows: dispatch goes blocks -> spans, combine back
    "uneven": (((0, 4), (4, 7)), ((0, 1), (1, 6))),  # row 6 past offsets[-1]
    "all-to-one": (((0, 4), (4, 7)), ((0, 7), (7, 7))),  # every row to the first member, none to the second
    "none": (((0, 4), (4, 7)), ((0, 0), (0, 0))),  # every expert empty: nothing moves, every rank still calls
}


def exchange_all(rank: int, tables: dict) -> dict:
    group = next(g for g in GROUPS if rank in g)
    me = group.index(rank)
    out = {}
    for name, (blocks, spans) in EXCHANGE_CASES.items():
        t = tables[group][name]
        for way, (src, dst) in (("dispatch", (blocks, spans)), ("combine", (spans, blocks))):
            held = t[src[me][0]: src[me][1]]
            out[name, way] = exchange_run(held, src, dst, group, me, timeout=60)
    return out


def test_the_exchange_on_gloo_equals_simulate_for_groups_of_one_mesh_axis_in_shuffled_rank_order():
    """collectives.exchange_run (one all_to_all_single of the default group, 0 to and from ranks outside the
    group) gives each rank collectives.exchange_simulate's result: two groups exchanging at once, members in
    mesh order unlike global rank order, uneven counts, everything to one rank, nothing at all (float64,
    bit for bit: rows are moved, not summed)."""
    g = torch.Generator().manual_seed(5)
    tables = {grp: {name: torch.randn(7, 3, generator=g, dtype=torch.float64) for name in EXCHANGE_CASES} for grp in GROUPS}
    results = launch(exchange_all, nprocs=4, backend="gloo", args=(tables,), timeout=120)
    for grp in GROUPS:
        for name, (blocks, spans) in EXCHANGE_CASES.items():
            t = tables[grp][name]
            for way, (src, dst) in (("dispatch", (blocks, spans)), ("combine", (spans, blocks))):
                want = exchange_simulate([t[a:b] for a, b in src], src, dst)
                for me, rank in enumerate(grp):
                    assert torch.equal(results[rank][name, way], want[me]), (grp, name, way, rank)
