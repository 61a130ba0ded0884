"""simulate(): one process runs every rank's local program of a plan and performs each collective
exactly; global tensors in, global tensors out. The reference for the runtime's behaviour.
"""
from __future__ import annotations

from typing import Mapping

import torch

from . import collectives
from .errors import PlanError, ShapeError
from .lowering.collective_matmul import ring_of, simulate_ring
from .lowering.communication import exchange_of, simulate_exchange
from .lowering.compute import check_step_indices, compute_on_rank, source_tensor  # noqa: F401  (public here too)
from .lowering.segment import lowered_plan, run_fused
from .plan import Collective, Plan
from .shards import shard, unshard


def collective(plan: Plan, c: Collective, local: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every rank's result of one collective, given every rank's input: its registry entry's simulate
    (collectives.KINDS) on each group of the collective's mesh axis.

    >>> import torch, egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> fd, mesh = row_sum(8, 64), ed.DeviceMesh.arange(4)
    >>> _ = fd["x"].set_device_mesh(mesh).outer_split(1, 4).axis(1).parallelize(ed.ParallelType.DIDx)
    >>> plan = ed.optimize(fd, mesh)
    >>> c = plan.collectives[0]  # y = sum(x, 1) is a partial sum: reduce-scatter it
    >>> c.kind, collective(plan, c, {r: torch.ones(8) for r in mesh.ranks})[3]
    ('reduce_scatter', tensor([4., 4.]))
    """
    entry = collectives.get(c.kind, f"simulate: {c.kind}[{c.mesh_axis_name}] {c.tensor}")
    move = plan.move(c)
    return {r: entry.simulate(move, [local[q] for q in plan.mesh.ranks_along(c.mesh_axis, r)], r).contiguous()
            for r in plan.mesh.ranks}


def bind_inputs(plan: Plan, inputs: Mapping[str, torch.Tensor]) -> dict[str, dict[int, torch.Tensor]]:
    """Every rank's shard of every input value.

    >>> import torch, egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> plan = ed.optimize(row_sum(4, 3), ed.DeviceMesh.arange(2))  # x's rows split over 2 ranks
    >>> bind_inputs(plan, {"x": torch.arange(12.).reshape(4, 3)})["x:S0"][1]
    tensor([[ 6.,  7.,  8.],
            [ 9., 10., 11.]])
    """
    plan.check_inputs(inputs, "simulate")
    env: dict[str, dict[int, torch.Tensor]] = {}
    for name, vals in plan.inputs.items():
        for v in vals:
            val = plan.values[v]
            if tuple(inputs[name].shape) != plan.input_shape(name):
                raise ShapeError(f"simulate: input {name!r} has shape {tuple(inputs[name].shape)}, the plan expects "
                                 f"{plan.input_shape(name)}; simulate takes whole (global) tensors, of the shapes the plan was "
                                 f"optimized for (optimize the fusion at these shapes, with like=plan)")
            whole = plan.bind_view(name, inputs[name])  # a viewed input: reshaped to the view it is planned as
            env[v] = {r: shard(whole, val.layout, plan.mesh, r, name) for r in plan.mesh.ranks}
    return env


def simulate(plan: Plan, inputs: Mapping[str, torch.Tensor], lowered: bool = True) -> dict[str, torch.Tensor]:
    """Run the plan's per-rank programs in one process; returns the outputs as global tensors.
    lowered=True runs the lowered program (Triton kernels for fused segments, under TRITON_INTERPRET on
    a CPU); lowered=False runs every compute step through torch eager.

    >>> import torch, egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((8, 16), name="x")
    ...     fd.add_output(fd.ops.sum(x, 1), name="y")
    >>> mesh = ed.DeviceMesh.arange(4)
    >>> _ = x.set_device_mesh(mesh).outer_split(1, 4).axis(1).parallelize(ed.ParallelType.DIDx)
    >>> X = torch.randn(8, 16)
    >>> torch.allclose(ed.simulate(ed.optimize(fd, mesh), {"x": X})["y"], X.sum(1), atol=1e-6)
    True
    """
    if not isinstance(plan, Plan):
        hint = ("; for the single-device reference of a fusion use ed.evaluate(fd, inputs), or optimize it "
                "first: ed.simulate(ed.optimize(fd, mesh), inputs)" if type(plan).__name__ in ("FusionDefinition", "Fusion")
                else "; ed.optimize(fd, mesh) makes one, ed.Plan.from_json(text) loads one")
        raise PlanError(f"simulate: expected a Plan, got the {type(plan).__name__} {plan!r:.40}{hint}")
    if not isinstance(lowered, bool):
        raise PlanError(f"simulate: lowered must be True (the lowered program: Triton kernels) or False (torch "
                        f"eager per step), got the {type(lowered).__name__} {lowered!r:.40}")
    mesh = plan.mesh
    env = bind_inputs(plan, inputs)
    if lowered:
        for seg in lowered_plan(plan).segments:
            if seg.kind == "comm":
                c = seg.steps[0]
                env[c.dst] = collective(plan, c, env[c.src])
                continue
            if ring_of(seg.steps[0]):  # a collective matmul: every rank of its ring at once
                env.update(simulate_ring(plan, seg.steps[0], env))
                continue
            if exchange_of(seg.steps[0]):  # an expert exchange: every rank of its all-to-all at once
                env.update(simulate_exchange(plan, seg.steps[0], env))
                continue
            for r in mesh.ranks:
                local = {v: env[v][r] for v in env if r in env[v]}
                for step in seg.steps:
                    check_step_indices(plan, step, local, r)
                outs = (run_fused(plan, seg, local, r) if seg.kind == "fused"
                        else compute_on_rank(plan, seg.steps[0], local, r))
                for v, t in outs.items():
                    env.setdefault(v, {})[r] = t
    else:
        for step in plan.steps:
            if isinstance(step, Collective):
                env[step.dst] = collective(plan, step, env[step.src])
                continue
            if ring_of(step):
                env.update(simulate_ring(plan, step, env))
                continue
            if exchange_of(step):
                env.update(simulate_exchange(plan, step, env))
                continue
            for r in mesh.ranks:
                outs = compute_on_rank(plan, step, {v: env[v][r] for v in env if r in env[v]}, r)
                for v, t in outs.items():
                    env.setdefault(v, {})[r] = t
    return {name: plan.deliver_view(name, unshard(env[v], plan.values[v].layout, mesh, plan.values[v].shape, name))
            for name, v in plan.outputs.items()}


__all__ = ["simulate", "collective", "compute_on_rank", "bind_inputs", "check_step_indices", "source_tensor"]
