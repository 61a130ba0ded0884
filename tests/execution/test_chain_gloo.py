"""A stamped plan (egraph_did/chain.py) on four gloo processes: a 6-layer GPT's training step planned as a window of
four layers with the middle layer's plan stamped on the others, three AdamW steps with the next weights and moments
fed back, equal to the single-device run (float32, relative 1e-5)."""
from __future__ import annotations

import torch

import egraph_did as ed
from egraph_did import models
from egraph_did.launcher import launch
from egraph_did.layout import Layout, S
from egraph_did.pins import apply_layout

from tests.execution.test_training_gloo import initial_state, reference, rel, train


def test_a_stamped_six_layer_step_trains_on_four_gloo_ranks_as_on_one_device():
    mesh = ed.DeviceMesh.arange(4)
    fd = models.gpt_training_step(2, 8, 16, 4, torch.float32, layers=6, optimizer=ed.AdamW(lr=1e-2))
    for n in ("x", "target"):
        apply_layout(fd[n], Layout((S(1),)), mesh)  # sequence-sharded data; every weight free
    plan = ed.optimize(fd, mesh)
    assert plan.stats["chain"]["layers"] == 6
    assert plan.collectives  # the plan communicates: the ranks hold different shards
    state = initial_state(fd)
    want_losses, want = reference(fd, state)
    for rank, res in enumerate(launch(train, nprocs=4, backend="gloo", args=({"chain": (plan.to_json(), state)},),
                                      timeout=240)):
        losses, got = res["chain"]
        assert rel(losses, want_losses) <= 1e-5, f"rank {rank}: losses {losses} vs {want_losses}"
        for k in want:
            if k not in ("x", "target"):
                assert rel(got[k], want[k]) <= 1e-5, f"rank {rank}: {k}"
