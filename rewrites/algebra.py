"""Program rewrites: identities between programs, on the logical sort (rewrites/sorts.py: one op_<name>
term per op application, T("t3") per tensor). Where the sharding rules of the other families say how one
op may run, these add equal programs, so that the optimizer can choose a cheaper one: the e-graph holds
both, and extraction prices every alternative under the cost model (egraph_did/expand.py turns the new
terms into ops of the working fusion).

Each rewrite is a few egglog rules with its identity as the docstring's first line and an Example (a
small fusion where it applies) beside it; tests/rewrites/test_program_rewrites.py evaluates every new
term of every example against the term it equals. `optimize(..., rewrites=...)` switches them by name.

Terms a rewrite builds carry no ShapeOf fact, and the rules ask one of every operand: a rewrite applies to
the user's program (and the decompositions), never to its own results, so a chain of n adds gains n - 1
terms, not every bracketing of the chain.

>>> sorted(REWRITES)
['sum_partials_first']
>>> REWRITES["sum_partials_first"].identity
'(x + a) + b = x + (a + b): partial sums add before their collective (one all-reduce, not two)'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from egglog import String, eq, relation, ruleset, union, var
from egglog import rule as erule

from .sorts import OPS_SORT, Def, Shape, ShapeOf, Tensor

# Rewrote(t, name): rewrite `name` added a term to the class of t (explain names it)
Rewrote = relation("Rewrote", Tensor, String, egg_fn="Rewrote")

t, x, y, z = (var(v, Tensor) for v in ("t", "x", "y", "z"))
s = var("s", Shape)
add = OPS_SORT["add"]


@dataclass(frozen=True)
class Example:
    """A small fusion where a rewrite applies: input shapes by name and a builder (ops, *tensors) ->
    outputs, as the sharding rules' Cases."""

    name: str
    inputs: dict[str, tuple[int, ...]]
    build: Callable


@dataclass(frozen=True)
class ProgramRewrite:
    """One identity between programs: its name, the identity in words, its egglog rules, its examples."""

    name: str
    identity: str
    rules: Callable[[], Iterable]
    examples: tuple[Example, ...]


REWRITES: dict[str, ProgramRewrite] = {}


def program_rewrite(*examples: Example):
    """Register a generator of egglog rules as the program rewrite named after it (its docstring's first
    line: the identity).

    >>> @program_rewrite(Example("x", {"a": (2,)}, lambda o, a: o.neg(o.neg(a))))
    ... def _demo():
    ...     '''-(-a) = a'''
    ...     return []
    >>> REWRITES.pop("_demo").identity
    '-(-a) = a'
    """
    def register(fn):
        assert fn.__doc__, f"program rewrite {fn.__name__} states its identity in its docstring"
        REWRITES[fn.__name__] = ProgramRewrite(fn.__name__, fn.__doc__.strip().splitlines()[0], fn, examples)
        return fn
    return register


def rewrite(name: str, lhs, rhs, *conditions):
    """The egglog rule of one identity: where a tensor t is the term lhs (and the conditions hold), t is
    also the term rhs; Rewrote records which rewrite added it.

    >>> r = rewrite("demo", add(x, y), add(y, x))
    >>> type(r).__name__
    'RewriteOrRule'
    """
    return erule(eq(t).to(lhs), *conditions).then(union(t).with_(rhs), Rewrote(t, String(name)))


def rewrite_ruleset(names: Iterable[str]):
    """One egglog ruleset of the named rewrites, with the rule that makes each tensor its term (Def).

    >>> rewrite_ruleset(["sum_partials_first"]).ident.name
    'rewrites:sum_partials_first'
    """
    names = sorted(names)
    for n in names:
        assert n in REWRITES, f"unknown program rewrite {n!r}; known: {sorted(REWRITES)}"
    rules = [erule(Def(t, x)).then(union(t).with_(x))]
    rules += [r for n in names for r in REWRITES[n].rules()]
    return ruleset(*rules, name="rewrites:" + ",".join(names))


# ---------------------------------------------------------------------- the rewrites

@program_rewrite(
    Example("parallel-residual", {"x": (4, 6), "a": (4, 6), "b": (4, 6)}, lambda o, x, a, b: o.add(o.add(x, a), b)),
    Example("three-chains", {"x": (3, 5), "a": (3, 5), "b": (3, 5), "c": (3, 5)},
            lambda o, x, a, b, c: o.add(o.add(o.add(x, a), b), c)),
)
def sum_partials_first():
    """(x + a) + b = x + (a + b): partial sums add before their collective (one all-reduce, not two)"""
    same = [ShapeOf(x, s), ShapeOf(y, s), ShapeOf(z, s)]  # tensors of one shape and dtype, not numbers
    yield rewrite("sum_partials_first", add(add(x, y), z), add(x, add(y, z)), *same)


__all__ = ["REWRITES", "Example", "ProgramRewrite", "Rewrote", "program_rewrite", "rewrite", "rewrite_ruleset"]
