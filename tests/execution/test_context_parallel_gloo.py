"""Context parallelism on four gloo processes (issue 28 item 2): attention with k and v pinned split on the
sequence, run as a reduction over the key blocks, equals the single-device run on every rank. The plans are
those of tests/optimizer/test_context_parallel.py (chosen at long-context bf16 shapes), replayed at small
float32 ones with uneven blocks (10 keys: 3, 3, 3, 1): the queries gathered and the block outputs sent to
the queries' split by all-to-all; the merge as an allreduce(max) and a bucketed allreduce(sum), causal;
and a training step whose dq is reduce-scattered while dk and dv stay where their keys are. One launch
runs them all (gloo_replay.replay_and_run)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from gloo_replay import random_inputs, replay_and_run

sys.path.insert(0, str(Path(__file__).parents[1] / "optimizer"))
from test_context_parallel import BF16, DECODE, SEQ_SHARDED, attention, attention_step, dear_gathers  # noqa: E402

F32 = torch.float32


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
    def keys_stay(name, plan):
        assert not any(c.tensor in ("k", "v") for c in plan.collectives), plan.explain()
        assert "attention_blocks" in {s.op for s in plan.compute_steps}, plan.explain()
    g = torch.Generator().manual_seed(0)
    plans = replay_and_run(specs, keys_stay, lambda name, small: random_inputs(small, g, F32))
    kinds = {c.kind for plan in plans.values() for c in plan.collectives}
    assert {"allgather", "alltoall", "allreduce", "reduce_scatter"} <= kinds
