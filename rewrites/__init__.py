"""Sharding rules, one module per family. Each rule states one identity: for an op whose operands sit on
one mesh axis as the rule says, computing the op locally on every rank yields the output in the
placement the rule gives. The optimizer takes the product of rules over mesh axes, and egglog
saturates the resulting physical e-graph from the pinned tensors.

    @rule("sum", "mean")
    def sum_over_sharded_axis(e):
        '''sum over a sharded axis is a local sum, then a partial'''
        for a in e.sharded_reduction_axes(): yield e.strategy(out=P, x=S(a))

Families: pointwise, views (propagation through reshape/permute/broadcast), reduction (rfactor),
aten (linear, matmul, sdpa, embedding, gather), resharding (collectives and their cancellations).
Every rule has a numeric test (tests/test_rules.py) that evaluates both sides on random data; a
registry test fails when a rule has none.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from egraph_did.layout import P, PMAX, R, S, Placement  # noqa: F401  (re-exported for rule modules)


@dataclass(frozen=True)
class Operand:
    """What a rule knows of one tensor operand or output."""

    param: str
    shape: tuple[int, ...]
    dtype: Any = None

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class OpView:
    """An op application as rules see it: op name, tensor operands by parameter, literal attributes,
    output shapes."""

    op: str
    operands: tuple[Operand, ...]
    attrs: tuple[tuple[str, Any], ...]
    outputs: tuple[Operand, ...]
    d: int = 1  # size of the mesh axis the rule is asked about

    def __getitem__(self, param: str) -> Operand:
        for o in self.operands:
            if o.param == param:
                return o
        raise KeyError(f"{self.op} has no tensor operand {param!r}")

    def has(self, param: str) -> bool:
        return any(o.param == param for o in self.operands)

    def attr(self, name: str, default=None):
        return dict(self.attrs).get(name, default)

    @property
    def out(self) -> Operand:
        return self.outputs[0]

    def divides(self, extent: int) -> bool:
        """Whether this mesh axis splits `extent` evenly."""
        return extent % self.d == 0

    def strategy(self, out: Placement | tuple[Placement, ...], flags: Iterable[str] = (), **inputs: Placement
                 ) -> "AxisStrategy":
        """Placements on one mesh axis; operands not named are replicated."""
        unknown = set(inputs) - {o.param for o in self.operands}
        assert not unknown, f"{self.op}: no operand(s) {unknown}"
        outs = out if isinstance(out, tuple) else (out,) * len(self.outputs)
        return AxisStrategy(tuple(inputs.get(o.param, R) for o in self.operands), outs, frozenset(flags))


@dataclass(frozen=True)
class AxisStrategy:
    """How one op runs on one mesh axis: operand and output placements, and local-kernel flags."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    flags: frozenset[str] = frozenset()
    rule: str = ""


@dataclass(frozen=True)
class Rule:
    name: str
    family: str
    ops: tuple[str, ...]
    identity: str
    fn: Callable[[OpView], Iterator[AxisStrategy]] = field(compare=False)

    def strategies(self, e: OpView) -> Iterator[AxisStrategy]:
        for s in self.fn(e):
            yield AxisStrategy(s.inputs, s.outputs, s.flags, self.name)


RULES: dict[str, list[Rule]] = defaultdict(list)
ALL_RULES: list[Rule] = []


def rule(*ops: str):
    """Register a sharding rule for `ops`; its docstring's first line states the identity."""
    def register(fn):
        doc = (fn.__doc__ or "").strip().splitlines()
        assert doc, f"rule {fn.__name__} needs a docstring stating its identity"
        r = Rule(fn.__name__, fn.__module__.rsplit(".", 1)[-1], ops, doc[0], fn)
        assert all(x.name != r.name for x in ALL_RULES), f"rule {r.name} registered twice"
        ALL_RULES.append(r)
        for o in ops:
            RULES[o].append(r)
        return fn
    return register


def axis_strategies(e: OpView) -> list[AxisStrategy]:
    """Every way to run e on one mesh axis (distinct placements; the first rule that finds one names it)."""
    seen, out = set(), []
    for r in RULES.get(e.op, ()) + RULES.get("*", []):
        for s in r.strategies(e):
            key = (s.inputs, s.outputs, s.flags)
            if key not in seen:
                seen.add(key)
                out.append(s)
    return out


def load_rule_families() -> None:
    """Import every family module so its rules register."""
    from . import aten, pointwise, reduction, resharding, views  # noqa: F401


load_rule_families()
