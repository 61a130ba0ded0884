"""Plan big, replay small, run on gloo: the pattern of the strategy runs of issue 28 (context parallelism,
expert parallelism, the Llama step of test_strategies_gloo.py). A strategy is chosen (or pinned) where it
pays, at real shapes; its plan is replayed at small shapes (optimize(like=): the same layouts and
strategies) and every plan runs on four gloo processes in one launch (process start-up dominates), each
rank's outputs compared with the single-device ones."""
from __future__ import annotations

import torch

import egraph_did as ed
from egraph_did.launcher import launch
from egraph_did.plan import Plan
from egraph_did.runtime import run_plan

MESH = ed.DeviceMesh.arange(4)


def replay(big, small, cost_model=None, mesh=MESH) -> Plan:
    """The plan of `small` that keeps the layouts and strategies `big`'s plan chose under cost_model."""
    return ed.optimize(small, mesh, like=ed.optimize(big, mesh, cost_model))


def _run(rank: int, plans: dict, inputs: dict) -> dict:
    return {name: run_plan(Plan.from_json(text), inputs[name]) for name, text in plans.items()}


def run_on_gloo(plans: dict[str, Plan], inputs: dict[str, dict], timeout: float = 180) -> list[dict]:
    """Every plan run on len(mesh) gloo processes in one launch, global tensors in and out: per rank
    {plan name: {output: tensor}}."""
    nprocs = {p.mesh.size for p in plans.values()}
    assert len(nprocs) == 1, nprocs
    texts = {name: plan.to_json() for name, plan in plans.items()}
    return launch(_run, nprocs=nprocs.pop(), backend="gloo", args=(texts, inputs), timeout=timeout)


def assert_ranks_equal(results: list[dict], want: dict[str, dict], rtol: float, atol: float) -> None:
    """Every rank's every output of every plan equals want[plan][output]."""
    for rank, got in enumerate(results):
        for name, outs in want.items():
            for out, ref in outs.items():
                torch.testing.assert_close(got[name][out], ref, rtol=rtol, atol=atol,
                                           msg=lambda m: f"{name}: {out} on rank {rank}: {m}")


def random_inputs(fd, g: torch.Generator, dtype=torch.float32, index_high: int = 8) -> dict[str, torch.Tensor]:
    """Random global inputs of a fusion: floats normal in `dtype`, integers in [0, index_high)."""
    return {t.name: (torch.randint(0, index_high, t.shape, generator=g) if t.dtype == torch.int64
                     else torch.randn(t.shape, generator=g, dtype=dtype)) for t in fd.fusion.inputs}
