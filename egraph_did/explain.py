"""Explain: a plan as text for people. Every explain-formatting lives here; a step's one-line
description is the step's own (`str(step)`: 'y:P = linear(gelu_1:S1, w2:S1)', 'allreduce[x] y:P -> y:R'),
and everything that names a step (this table, the runtime's progress, the lowering's segments, a
collective's reason) uses it.

Plan layer: plan.py imports this module, so this module takes a plan as it comes and never imports
plan.py.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from .collectives import RING_FLAGS

STEP_WIDTH = 60  # the step column of the table; a longer step is cut with '…'


def explain_plan(plan) -> str:
    """The text of plan.explain(): a header, every tensor's loop domain, then one row per step.

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> print(explain_plan(ed.optimize(row_sum(8, 64), ed.DeviceMesh.arange(2))).splitlines()[2])
    tensor layouts (loop domain):
    """
    return "\n".join([_header(plan), "", *_layouts(plan), "", *_memory(plan), *_rewrites(plan), *_table(plan)])


def _memory(plan) -> list[str]:
    """Per-device bytes by category (plan.memory_breakdown), for a plan of a training step: one that takes
    weights (inputs it outputs again as next.<name>) or reads saved activations; nothing for other plans.
    Where the plan recomputes values in the backward, which ones and the bound that forced it."""
    mem = plan.memory_breakdown()
    if not mem["weights"] and "saved activations" not in mem:
        return []
    bound = plan.cost_model.memory_limit
    bound_text = "none" if bound is None else _mib(bound).strip()
    if "saved activations" in mem:
        head = (f"memory per device (held across the step: persistent values and the activations saved for "
                f"the backward; transients not counted; bound {bound_text}):")
    else:
        head = f"memory per device (every value the plan holds; bound {bound_text}):"
    lines = [head] + [f"  {k:<18} {_mib(v)}" for k, v in mem.items()]
    return lines + _recomputed(plan, mem, bound) + [""]


def _recomputed(plan, mem: Mapping[str, float], bound) -> list[str]:
    """The values the backward recomputes instead of reading them saved (rewrites/recompute.py), their
    bytes, and why: the memory bound that saving them would break."""
    rewritten = getattr(plan, "rewrites", {})
    redone = [s for s in plan.steps if s.kind == "compute" and rewritten.get(s.key) == "recompute"]
    kept_for = [v for s in redone for v in s.outputs if plan.values[v].tensor != s.key]  # a saved value's class
    if not redone:
        return []
    spared = sum(plan.held_bytes(v) for v in kept_for)
    names = ", ".join(plan.values[v].tensor for v in kept_for) or "none"
    lines = [f"  recomputed in the backward: {len(redone)} step(s); instead of saving {names} "
             f"({_mib(spared).strip()})"]
    if bound is not None and plan.memory + spared > bound:
        lines.append(f"  the memory bound of {_mib(bound).strip()} forced it: saving them would hold "
                     f"{_mib(plan.memory + spared).strip()} per device")
    elif bound is not None:
        lines.append(f"  chosen under the memory bound of {_mib(bound).strip()} (the plan's cheapest within it)")
    return lines


def _mib(n: float) -> str:
    return f"{n / 2**20:10.1f} MiB"


def _header(plan) -> str:
    return (f"plan for {plan.mesh} under cost model {plan.cost_model.name} ({plan.method}): "
            f"predicted {plan.predicted_time * 1e6:.1f} us, {len(plan.collectives)} collective(s), "
            + (f"{len(plan.rings)} collective matmul ring(s), " if plan.rings else "") +
            f"{plan.memory / 2**20:.1f} MiB per device")


def _layouts(plan) -> list[str]:
    """Each tensor once, in the order the plan first holds it, with its loop domain."""
    lines = ["tensor layouts (loop domain):"]
    for tensor in dict.fromkeys(v.tensor for v in plan.values.values()):
        pinned = " (pinned)" if tensor in plan.pins else ""
        if tensor in plan.dtensor_chunks:  # runtime.pin_placements: no loop domain cuts DTensor's chunks
            pinned = " (pinned in DTensor's chunks: rechunked at the plan's boundary)"
        lines.append(f"  {tensor:<14} {plan.loop_domain(tensor)}{pinned}")
    return lines


def _rewrites(plan) -> list[str]:
    """The steps that compute a program the rewrites of rewrites/algebra.py added, by rewrite (nothing when
    the plan runs the program as written)."""
    rewritten = getattr(plan, "rewrites", {})
    steps = [s for s in plan.steps if s.kind == "compute" and (s.key in rewritten or _ring(s))]
    if not steps:
        return []
    lines = ["program rewrites (the plan computes an equal program):"]
    lines += [f"  {rewritten.get(s.key) or _ring(s):<22} {s}" for s in steps]
    return lines + [""]


def _ring(step) -> str:
    """'collective_matmul (<ring> over mesh axis m)' for a step that runs a ring (rewrites/
    collective_matmul.py: its flags name collectives.RING_FLAGS), else ''."""
    ring = next(((RING_FLAGS[f].name, ms) for f, ms in step.flags if f in RING_FLAGS), None)
    return f"collective_matmul ({ring[0]} on mesh axis {ring[1][0]})" if ring else ""


def _table(plan) -> list[str]:
    lines = [f"{'#':>3}  {'step':<{STEP_WIDTH}}{'bytes':>12}{'time us':>10}  why / rule"]
    for i, s in enumerate(plan.steps):
        lines.append(step_row(i, s))
    return lines


def step_row(i: int, step) -> str:
    """One row of the table: number, the step's description, bytes moved (collectives), predicted
    microseconds, and why (a collective: the step that needed it) or the rule (a compute step).

    >>> from egraph_did.plan import Collective
    >>> step_row(3, Collective("allreduce", "y", "y:P", "y:R", 0, "x", bytes=32.0, time=2e-5, why="output y"))[-30:]
    '        32     20.00  output y'
    """
    if step.kind == "compute":
        moved, reason = "", "/".join(step.rules) + "".join(f" +{f}" for f, _ in step.flags)
        if step.op == "opaque":  # an ATen op from_torch does not map: say which, and where the model has it
            args = dict(step.args)
            reason += f" ({args.get('target')} at {args.get('source') or 'an unknown line'})"
    else:
        moved, reason = f"{step.bytes:.0f}", step.why
    return f"{i:>3}  {_fit(str(step)):<{STEP_WIDTH}}{moved:>12}{step.time * 1e6:>10.2f}  {reason}"


def _fit(text: str, width: int = STEP_WIDTH - 1) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def why(steps: Sequence, i: int, layouts: Mapping[str, str], outputs: Mapping[str, str],
        pinned: Sequence[str] = ()) -> str:
    """Why collective steps[i] runs: the first later step that reads what it made, else the output it
    delivers, else the pin it materializes. `layouts` maps value names to layout codes, `outputs` fusion
    outputs to values, `pinned` the pinned tensors.

    >>> from egraph_did.plan import Collective, ComputeStep
    >>> c = Collective("allgather", "h", "h:S1", "h:R", 0, "x", bytes=64.0, time=1e-5)
    >>> relu = ComputeStep("relu", (("x", "h:R"),), ("x",), ("y:R",), (), ("elementwise",), 1e-6)
    >>> why([c, relu], 0, {"h:R": "R", "y:R": "R"}, {"y": "y:R"})
    'y:R = relu(h:R) [elementwise] reads h:R'
    >>> why([c], 0, {"h:R": "R"}, {"h": "h:R"}, pinned=["h"])
    'output h is delivered as R (pinned)'
    """
    c = steps[i]
    return _why(c, next((s for s in steps[i + 1:] if c.dst in s.reads), None), layouts, outputs, pinned)


def whys(steps: Sequence, layouts: Mapping[str, str], outputs: Mapping[str, str],
         pinned: Sequence[str] = ()) -> list[str | None]:
    """why() of every collective of `steps` (None for the other steps), in one pass: each value's first
    reader is looked up once, where why() scans the steps after each collective (a 96-layer step's plan
    holds ~10^5 steps).

    >>> from egraph_did.plan import Collective, ComputeStep
    >>> c = Collective("allgather", "h", "h:S1", "h:R", 0, "x", bytes=64.0, time=1e-5)
    >>> relu = ComputeStep("relu", (("x", "h:R"),), ("x",), ("y:R",), (), ("elementwise",), 1e-6)
    >>> whys([c, relu], {"h:R": "R", "y:R": "R"}, {"y": "y:R"})
    ['y:R = relu(h:R) [elementwise] reads h:R', None]
    """
    first: dict[str, object] = {}  # value -> the first step that reads it (a value is made once, before it)
    for s in steps:
        for v in s.reads:
            first.setdefault(v, s)
    return [_why(s, first.get(s.dst), layouts, outputs, pinned) if s.kind != "compute" else None for s in steps]


def _why(c, reader, layouts: Mapping[str, str], outputs: Mapping[str, str], pinned: Sequence[str]) -> str:
    lay = layouts[c.dst]
    if reader is not None and reader.kind == "compute":
        return f"{reader} [{'/'.join(reader.rules)}] reads {c.dst}"
    if reader is not None:
        return f"then {reader.kind} on {reader.mesh_axis_name}"
    name = next((k for k, v in outputs.items() if v == c.dst), None)
    if name is None:  # nothing reads it and it is no output: a pinned intermediate, materialized
        return f"{c.tensor} is pinned to {lay}"
    return f"output {name} is delivered as {lay}{' (pinned)' if name in pinned else ''}"


__all__ = ["explain_plan", "step_row", "why", "whys", "STEP_WIDTH"]
