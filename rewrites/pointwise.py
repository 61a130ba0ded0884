"""Pointwise rules: elementwise ops carry shardings through; linear ones carry partials."""
from __future__ import annotations

from . import P, R, S, rule

UNARY = ("neg", "exp", "log", "tanh", "sigmoid", "relu", "rsqrt", "sqrt", "erf", "abs", "cast", "gelu", "silu")
BINARY = ("add", "sub", "mul", "div", "maximum", "pow")


@rule("*")
def replicated(e):
    """f(x) with every operand replicated is f computed redundantly: replicated"""
    yield e.strategy(out=R)


@rule(*UNARY, *BINARY, "causal_mask")
def elementwise_sharded(e):
    """f(x)[shard] = f(x[shard]) for elementwise f; an operand broadcast along the axis stays replicated"""
    out = e.out
    last = out.ndim - 2 if e.op == "causal_mask" else out.ndim  # the mask reads positions of its last 2 axes
    for a in range(last):
        ins = {}
        for o in e.operands:
            k = a - (out.ndim - o.ndim)  # numpy broadcasting aligns from the right
            ins[o.param] = S(k) if k >= 0 and o.shape[k] == out.shape[a] else R
        yield e.strategy(out=S(a), **ins)


@rule("add", "sub")
def sum_of_partials(e):
    """sum_r a_r + sum_r b_r = sum_r (a_r + b_r): partial + partial is partial"""
    if len(e.operands) == 2:
        yield e.strategy(out=P, a=P, b=P)


@rule("mul", "div")
def partial_scaled(e):
    """(sum_r a_r) * b = sum_r (a_r * b) for replicated b (a number included); likewise a / b"""
    params = [o.param for o in e.operands]
    for p in params if e.op == "mul" else [p for p in params if p == "a"]:
        yield e.strategy(out=P, **{p: P})


@rule("neg", "cast")
def partial_through_linear_unary(e):
    """-(sum_r x_r) = sum_r -x_r; an exact upcast commutes with the sum too"""
    src, dst = e["x"].dtype, e.out.dtype  # the output's dtype: the cast's target, a torch dtype however named
    exact = e.op == "cast" and src.is_floating_point and dst.is_floating_point and src.itemsize <= dst.itemsize
    if e.op == "neg" or exact:
        yield e.strategy(out=P, x=P)
