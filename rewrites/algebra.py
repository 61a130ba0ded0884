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
['bucket_pair', 'sum_partials_first']
>>> REWRITES["sum_partials_first"].identity
'(x + a) + b = x + (a + b): partial sums add before their collective (one all-reduce, not two)'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from egglog import String, eq, relation, ruleset, union, var
from egglog import rule as erule

from .sorts import OPS_SORT, Def, Lit, Shape, ShapeOf, Tensor

# Rewrote(t, name): rewrite `name` added a term to the class of t (explain names it)
Rewrote = relation("Rewrote", Tensor, String, egg_fn="Rewrote")
# Bucket(a, b, flat a, flat b, shape a, shape b, n_a, n_a + n_b): a and b may travel in one buffer (the
# literals of their flat and real shapes and of the split point come with it). The optimizer names the
# pairs: two collectives of one kind on one mesh axis that a plan without buckets runs (egraph_did/expand.py)
Bucket = relation("Bucket", *[Tensor] * 8, egg_fn="Bucket")

t, x, y, z = (var(v, Tensor) for v in ("t", "x", "y", "z"))
s = var("s", Shape)
add, cat, reshape, slice_ = OPS_SORT["add"], OPS_SORT["cat"], OPS_SORT["reshape"], OPS_SORT["slice"]


@dataclass(frozen=True)
class Example:
    """A small fusion where a rewrite applies: input shapes by name and a builder (ops, *tensors) ->
    outputs, as the sharding rules' Cases."""

    name: str
    inputs: dict[str, tuple[int, ...]]
    build: Callable
    buckets: tuple[tuple[int, int], ...] = ()  # pairs of outputs (by index) offered to bucket_pair


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



@program_rewrite(
    Example("two-gradients", {"a": (4, 6), "b": (5,)}, lambda o, a, b: (o.mul(a, 2.0), o.mul(b, 3.0)), ((0, 1),)),
    Example("three-sums", {"a": (3, 4, 2), "b": (3, 4), "c": (2, 5)},
            lambda o, a, b, c: (o.sum(a, 0), o.sum(b, 1), o.sum(c, 1)), ((0, 1), (1, 2))),
)
def bucket_pair():
    """a = unflat(flat(a) ++ flat(b))[:n_a], b likewise: two tensors travel in one buffer (one collective's latency, not two)"""
    fa, fb, sha, shb, k, n = (var(v, Tensor) for v in ("fa", "fb", "sha", "shb", "k", "n"))
    buffer = cat(reshape(x, fa), reshape(y, fb), Lit("0"))
    yield erule(Bucket(x, y, fa, fb, sha, shb, k, n)).then(
        union(x).with_(reshape(slice_(buffer, Lit("0"), Lit("0"), k), sha)), Rewrote(x, String("bucket_pair")),
        union(y).with_(reshape(slice_(buffer, Lit("0"), k, n), shb)), Rewrote(y, String("bucket_pair")))


__all__ = ["Bucket", "REWRITES", "Example", "ProgramRewrite", "Rewrote", "program_rewrite", "rewrite", "rewrite_ruleset"]
