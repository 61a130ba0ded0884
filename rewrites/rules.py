"""The rule registry: how a sharding rule sees an op (OpView), what it yields (AxisStrategy), and the
numeric cases it is declared with (Case). The family modules register their rules here with `@rule`.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from egraph_did.layout import P, PMAX, R, S, Placement  # noqa: F401  (re-exported for rule modules)
from egraph_did.ops import OPS, LocalKernel


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
class AxisStrategy:
    """How one op runs on one mesh axis: operand and output placements, and the rank-local kernel the
    ranks run instead of the op's reference (None: the reference).

    >>> from egraph_did.ops import MEAN_GLOBAL_COUNT
    >>> AxisStrategy((S(1),), (P,), MEAN_GLOBAL_COUNT).flags
    frozenset({'global_count'})
    """

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    local: LocalKernel | None = None
    rule: str = ""
    nestable: bool = True  # the rule's identity holds when another mesh axis also splits the same axis

    @property
    def flags(self) -> frozenset[str]:
        """The local kernel's name, as a plan stores it."""
        return frozenset({self.local.name}) if self.local else frozenset()


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

    def strategy(self, out: Placement | tuple[Placement, ...], local: LocalKernel | None = None,
                 **inputs: Placement) -> AxisStrategy:
        """Placements on one mesh axis; operands not named are replicated. `local`: the rank-local kernel
        (declared beside the op in egraph_did/ops.py) the identity needs, if any.

        >>> from egraph_did.ops import MEAN_GLOBAL_COUNT
        >>> e = OpView("mean", (Operand("x", (4, 8)),), (("dims", 1),), (Operand("out", (4,)),), d=2)
        >>> s = e.strategy(out=P, x=S(1), local=MEAN_GLOBAL_COUNT)
        >>> [str(p) for p in s.inputs], [str(p) for p in s.outputs], s.local.name
        (['S(1)'], ['P'], 'global_count')
        """
        unknown = set(inputs) - {o.param for o in self.operands}
        assert not unknown, f"{self.op}: no operand(s) {unknown}"
        assert local is None or local in OPS[self.op].local_kernels, (
            f"{self.op}: local kernel {local} is not one of the op's (declare it in its op table entry)")
        outs = out if isinstance(out, tuple) else (out,) * len(self.outputs)
        return AxisStrategy(tuple(inputs.get(o.param, R) for o in self.operands), outs, local)


# ---------------------------------------------------------------------- numeric cases

@dataclass(frozen=True)
class Input:
    """An input of a numeric case: shape, dtype and, for an integer input, the exclusive upper bound of
    its values."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float64
    high: int = 0


def indices(shape: tuple[int, ...], high: int) -> Input:
    """An int64 input of values in [0, high) (embedding ids, gather indices, class targets).

    >>> indices((2, 3), high=10)
    Input(shape=(2, 3), dtype=torch.int64, high=10)
    """
    return Input(tuple(shape), torch.int64, high)


@dataclass(frozen=True)
class Case:
    """A rule's numeric case: a small fusion on a small mesh. tests/rewrites/test_rules.py runs every strategy
    the optimizer offers for it that names the rule, rank by rank on random data, and compares the
    assembled outputs with the single-device reference.

    inputs: name -> shape (float64) or Input; body(fd.ops, **inputs) -> an output or a tuple of them.

    >>> c = Case("uneven", (3,), {"x": (3, 7)}, lambda o, x: o.sum(x, 1))
    >>> c.specs()["x"]
    Input(shape=(3, 7), dtype=torch.float64, high=0)
    """

    name: str
    mesh: tuple[int, ...]
    inputs: dict
    body: Callable = field(compare=False)

    def specs(self) -> dict[str, Input]:
        """Every input as an Input."""
        return {n: s if isinstance(s, Input) else Input(tuple(s)) for n, s in self.inputs.items()}


# ---------------------------------------------------------------------- the registry

@dataclass(frozen=True)
class Rule:
    name: str
    family: str
    ops: tuple[str, ...]
    identity: str
    fn: Callable[[OpView], Iterator[AxisStrategy]] = field(compare=False)
    cases: tuple[Case, ...] = field(default=(), compare=False)
    nestable: bool = True

    def strategies(self, e: OpView) -> Iterator[AxisStrategy]:
        for s in self.fn(e):
            yield AxisStrategy(s.inputs, s.outputs, s.local, self.name, self.nestable)


RULES: dict[str, list[Rule]] = defaultdict(list)
ALL_RULES: list[Rule] = []
EGGLOG: dict[str, Callable[[], Iterator]] = {}  # rule name -> its egglog rules (egglog_form)


def rule(*ops: str, cases: Sequence[Case], nestable: bool = True):
    """Register a sharding rule for `ops` ("*": every op) with its numeric cases; its docstring's first
    line states the identity. nestable=False: the identity holds only where this rule's mesh axis alone
    splits the tensor axis it shards (the rule reasons about the whole extent of one split).

    >>> [(r.name, len(r.cases)) for r in RULES["amax"]]  # the rules of the reduction family that cover amax
    [('reduce_other_axis', 8), ('amax_over_sharded_axis', 3)]
    """
    def register(fn):
        doc = (fn.__doc__ or "").strip().splitlines()
        assert doc, f"rule {fn.__name__} needs a docstring stating its identity"
        assert cases, f"rule {fn.__name__} needs at least one numeric case (cases=[Case(...)])"
        r = Rule(fn.__name__, fn.__module__.rsplit(".", 1)[-1], ops, doc[0], fn, tuple(cases), nestable)
        assert all(x.name != r.name for x in ALL_RULES), f"rule {r.name} registered twice"
        ALL_RULES.append(r)
        for o in ops:
            RULES[o].append(r)
        return fn
    return register


def axis_strategies(e: OpView) -> list[AxisStrategy]:
    """Every way to run e on one mesh axis (distinct placements; the first rule that finds one names it).

    >>> e = OpView("mean", (Operand("x", (4, 8)),), (("dims", 1), ("keepdim", False)), (Operand("out", (4,)),), 2)
    >>> [(s.rule, str(s.inputs[0]), str(s.outputs[0]), str(s.local)) for s in axis_strategies(e)][:2]
    [('reduce_other_axis', 'S(0)', 'S(0)', 'None'), ('mean_over_sharded_axis', 'S(1)', 'P', 'global_count')]
    """
    seen, out = set(), []
    for r in RULES.get(e.op, []) + RULES.get("*", []):
        for s in r.strategies(e):
            key = (s.inputs, s.outputs, s.local)
            if key not in seen:
                seen.add(key)
                out.append(s)
    return out


# ---------------------------------------------------------------------- egglog forms

def egglog_form(spec: Callable):
    """Declare the egglog form of the Python rule `spec`: a generator, given the registered Rule (its ops),
    of egglog rules deriving the Ax rows (rewrites/sorts.py) that `spec` yields on one mesh axis. The Python
    rule stays as its executable spec, with the numeric cases; tests/rewrites/test_egglog_rules.py holds
    both equal on those cases.

    >>> from egraph_did.rewrites.reduction import sum_over_sharded_axis
    >>> [str(x) for x in EGGLOG["sum_over_sharded_axis"]()][0][:60]
    'rule(Sig1x1(sig, "sum", sy, sx0), Reduced(sig, a), MeshSize('
    """
    r = next(x for x in ALL_RULES if x.name == spec.__name__)

    def register(gen):
        assert (gen.__doc__ or "").strip(), f"the egglog form of {r.name} needs a docstring stating its identity"
        EGGLOG[r.name] = lambda: gen(r)
        return gen
    return register


def family_ruleset(family: str):
    """One egglog ruleset of every egglog form of the family's rules (egglog_form).

    >>> len(family_ruleset("reduction").__egg_ruleset__.rules) > 0
    True
    """
    from egglog import ruleset
    return ruleset(*(x for r in ALL_RULES if r.family == family and r.name in EGGLOG for x in EGGLOG[r.name]()),
                   name=family)
