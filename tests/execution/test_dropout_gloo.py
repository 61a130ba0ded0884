"""Dropout on four gloo processes (issue 11 item 2): each rank draws its shard's part of the one mask from
the seed input and its shard's global offsets, so the plan's outputs equal the single-device run, on every
rank: a dropout of a pending sum (a row-parallel linear whose output stays pending: every rank drops out its
summand with the same mask) and a dropout of column shards that do not divide (7 columns: 2, 2, 2, 1)."""
from __future__ import annotations

import torch

import egraph_did as ed
from egraph_did.frontend import SEED_INPUT
from egraph_did.launcher import launch
from egraph_did.layout import Layout
from egraph_did.pins import apply_layout
from egraph_did.plan import Plan
from egraph_did.runtime import run_plan

MESH = ed.DeviceMesh.arange(4)


def fusion():
    fd = ed.FusionDefinition()
    x, w = fd.define_tensor((8, 12), name="x"), fd.define_tensor((6, 12), name="w")
    u = fd.define_tensor((5, 7), name="u")
    seed = fd.define_tensor((), torch.int64, name=SEED_INPUT)
    fd.add_output(fd.ops.dropout(fd.ops.linear(x, w), seed, 0.5), name="y")
    fd.add_output(fd.ops.dropout(u, seed, 0.3, 48), name="z")
    for name, code in (("x", "S1"), ("w", "S1"), ("y", "P"), ("u", "S1"), ("z", "S1")):
        apply_layout(fd[name], Layout.from_code(code), MESH)
    return fd


def run(rank: int, plan_json: str, inputs: dict):
    return run_plan(Plan.from_json(plan_json), inputs)


def test_dropout_plans_on_four_gloo_ranks_draw_the_single_device_masks():
    fd = fusion()
    plan = ed.optimize(fd, MESH)
    steps = {s.writes[0]: s for s in plan.compute_steps if s.op == "dropout"}
    assert str(plan.values[steps["y:P"].operands["x"]].layout) == "[P]" and not steps["y:P"].flags
    assert set(dict(steps["z:S1"].flags)) == {"global_index"} and not plan.collectives
    g = torch.Generator().manual_seed(0)
    inputs = {"x": torch.randn(8, 12, generator=g), "w": torch.randn(6, 12, generator=g),
              "u": torch.randn(5, 7, generator=g), SEED_INPUT: torch.tensor(987654321987)}
    want = ed.evaluate(fd, inputs)
    results = launch(run, nprocs=4, backend="gloo", args=(plan.to_json(), inputs), timeout=120)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["y"], want["y"], rtol=1e-5, atol=1e-5, msg=lambda m: f"y on rank {rank}: {m}")
        assert torch.equal(got["z"], want["z"]), f"z on rank {rank}"
        assert torch.equal(got["y"] == 0, want["y"] == 0), f"y's mask on rank {rank}"
