"""Execute a lowered plan on one rank: fused segments through their Triton kernels, ATen segments through
torch, collectives through the function the caller gives (torch.distributed in the runtime, a stand-in
in single-device benchmarks). simulate() drives the same segments for every rank in one process."""
from __future__ import annotations

from typing import Callable

import torch

from egraph_did.plan import Collective, Plan
from egraph_did.simulate import compute_on_rank

from .segment import LoweredPlan, Segment, lower, run_fused

CollectiveFn = Callable[[Plan, Collective, torch.Tensor, int], torch.Tensor]


def run_segment(plan: Plan, seg: Segment, env: dict[str, torch.Tensor], rank: int,
                collective: CollectiveFn) -> dict[str, torch.Tensor]:
    """One segment on one rank; returns the values it produced."""
    if seg.kind == "comm":
        c = seg.steps[0]
        return {c.dst: collective(plan, c, env[c.src], rank)}
    if seg.kind == "fused":
        return run_fused(plan, seg, env, rank)
    return compute_on_rank(plan, seg.steps[0], env, rank)


def run_rank(plan: Plan, env: dict[str, torch.Tensor], rank: int, collective: CollectiveFn,
             lowered: LoweredPlan | None = None, on_segment: Callable[[int, Segment], None] | None = None
             ) -> dict[str, torch.Tensor]:
    """Every segment of the plan on this rank, in order; env (value -> local tensor) grows in place."""
    lowered = lowered or lower(plan)
    for i, seg in enumerate(lowered.segments):
        if on_segment is not None:
            on_segment(i, seg)
        env.update(run_segment(plan, seg, env, rank, collective))
    return env
