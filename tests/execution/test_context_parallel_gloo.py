"""Context parallelism on four gloo processes (issue 28 item 2): attention with k and v pinned split on the
sequence, run as a reduction over the key blocks, equals the single-device run on every rank. The plans are
those of tests/optimizer/test_context_parallel.py (chosen at long-context bf16 shapes), replayed at small
float32 ones with uneven blocks (10 keys: 3, 3, 3, 1): the queries gathered and the block outputs sent to
the queries' split by all-to-all; the merge as an allreduce(max) and a bucketed allreduce(sum), causal;
and a training step whose dq is reduce-scattered while dk and dv stay where their keys are. One launch
runs them all (process start-up dominates)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

import egraph_did as ed
from egraph_did.launcher import launch
from egraph_did.plan import Plan
from egraph_did.runtime import run_plan

sys.path.insert(0, str(Path(__file__).parents[1] / "optimizer"))
from test_context_parallel import BF16, DECODE, MESH, SEQ_SHARDED, attention, attention_step, dear_gathers  # noqa: E402

F32 = torch.float32


def run(rank: int, plans: dict, inputs: dict):
    return {name: run_plan(Plan.from_json(text), inputs[name]) for name, text in plans.items()}


def test_attention_over_sequence_sharded_keys_on_four_gloo_ranks_equals_one_device():
    step_pins = {**dict.fromkeys(("q", "g", "k", "v", "grad_q", "grad_k", "grad_v"), "[S(2)]"), "loss": "R"}
    specs = {  # name -> (big fusion, cost model, small fusion)
        "pass_q": (attention(1, 16, 512, 65536, 128, BF16, SEQ_SHARDED), None,
                   attention(1, 2, 7, 10, 3, F32, SEQ_SHARDED)),
        "pending_max_and_sums_causal": (attention(1, 16, 64, 64, 128, BF16, DECODE, causal=True, lse=True),
                                        dear_gathers(), attention(2, 1, 10, 10, 2, F32, DECODE, causal=True, lse=True)),
        "training_step": (attention_step(1, 16, 512, 65536, 128, BF16, step_pins), None,
                          attention_step(1, 4, 7, 10, 3, F32, step_pins)),
    }
    plans, inputs, want = {}, {}, {}
    g = torch.Generator().manual_seed(0)
    for name, (big, cm, small) in specs.items():
        plan = ed.optimize(small, MESH, like=ed.optimize(big, MESH, cm))
        assert not any(c.tensor in ("k", "v") for c in plan.collectives), plan.explain()
        assert "attention_blocks" in {s.op for s in plan.compute_steps}, plan.explain()
        plans[name] = plan.to_json()
        inputs[name] = {t.name: torch.randn(t.shape, generator=g, dtype=F32) for t in small.fusion.inputs}
        want[name] = ed.evaluate(small, inputs[name])
    kinds = {c.kind for text in plans.values() for c in Plan.from_json(text).collectives}
    assert {"allgather", "alltoall", "allreduce", "reduce_scatter"} <= kinds
    results = launch(run, nprocs=4, backend="gloo", args=(plans, inputs), timeout=180)
    for rank, got in enumerate(results):
        for name in plans:
            for out, ref in want[name].items():
                torch.testing.assert_close(got[name][out], ref, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{name}: {out} on rank {rank}: {m}")
