"""Collective matmuls in the lowering: a plan's ring step (a matmul or bias-free linear whose flags name
a ring of collectives.RINGS, rewrites/collective_matmul.py) runs every rank at once in simulate, and
rank by rank under torch.distributed through its local kernel (collectives.ring_kernel, listed beside
the op in ops.py: the runtime's compute path, run_local, calls it as any local kernel). On a GPU the
ring's point-to-point transfers run on NCCL's stream beside the GEMMs on the current one (untested here:
this machine has no GPU).
"""
from __future__ import annotations

from typing import Mapping

import torch

from egraph_did.collectives import (RING_FLAGS, Ring, ring_attention_backward_simulate, ring_attention_simulate,
                                   ring_simulate)
from egraph_did.layout import Layout
from egraph_did.ops import ring_attention_backward_block, ring_attention_block
from egraph_did.plan import ComputeStep, Plan


def ring_of(step) -> tuple[Ring, int] | None:
    """The ring a compute step runs and its mesh axis, or None for any other step.

    >>> step = ComputeStep("matmul", (("a", "x:S0"), ("b", "w:S1")), ("a", "b"), ("y:S1",), (("ag_ring", (0,)),),
    ...                    ("allgather_matmul",), 1e-3)
    >>> ring, m = ring_of(step); ring.name, m
    ('allgather_matmul', 0)
    """
    if not isinstance(step, ComputeStep):
        return None
    for flag, axes in step.flags:
        if flag in RING_FLAGS:
            return RING_FLAGS[flag], axes[0]
    return None


def simulate_ring(plan: Plan, step: ComputeStep, env: Mapping[str, Mapping[int, torch.Tensor]]
                  ) -> dict[str, dict[int, torch.Tensor]]:
    """Every rank's output of a ring step, given every rank's operands (simulate's env: value -> rank ->
    tensor): collectives.ring_simulate on each group of the ring's mesh axis, in the ring's order of sums.

    >>> import torch, egraph_did as ed
    >>> mesh = ed.DeviceMesh.arange(2)
    >>> step = ComputeStep("matmul", (("a", "x:S0"), ("b", "w:R")), ("a", "b"), ("y:R",), (("ag_ring", (0,)),),
    ...                    ("allgather_matmul",), 1e-3)
    >>> plan = ed.Plan(mesh, ed.CostModel.h200(), {}, [step], {}, {})
    >>> out = simulate_ring(plan, step, {"x:S0": {0: torch.ones(1, 2), 1: 2 * torch.ones(1, 2)},
    ...                                  "w:R": {0: torch.eye(2), 1: torch.eye(2)}})
    >>> out["y:R"][0]
    tensor([[1., 1.],
            [2., 2.]])
    """
    ring, m = ring_of(step)
    if ring.name in ("ring_attention", "ring_attention_backward"):
        return _simulate_attention_ring(plan, step, env, m)
    xv, wv = step.reads
    a = _layout(plan, xv if ring.name == "allgather_matmul" else step.outputs[0])[m].axis  # the rows it cuts
    out: dict[int, torch.Tensor] = {}
    for group in plan.mesh.groups(m):
        ys = ring_simulate(ring.name, step.op, [env[xv][r] for r in group], [env[wv][r] for r in group], a)
        out.update(zip(group, ys))
    return {step.outputs[0]: out}


def _simulate_attention_ring(plan: Plan, step: ComputeStep, env, m: int) -> dict[str, dict[int, torch.Tensor]]:
    """Every rank's outputs of a ring attention step (sdpa: out; sdpa_lse: out and lse; sdpa_backward: dq,
    dk, dv), by collectives.ring_attention_simulate (ring_attention_backward_simulate) on each group of mesh
    axis m, with ops.ring_attention_block (ring_attention_backward_block)."""
    attrs = {k: v for k, v in step.args if k not in step.tensor_params}
    causal, scale = bool(attrs.get("is_causal")), attrs.get("scale")
    outs: list[dict[int, torch.Tensor]] = [{} for _ in step.outputs]
    for group in plan.mesh.groups(m):
        blocks = {p: [env[v][r] for r in group] for p, v in step.operands.items()}
        if step.op == "sdpa_backward":
            res = ring_attention_backward_simulate(ring_attention_backward_block, *(blocks[p] for p in (
                "g", "q", "k", "v", "output", "lse")), causal, scale)
        else:
            res = ring_attention_simulate(ring_attention_block, blocks["q"], blocks["k"], blocks["v"], causal, scale,
                                          step.op == "sdpa_lse")
        for r, got in zip(group, res):
            for i, t in enumerate(got if isinstance(got, tuple) else (got,)):
                outs[i][r] = t
    return dict(zip(step.outputs, outs))


def _layout(plan: Plan, value: str) -> Layout:
    """A value's layout: the plan's, else read from its name '<tensor>:<layout code>'."""
    return plan.values[value].layout if value in plan.values else Layout.from_code(value.rsplit(":", 1)[1])


__all__ = ["ring_of", "simulate_ring"]
