"""collective_matmul on four gloo processes: the rings of tests/optimizer/test_collective_matmul.py (an MLP
with sequence-parallel x and y, column- then row-parallel weights, both GEMMs as rings under a slow-link
cost model) run through plan.run, point-to-point sends round the ring, and give the single-device
reference on every rank, bit for bit what simulate gives (it adds in the ring's order); matmul, linear and
the matmul on a 2x2 (dp, tp) mesh with its rings over tp's groups in one launch (float64: against the reference the ring only reorders sums)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

import egraph_did as ed
from egraph_did.launcher import launch
from egraph_did.plan import Plan
from egraph_did.runtime import run_plan

sys.path.insert(0, str(Path(__file__).parents[1] / "optimizer"))
from test_collective_matmul import MESH2, SLOW, mlp, mlp_2d, rings  # noqa: E402


def run_all(rank: int, jobs: dict) -> dict:
    return {name: run_plan(Plan.from_json(plan), inputs) for name, (plan, inputs) in jobs.items()}


def test_rings_run_on_gloo_equal_to_the_reference():
    mesh = ed.DeviceMesh.arange(4)
    jobs, want, sim = {}, {}, {}
    for op in ("matmul", "linear", "2d"):
        fd = mlp_2d(MESH2) if op == "2d" else mlp(16, 8, 32, torch.float64, mesh, op)
        plan = ed.optimize(fd, MESH2 if op == "2d" else mesh, cost_model=SLOW)
        assert rings(plan) == ["ag_ring", "rs_ring"]
        g = torch.Generator().manual_seed(1)
        inputs = {t.name: torch.randn(t.shape, generator=g, dtype=torch.float64) for t in fd.fusion.inputs}
        jobs[op], want[op] = (plan.to_json(), inputs), ed.evaluate(fd, inputs)["y"]
        sim[op] = ed.simulate(plan, inputs)["y"]
    for rank, got in enumerate(launch(run_all, nprocs=4, args=(jobs,))):
        for op in jobs:
            torch.testing.assert_close(got[op]["y"], want[op], rtol=1e-12, atol=1e-12, msg=f"{op} on rank {rank}")
            assert torch.equal(got[op]["y"], sim[op]), f"{op} on rank {rank}: the ring sums as simulate does"
