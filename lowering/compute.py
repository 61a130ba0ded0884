"""One compute step on one rank through torch: the op's rank-local semantics (egraph_did/local.py) on
this rank's shards, with the indices it reads checked first. The ATen segments of the lowered program
run here, and so do simulate() (every rank in one process) and the runtime (one rank per process): the
execution layer imports this, never the reverse.
"""
from __future__ import annotations

from typing import Mapping

import torch

from egraph_did.local import run_local
from egraph_did.ops import OPS, check_indices, ops_where
from egraph_did.plan import ComputeStep, Plan
from egraph_did.shards import Operand, RankContext

# Ops whose output holds the input's elements, rearranged or retyped: a value made by them has its source's ids.
VIEW_OPS = ops_where(kind="view") + ("cast",)


def compute_on_rank(plan: Plan, step: ComputeStep, env: Mapping[str, torch.Tensor], rank: int
                    ) -> dict[str, torch.Tensor]:
    """One compute step on one rank through torch (the op's reference on local shards).

    >>> import torch, egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> plan = ed.optimize(row_sum(4, 3), ed.DeviceMesh.arange(2))  # rows split: y = sum(x, 1) is local
    >>> compute_on_rank(plan, plan.steps[0], {"x:S0": torch.ones(2, 3)}, rank=1)
    {'y:S0': tensor([3., 3.])}
    """
    check_step_indices(plan, step, env, rank)
    operands = {k: _operand(plan, v) for k, v in step.operands.items()}
    outputs = [_operand(plan, o) for o in step.writes]
    args = step.bind(env.__getitem__)
    outs = run_local(step.op, args, operands, outputs, dict(step.flags), RankContext(plan.mesh, rank))
    return dict(zip(step.writes, outs))


def _operand(plan: Plan, value: str) -> Operand:
    v = plan.values[value]
    return Operand(v.shape, v.layout)


def source_tensor(plan: Plan, value: str) -> str:
    """The tensor a value is a view of: follows views and casts back to an input where there is one (the
    index of cross_entropy's take_along_axis is unsqueeze(target): this says 'target').

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> plan = ed.optimize(row_sum(4, 3), ed.DeviceMesh.arange(2))
    >>> source_tensor(plan, plan.outputs["y"])
    'y'
    """
    producer = {o: s for s in plan.compute_steps for o in s.writes}
    while value in producer and producer[value].op in VIEW_OPS and len(producer[value].reads) == 1:
        value = producer[value].reads[0]
    return plan.values[value].tensor


def check_step_indices(plan: Plan, step, env: Mapping[str, torch.Tensor], rank: int) -> None:
    """ShapeError naming the tensor if an indexing step (embedding, take_along_axis, cross_entropy) would
    read outside the table it indexes; env holds this rank's shards (indices are global ids).

    >>> import torch, egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     ids = fd.define_tensor((3,), torch.int64, name="ids")
    ...     wte = fd.define_tensor((5, 4), name="wte")
    ...     fd.add_output(fd.ops.embedding(ids, wte), name="y")
    >>> plan = ed.optimize(fd, ed.DeviceMesh.arange(2))
    >>> env = {plan.inputs["ids"][0]: torch.tensor([0, 9, 1]), plan.inputs["wte"][0]: torch.zeros(5, 2)}
    >>> check_step_indices(plan, plan.steps[0], env, rank=0)
    Traceback (most recent call last):
    ...
    egraph_did.errors.ShapeError: embedding(ids, wte): ids holds 9 (at [1] on rank 0), but wte has 5 rows (axis 0); every index must lie in [0, 5): fix ids, or give wte more rows
    """
    if not isinstance(step, ComputeStep) or OPS[step.op].indexes is None:
        return
    args = step.bind(env.get)
    tensors = step.operands
    check_indices(step.op, args, {k: source_tensor(plan, v) for k, v in tensors.items()},
                  {k: plan.values[v].shape for k, v in tensors.items()}, f" on rank {rank}")


__all__ = ["compute_on_rank", "check_step_indices", "source_tensor", "VIEW_OPS"]
