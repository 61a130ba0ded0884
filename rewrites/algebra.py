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

>>> import rewrites.recompute  # registers 'recompute' (imported by the optimizer, not by this module)
>>> sorted(REWRITES)
['bucket_pair', 'merge_siblings', 'recompute', 'sum_partials_first']
>>> REWRITES["sum_partials_first"].identity
'(x + a) + b = x + (a + b): partial sums add before their collective (one all-reduce, not two)'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from egglog import String, eq, function, i64, i64Like, relation, ruleset, union, var
from egglog import rule as erule

from .sorts import OPS_SORT, Def, Lit, Shape, ShapeOf, Tensor

# Rewrote(t, name): rewrite `name` added a term to the class of t (explain names it)
Rewrote = relation("Rewrote", Tensor, String, egg_fn="Rewrote")
# Bucket(a, b, flat a, flat b, shape a, shape b, n_a, n_a + n_b): a and b may travel in one buffer (the
# literals of their flat and real shapes and of the split point come with it). The optimizer names the
# pairs: two collectives of one kind on one mesh axis that a plan without buckets runs (egraph_did/expand.py)
Bucket = relation("Bucket", *[Tensor] * 8, egg_fn="Bucket")
# Merge(g, x, n, shape of W, shape of B or null, view of Y [.., k, sum b_i], axis W's blocks join on): the
# set g of n sibling GEMMs of x merges with these literal shapes; Member(g, i, y_i, w_i, b_i or null, w_i's
# block view, b_i's block view, lo_i, hi_i, shape of y_i): its i-th sibling (in program order). expand
# writes them for the sets that can pay only (egglog does no arithmetic on shapes)
Merge = relation("Merge", i64, Tensor, i64, *[Tensor] * 4, egg_fn="Merge")
Member = relation("Member", i64, i64, *[Tensor] * 8, egg_fn="Member")


@function(egg_fn="MergedW")
def MergedW(g: i64Like, i: i64Like) -> Tensor:
    """The blocks of the first i + 1 weights of set g, stacked (a fold: sets of any size merge)."""


@function(egg_fn="MergedB")
def MergedB(g: i64Like, i: i64Like) -> Tensor:
    """The blocks of the first i + 1 biases of set g, stacked."""


@function(egg_fn="MergedY")
def MergedY(g: i64Like) -> Tensor:
    """The merged GEMM's output of set g, viewed as [.., k, sum b_i]."""


t, x, y, z = (var(v, Tensor) for v in ("t", "x", "y", "z"))
s = var("s", Shape)
add, cat, reshape, slice_ = OPS_SORT["add"], OPS_SORT["cat"], OPS_SORT["reshape"], OPS_SORT["slice"]
linear, matmul = OPS_SORT["linear"], OPS_SORT["matmul"]


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
    """One identity between programs: its name, the identity in words, its egglog rules, its examples, and
    whether it joins steps (see joining_rewrites)."""

    name: str
    identity: str
    rules: Callable[[], Iterable]
    examples: tuple[Example, ...]
    joins: bool = False


REWRITES: dict[str, ProgramRewrite] = {}


def program_rewrite(*examples: Example, joins: bool = False):
    """Register a generator of egglog rules as the program rewrite named after it (its docstring's first
    line: the identity). joins: its terms may make one step of two independent ones (joining_rewrites).

    >>> @program_rewrite(Example("x", {"a": (2,)}, lambda o, a: o.neg(o.neg(a))))
    ... def _demo():
    ...     '''-(-a) = a'''
    ...     return []
    >>> demo = REWRITES.pop("_demo")
    >>> demo.identity, demo.joins
    ('-(-a) = a', False)
    """
    def register(fn):
        assert fn.__doc__, f"program rewrite {fn.__name__} states its identity in its docstring"
        REWRITES[fn.__name__] = ProgramRewrite(fn.__name__, fn.__doc__.strip().splitlines()[0], fn, examples, joins)
        return fn
    return register


def joining_rewrites() -> tuple[str, ...]:
    """The program rewrites that may join two independent steps into one (one buffer for two collectives,
    one GEMM for sibling GEMMs), so a plan that takes one may not split between those steps: a forward
    tensor joined with a backward one cannot be delivered before the backward's inputs arrive
    (ed.parallelize re-optimizes without them).

    >>> joining_rewrites()
    ('bucket_pair', 'merge_siblings')
    """
    return tuple(sorted(n for n, r in REWRITES.items() if r.joins))


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
    joins=True,  # one buffer for two collectives: an output's all-reduce and an input gradient's
)
def bucket_pair():
    """a = unflat(flat(a) ++ flat(b))[:n_a], b likewise: two tensors travel in one buffer (one collective's latency, not two)"""
    fa, fb, sha, shb, k, n = (var(v, Tensor) for v in ("fa", "fb", "sha", "shb", "k", "n"))
    buffer = cat(reshape(x, fa), reshape(y, fb), Lit("0"))
    yield erule(Bucket(x, y, fa, fb, sha, shb, k, n)).then(
        union(x).with_(reshape(slice_(buffer, Lit("0"), Lit("0"), k), sha)), Rewrote(x, String("bucket_pair")),
        union(y).with_(reshape(slice_(buffer, Lit("0"), k, n), shb)), Rewrote(y, String("bucket_pair")))


def _merge_rules(app, biased: bool):
    """The rules merging the siblings y_i = app(x, w_i, b_i) of each Merge group: stack the weights' blocks
    (MergedW(g, i): blocks of siblings 0..i, joined along the Merge's axis; MergedB alike for biases), run
    one app of x on the stack, and give each y_i its slice of the output. A fold over the members, so one
    set of rules merges groups of any size."""
    g, i, n = (var(v, i64) for v in ("g", "i", "n"))
    x, w, b, y, acc, bacc, y0, w0, b0 = (var(v, Tensor) for v in ("x", "w", "b", "y", "acc", "bacc", "y0", "w0", "b0"))
    wblk, bblk, lo, hi, shy, shw, shb, view, axis = (var(v, Tensor) for v in (
        "wblk", "bblk", "lo", "hi", "shy", "shw", "shb", "view", "axis"))
    sb = var("sb", Shape)
    group = Merge(g, x, n, shw, shb, view, axis)
    sibling = [eq(y).to(app(x, w, b))] + ([ShapeOf(b, sb)] if biased else [eq(b).to(Lit("null"))])

    def member(k):
        return Member(g, k, y, w, b, wblk, bblk, lo, hi, shy)

    yield erule(group, member(i64(0)), *sibling).then(union(MergedW(g, i64(0))).with_(reshape(w, wblk)))
    yield erule(group, member(i), i > 0, *sibling, eq(acc).to(MergedW(g, i - 1))).then(
        union(MergedW(g, i)).with_(cat(acc, reshape(w, wblk), axis)))
    first = [Member(g, i64(0), y0, w0, b0, wblk, bblk, lo, hi, shy), eq(y0).to(app(x, w0, b0))]
    if biased:  # biases stack as [k, b_i] blocks along axis 1, as the weights' out rows
        yield erule(group, member(i64(0)), *sibling).then(union(MergedB(g, i64(0))).with_(reshape(b, bblk)))
        yield erule(group, member(i), i > 0, *sibling, eq(bacc).to(MergedB(g, i - 1))).then(
            union(MergedB(g, i)).with_(cat(bacc, reshape(b, bblk), Lit("1"))))
        merged = app(x, reshape(MergedW(g, n - 1), shw), reshape(MergedB(g, n - 1), shb))
        ready = [eq(acc).to(MergedW(g, n - 1)), eq(bacc).to(MergedB(g, n - 1)), ShapeOf(b0, sb)]
    else:
        merged = app(x, reshape(MergedW(g, n - 1), shw), Lit("null"))
        ready = [eq(acc).to(MergedW(g, n - 1)), eq(b0).to(Lit("null"))]
    yield erule(group, *first, *ready).then(union(MergedY(g)).with_(reshape(merged, view)))


def _slice_rule():
    """Each sibling is its slice of the merged output: y_i = reshape(Y[.., lo_i:hi_i], shape of y_i), Y the
    merged GEMM's output viewed as [.., k, sum_i b_i]."""
    g, i = var("g", i64), var("i", i64)
    y, w, b, yy = (var(v, Tensor) for v in ("y", "w", "b", "yy"))
    wblk, bblk, lo, hi, shy = (var(v, Tensor) for v in ("wblk", "bblk", "lo", "hi", "shy"))
    return erule(Member(g, i, y, w, b, wblk, bblk, lo, hi, shy), eq(yy).to(MergedY(g))).then(
        union(y).with_(reshape(slice_(yy, Lit("-1"), lo, hi), shy)), Rewrote(y, String("merge_siblings")))


def _stack(o, x, ws, bs=(), op="linear"):
    """The examples' programs: one linear (or matmul) of x per weight, with its bias where given."""
    if op == "matmul":
        return tuple(o.matmul(x, w) for w in ws)
    return tuple(o.linear(x, w, b) for w, b in zip(ws, list(bs) or [None] * len(ws)))


@program_rewrite(
    Example("gate-up", {"x": (2, 3, 4), "wg": (6, 4), "wu": (6, 4)}, lambda o, x, *ws: _stack(o, x, ws)),
    Example("qkv-bias", {"x": (5, 4), "wq": (3, 4), "wk": (3, 4), "wv": (3, 4), "bq": (3,), "bk": (3,), "bv": (3,)},
            lambda o, x, *wb: _stack(o, x, wb[:3], wb[3:])),
    Example("gqa", {"x": (2, 5, 4), "wq": (8, 4), "wk": (4, 4), "wv": (4, 4)}, lambda o, x, *ws: _stack(o, x, ws)),
    Example("gqa-bias", {"x": (5, 4), "wq": (6, 4), "wk": (4, 4), "bq": (6,), "bk": (4,)},
            lambda o, x, *wb: _stack(o, x, wb[:2], wb[2:])),
    Example("matmul-gqa", {"x": (3, 5, 4), "wq": (4, 12), "wk": (4, 6), "wv": (4, 6)},
            lambda o, x, *ws: _stack(o, x, ws, op="matmul")),
    Example("five-heads", {"x": (5, 4), **{f"w{i}": (2 + (i % 2) * 2, 4) for i in range(5)}},
            lambda o, x, *ws: _stack(o, x, ws)),
    joins=True,  # one GEMM for a forward linear and a backward matmul of the same weight
)
def merge_siblings():
    """linear(x, w_i, b_i) = linear(x, W, B)[.., k blocks: i-th of each] where W stacks k blocks, block j = [w_1's j-th b_1 rows; ..; w_n's j-th b_n rows] (b_i = o_i / k, k = gcd of the widths o_i; B alike; matmul on columns alike): sibling GEMMs of one input run as one, one collective where each had its own

    W = reshape(cat_i(reshape(w_i, [k, b_i, in]), axis 1), [k sum b_i, in]) and y_i =
    reshape(reshape(Y, [.., k, sum b_i])[.., lo_i:hi_i], [.., o_i]). Equal widths (k = o, b_i = 1) are the
    row-by-row interleave W[j n + i] = w_i[j]. Not cat(w_1, .., w_n): with every w_i split on its out
    rows over d ranks, a rank's rows of a cat are not its rows of each w_i (a gather), and slicing y_i back
    out of a column-split Y moves data again. Split into k blocks, a rank's blocks of W are exactly its rows
    of every w_i where each w_i's split over the d ranks falls on block edges (d divides k; or uneven,
    where ceil(o_i / d) = ceil(k / d) b_i): the view rules check that on every reshape, so the
    column-parallel merged GEMM reads local shards of the w_i only where it is local. Elsewhere (widths 4
    and 2 on 4 ranks: k = 2 blocks cannot give 4 ranks a row of each) a split W costs a reshard of a
    block, priced as such, and the merge pays row-parallel only (x split on in-features: any stacking of
    W's rows is local): the merge worth having there anyway, one all-reduce or reduce-scatter for all.
    Siblings are all linears with biases, all without, or all matmuls with 2-D weights, of one dtype and
    in-features: the program's own ops (a linear beside a matmul would need a transposed copy of one
    weight, a missing bias a zero one). Which sets merge is expand's choice (Merge and Member facts: every
    set of two or more where a group is small, the whole group where it is large, each only where it can
    pay); the rules fold over the members, so a set of any size merges.
    """
    for biased in (False, True):
        yield from _merge_rules(linear, biased)
    yield from _merge_rules(lambda x, w, b: matmul(x, w), False)
    yield _slice_rule()


__all__ = ["Bucket", "Member", "Merge", "MergedB", "MergedW", "MergedY", "REWRITES", "Example", "ProgramRewrite", "Rewrote", "program_rewrite", "rewrite", "rewrite_ruleset"]
