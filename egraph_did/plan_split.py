"""Split one plan in two at run time: the steps that do not depend on some inputs (a training step's
cotangents) run first, the rest later, with the values the second part reads handed over between them.

A joint plan (the forward and the vector-Jacobian product of one fusion, optimized once) is what
ed.parallelize runs across torch's forward and backward calls: `split_plan(joint, first_outputs,
late_inputs)` gives

- `first`: every step that reads no late input, directly or through another step, and that is needed:
  for `first_outputs`, or for a value the second part reads. Its outputs are `first_outputs` and one
  `saved.<value>` per handed-over value, in the value's own layout (a rank's local shard, partial sums
  left pending): no collective is added, the second part takes it as it is;
- `second`: every other step; its inputs are the late inputs, the plan inputs its steps read (loaded in
  the layouts they read) and `saved.<value>` for each handed-over value; its outputs the joint's others.

Every step of the joint runs once, in one of the parts, in the joint's order; the parts move exactly the
joint's collectives. What the first part keeps for the second is the `saved` list (the values a
forward keeps for its backward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .cost import size_text
from .errors import PlanError
from .plan import Plan, Step

# The first part's output, and the second part's input, that hands over a value: HANDOVER_PREFIX + the
# value's name ('<tensor>:<layout code>'), what torch's autograd calls saved for backward. Not grad's
# marker (grad.SAVED_MARKER_PREFIX names a fusion tensor, saved(t)): a part may hand over a marker's value
# or any other value the backward reads, so the two namespaces stay apart.
HANDOVER_PREFIX = "saved."


class SplitError(PlanError):
    """A plan cannot be split where asked: an output of the first part depends on a late input (a program
    rewrite joined a forward step with a backward one, e.g. one buffer for both collectives)."""


@dataclass(frozen=True)
class SplitPlan:
    """A joint plan and its two parts (see the module's docstring); `saved` lists the values the first
    hands to the second ('<tensor>:<layout code>', the input/output `saved.<value>` of the parts)."""

    joint: Plan
    first: Plan
    second: Plan
    saved: tuple[str, ...]
    late: tuple[str, ...]  # the inputs the second part waits for

    def saved_bytes(self) -> float:
        """Bytes one device keeps between the two parts (the largest shard of each saved value)."""
        return sum(self.joint.held_bytes(v) for v in self.saved)

    def explain(self) -> str:
        """The joint plan's explain(), then how it is split: the steps of each part, and each saved value
        with its loop domain, its bytes per device and the first step of the second part that reads it.

        >>> import egraph_did as ed
        >>> with ed.FusionDefinition() as fd:
        ...     x, c = fd.define_tensor((4, 8), name="x"), fd.define_tensor((4, 8), name="c")
        ...     e = fd.ops.exp(x)
        ...     fd.add_output(fd.ops.sum(e), name="y")
        ...     fd.add_output(fd.ops.mul(e, c), name="g")
        >>> print(split_plan(ed.optimize(fd, ed.DeviceMesh.arange(2)), ["y"], ["c"]).explain().split(chr(10) * 2)[-1])
        split at c: the first part runs 2 of the 3 steps, the second 1; the first saves 1 value for the second (128 B per device):
          exp_0:R  [4, 8]  128 B, read by: g:R = mul(exp_0:R, c:R)
        """
        lines = [f"split at {', '.join(self.late)}: the first part runs {len(self.first.steps)} of the "
                 f"{len(self.joint.steps)} steps, the second {len(self.second.steps)}; the first saves "
                 f"{len(self.saved)} value{'s' * (len(self.saved) != 1)} for the second "
                 f"({size_text(self.saved_bytes(), digits=4)} per device):"]
        for v in self.saved:
            reader = next((s for s in self.second.steps if v in s.reads), None)
            why = f"read by: {reader}" if reader is not None else "an output of the second part"
            lines.append(f"  {v}  {self.joint.value_view(v).loop_str()}  {size_text(self.joint.held_bytes(v), digits=4)}, {why}")
        return self.joint.explain() + "\n\n" + "\n".join(lines)


def split_plan(joint: Plan, first_outputs: Sequence[str], late_inputs: Sequence[str]) -> SplitPlan:
    """Split `joint` into the steps that can run before the `late_inputs` are known and those that cannot.

    >>> import torch, egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((4, 8), name="x")
    ...     c = fd.define_tensor((4,), name="c")       # known later (a cotangent)
    ...     e = fd.ops.exp(x)
    ...     fd.add_output(fd.ops.sum(e, 1), name="y")
    ...     fd.add_output(fd.ops.mul(e, fd.ops.reshape(c, (4, 1))), name="g")
    >>> parts = split_plan(ed.optimize(fd, ed.DeviceMesh.arange(2)), ["y"], ["c"])
    >>> sorted(parts.first.outputs), sorted(parts.second.inputs)  # exp(x) is computed once, kept for later
    (['saved.exp_0:S0', 'y'], ['c', 'saved.exp_0:S0'])
    >>> [s.op for s in parts.second.compute_steps]
    ['reshape', 'mul']
    """
    late_in = set(late_inputs)
    unknown = sorted((late_in | set(first_outputs)) - set(joint.inputs) - set(joint.outputs))
    if unknown:
        raise PlanError(f"split_plan: {unknown} are neither inputs nor outputs of the plan (inputs "
                        f"{sorted(joint.inputs)}, outputs {sorted(joint.outputs)})")
    late = {v for n in late_in for v in joint.inputs.get(n, ())}
    is_late = []
    for s in joint.steps:
        is_late.append(any(v in late for v in s.reads))
        if is_late[-1]:
            late.update(s.writes)
    for name in first_outputs:
        if joint.outputs[name] in late:
            raise SplitError(f"split_plan: output {name!r} depends on a late input ({sorted(late_in)}); it cannot "
                            f"be delivered by the first part (optimize the plan without the program rewrite that joined them)")
    second_steps = [s for s, lt in zip(joint.steps, is_late) if lt]
    second_outputs = {n: v for n, v in joint.outputs.items() if n not in set(first_outputs)}
    produced_early = {v for s, lt in zip(joint.steps, is_late) if not lt for v in s.writes}
    wanted = {v for s in second_steps for v in s.reads} | set(second_outputs.values())
    saved = tuple(sorted(v for v in wanted if v in produced_early))
    first_steps = _live([s for s, lt in zip(joint.steps, is_late) if not lt],
                        {joint.outputs[n] for n in first_outputs} | set(saved))
    first = _part(joint, first_steps, {n: joint.outputs[n] for n in first_outputs} |
                  {HANDOVER_PREFIX + v: v for v in saved}, {}, "first")
    second = _part(joint, second_steps, second_outputs, {HANDOVER_PREFIX + v: [v] for v in saved}, "second")
    return SplitPlan(joint, first, second, saved, tuple(late_inputs))


def _live(steps: list[Step], needed: set[str]) -> list[Step]:
    """The steps `needed` depends on, in order."""
    keep = []
    for s in reversed(steps):
        if any(v in needed for v in s.writes):
            keep.append(s)
            needed |= set(s.reads)
    return keep[::-1]


def _part(joint: Plan, steps: list[Step], outputs: dict[str, str], handed: dict[str, list[str]], which: str) -> Plan:
    """A plan of `steps` of joint: inputs the joint's inputs whose values they read (only those values),
    plus `handed`; outputs as given."""
    read = {v for s in steps for v in s.reads} | set(outputs.values())
    inputs = {n: [v for v in vs if v in read] for n, vs in joint.inputs.items()}
    inputs = {n: vs for n, vs in inputs.items() if vs} | handed
    held = read | {v for s in steps for v in s.writes}
    values = {k: v for k, v in joint.values.items() if k in held}
    tensors = {v.tensor for v in values.values()}
    plan = Plan(joint.mesh, joint.cost_model, values, list(steps), inputs, dict(outputs), 0.0,
                f"{joint.method}, {which} part", dict(joint.stats),
                {t: v for t, v in joint.pins.items() if v in values},
                {t: r for t, r in joint.rewrites.items() if t in tensors},
                [list(b) for b in joint.buckets if all(t in tensors for t in b)],
                {t: list(p) for t, p in joint.pinned_loops.items() if t in tensors})
    plan.memory = plan.memory_breakdown()["total"]  # as the memory model counts it: views are free
    plan.validate()
    return plan


__all__ = ["SplitPlan", "SplitError", "split_plan", "HANDOVER_PREFIX"]
