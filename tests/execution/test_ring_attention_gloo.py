"""Ring attention on four gloo processes: the plans of tests/optimizer/test_ring_attention.py run through
plan.run, k and v passed round the ring by point-to-point sends, and give the single-device reference on
every rank, bit for bit what simulate gives (it merges in the ring's order): the golden long-sequence plan
(bidirectional sdpa) replayed at 8 positions, causal sdpa_lse on 12 positions, causal sdpa on a 2 x 2
(dp, cp) mesh with its rings over cp's groups, and training steps whose backward runs as a ring too (k and v
travelling with their dk, dv accumulators; bidirectional, and causal replayed on its rings), in one launch
(float64)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

import egraph_did as ed
from egraph_did.launcher import launch
from egraph_did.plan import Plan
from egraph_did.runtime import run_plan

sys.path.insert(0, str(Path(__file__).parents[1] / "optimizer"))
from test_ring_attention import (BF16, F64, MESH, PACED, SLOW, attention, attention_step, ring_rules,  # noqa: E402
                                 ring_steps)

MESH22 = ed.DeviceMesh(torch.arange(4).reshape(2, 2), axis_names=("dp", "cp"))


def run_all(rank: int, jobs: dict) -> dict:
    return {name: run_plan(Plan.from_json(plan), inputs) for name, (plan, inputs) in jobs.items()}


def test_ring_attention_on_four_gloo_ranks_equals_one_device():
    golden = ed.optimize(attention(1, 2, 32768, 128, BF16), MESH)
    cases = {
        "golden_replayed": (attention(1, 2, 8, 3, F64), lambda fd: ed.optimize(fd, MESH, like=golden)),
        "lse_causal": (attention(2, 2, 12, 3, F64, causal=True, lse=True), lambda fd: ed.optimize(fd, MESH, SLOW)),
        "causal_2x2": (attention(2, 2, 8, 3, F64, causal=True, mesh=MESH22, lay="[S(0), S(2)]"),
                       lambda fd: ed.optimize(fd, MESH22, SLOW)),
    }
    step_golden = ed.optimize(attention_step(1, 2, 12, 3, F64), MESH, PACED)
    steps = {  # the training step: forward and backward rings (its loss allreduced)
        "training_step": (attention_step(1, 2, 8, 3, F64), lambda fd: ed.optimize(fd, MESH, PACED)),
        "training_step_causal": (attention_step(1, 2, 12, 3, F64, causal=True),
                                 lambda fd: ed.optimize(fd, MESH, like=step_golden)),
    }
    jobs, want, sim = {}, {}, {}
    for name, (fd, plan_of) in {**cases, **steps}.items():
        plan = plan_of(fd)
        if name in steps:
            assert len(ring_rules(plan)) == 2 and [c.tensor for c in plan.collectives] == ["loss"], plan.explain()
        else:
            assert len(ring_steps(plan)) == 1 and not plan.collectives, plan.explain()
        g = torch.Generator().manual_seed(4)
        inputs = {t.name: torch.randn(t.shape, generator=g, dtype=F64) for t in fd.fusion.inputs}
        jobs[name], want[name], sim[name] = (plan.to_json(), inputs), ed.evaluate(fd, inputs), ed.simulate(plan, inputs)
    for rank, got in enumerate(launch(run_all, nprocs=4, args=(jobs,), timeout=180)):
        for name in jobs:
            for out, ref in want[name].items():
                torch.testing.assert_close(got[name][out], ref, rtol=1e-12, atol=1e-12, msg=f"{name}: {out} on rank {rank}")
                if out != "loss":  # (an allreduce: gloo's order of sums, not simulate's)
                    assert torch.equal(got[name][out], sim[name][out]), f"{name}: {out} on rank {rank}: merged as simulate does"
