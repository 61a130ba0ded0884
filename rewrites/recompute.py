"""Recomputation (activation checkpointing) as a program rewrite: the backward of a training step reads
every forward value t through the marker saved(t) (egraph_did/grad.py), and

    saved(f(a, b, ..)) = f(saved(a), saved(b), ..)

says that the value kept for the backward may instead be computed again in the backward from the values
kept for its operands (a literal operand stays as it is). The e-graph then holds both per tensor: the
saved one costs memory (plan.StepMemory counts the marker's bytes for the whole step) and no time, the
recomputed one costs f's time again and no memory beyond its operands'. Extraction picks per tensor under
the memory bound: without a bound every value is saved; a bound that cannot hold them makes the plan
recompute the cheapest ones to recompute.

The rule applies through whole chains: saved(gelu(linear(x, w1))) = gelu(saved(linear(x, w1))) =
gelu(linear(saved(x), saved(w1))), and saved of an input costs no memory (it is held for the whole step
anyway). Ops that recompute: the deterministic single-output ops of the kinds in RECOMPUTE_KINDS
(pointwise ops, masks, softmax and the norms, views, GEMMs, attention, constants); never a random op's
(dropout), an opaque one's or a reduction's.

>>> REWRITES["recompute"].identity
'saved(f(a, b, ..)) = f(saved(a), saved(b), ..): a value the backward reads is kept from the forward or computed again from kept operands'
"""
from __future__ import annotations

from egglog import eq, function, i64, relation, var
from egglog import rule as erule
from egglog import String, union

from egraph_did.ops import OPS, SAVE_OP, ops_where

from .algebra import REWRITES, Example, program_rewrite, rewrite
from .sorts import OPS_SORT, Lit, Out, Shape, ShapeOf, Tensor

RECOMPUTE_KINDS = ("pointwise", "mask", "normalization", "view", "matmul", "attention", "constant")
saved = OPS_SORT[SAVE_OP]
i = var("i", i64)


def recomputable() -> tuple[str, ...]:
    """The ops whose saved value may be recomputed: those of RECOMPUTE_KINDS (deterministic; a multi-output
    one's output i is the term Out(i, app): sdpa_lse's output and logsumexp), but the marker itself.

    >>> ops = recomputable()
    >>> "gelu" in ops, "softmax" in ops, "linear" in ops, "dropout" in ops, "saved" in ops, "var_mean" in ops
    (True, True, True, False, False, False)
    """
    return tuple(n for k in RECOMPUTE_KINDS for n in ops_where(kind=k) if n != SAVE_OP)


@function(egg_fn="Kept")
def Kept(x: Tensor) -> Tensor:
    """What the backward reads of an operand x: saved(x) for a tensor of the program, x for a literal."""


# Keepable(x): x is a tensor of the program (it has a ShapeOf) or a literal. The rule asks it of every
# operand, so a Kept term is made only where it resolves (a Kept of a rewrite's own term would be a fresh
# class, which the rule could wrap again without end)
Keepable = relation("Keepable", Tensor, egg_fn="Keepable")


def _kept_rules():
    k, x = var("k", Tensor), var("x", Tensor)
    s, j = var("s", Shape), var("j", String)
    yield erule(ShapeOf(x, s)).then(Keepable(x))
    yield erule(eq(x).to(Lit(j))).then(Keepable(x))
    yield erule(eq(k).to(Kept(x)), ShapeOf(x, s)).then(union(k).with_(saved(x)))
    yield erule(eq(k).to(Kept(x)), eq(x).to(Lit(j))).then(union(k).with_(x))


@program_rewrite(
    Example("mlp-hidden", {"x": (4, 6), "w": (5, 6)}, lambda o, x, w: o.saved(o.gelu(o.linear(x, w)))),
    Example("attention-probabilities", {"q": (2, 3, 4), "k": (2, 3, 4)},
            lambda o, q, k: o.saved(o.softmax(o.mul(o.matmul(q, o.transpose(k, -2, -1)), 0.5), -1))),
    Example("swiglu", {"g": (3, 4), "u": (3, 4)}, lambda o, g, u: o.saved(o.mul(o.silu(g), u))),
    Example("attention-output-and-logsumexp", {"q": (1, 2, 4, 3), "k": (1, 2, 4, 3), "v": (1, 2, 4, 3)},
            lambda o, q, k, v: tuple(o.saved(t) for t in o.sdpa_lse(o.mul(q, 2.0), k, v, is_causal=True))),
)
def recompute():
    """saved(f(a, b, ..)) = f(saved(a), saved(b), ..): a value the backward reads is kept from the forward or computed again from kept operands"""
    yield from _kept_rules()
    for name in recomputable():
        params = list(OPS[name].signature.parameters)
        xs = [var(f"a{i}", Tensor) for i in range(len(params))]
        f = OPS_SORT[name]
        yield rewrite("recompute", saved(f(*xs)), f(*[Kept(x) for x in xs]), *[Keepable(x) for x in xs])
        yield rewrite("recompute", saved(Out(i, f(*xs))), Out(i, f(*[Kept(x) for x in xs])), *[Keepable(x) for x in xs])


__all__ = ["Keepable", "Kept", "RECOMPUTE_KINDS", "REWRITES", "recompute", "recomputable"]
