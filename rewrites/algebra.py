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
['bucket_pair', 'merge_siblings', 'sum_partials_first']
>>> REWRITES["sum_partials_first"].identity
'(x + a) + b = x + (a + b): partial sums add before their collective (one all-reduce, not two)'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from egglog import String, eq, i64, relation, ruleset, union, var
from egglog import rule as erule

from .sorts import OPS_SORT, Def, Lit, Shape, ShapeOf, Tensor

# Rewrote(t, name): rewrite `name` added a term to the class of t (explain names it)
Rewrote = relation("Rewrote", Tensor, String, egg_fn="Rewrote")
# Bucket(a, b, flat a, flat b, shape a, shape b, n_a, n_a + n_b): a and b may travel in one buffer (the
# literals of their flat and real shapes and of the split point come with it). The optimizer names the
# pairs: two collectives of one kind on one mesh axis that a plan without buckets runs (egraph_did/expand.py)
Bucket = relation("Bucket", *[Tensor] * 8, egg_fn="Bucket")
# Order(w, i): the weight w of a linear is the program's i-th tensor (siblings merge in this order: each set
# of them once, not once per permutation). expand writes it for the siblings that can pay only
Order = relation("Order", Tensor, i64, egg_fn="Order")
# Interleave(n, shape of w, shape of y, [o, n, in] -> [n o, in], y -> [.., o, n], y, [o, n] -> [n o]): the
# literal shapes that n sibling linears y = linear(x, w[, b]) of these shapes merge with (expand writes one
# per shape pair of the program's linears and n in SIBLINGS; egglog does no arithmetic on shapes)
Interleave = relation("Interleave", i64, Shape, Shape, *[Tensor] * 4, egg_fn="Interleave")
SIBLINGS = (2, 3)  # gate and up; q, k and v (pairs of three siblings merge too: the plan picks)

t, x, y, z = (var(v, Tensor) for v in ("t", "x", "y", "z"))
s = var("s", Shape)
add, cat, reshape, slice_ = OPS_SORT["add"], OPS_SORT["cat"], OPS_SORT["reshape"], OPS_SORT["slice"]
linear, unsqueeze = OPS_SORT["linear"], OPS_SORT["unsqueeze"]


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


def _interleaved(parts, merged_shape):
    """The n tensors [o, ...] (weights or biases) as one [n o, ...] whose row j n + i is row j of parts[i]:
    a shard of o rows of each is a shard of n o rows of this, so the per-rank merge is local."""
    one = Lit("1")
    stacked = unsqueeze(parts[0], one)
    for p in parts[1:]:
        stacked = cat(stacked, unsqueeze(p, one), one)
    return reshape(stacked, merged_shape)


def _merge_rule(n: int, biased: bool):
    """The rule merging n sibling linears of one input (with biases, or none)."""
    ws = [var(f"w{i}", Tensor) for i in range(n)]
    bs = [var(f"b{i}", Tensor) for i in range(n)] if biased else [Lit("null")] * n
    ts = [var(f"t{i}", Tensor) for i in range(n)]
    order = [var(f"i{i}", i64) for i in range(n)]
    sw, sy, sb = (var(v, Shape) for v in ("sw", "sy", "sb"))
    lw, lsplit, ly, lb = (var(v, Tensor) for v in ("lw", "lsplit", "ly", "lb"))
    query = [eq(t).to(linear(x, w, b)) for t, w, b in zip(ts, ws, bs)]
    query += [ShapeOf(w, sw) for w in ws] + [Order(w, i) for w, i in zip(ws, order)]
    query += [order[k] < order[k + 1] for k in range(n - 1)]
    query += [ShapeOf(b, sb) for b in bs] if biased else []
    query += [ShapeOf(ts[0], sy), Interleave(i64(n), sw, sy, lw, lsplit, ly, lb)]
    merged = linear(x, _interleaved(ws, lw), _interleaved(bs, lb) if biased else Lit("null"))
    split = reshape(merged, lsplit)  # [.., o, n]: sibling i is the last axis' i-th column
    actions = []
    for k, t in enumerate(ts):
        actions += [union(t).with_(reshape(slice_(split, Lit("-1"), Lit(str(k)), Lit(str(k + 1))), ly)),
                    Rewrote(t, String("merge_siblings"))]
    return erule(*query).then(*actions)


def _siblings(o, x, *weights_then_biases):
    """The examples' programs: two or three linears of x (weights, then biases where given)."""
    n = 3 if len(weights_then_biases) in (3, 6) else 2
    ws, bs = weights_then_biases[:n], weights_then_biases[n:] or [None] * n
    return tuple(o.linear(x, w, b) for w, b in zip(ws, bs))


@program_rewrite(
    Example("gate-up", {"x": (2, 3, 4), "wg": (6, 4), "wu": (6, 4)}, _siblings),
    Example("qkv-bias", {"x": (5, 4), "wq": (3, 4), "wk": (3, 4), "wv": (3, 4), "bq": (3,), "bk": (3,), "bv": (3,)},
            _siblings),
)
def merge_siblings():
    """linear(x, w_i, b_i) = linear(x, W, B)[.., i::n] where W[j n + i] = w_i[j] (B alike): sibling linears of one input run as one GEMM, one collective where each had its own

    The weights interleave row by row, not end to end: a rank's shard of o rows of every w_i is then its
    shard of n o rows of W (cat along the sharded out-features would need a gather, and so would slicing
    y_i out of its output), so a column- or row-parallel merged GEMM reads only local shards, and one
    collective moves every sibling's output. Groups of two and three (gate and up; q, k and v) of one
    weight shape, all with biases or none; their order is the program's (Order), so each group merges once.
    """
    for n in SIBLINGS:
        for biased in (False, True):
            yield _merge_rule(n, biased)


__all__ = ["Bucket", "Interleave", "Order", "SIBLINGS", "REWRITES", "Example", "ProgramRewrite", "Rewrote", "program_rewrite", "rewrite", "rewrite_ruleset"]
