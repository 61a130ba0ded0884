"""Execute a lowered plan on one rank: fused segments through their Triton kernels, ATen segments through
torch (lowering/compute.py), collectives through the function the caller gives (torch.distributed in the runtime, a stand-in
in single-device benchmarks). simulate() drives the same segments for every rank in one process."""
from __future__ import annotations

from typing import Callable

import torch

from egraph_did.plan import Collective, Plan

from .compute import compute_on_rank
from .epilogue import epilogue_plan, run_gemm
from .segment import LoweredPlan, Segment, lower, run_fused

CollectiveFn = Callable[[Plan, Collective, torch.Tensor, int], torch.Tensor]


def run_segment(plan: Plan, seg: Segment, env: dict[str, torch.Tensor], rank: int,
                collective: CollectiveFn) -> dict[str, torch.Tensor]:
    """One segment on one rank; returns the values it produced.

    >>> import torch, egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> fd, mesh = row_sum(8, 64), ed.DeviceMesh.arange(4)
    >>> _ = fd["x"].set_device_mesh(mesh).outer_split(1, 4).axis(1).parallelize(ed.ParallelType.DIDx)
    >>> plan = ed.optimize(fd, mesh); comm = lower(plan).segments[-1]  # reduce_scatter[x] y
    >>> stand_in = lambda plan, c, t, rank: 4 * t[2 * rank: 2 * rank + 2]  # as if every rank held t
    >>> run_segment(plan, comm, {"y:P": torch.ones(8)}, rank=1, collective=stand_in)
    {'y:S0': tensor([4., 4.])}
    """
    if seg.kind == "comm":
        c = seg.steps[0]
        return {c.dst: collective(plan, c, env[c.src], rank)}
    if seg.kind == "fused":
        return run_fused(plan, seg, env, rank)
    if seg.kind == "gemm":
        return run_gemm(plan, seg, env, rank)
    return compute_on_rank(plan, seg.steps[0], env, rank)


def run_rank(plan: Plan, env: dict[str, torch.Tensor], rank: int, collective: CollectiveFn,
             lowered: LoweredPlan | None = None, on_segment: Callable[[int, Segment], None] | None = None
             ) -> dict[str, torch.Tensor]:
    """Every segment of the plan on this rank, in order; env (value -> local tensor) grows in place.

    >>> import torch, egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> plan = ed.optimize(row_sum(4, 3), ed.DeviceMesh.arange(2))  # rows split: no collective to call
    >>> run_rank(plan, {"x:S0": torch.ones(2, 3)}, rank=1, collective=None)["y:S0"]
    tensor([3., 3.])
    """
    lowered = lowered or epilogue_plan(plan)
    for i, seg in enumerate(lowered.segments):
        if on_segment is not None:
            on_segment(i, seg)
        env.update(run_segment(plan, seg, env, rank, collective))
    return env
