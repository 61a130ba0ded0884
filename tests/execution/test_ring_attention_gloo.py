"""Attention over sequence shards on four gloo processes, in one launch (a launch's start-up, four processes
importing torch, is seconds of the module's time).

Ring attention: the plans of tests/optimizer/test_ring_attention.py run through plan.run, k and v passed round
the ring by point-to-point sends, and give the single-device reference on every rank, bit for bit what simulate
gives (it merges in the ring's order): the golden long-sequence plan (bidirectional sdpa) replayed at 8
positions, causal sdpa_lse on 12 positions, causal sdpa on a 2 x 2 (dp, cp) mesh with its rings over cp's
groups, and training steps whose backward runs as a ring too (k and v travelling with their dk, dv
accumulators; bidirectional, and causal replayed on its rings) (float64).

Context parallelism (issue 28 item 2): attention with k and
v pinned split on the sequence, run as a reduction over the key blocks, equals the single-device run on every
rank. The plans are those of tests/optimizer/test_context_parallel.py (chosen at long-context bf16 shapes),
replayed at small float32 ones with uneven blocks (10 keys: 3, 3, 3, 1): the queries gathered and the block
outputs sent to the queries' split by all-to-all; the merge as an allreduce(max) and a bucketed
allreduce(sum), causal; and a training step whose dq is reduce-scattered while dk and dv stay where their keys
are.

Collective matmul: the rings of
tests/optimizer/test_collective_matmul.py (an MLP with sequence-parallel x and y, column- then row-parallel
weights, both GEMMs as rings under a slow-link cost model) run through plan.run, point-to-point sends round the
ring, and give the single-device reference on every rank, bit for bit what simulate gives (it adds in the ring's
order): matmul, linear and the matmul on a 2x2 (dp, tp) mesh with its rings over tp's groups (float64: against
the reference the ring only reorders sums)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import egraph_did as ed
from egraph_did.launcher import launch
from egraph_did.plan import Plan
from egraph_did.runtime import run_plan

from gloo_replay import assert_ranks_equal, random_inputs, replay

sys.path.insert(0, str(Path(__file__).parents[1] / "optimizer"))
from test_ring_attention import (BF16, F64, MESH, PACED, SLOW, attention, attention_step, ring_rules,  # noqa: E402
                                 ring_steps)
import test_context_parallel as cp  # noqa: E402
import test_collective_matmul as cm  # noqa: E402

MESH22 = ed.DeviceMesh(torch.arange(4).reshape(2, 2), axis_names=("dp", "cp"))
F32 = torch.float32
CP = "context parallel: "  # the context-parallel plans' names in the launch
CM = "collective matmul: "  # the collective matmul plans' names in the launch


def run_all(rank: int, jobs: dict) -> dict:
    return {name: run_plan(Plan.from_json(plan), inputs) for name, (plan, inputs) in jobs.items()}


def ring_jobs() -> tuple[dict, dict, dict]:
    """The ring plans, each checked for its rings: (jobs, want, simulate's outputs) by name."""
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
    return jobs, want, sim


def context_parallel_plans() -> tuple[dict, dict, dict]:
    """The context-parallel replays (gloo_replay.replay), unchecked: (plans, inputs, want) by name."""
    step_pins = {**dict.fromkeys(("q", "g", "k", "v", "grad_q", "grad_k", "grad_v"), "[S(2)]"), "loss": "R"}
    specs = {  # name -> (big fusion, cost model, small fusion)
        "pass_q": (cp.attention(1, 16, 512, 65536, 128, BF16, cp.SEQ_SHARDED), None,
                   cp.attention(1, 2, 7, 10, 3, F32, cp.SEQ_SHARDED)),
        "pending_max_and_sums_causal": (cp.attention(1, 16, 64, 64, 128, BF16, cp.DECODE, causal=True, lse=True),
                                        cp.dear_gathers(),
                                        cp.attention(2, 1, 10, 10, 2, F32, cp.DECODE, causal=True, lse=True)),
        "training_step": (cp.attention_step(1, 16, 512, 65536, 128, BF16, step_pins), None,
                          cp.attention_step(1, 4, 7, 10, 3, F32, step_pins)),
    }
    g = torch.Generator().manual_seed(0)
    plans, inputs, want = {}, {}, {}
    for name, (big, cm, small) in specs.items():
        plans[name] = replay(big, small, cm)
        inputs[name] = random_inputs(small, g, F32)
        want[name] = ed.evaluate(small, inputs[name])
    return plans, inputs, want


def collective_matmul_jobs() -> tuple[dict, dict, dict, dict]:
    """The collective matmul plans by op: (plans, jobs, want, simulate's y)."""
    mesh = ed.DeviceMesh.arange(4)
    plans, jobs, want, sim = {}, {}, {}, {}
    for op in ("matmul", "linear", "2d"):
        fd = cm.mlp_2d(cm.MESH2) if op == "2d" else cm.mlp(16, 8, 32, torch.float64, mesh, op)
        plans[op] = plan = ed.optimize(fd, cm.MESH2 if op == "2d" else mesh, cost_model=cm.SLOW)
        g = torch.Generator().manual_seed(1)
        inputs = {t.name: torch.randn(t.shape, generator=g, dtype=torch.float64) for t in fd.fusion.inputs}
        jobs[op], want[op] = (plan.to_json(), inputs), ed.evaluate(fd, inputs)["y"]
        sim[op] = ed.simulate(plan, inputs)["y"]
    return plans, jobs, want, sim


@pytest.fixture(scope="module")
def runs():
    """Every plan of the three tests on four gloo ranks in one launch: (ring (jobs, want, sim), context-parallel
    (plans, want), collective matmul (plans, jobs, want, sim), per-rank results by name; the context-parallel
    ones' names prefixed CP, the collective matmul ones' CM)."""
    ring = ring_jobs()
    plans, inputs, want = context_parallel_plans()
    matmul = collective_matmul_jobs()
    jobs = (dict(ring[0]) | {CP + n: (p.to_json(), inputs[n]) for n, p in plans.items()}
            | {CM + op: job for op, job in matmul[1].items()})
    return ring, (plans, want), matmul, launch(run_all, nprocs=4, args=(jobs,), timeout=180)


def test_ring_attention_on_four_gloo_ranks_equals_one_device(runs):
    (jobs, want, sim), _, _, results = runs
    for rank, got in enumerate(results):
        for name in jobs:
            for out, ref in want[name].items():
                torch.testing.assert_close(got[name][out], ref, rtol=1e-12, atol=1e-12, msg=f"{name}: {out} on rank {rank}")
                if out != "loss":  # (an allreduce: gloo's order of sums, not simulate's)
                    assert torch.equal(got[name][out], sim[name][out]), f"{name}: {out} on rank {rank}: merged as simulate does"


def test_attention_over_sequence_sharded_keys_on_four_gloo_ranks_equals_one_device(runs):
    _, (plans, want), _, results = runs
    for plan in plans.values():  # the keys stay where they are; attention runs over the key blocks
        assert not any(c.tensor in ("k", "v") for c in plan.collectives), plan.explain()
        assert "attention_blocks" in {s.op for s in plan.compute_steps}, plan.explain()
    assert_ranks_equal([{n: got[CP + n] for n in plans} for got in results], want, rtol=1e-5, atol=1e-5)
    kinds = {c.kind for plan in plans.values() for c in plan.collectives}
    assert {"allgather", "alltoall", "allreduce", "reduce_scatter"} <= kinds


def test_rings_run_on_gloo_equal_to_the_reference(runs):
    *_, (plans, jobs, want, sim), results = runs
    for plan in plans.values():
        assert cm.rings(plan) == ["ag_ring", "rs_ring"]
    for rank, got in enumerate(results):
        for op in jobs:
            torch.testing.assert_close(got[CM + op]["y"], want[op], rtol=1e-12, atol=1e-12, msg=f"{op} on rank {rank}")
            assert torch.equal(got[CM + op]["y"], sim[op]), f"{op} on rank {rank}: the ring sums as simulate does"
