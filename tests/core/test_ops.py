"""The op table: every op's shape and dtype rule agrees with what torch produces, every composite's
primitive decomposition computes what torch.nn.functional computes, and errors are raised at the op that
is wrong, naming the tensor and the axis.

CASES is a registry: test_every_registered_op_has_a_case fails when an op in ed.OPS has no case here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import egraph_did as ed
import random_reference
from egraph_did import DtypeError, ShapeError

F64, F32 = torch.float64, torch.float32
TOL = {F64: 1e-10, F32: 1e-5}


def rand(*shape, dtype=F64, seed=0, positive=False):
    g = torch.Generator().manual_seed(seed + 7 * len(shape) + sum(shape))
    x = torch.randn(*shape, generator=g, dtype=F64)
    if positive:
        x = x.abs() + 0.5
    return x.to(dtype)


def ints(*shape, high, dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed + 11 * sum(shape))
    return torch.randint(0, high, shape, generator=g).to(dtype)


@dataclass
class Case:
    """One op application: inputs (a function of the float dtype), how to emit it with fd.ops, and what
    torch computes for it."""

    op: str
    id: str
    inputs: Callable[[torch.dtype], dict[str, torch.Tensor]]
    call: Callable[[Any, dict], Any]
    torch_fn: Callable[[dict], Any]
    dtypes: tuple = (F64, F32)
    marks: list = field(default_factory=list)


def as_tuple(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def build(case: Case, dtype):
    """(fd, inputs, output names) for one case."""
    inputs = case.inputs(dtype)
    fd = ed.FusionDefinition()
    tvs = {k: fd.define_tensor(tuple(v.shape), dtype=v.dtype, name=k) for k, v in inputs.items()}
    outs = as_tuple(case.call(fd.ops, tvs))
    names = []
    for i, o in enumerate(outs):
        fd.add_output(o, name=f"out{i}")
        names.append(f"out{i}")
    return fd, inputs, outs, names


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if want.is_floating_point():
        tol = TOL.get(dtype, 1e-5)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)
    else:
        assert torch.equal(got, want)


# ---------------------------------------------------------------- the registry of cases

def x_(*shape, positive=False):
    return lambda dt: {"x": rand(*shape, dtype=dt, positive=positive)}


def xy(sx, sy):
    return lambda dt: {"x": rand(*sx, dtype=dt), "y": rand(*sy, dtype=dt, seed=1)}


def unary_case(name, fn, positive=False):
    return Case(name, name, x_(3, 5, positive=positive), lambda o, t: getattr(o, name)(t["x"]),
                lambda v: fn(v["x"]))


def ln_inputs(weight, bias, shape=(4, 3, 5), norm=(5,)):
    def make(dt):
        d = {"x": rand(*shape, dtype=dt)}
        if weight:
            d["w"] = rand(*norm, dtype=dt, seed=2)
        if bias:
            d["b"] = rand(*norm, dtype=dt, seed=3)
        return d
    return make


def sdpa_inputs(sq=5, sk=5, d=4, dv=4):
    return lambda dt: {"q": rand(2, 3, sq, d, dtype=dt), "k": rand(2, 3, sk, d, dtype=dt, seed=1),
                       "v": rand(2, 3, sk, dv, dtype=dt, seed=2)}


def sdpa_with_lse(v, **kw):
    """torch's sdpa and the logsumexp of its scaled (masked) scores."""
    q, k = v["q"], v["k"]
    s = q @ k.transpose(-2, -1) * kw.get("scale", q.shape[-1] ** -0.5)
    if kw.get("is_causal"):
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v["v"], **kw), torch.logsumexp(s, -1)


def grouped_inputs(offsets, dtype=torch.int64, w=(4, 3, 5)):
    """x [7, 3], w [4, 3, 5] (or [4, 5, 3]: transposed in the case) and offsets."""
    return lambda dt: {"x": rand(7, 3, dtype=dt), "w": rand(*w, dtype=dt, seed=1),
                       "o": torch.tensor(offsets, dtype=dtype)}


def grouped_mm_ref(x, w, offsets):
    """torch, one expert at a time: rows offsets[e-1]:offsets[e] times w[e], the others zero."""
    parts, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        parts.append(x[start:end] @ w[e])
        start = end
    parts.append(torch.zeros(x.shape[0] - start, w.shape[2], dtype=x.dtype))
    return torch.cat(parts)


def grouped_wgrad_ref(x, g, offsets):
    out, start = [], 0
    for end in offsets.tolist():
        out.append(x[start:end].T @ g[start:end])
        start = end
    return torch.stack(out)


def sdpa_grad_inputs(sq=5, sk=5, d=4, dv=4):
    def make(dt):
        out = sdpa_inputs(sq, sk, d, dv)(dt)
        out["g"] = rand(2, 3, sq, dv, dtype=dt, seed=3)
        return out
    return make


def sdpa_grads(v, **kw):
    """dq, dk, dv of torch's sdpa by torch.autograd, for the output gradient g."""
    leaves = [v[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
    return torch.autograd.grad(F.scaled_dot_product_attention(*leaves, **kw), leaves, v["g"])


def attention_blocks_ref(v, blocks, **kw):
    """torch's sdpa of q against each torch.chunk piece of k and v on its own (a row that sees none of a
    piece's keys: out 0, lse -inf), stacked on axis 2, with the logsumexp of each piece's scores."""
    q, k, vv = v["q"], v["k"], v["v"]
    s = q @ k.transpose(-2, -1) * kw.get("scale", q.shape[-1] ** -0.5)
    if kw.get("is_causal"):
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    outs, lses = [], []
    chunks = list(zip(torch.chunk(torch.arange(k.shape[2]), blocks)))
    chunks += [(torch.arange(0),)] * (blocks - len(chunks))
    for (idx,) in chunks:
        piece = s[..., idx]
        lse = torch.logsumexp(piece, -1)
        p = torch.softmax(piece, -1).nan_to_num(0.0)
        outs.append(p @ vv[:, :, idx])
        lses.append(lse)
    return torch.stack(outs, 2), torch.stack(lses, 2)


def ce_inputs(n=6, c=5, tdtype=torch.int64):
    return lambda dt: {"logits": rand(n, c, dtype=dt), "target": ints(n, high=c, dtype=tdtype)}


def ce_ignored(rows, n=6, c=5):
    """cross entropy's inputs with the targets of `rows` set to -100 (transformers' ignore_index)"""
    def inputs(dt):
        t = ints(n, high=c)
        t[list(rows)] = -100
        return {"logits": rand(n, c, dtype=dt), "target": t}
    return inputs


def welford_stats(x, dim, blocks):
    """(count, mean, M2) of each torch.chunk piece of x along dim; missing trailing pieces are empty (0, 0, 0)."""
    pieces = list(torch.chunk(x, blocks, dim))
    stats = []
    for g in range(blocks):
        p = pieces[g] if g < len(pieces) else x.narrow(dim, 0, 0)
        shape = list(x.shape)
        shape[dim] = 1
        n = torch.full(shape, float(p.shape[dim]), dtype=x.dtype)
        m = p.mean(dim, keepdim=True) if p.shape[dim] else torch.zeros(shape, dtype=x.dtype)
        m2 = ((p - m) ** 2).sum(dim, keepdim=True) if p.shape[dim] else torch.zeros(shape, dtype=x.dtype)
        stats.append(torch.stack([n, m, m2], -1))
    return torch.cat(stats, dim)


CASES: list[Case] = [
    # ---- binary pointwise, broadcasting and type promotion
    Case("add", "add-broadcast", xy((4, 1, 3), (5, 1)), lambda o, t: o.add(t["x"], t["y"]), lambda v: v["x"] + v["y"]),
    Case("add", "add-int32-float-scalar", lambda dt: {"x": ints(3, 4, high=9, dtype=torch.int32)},
         lambda o, t: o.add(t["x"], 2.5), lambda v: v["x"] + 2.5, dtypes=(None,)),
    Case("add", "add-int32-int64", lambda dt: {"x": ints(3, 4, high=9, dtype=torch.int32), "y": ints(4, high=9)},
         lambda o, t: o.add(t["x"], t["y"]), lambda v: v["x"] + v["y"], dtypes=(None,)),
    Case("add", "add-bool-int-scalar", lambda dt: {"x": ints(3, high=2, dtype=torch.bool)},
         lambda o, t: o.add(t["x"], 1), lambda v: v["x"] + 1, dtypes=(None,)),
    Case("sub", "sub-scalar-left", x_(3, 4), lambda o, t: o.sub(2.0, t["x"]), lambda v: 2.0 - v["x"]),
    Case("sub", "sub-broadcast", xy((3, 4), (4,)), lambda o, t: o.sub(t["x"], t["y"]), lambda v: v["x"] - v["y"]),
    Case("mul", "mul-f16-f64", lambda dt: {"x": rand(3, 4, dtype=torch.float16), "y": rand(4, dtype=F64, seed=1)},
         lambda o, t: o.mul(t["x"], t["y"]), lambda v: v["x"] * v["y"], dtypes=(None,)),
    Case("mul", "mul-scalar", x_(3, 4), lambda o, t: o.mul(t["x"], 3), lambda v: v["x"] * 3),
    Case("div", "div-broadcast", xy((2, 3, 4), (3, 1)), lambda o, t: o.div(t["x"], t["y"]), lambda v: v["x"] / v["y"]),
    Case("div", "div-int-int-is-float", lambda dt: {"x": ints(3, 4, high=9), "y": ints(3, 4, high=9, seed=1) + 1},
         lambda o, t: o.div(t["x"], t["y"]), lambda v: v["x"] / v["y"], dtypes=(None,)),
    Case("maximum", "maximum", xy((3, 4), (3, 4)), lambda o, t: o.maximum(t["x"], t["y"]),
         lambda v: torch.maximum(v["x"], v["y"])),
    Case("maximum", "maximum-scalar", x_(3, 4), lambda o, t: o.maximum(t["x"], 0.0),
         lambda v: torch.clamp_min(v["x"], 0.0)),
    Case("maximum", "maximum-int-tensor-float-scalar", lambda dt: {"x": torch.tensor([1, 2, 3])},
         lambda o, t: o.maximum(t["x"], 2.5), lambda v: torch.maximum(v["x"], torch.tensor(2.5)), dtypes=(None,),
         ),
    Case("minimum", "minimum-broadcast", xy((3, 4), (4,)), lambda o, t: o.minimum(t["x"], t["y"]),
         lambda v: torch.minimum(v["x"], v["y"])),
    Case("minimum", "minimum-ties-split-the-gradient", lambda dt: {"x": torch.tensor([1.0, -2.0, 0.5], dtype=dt),
                                                                  "y": torch.tensor([1.0, 3.0, -1.0], dtype=dt)},
         lambda o, t: o.minimum(t["x"], t["y"]), lambda v: torch.minimum(v["x"], v["y"])),
    Case("minimum", "minimum-scalar-left", x_(3, 4), lambda o, t: o.minimum(0.25, t["x"]),
         lambda v: torch.clamp_max(v["x"], 0.25)),
    Case("minimum", "minimum-int-tensor-float-scalar", lambda dt: {"x": torch.tensor([1, 2, 3])},
         lambda o, t: o.minimum(t["x"], 2.5), lambda v: torch.minimum(v["x"], torch.tensor(2.5)), dtypes=(None,)),
    Case("pow", "pow-scalar-exponent", x_(3, 4, positive=True), lambda o, t: o.pow(t["x"], 2.5),
         lambda v: v["x"] ** 2.5),
    Case("pow", "pow-int32", lambda dt: {"x": ints(3, high=5, dtype=torch.int32)}, lambda o, t: o.pow(t["x"], 2),
         lambda v: v["x"] ** 2, dtypes=(None,)),
    Case("gt", "gt-broadcast", xy((3, 4), (4,)), lambda o, t: o.gt(t["x"], t["y"]), lambda v: v["x"] > v["y"]),
    Case("gt", "gt-scalar-left", x_(3, 4), lambda o, t: o.gt(0.5, t["x"]), lambda v: 0.5 > v["x"]),
    Case("eq", "eq-row-max", x_(3, 4), lambda o, t: o.eq(t["x"], o.amax(t["x"], 1, keepdim=True)),
         lambda v: v["x"] == v["x"].amax(1, keepdim=True)),
    Case("eq", "eq-int-scalar", lambda dt: {"x": ints(3, 4, high=3)}, lambda o, t: o.eq(t["x"], 1),
         lambda v: v["x"] == 1, dtypes=(None,)),
    Case("ne", "ne-broadcast", xy((3, 4), (4,)), lambda o, t: o.ne(t["x"], t["y"]), lambda v: v["x"] != v["y"]),
    Case("ne", "ne-int-scalar", lambda dt: {"x": ints(3, 4, high=3)}, lambda o, t: o.ne(t["x"], 1),
         lambda v: v["x"] != 1, dtypes=(None,)),
    Case("lt", "lt-broadcast", xy((3, 4), (3, 1)), lambda o, t: o.lt(t["x"], t["y"]), lambda v: v["x"] < v["y"]),
    Case("le", "le-int-tensors", lambda dt: {"x": ints(4, 4, high=3), "y": ints(4, 1, high=3, seed=1)},
         lambda o, t: o.le(t["x"], t["y"]), lambda v: v["x"] <= v["y"], dtypes=(None,)),
    Case("ge", "ge-scalar-left", x_(3, 4), lambda o, t: o.ge(0.25, t["x"]), lambda v: 0.25 >= v["x"]),
    Case("where", "where-broadcast", lambda dt: {"c": rand(3, 1) > 0, "x": rand(3, 4, dtype=dt, seed=1),
                                                 "y": rand(4, dtype=dt, seed=2)},
         lambda o, t: o.where(t["c"], t["x"], t["y"]), lambda v: torch.where(v["c"], v["x"], v["y"])),
    Case("where", "where-number-fills", lambda dt: {"x": rand(3, 4, dtype=dt)},
         lambda o, t: (o.where(o.gt(t["x"], 0.0), t["x"], float("-inf")), o.where(o.lt(t["x"], 0.0), 0.5, t["x"])),
         lambda v: (torch.where(v["x"] > 0, v["x"], float("-inf")), torch.where(v["x"] < 0, 0.5, v["x"]))),
    Case("where", "where-int-and-float-promote", lambda dt: {"c": rand(4) > 0, "i": ints(4, high=9)},
         lambda o, t: o.where(t["c"], t["i"], 2.5), lambda v: torch.where(v["c"], v["i"], 2.5), dtypes=(None,)),
    # ---- unary pointwise
    unary_case("neg", torch.neg),
    Case("neg", "neg-int64", lambda dt: {"x": ints(3, 4, high=9)}, lambda o, t: o.neg(t["x"]),
         lambda v: -v["x"], dtypes=(None,)),
    unary_case("exp", torch.exp),
    unary_case("log", torch.log, positive=True),
    unary_case("tanh", torch.tanh),
    unary_case("sigmoid", torch.sigmoid),
    unary_case("relu", torch.relu),
    unary_case("rsqrt", torch.rsqrt, positive=True),
    unary_case("sqrt", torch.sqrt, positive=True),
    unary_case("erf", torch.erf),
    unary_case("abs", torch.abs),
    Case("abs", "abs-int32", lambda dt: {"x": ints(3, high=9, dtype=torch.int32) - 4}, lambda o, t: o.abs(t["x"]),
         lambda v: v["x"].abs(), dtypes=(None,)),
    Case("gelu", "gelu-erf", x_(4, 7), lambda o, t: o.gelu(t["x"]), lambda v: F.gelu(v["x"])),
    Case("gelu", "gelu-tanh", x_(4, 7), lambda o, t: o.gelu(t["x"], approximate="tanh"),
         lambda v: F.gelu(v["x"], approximate="tanh")),
    Case("silu", "silu", x_(4, 7), lambda o, t: o.silu(t["x"]), lambda v: F.silu(v["x"])),
    Case("silu_backward", "silu_backward", lambda dt: {"dy": rand(4, 7, dtype=dt), "x": rand(4, 7, dtype=dt, seed=1) * 4},
         lambda o, t: o.silu_backward(t["dy"], t["x"]),  # aten.silu_backward's formula (torch has no derivative of it)
         lambda v: (lambda s: v["dy"] * s * (1 + v["x"] * (1 - s)))(torch.sigmoid(v["x"]))),
    Case("saved", "saved", x_(4, 7), lambda o, t: o.saved(o.exp(t["x"])), lambda v: torch.exp(v["x"])),
    Case("cast", "cast-to-bf16", x_(3, 4), lambda o, t: o.cast(t["x"], torch.bfloat16),
         lambda v: v["x"].to(torch.bfloat16)),
    Case("cast", "cast-int-to-float-by-name", lambda dt: {"x": ints(3, high=9)}, lambda o, t: o.cast(t["x"], "fp32"),
         lambda v: v["x"].to(torch.float32), dtypes=(None,)),
    Case("cast", "cast-by-torch-name", x_(3), lambda o, t: o.cast(t["x"], "float16"),
         lambda v: v["x"].to(torch.float16), dtypes=(F32,)),
    Case("causal_mask", "causal_mask", x_(2, 4, 4), lambda o, t: o.causal_mask(t["x"]),
         lambda v: v["x"].masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))),
    Case("causal_mask", "causal_mask-offset-rectangular", x_(3, 5), lambda o, t: o.causal_mask(t["x"], 1),
         lambda v: v["x"].masked_fill(~torch.ones(3, 5, dtype=torch.bool).tril(1), float("-inf"))),
    # ---- reductions
    Case("sum", "sum-one-axis", x_(3, 4, 5), lambda o, t: o.sum(t["x"], 1), lambda v: v["x"].sum(1)),
    Case("sum", "sum-all", x_(3, 4), lambda o, t: o.sum(t["x"]), lambda v: v["x"].sum()),
    Case("sum", "sum-keepdim-negative", x_(3, 4, 5), lambda o, t: o.sum(t["x"], (-1, 0), keepdim=True),
         lambda v: v["x"].sum((-1, 0), keepdim=True)),
    Case("sum", "sum-int64", lambda dt: {"x": ints(3, 4, high=9)}, lambda o, t: o.sum(t["x"], 0),
         lambda v: v["x"].sum(0), dtypes=(None,)),
    Case("sum", "sum-int32-promotes-to-int64", lambda dt: {"x": ints(3, 4, high=9, dtype=torch.int32)},
         lambda o, t: o.sum(t["x"], 1), lambda v: v["x"].sum(1), dtypes=(None,)),
    Case("sum", "sum-bool-counts-in-int64", lambda dt: {"x": ints(3, 4, high=2, dtype=torch.bool)},
         lambda o, t: o.sum(t["x"], 1), lambda v: v["x"].sum(1), dtypes=(None,)),
    Case("amax", "amax", x_(3, 4, 5), lambda o, t: o.amax(t["x"], (0, 2)), lambda v: v["x"].amax((0, 2))),
    Case("amax", "amax-all-keepdim", x_(3, 4), lambda o, t: o.amax(t["x"], keepdim=True),
         lambda v: v["x"].amax((0, 1), keepdim=True)),
    Case("mean", "mean-one-axis", x_(3, 4, 5), lambda o, t: o.mean(t["x"], 1), lambda v: v["x"].mean(1)),
    Case("mean", "mean-all", x_(3, 4), lambda o, t: o.mean(t["x"]), lambda v: v["x"].mean()),
    Case("mean", "mean-multi-keepdim", x_(3, 4, 5), lambda o, t: o.mean(t["x"], (0, -1), keepdim=True),
         lambda v: v["x"].mean((0, -1), keepdim=True)),
    Case("var_mean", "var_mean-correction1", x_(3, 6), lambda o, t: o.var_mean(t["x"], 1),
         lambda v: torch.var_mean(v["x"], 1)),
    Case("var_mean", "var_mean-correction0", x_(3, 6), lambda o, t: o.var_mean(t["x"], 1, correction=0),
         lambda v: torch.var_mean(v["x"], 1, correction=0)),
    Case("var_mean", "var_mean-keepdim-multi", x_(3, 4, 5), lambda o, t: o.var_mean(t["x"], (0, 2), keepdim=True),
         lambda v: torch.var_mean(v["x"], (0, 2), keepdim=True)),
    Case("var_mean", "var_mean-all-correction0", x_(3, 4), lambda o, t: o.var_mean(t["x"], correction=0),
         lambda v: torch.var_mean(v["x"], (0, 1), correction=0)),
    Case("var_mean", "var_mean-all-keepdim", x_(3, 4), lambda o, t: o.var_mean(t["x"], keepdim=True),
         lambda v: torch.var_mean(v["x"], (0, 1), keepdim=True)),
    Case("welford_blocks", "welford_blocks-uneven", x_(3, 7), lambda o, t: o.welford_blocks(t["x"], 1, 3),
         lambda v: welford_stats(v["x"], 1, 3)),
    Case("welford_blocks", "welford_blocks-empty-trailing-block", x_(7, 2), lambda o, t: o.welford_blocks(t["x"], 0, 5),
         lambda v: welford_stats(v["x"], 0, 5)),
    Case("welford_merge", "welford_merge-is-var_mean", x_(3, 7),
         lambda o, t: o.welford_merge(o.welford_blocks(t["x"], 1, 3), 1), lambda v: torch.var_mean(v["x"], 1)),
    Case("welford_merge", "welford_merge-empty-block-keepdim-correction0", x_(7, 2),
         lambda o, t: o.welford_merge(o.welford_blocks(t["x"], -2, 5), -2, correction=0, keepdim=True),
         lambda v: torch.var_mean(v["x"], 0, correction=0, keepdim=True)),
    Case("softmax", "softmax-last", x_(3, 7), lambda o, t: o.softmax(t["x"]), lambda v: torch.softmax(v["x"], -1)),
    Case("softmax", "softmax-axis0", x_(4, 3, 5), lambda o, t: o.softmax(t["x"], 0), lambda v: torch.softmax(v["x"], 0)),
    # ---- normalizations
    Case("layer_norm", "layer_norm-plain", ln_inputs(False, False), lambda o, t: o.layer_norm(t["x"]),
         lambda v: F.layer_norm(v["x"], (5,))),
    Case("layer_norm", "layer_norm-weight", ln_inputs(True, False), lambda o, t: o.layer_norm(t["x"], weight=t["w"]),
         lambda v: F.layer_norm(v["x"], (5,), v["w"])),
    Case("layer_norm", "layer_norm-weight-bias", ln_inputs(True, True),
         lambda o, t: o.layer_norm(t["x"], (5,), t["w"], t["b"]), lambda v: F.layer_norm(v["x"], (5,), v["w"], v["b"])),
    Case("layer_norm", "layer_norm-bias-only-eps", ln_inputs(False, True),
         lambda o, t: o.layer_norm(t["x"], 5, bias=t["b"], eps=1e-3),
         lambda v: F.layer_norm(v["x"], (5,), None, v["b"], 1e-3)),
    Case("layer_norm", "layer_norm-multi-axis", ln_inputs(False, False), lambda o, t: o.layer_norm(t["x"], (3, 5)),
         lambda v: F.layer_norm(v["x"], (3, 5))),
    Case("layer_norm", "layer_norm-multi-axis-affine", ln_inputs(True, True, norm=(3, 5)),
         lambda o, t: o.layer_norm(t["x"], (3, 5), t["w"], t["b"]),
         lambda v: F.layer_norm(v["x"], (3, 5), v["w"], v["b"])),
    Case("layer_norm", "layer_norm-multi-axis-from-weight", ln_inputs(True, False, norm=(3, 5)),
         lambda o, t: o.layer_norm(t["x"], weight=t["w"]), lambda v: F.layer_norm(v["x"], (3, 5), v["w"])),
    Case("rms_norm", "rms_norm-plain", ln_inputs(False, False), lambda o, t: o.rms_norm(t["x"]),
         lambda v: F.rms_norm(v["x"], (5,), eps=1e-6)),
    Case("rms_norm", "rms_norm-weight", ln_inputs(True, False), lambda o, t: o.rms_norm(t["x"], weight=t["w"]),
         lambda v: F.rms_norm(v["x"], (5,), v["w"], eps=1e-6)),
    Case("rms_norm", "rms_norm-multi-axis-eps", ln_inputs(True, False, norm=(3, 5)),
         lambda o, t: o.rms_norm(t["x"], (3, 5), t["w"], eps=1e-2),
         lambda v: F.rms_norm(v["x"], (3, 5), v["w"], eps=1e-2)),
    # ---- aten
    Case("linear", "linear-bias", lambda dt: {"x": rand(2, 3, 4, dtype=dt), "w": rand(6, 4, dtype=dt, seed=1),
                                              "b": rand(6, dtype=dt, seed=2)},
         lambda o, t: o.linear(t["x"], t["w"], t["b"]), lambda v: F.linear(v["x"], v["w"], v["b"])),
    Case("linear", "linear-no-bias-1d", lambda dt: {"x": rand(4, dtype=dt), "w": rand(6, 4, dtype=dt, seed=1)},
         lambda o, t: o.linear(t["x"], t["w"]), lambda v: F.linear(v["x"], v["w"])),
    Case("matmul", "matmul-2d", xy((3, 4), (4, 5)), lambda o, t: o.matmul(t["x"], t["y"]),
         lambda v: v["x"] @ v["y"]),
    Case("matmul", "matmul-broadcast-batch", xy((2, 1, 3, 4), (5, 4, 6)), lambda o, t: o.matmul(t["x"], t["y"]),
         lambda v: torch.matmul(v["x"], v["y"])),
    Case("matmul", "matmul-batch-vs-2d", xy((2, 3, 4), (4, 5)), lambda o, t: o.matmul(t["x"], t["y"]),
         lambda v: torch.matmul(v["x"], v["y"])),
    Case("sdpa", "sdpa", sdpa_inputs(), lambda o, t: o.sdpa(t["q"], t["k"], t["v"]),
         lambda v: F.scaled_dot_product_attention(v["q"], v["k"], v["v"])),
    Case("sdpa", "sdpa-causal", sdpa_inputs(), lambda o, t: o.sdpa(t["q"], t["k"], t["v"], is_causal=True),
         lambda v: F.scaled_dot_product_attention(v["q"], v["k"], v["v"], is_causal=True)),
    Case("sdpa", "sdpa-cross-scale-dv", sdpa_inputs(sq=3, sk=6, d=4, dv=2),
         lambda o, t: o.sdpa(t["q"], t["k"], t["v"], scale=0.3),
         lambda v: F.scaled_dot_product_attention(v["q"], v["k"], v["v"], scale=0.3)),
    Case("sdpa_lse", "sdpa_lse-causal", sdpa_inputs(), lambda o, t: o.sdpa_lse(t["q"], t["k"], t["v"], is_causal=True),
         lambda v: sdpa_with_lse(v, is_causal=True)),
    Case("sdpa_lse", "sdpa_lse-cross-scale-dv", sdpa_inputs(sq=3, sk=6, d=4, dv=2),
         lambda o, t: o.sdpa_lse(t["q"], t["k"], t["v"], scale=0.3), lambda v: sdpa_with_lse(v, scale=0.3)),
    Case("attention_blocks", "attention_blocks-causal-uneven-empty-block", sdpa_inputs(sk=5),
         lambda o, t: o.attention_blocks(t["q"], t["k"], t["v"], 4, is_causal=True),
         lambda v: attention_blocks_ref(v, 4, is_causal=True)),
    Case("attention_blocks", "attention_blocks-cross-scale-dv", sdpa_inputs(sq=3, sk=6, d=4, dv=2),
         lambda o, t: o.attention_blocks(t["q"], t["k"], t["v"], 2, scale=0.3),
         lambda v: attention_blocks_ref(v, 2, scale=0.3)),
    Case("sdpa_backward", "sdpa_backward-causal", sdpa_grad_inputs(),
         lambda o, t: o.sdpa_backward(t["g"], t["q"], t["k"], t["v"],
                                      *o.sdpa_lse(t["q"], t["k"], t["v"], is_causal=True), is_causal=True),
         lambda v: sdpa_grads(v, is_causal=True)),
    Case("sdpa_backward", "sdpa_backward-cross-scale-dv", sdpa_grad_inputs(sq=3, sk=6, d=4, dv=2),
         lambda o, t: o.sdpa_backward(t["g"], t["q"], t["k"], t["v"], *o.sdpa_lse(t["q"], t["k"], t["v"], scale=0.3),
                                      scale=0.3),
         lambda v: sdpa_grads(v, scale=0.3)),
    Case("embedding", "embedding", lambda dt: {"ids": ints(2, 5, high=7), "table": rand(7, 3, dtype=dt)},
         lambda o, t: o.embedding(t["ids"], t["table"]), lambda v: F.embedding(v["ids"], v["table"])),
    Case("embedding", "embedding-int32-ids", lambda dt: {"ids": ints(4, high=7, dtype=torch.int32),
                                                         "table": rand(7, 3, dtype=dt)},
         lambda o, t: o.embedding(t["ids"], t["table"]), lambda v: F.embedding(v["ids"], v["table"])),
    Case("take_along_axis", "take_along_axis", lambda dt: {"x": rand(3, 5, dtype=dt), "i": ints(3, 2, high=5)},
         lambda o, t: o.take_along_axis(t["x"], t["i"], 1), lambda v: torch.take_along_dim(v["x"], v["i"], 1)),
    Case("take_along_axis", "take_along_axis-axis0", lambda dt: {"x": rand(3, 5, dtype=dt), "i": ints(4, 5, high=3)},
         lambda o, t: o.take_along_axis(t["x"], t["i"], 0), lambda v: torch.take_along_dim(v["x"], v["i"], 0)),
    Case("scatter_add", "scatter_add", lambda dt: {"x": rand(3, 5, dtype=dt), "i": ints(3, 4, high=5),
                                                 "s": rand(3, 4, dtype=dt, seed=1)},
         lambda o, t: o.scatter_add(t["x"], 1, t["i"], t["s"]), lambda v: v["x"].scatter_add(1, v["i"], v["s"])),
    Case("scatter_add", "scatter_add-axis0-repeated-ids", lambda dt: {"x": rand(4, 3, dtype=dt),
                                                                      "i": ints(7, 3, high=4),
                                                                      "s": rand(7, 3, dtype=dt, seed=1)},
         lambda o, t: o.scatter_add(t["x"], -2, t["i"], t["s"]), lambda v: v["x"].scatter_add(0, v["i"], v["s"])),
    Case("cross_entropy", "cross_entropy-mean", ce_inputs(), lambda o, t: o.cross_entropy(t["logits"], t["target"]),
         lambda v: F.cross_entropy(v["logits"], v["target"])),
    Case("cross_entropy", "cross_entropy-sum", ce_inputs(),
         lambda o, t: o.cross_entropy(t["logits"], t["target"], "sum"),
         lambda v: F.cross_entropy(v["logits"], v["target"], reduction="sum")),
    Case("cross_entropy", "cross_entropy-none", ce_inputs(),
         lambda o, t: o.cross_entropy(t["logits"], t["target"], reduction="none"),
         lambda v: F.cross_entropy(v["logits"], v["target"], reduction="none")),
    *(Case("cross_entropy", f"cross_entropy-ignore_index-{red}", ce_ignored((0, 3, 4)),
           lambda o, t, red=red: o.cross_entropy(t["logits"], t["target"], red, ignore_index=-100),
           lambda v, red=red: F.cross_entropy(v["logits"], v["target"], reduction=red, ignore_index=-100))
      for red in ("mean", "sum", "none")),
    Case("cross_entropy", "cross_entropy-ignore_index-a-class", ce_inputs(),  # a class as ignore_index (torch allows it)
         lambda o, t: o.cross_entropy(t["logits"], t["target"], ignore_index=2),
         lambda v: F.cross_entropy(v["logits"], v["target"], ignore_index=2)),
    *(Case("cross_entropy", f"cross_entropy-all-ignored-{red}", ce_ignored(range(6)),  # mean: 0 / 0, nan as torch
           lambda o, t, red=red: o.cross_entropy(t["logits"], t["target"], red, ignore_index=-100),
           lambda v, red=red: F.cross_entropy(v["logits"], v["target"], reduction=red, ignore_index=-100))
      for red in ("mean", "sum")),
    # ---- views
    Case("reshape", "reshape-infer", x_(3, 4), lambda o, t: o.reshape(t["x"], (2, -1)), lambda v: v["x"].reshape(2, -1)),
    Case("reshape", "reshape-to-scalar", x_(1, 1), lambda o, t: o.reshape(t["x"], ()), lambda v: v["x"].reshape(())),
    Case("permute", "permute", x_(2, 3, 4), lambda o, t: o.permute(t["x"], (2, 0, 1)),
         lambda v: v["x"].permute(2, 0, 1)),
    Case("transpose", "transpose", x_(2, 3, 4), lambda o, t: o.transpose(t["x"], 0, -1),
         lambda v: v["x"].transpose(0, -1)),
    Case("unsqueeze", "unsqueeze-end", x_(2, 3), lambda o, t: o.unsqueeze(t["x"], -1), lambda v: v["x"].unsqueeze(-1)),
    Case("unsqueeze", "unsqueeze-front", x_(2, 3), lambda o, t: o.unsqueeze(t["x"], 0), lambda v: v["x"].unsqueeze(0)),
    Case("slice", "slice-middle", x_(3, 7), lambda o, t: o.slice(t["x"], 1, 2, 5), lambda v: v["x"][:, 2:5]),
    Case("slice", "slice-negative-and-open-end", x_(4, 3, 6), lambda o, t: (o.slice(t["x"], -1, -2),
                                                                             o.slice(t["x"], 0, 1, 99)),
         lambda v: (v["x"][..., -2:], v["x"][1:99])),
    Case("slice", "slice-empty", x_(3, 4), lambda o, t: o.slice(t["x"], 1, 3, 1), lambda v: v["x"][:, 3:1]),
    Case("cat", "cat-last-axis", xy((2, 3, 2), (2, 3, 4)), lambda o, t: o.cat(t["x"], t["y"], -1),
         lambda v: torch.cat((v["x"], v["y"]), -1)),
    Case("cat", "cat-rotate-half", x_(2, 3, 6),
         lambda o, t: o.cat(o.neg(o.slice(t["x"], 2, 3)), o.slice(t["x"], 2, 0, 3), 2),
         lambda v: torch.cat((-v["x"][..., 3:], v["x"][..., :3]), -1)),
    Case("cat", "cat-int64-axis0", lambda dt: {"x": ints(2, 3, high=9), "y": ints(1, 3, high=9, seed=1)},
         lambda o, t: o.cat(t["x"], t["y"], 0), lambda v: torch.cat((v["x"], v["y"]), 0), dtypes=(None,)),
    Case("expand", "expand-new-leading", x_(3, 1), lambda o, t: o.expand(t["x"], (2, 3, 4)),
         lambda v: v["x"].expand(2, 3, 4)),
    Case("expand", "expand-keep", x_(3, 1), lambda o, t: o.expand(t["x"], (-1, 5)), lambda v: v["x"].expand(-1, 5)),
    Case("expand", "expand-0d-to-0d", lambda dt: {"x": rand(1, dtype=dt).reshape(())}, lambda o, t: o.expand(t["x"], ()), lambda v: v["x"].expand(())),
    Case("broadcast_in_dim", "broadcast_in_dim", x_(3), lambda o, t: o.broadcast_in_dim(t["x"], (2, 3, 4), (1,)),
         lambda v: v["x"].reshape(1, 3, 1).expand(2, 3, 4)),
    Case("broadcast_in_dim", "broadcast_in_dim-size1", x_(1, 4),
         lambda o, t: o.broadcast_in_dim(t["x"], (2, 3, 4), (1, 2)), lambda v: v["x"].reshape(1, 1, 4).expand(2, 3, 4)),
    # ---- masks and positions (issue 11): logic and bit ops, reductions without a partial, cumsum
    Case("bitwise_and", "bitwise_and-bool-broadcast", lambda dt: {"m": rand(3, 4) > 0, "n": rand(4, seed=1) > 0},
         lambda o, t: o.bitwise_and(t["m"], t["n"]), lambda v: v["m"] & v["n"], dtypes=(None,)),
    Case("bitwise_and", "bitwise_and-int-and-number", lambda dt: {"i": ints(3, 4, high=16)},
         lambda o, t: (o.bitwise_and(t["i"], 6), o.bitwise_and(5, t["i"])), lambda v: (v["i"] & 6, 5 & v["i"]),
         dtypes=(None,)),
    Case("bitwise_or", "bitwise_or-int32-int64", lambda dt: {"i": ints(3, 4, high=16, dtype=torch.int32),
                                                            "j": ints(4, high=16, seed=1)},
         lambda o, t: o.bitwise_or(t["i"], t["j"]), lambda v: v["i"] | v["j"], dtypes=(None,)),
    Case("bitwise_or", "bitwise_or-bool-true", lambda dt: {"m": rand(5) > 0},
         lambda o, t: o.bitwise_or(t["m"], True), lambda v: v["m"] | True, dtypes=(None,)),
    Case("bitwise_xor", "bitwise_xor-bool-and-int", lambda dt: {"m": rand(2, 3) > 0, "i": ints(2, 3, high=8)},
         lambda o, t: (o.bitwise_xor(t["m"], t["i"]), o.bitwise_xor(t["i"], -1)),
         lambda v: (v["m"] ^ v["i"], v["i"] ^ -1), dtypes=(None,)),
    Case("logical_not", "logical_not-float-int-bool", lambda dt: {"x": torch.tensor([0.0, -1.5, float("nan")], dtype=dt),
                                                                  "i": torch.tensor([0, 3, -2]), "m": rand(3) > 0},
         lambda o, t: (o.logical_not(t["x"]), o.logical_not(t["i"]), o.logical_not(t["m"])),
         lambda v: (v["x"].logical_not(), v["i"].logical_not(), ~v["m"])),
    Case("logical_and", "logical_and-float-bool-number", lambda dt: {"x": torch.tensor([0.0, 2.0, -1.0], dtype=dt),
                                                                     "m": torch.tensor([True, True, False])},
         lambda o, t: (o.logical_and(t["x"], t["m"]), o.logical_and(t["x"], 0.5), o.logical_and(0, t["m"])),
         lambda v: (v["x"].logical_and(v["m"]), v["x"].logical_and(torch.tensor(0.5)),
                    torch.tensor(0).logical_and(v["m"]))),
    Case("logical_or", "logical_or-broadcast", lambda dt: {"x": rand(3, 1, dtype=dt).round(), "i": ints(4, high=2)},
         lambda o, t: o.logical_or(t["x"], t["i"]), lambda v: v["x"].logical_or(v["i"])),
    Case("amin", "amin", x_(3, 4, 5), lambda o, t: o.amin(t["x"], (0, 2)), lambda v: v["x"].amin((0, 2))),
    Case("amin", "amin-all-keepdim", x_(3, 4), lambda o, t: o.amin(t["x"], keepdim=True),
         lambda v: v["x"].amin((0, 1), keepdim=True)),
    Case("amin", "amin-ties-split-the-gradient", lambda dt: {"x": torch.tensor([[1.0, -2.0, -2.0], [0.5, 3.0, 0.5]],
                                                                              dtype=dt)},
         lambda o, t: o.amin(t["x"], -1), lambda v: v["x"].amin(-1)),
    Case("amin", "amin-int32-bool", lambda dt: {"i": ints(3, 4, high=9, dtype=torch.int32), "m": rand(3, 4) > 0},
         lambda o, t: (o.amin(t["i"], 1), o.amin(t["m"], 0)), lambda v: (v["i"].amin(1), v["m"].amin(0)),
         dtypes=(None,)),
    Case("prod", "prod-one-axis", x_(3, 4, 5), lambda o, t: o.prod(t["x"], 1), lambda v: v["x"].prod(1)),
    Case("prod", "prod-axes-keepdim-negative", x_(3, 4, 5), lambda o, t: o.prod(t["x"], (-1, 0), keepdim=True),
         lambda v: v["x"].prod(-1, keepdim=True).prod(0, keepdim=True)),
    Case("prod", "prod-all", x_(2, 3), lambda o, t: (o.prod(t["x"]), o.prod(t["x"], None, keepdim=True)),
         lambda v: (v["x"].prod(), v["x"].prod().reshape(1, 1))),
    Case("prod", "prod-with-zeros", lambda dt: {"x": torch.tensor([[2.0, 0.0, 3.0], [0.0, 4.0, 0.0], [1.5, -2.0, 0.5]],
                                                                  dtype=dt)},
         lambda o, t: o.prod(t["x"], 1), lambda v: v["x"].prod(1)),
    Case("prod", "prod-int32-and-bool-widen", lambda dt: {"i": ints(3, 4, high=5, dtype=torch.int32),
                                                         "m": rand(3, 4) > -1},
         lambda o, t: (o.prod(t["i"], 0), o.prod(t["m"], 1)), lambda v: (v["i"].prod(0), v["m"].prod(1)),
         dtypes=(None,)),
    Case("any", "any-of-a-mask", lambda dt: {"m": rand(3, 4, 5) > 1.0},
         lambda o, t: (o.any(t["m"], -1), o.any(t["m"], (0, 1), keepdim=True), o.any(t["m"])),
         lambda v: (v["m"].any(-1), v["m"].any((0, 1), keepdim=True), v["m"].any()), dtypes=(None,)),
    Case("any", "any-of-floats", x_(3, 4), lambda o, t: o.any(o.mul(t["x"], 0.0), 1),
         lambda v: (v["x"] * 0.0).any(1)),
    Case("all", "all-of-a-mask-and-ints", lambda dt: {"m": rand(4, 3) > -1.0, "i": ints(4, 3, high=3)},
         lambda o, t: (o.all(t["m"], 0), o.all(t["i"], 1, keepdim=True), o.all(t["i"])),
         lambda v: (v["m"].all(0), v["i"].all(1, keepdim=True), v["i"].all()), dtypes=(None,)),
    Case("cumsum", "cumsum", x_(3, 4, 5), lambda o, t: (o.cumsum(t["x"], 1), o.cumsum(t["x"], -1)),
         lambda v: (v["x"].cumsum(1), v["x"].cumsum(-1))),
    Case("cumsum", "cumsum-positions-of-a-mask", lambda dt: {"m": rand(2, 6) > 0, "i": ints(2, 6, high=9, dtype=torch.int32)},
         lambda o, t: (o.sub(o.cumsum(t["m"], -1), 1), o.cumsum(t["i"], 0)),
         lambda v: (v["m"].cumsum(-1) - 1, v["i"].cumsum(0)), dtypes=(None,)),
    Case("cumsum", "cumsum-0d", lambda dt: {"x": rand(1, dtype=dt).reshape(())}, lambda o, t: o.cumsum(t["x"], 0),
         lambda v: v["x"].cumsum(0)),
    # ---- mixture of experts (issue 28 item 4): sort tokens by expert, count them, a matmul per expert's rows
    Case("argsort", "argsort-stable-ties-both-ways", lambda dt: {"i": ints(3, 7, high=3)},
         lambda o, t: (o.argsort(t["i"], 1), o.argsort(t["i"], 0, descending=True)),
         lambda v: (torch.argsort(v["i"], dim=1, stable=True),
                    torch.argsort(v["i"], dim=0, descending=True, stable=True)),
         dtypes=(None,)),
    Case("argsort", "argsort-floats", x_(4, 5), lambda o, t: o.argsort(t["x"]),
         lambda v: torch.argsort(v["x"], dim=-1, stable=True)),
    Case("histc", "histc-expert-counts", lambda dt: {"x": ints(9, high=5).to(dt)},
         lambda o, t: (o.histc(t["x"], 4, 0, 3), o.histc(t["x"], 3, 0.5, 2.5)),
         lambda v: (torch.histc(v["x"], 4, 0, 3), torch.histc(v["x"], 3, 0.5, 2.5))),
    Case("grouped_mm", "grouped_mm-uneven-empty-expert-rows-past-the-end", grouped_inputs((2, 2, 5, 6)),
         lambda o, t: o.grouped_mm(t["x"], t["w"], t["o"]), lambda v: grouped_mm_ref(v["x"], v["w"], v["o"])),
    Case("grouped_mm", "grouped_mm-int32-offsets-all-rows", grouped_inputs((0, 4, 7, 7), torch.int32, (4, 5, 3)),
         lambda o, t: o.grouped_mm(t["x"], o.transpose(t["w"], 1, 2), t["o"]),
         lambda v: grouped_mm_ref(v["x"], v["w"].transpose(1, 2), v["o"])),
    Case("grouped_mm_wgrad", "grouped_mm_wgrad-uneven-empty-expert", lambda dt: {
         "x": rand(7, 3, dtype=dt), "g": rand(7, 5, dtype=dt, seed=1), "o": torch.tensor([2, 2, 5, 6])},
         lambda o, t: o.grouped_mm_wgrad(t["x"], t["g"], t["o"]),
         lambda v: grouped_wgrad_ref(v["x"], v["g"], v["o"])),
    # ---- constants (issue 11): full reads nothing; ed.grad seeds d loss / d loss with it
    Case("full", "full-added", x_(3, 4), lambda o, t: o.add(t["x"], o.full((3, 4), 1.5, t["x"].dtype)),
         lambda v: v["x"] + 1.5),
    Case("full", "full-0d-int", lambda dt: {}, lambda o, t: o.full((), 7, "int64"),
         lambda v: torch.tensor(7), dtypes=(None,)),
    # ---- random (issue 11): dropout's mask from a hash of (seed, global index), checked bit for bit against
    # a Python-integer reference of the hash (tests/core/random_reference.py)
    Case("dropout", "dropout-seeded", lambda dt: {"x": rand(6, 9, dtype=dt), "seed": torch.tensor(-(2 ** 40) - 3)},
         lambda o, t: (o.dropout(t["x"], t["seed"], 0.4), o.dropout(t["x"], t["seed"], 0.25, 1000)),
         lambda v: (random_reference.dropout(v["x"], int(v["seed"]), 0.4),
                    random_reference.dropout(v["x"], int(v["seed"]), 0.25, 1000))),
    # ---- opaque: an ATen op from_torch does not map, run as torch runs it (issue 11)
    Case("opaque", "opaque-flip", x_(3, 4), lambda o, t: o.opaque(
        t["x"], target="aten.flip.default", call='{"args": [{"tensor": 0}, [0, 1]]}', shape=(3, 4),
        dtype=t["x"].dtype, source="model.py:3"), lambda v: v["x"].flip(0, 1)),
    Case("opaque", "opaque-two-operands-and-a-list", xy((3, 4), (3, 4)), lambda o, t: o.opaque(
        t["x"], t["y"], target="aten.stack.default", call='{"args": [[{"tensor": 0}, {"tensor": 1}]], "kwargs": {"dim": 1}}',
        shape=(3, 2, 4), dtype=t["x"].dtype), lambda v: torch.stack([v["x"], v["y"]], 1)),
    # its gradient: torch's autograd of the same call, with respect to one operand (opaque's vjp)
    Case("opaque_grad", "opaque-grad-of-stack-wrt-the-second", lambda dt: {"x": rand(3, 4, dtype=dt),
         "y": rand(3, 4, dtype=dt), "g": rand(3, 2, 4, dtype=dt)}, lambda o, t: o.opaque_grad(
        t["x"], t["y"], g=t["g"], target="aten.stack.default", wrt=1,
        call='{"args": [[{"tensor": 0}, {"tensor": 1}]], "kwargs": {"dim": 1}}'), lambda v: v["g"][:, 1]),
]


def case_params(cases, test, per_dtype=True):
    out = []
    for c in cases:
        marks = list(c.marks)
        for dt in (c.dtypes if per_dtype else c.dtypes[:1]):
            suffix = "" if dt is None or not per_dtype else "-" + str(dt).replace("torch.", "")
            out.append(pytest.param(c, dt, id=c.id + suffix, marks=marks))
    return out


COMPOSITES = sorted(n for n, d in ed.OPS.items() if d.is_composite)
COMPOSITE_CASES = [c for c in CASES if ed.OPS[c.op].is_composite]


def test_every_registered_op_has_a_case():
    covered = {c.op for c in CASES}
    assert covered <= set(ed.OPS), f"cases for unknown ops: {sorted(covered - set(ed.OPS))}"
    missing = sorted(set(ed.OPS) - covered)
    assert not missing, f"ops with no case in tests/core/test_ops.py CASES: {missing}"


def test_every_composite_op_has_a_float64_and_float32_case():
    expected = {"gelu", "silu", "softmax", "layer_norm", "rms_norm", "var_mean", "mean", "sdpa", "cross_entropy"}
    assert expected <= set(COMPOSITES)
    for name in COMPOSITES:
        dts = {dt for c in COMPOSITE_CASES if c.op == name for dt in c.dtypes}
        assert {F64, F32} <= dts, name


def test_case_ids_are_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


def test_design_op_list_is_registered():
    # DESIGN.md: fd.ops covers at least these (broadcast/expand as expand + broadcast_in_dim)
    design = ("add sub mul div neg exp log tanh sigmoid relu gelu silu rsqrt cast sum mean amax var_mean softmax "
              "layer_norm rms_norm linear matmul sdpa reshape permute expand broadcast_in_dim embedding cross_entropy")
    assert set(design.split()) <= set(ed.op_names())
    assert ed.op_names() == sorted(ed.OPS)


# ---------------------------------------------------------------- shape / dtype inference vs torch

@pytest.mark.parametrize("case, dtype", case_params(CASES, "infer"))
def test_shape_and_dtype_inference_equals_torch(case, dtype):
    fd, inputs, outs, _ = build(case, dtype)
    want = as_tuple(case.torch_fn(inputs))
    assert len(outs) == len(want)
    for tv, w in zip(outs, want):
        assert tv.shape == tuple(w.shape), f"{case.id}: inferred {tv.shape}, torch gives {tuple(w.shape)}"
        assert tv.dtype == w.dtype, f"{case.id}: inferred {tv.dtype}, torch gives {w.dtype}"
        assert len(tv.logical_domain) == len(tv.shape)
        assert not tv.is_sharded


@pytest.mark.parametrize("case, dtype", case_params(CASES, "evaluate"))
def test_evaluate_matches_torch(case, dtype):
    fd, inputs, _, names = build(case, dtype)
    got = ed.evaluate(fd, inputs)
    assert sorted(got) == sorted(names)
    for name, want in zip(names, as_tuple(case.torch_fn(inputs))):
        assert_matches(got[name], want, dtype)


# ---------------------------------------------------------------- primitive decompositions

def declines(e) -> bool:
    """A composite whose decomposition declines its operands (amin of integers or bools)."""
    return e.op.is_composite and not any(t.dtype.is_floating_point for t in e.inputs)


def fully_decompose(fd):
    """decompose until no composite is left (a decomposition may emit another composite), but those that
    decline their operands."""
    fusion = fd.fusion
    for _ in range(10):
        if not any(e.op.is_composite and not declines(e) for e in fusion.exprs):
            return fusion
        fusion, _ = ed.decompose(fusion)
    raise AssertionError("decompose did not reach primitives in 10 rounds")


@pytest.mark.parametrize("case, dtype", case_params(COMPOSITE_CASES, "decompose"))
def test_primitive_decomposition_matches_torch(case, dtype):
    fd, inputs, _, names = build(case, dtype)
    want = as_tuple(case.torch_fn(inputs))
    got = ed.evaluate(fd, inputs, decompose_composites=True)
    prim = ed.evaluate(fully_decompose(fd), inputs)
    for name, w in zip(names, want):
        assert_matches(got[name], w, dtype)
        assert_matches(prim[name], w, dtype)


def _decompose_params():
    return [pytest.param(c, id=c.id) for c in COMPOSITE_CASES]


@pytest.mark.parametrize("case", _decompose_params())
def test_decompose_leaves_only_primitive_ops(case):
    fd, inputs, _, names = build(case, F64)
    prim, rename = ed.decompose(fd)
    left = [str(e) for e in prim.exprs if e.op.is_composite and not declines(e)]
    assert not left, f"composites left after decompose: {left}"
    assert rename == {k: k for k in inputs}
    assert [t.name for t in prim.inputs] == list(inputs)
    assert list(prim.outputs) == names


def test_softmax_decomposes_into_max_shifted_exp_over_sum():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((2, 3), name="x")
        fd.add_output(fd.ops.softmax(x), name="y")
    prim, _ = ed.decompose(fd)
    assert [e.op.name for e in prim.exprs] == ["amax", "sub", "exp", "sum", "div"]


def test_softmax_decomposition_is_stable_for_large_logits():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((2, 3), dtype=F32, name="x")
        fd.add_output(fd.ops.softmax(x), name="y")
    X = torch.tensor([[1000.0, 1001.0, 999.0], [-1000.0, 0.0, 1000.0]])
    got = ed.evaluate(fd, {"x": X}, decompose_composites=True)["y"]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.softmax(X, -1))


def _pass_through_fusion():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((3,), name="x")
        fd.add_output(fd.ops.gelu(x), name="g")
        fd.add_output(x)
    return fd, rand(3, dtype=F32)


def test_input_passed_through_as_an_output_evaluates():
    fd, X = _pass_through_fusion()
    got = ed.evaluate(fd, {"x": X})
    assert torch.equal(got["x"], X)
    torch.testing.assert_close(got["g"], F.gelu(X))


def test_decompose_keeps_an_input_passed_through_as_an_output():
    fd, X = _pass_through_fusion()
    got = ed.evaluate(fd, {"x": X}, decompose_composites=True)
    assert torch.equal(got["x"], X)
    torch.testing.assert_close(got["g"], F.gelu(X))


def test_composites_in_a_small_mlp_block_match_torch_after_decomposition():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((2, 5, 8), dtype=F64, name="x")
        w1 = fd.define_tensor((16, 8), dtype=F64, name="w1")
        w2 = fd.define_tensor((8, 16), dtype=F64, name="w2")
        g = fd.define_tensor((8,), dtype=F64, name="g")
        h = fd.ops.layer_norm(x, weight=g)
        y = fd.ops.add(x, fd.ops.linear(fd.ops.gelu(fd.ops.linear(h, w1), approximate="tanh"), w2))
        fd.add_output(y, name="y")
    v = {"x": rand(2, 5, 8), "w1": rand(16, 8, seed=1), "w2": rand(8, 16, seed=2), "g": rand(8, seed=3)}
    want = v["x"] + F.linear(F.gelu(F.linear(F.layer_norm(v["x"], (8,), v["g"]), v["w1"]), approximate="tanh"), v["w2"])
    for dec in (False, True):
        torch.testing.assert_close(ed.evaluate(fd, v, decompose_composites=dec)["y"], want, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- errors at the op that is wrong

def fdef(*specs):
    """A FusionDefinition and its inputs from (name, shape[, dtype]) specs."""
    fd = ed.FusionDefinition()
    tvs = [fd.define_tensor(s[1], dtype=s[2] if len(s) > 2 else F32, name=s[0]) for s in specs]
    return fd, tvs


def test_mismatched_broadcast_names_both_tensors_and_the_axes():
    fd, (acts, bias) = fdef(("acts", (3, 4)), ("bias", (5,)))
    with pytest.raises(ShapeError) as info:
        fd.ops.add(acts, bias)
    msg = str(info.value)
    assert "acts" in msg and "bias" in msg
    assert "axis 0 of bias has extent 5" in msg and "axis 1 of acts has 4" in msg


def test_mismatched_broadcast_in_a_3d_operand_names_the_right_axis():
    fd, (a, b) = fdef(("a", (2, 3, 4)), ("b", (5, 4)))
    with pytest.raises(ShapeError, match="axis 0 of b has extent 5 but axis 1 of a has 3"):
        fd.ops.mul(a, b)
    assert not fd.fusion.exprs  # nothing emitted


def test_broadcast_error_names_the_tensor_that_fixed_the_extent():
    # a [1, 4] leaves axis 0 open; b [3, 1] fixes it to 3; c [5, 4] conflicts with b, not with a
    fd, (a, b) = fdef(("a", (1, 4)), ("b", (3, 1)))
    ab = fd.ops.add(a, b)
    _, (c,) = fd, [fd.define_tensor((5, 4), name="c")]
    with pytest.raises(ShapeError, match=f"axis 0 of c has extent 5 but axis 0 of {ab.name} has 3"):
        fd.ops.sub(ab, c)


@pytest.mark.parametrize("op, axis", [("sum", 2), ("sum", -3), ("sum", (0, 0)), ("amax", 5), ("mean", 9),
                                      ("softmax", 2), ("softmax", -3)])
def test_bad_reduction_axis_raises_naming_the_tensor_and_axis(op, axis):
    fd, (acts,) = fdef(("acts", (3, 4)))
    with pytest.raises(ShapeError) as info:
        getattr(fd.ops, op)(acts, axis)
    msg = str(info.value)
    assert f"{op}(acts)" in msg
    if isinstance(axis, int):
        assert f"axis {axis} out of range" in msg
    else:
        assert f"axes {axis} repeat an axis" in msg


def test_sum_axis_out_of_range_message():
    fd, (acts,) = fdef(("acts", (3, 4)))
    with pytest.raises(ShapeError, match=r"sum\(acts\): axis 2 out of range; acts has 2 axes \(shape \(3, 4\)\)"):
        fd.ops.sum(acts, 2)


@pytest.mark.parametrize("dtype", ["float8", "complex7", torch.complex64, "float8_e4m3fn", None])
def test_unknown_dtype_in_define_tensor_raises_dtype_error(dtype):
    fd = ed.FusionDefinition()
    # a complex dtype says what it is and how to hold it as reals (issue 29)
    want = "is a complex dtype" if dtype is torch.complex64 else "unknown or unsupported dtype"
    with pytest.raises(DtypeError, match=want):
        fd.define_tensor((2,), dtype=dtype, name="x")
    assert not fd.fusion.inputs


@pytest.mark.parametrize("name", ["float8", "complex7"])
def test_unknown_dtype_message_names_the_dtype_asked_for(name):
    with pytest.raises(DtypeError, match=name):
        ed.FusionDefinition().define_tensor((2,), dtype=name, name="x")


def test_unknown_dtype_message_names_the_tensor():
    with pytest.raises(DtypeError, match="tokens"):
        ed.FusionDefinition().define_tensor((2,), dtype="float8", name="tokens")


@pytest.mark.parametrize("alias, dtype", [("bf16", torch.bfloat16), ("fp32", F32), ("float64", F64),
                                          ("half", torch.float16), ("long", torch.int64), ("bool", torch.bool)])
def test_dtype_aliases_resolve(alias, dtype):
    assert ed.FusionDefinition().define_tensor((2,), dtype=alias).dtype == dtype


def test_linear_weight_of_the_wrong_shape_says_in_features_and_out_in():
    fd, (x, w1) = fdef(("x", (2, 768)), ("w1", (1024, 1024)))
    with pytest.raises(ShapeError) as info:
        fd.ops.linear(x, w1)
    msg = str(info.value)
    assert "in-features" in msg and "[out, in]" in msg
    assert "w1 has in-features 1024" in msg and "x's last axis is 768" in msg


def test_linear_weight_given_as_in_out_is_caught():
    fd, (x, w) = fdef(("x", (2, 8)), ("w", (8, 16)))
    with pytest.raises(ShapeError, match=r"in-features 16.*\[out, in\]"):
        fd.ops.linear(x, w)


def test_linear_bias_of_the_wrong_shape_names_out_features():
    fd, (x, w, b) = fdef(("x", (2, 8)), ("w", (16, 8)), ("b", (8,)))
    with pytest.raises(ShapeError, match="out-features"):
        fd.ops.linear(x, w, b)


def test_linear_3d_weight_raises():
    fd, (x, w) = fdef(("x", (2, 8)), ("w", (2, 16, 8)))
    with pytest.raises(ShapeError, match=r"\[out, in\]"):
        fd.ops.linear(x, w)


def test_linear_mixed_dtypes_raise_dtype_error():
    fd, (x, w) = fdef(("x", (2, 8), F32), ("w", (16, 8), F64))
    with pytest.raises(DtypeError, match="float32.*float64|float64.*float32"):
        fd.ops.linear(x, w)


def test_matmul_contraction_mismatch_names_both_axes():
    fd, (a, b) = fdef(("a", (3, 4)), ("b", (5, 6)))
    with pytest.raises(ShapeError, match="a's last axis is 4 but b's axis -2 is 5"):
        fd.ops.matmul(a, b)


def test_matmul_batch_mismatch_raises():
    fd, (a, b) = fdef(("a", (2, 3, 4)), ("b", (3, 4, 5)))
    with pytest.raises(ShapeError, match="broadcast"):
        fd.ops.matmul(a, b)


def test_matmul_of_a_vector_raises():
    fd, (a, b) = fdef(("a", (4,)), ("b", (4, 5)))
    with pytest.raises(ShapeError, match="at least 2 axes"):
        fd.ops.matmul(a, b)


@pytest.mark.parametrize("bad", ["q", "k", "v"])
def test_sdpa_wrong_rank_names_the_operand(bad):
    shapes = {"q": (2, 3, 5, 4), "k": (2, 3, 5, 4), "v": (2, 3, 5, 4)}
    shapes[bad] = (6, 5, 4)
    fd, (q, k, v) = fdef(*[(n, s) for n, s in shapes.items()])
    with pytest.raises(ShapeError, match=f"{bad} must be 4-D"):
        fd.ops.sdpa(q, k, v)


def test_sdpa_head_dim_mismatch_raises():
    fd, (q, k, v) = fdef(("q", (2, 3, 5, 4)), ("k", (2, 3, 5, 8)), ("v", (2, 3, 5, 4)))
    with pytest.raises(ShapeError, match="head_dim"):
        fd.ops.sdpa(q, k, v)


def test_sdpa_causal_with_unequal_lengths_raises():
    fd, (q, k, v) = fdef(("q", (2, 3, 4, 4)), ("k", (2, 3, 5, 4)), ("v", (2, 3, 5, 4)))
    with pytest.raises(ShapeError, match="is_causal"):
        fd.ops.sdpa(q, k, v, is_causal=True)


def test_attention_blocks_without_blocks_raises():
    from egraph_did.ops import TensorSpec, attention_blocks
    q = TensorSpec("q", (1, 2, 4, 8), F32, ("b", "h", "s", "d"))
    with pytest.raises(ShapeError, match="blocks must be a positive int"):
        attention_blocks(q, q, q, 0)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_blocks_in_fused_pieces_equal_the_math_on_every_diagonal(causal):
    """On a GPU a block runs as torch's fused kernels on pieces of its rows and keys (rows that see the whole
    block, rows that see a prefix whole and a square causal part, rows that see nothing), merged by the
    logsumexp: with the math as the stand-in kernel it equals the math block for every query and key offset."""
    from egraph_did.ops import _fused_block, _math_block

    def square(q, k, v, c, scale):
        assert not c or q.shape[2] == k.shape[2], "a fused causal piece must be square (no alignment question)"
        return _math_block(q, k, v, c, scale, 0, 0)
    g = torch.Generator().manual_seed(0)
    for sq, n, offset, key_offset in [(s, n, o, k) for s in (1, 3, 7) for n in (1, 2, 5) for o in (0, 2, 5, 9)
                                      for k in (0, 1, 4, 8)]:
        q, k = torch.randn(2, 3, sq, 4, generator=g, dtype=F64), torch.randn(2, 3, n, 4, generator=g, dtype=F64)
        v = torch.randn(2, 3, n, 5, generator=g, dtype=F64)
        (out, lse), (want, want_lse) = (f(q, k, v, causal, 0.3, offset, key_offset) for f in (
            lambda *a: _fused_block(*a, forward=square), _math_block))
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)  # -inf where a row sees nothing


def test_the_causal_backward_in_fused_pieces_equals_the_math_on_every_diagonal():
    """On a GPU the causal backward of a shard of the queries and of the keys runs torch's fused backward on
    the same pieces as the forward blocks, each with its rows' whole output and logsumexp (exact for its
    keys): with the math as the stand-in kernel it equals the math backward at every query and key offset."""
    from egraph_did.ops import _fused_backward_pieces, _sdpa_backward_math

    def square(g, q, k, v, out, lse, c, scale):
        assert not c or q.shape[2] == k.shape[2], "a fused causal piece must be square (no alignment question)"
        return _sdpa_backward_math(g, q, k, v, out, lse, c, scale)
    gen = torch.Generator().manual_seed(1)
    for sq, n, offset, key_offset in [(s, n, o, k) for s in (1, 3, 7) for n in (1, 2, 5) for o in (0, 2, 5, 9)
                                      for k in (0, 1, 4, 8)]:
        q, g = (torch.randn(2, 3, sq, 4, generator=gen, dtype=F64) for _ in range(2))
        k, v = (torch.randn(2, 3, n, 4, generator=gen, dtype=F64) for _ in range(2))
        out = torch.randn(2, 3, sq, 4, generator=gen, dtype=F64)  # any rows' output and logsumexp: both
        lse = torch.randn(2, 3, sq, generator=gen, dtype=F64)     # sides read the same ones
        got = _fused_backward_pieces(g, q, k, v, out, lse, True, 0.3, offset, key_offset, backward=square)
        want = _sdpa_backward_math(g, q, k, v, out, lse, True, 0.3, offset, key_offset)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_layer_norm_weight_of_the_wrong_shape_raises():
    fd, (x, w) = fdef(("x", (3, 4)), ("w", (3,)))
    with pytest.raises(ShapeError, match="normalized_shape"):
        fd.ops.layer_norm(x, weight=w)
    fd, (x, w) = fdef(("x", (3, 4)), ("w", (5,)))
    with pytest.raises(ShapeError, match="w has shape"):
        fd.ops.layer_norm(x, 4, weight=w)


def test_cross_entropy_needs_integer_targets():
    fd, (logits, target) = fdef(("logits", (6, 5)), ("target", (6,), F32))
    with pytest.raises(DtypeError, match="target"):
        fd.ops.cross_entropy(logits, target)


def test_float_only_op_on_an_int_tensor_raises_dtype_error():
    fd, (ids,) = fdef(("ids", (3,), torch.int64))
    with pytest.raises(DtypeError, match=r"exp\(ids\).*cast"):
        fd.ops.exp(ids)


def test_gelu_with_an_unknown_approximation_raises():
    fd, (x,) = fdef(("x", (3,)))
    with pytest.raises(ShapeError, match="approximate"):
        fd.ops.gelu(x, approximate="fast")


def test_operand_from_another_fusion_raises():
    fd1, (a,) = fdef(("a", (3,)))
    fd2, (b,) = fdef(("b", (3,)))
    with pytest.raises(ShapeError, match="another fusion"):
        fd1.ops.add(a, b)


# ---------------------------------------------------------------- ops whose shape rule accepts what torch rejects

def _accepted_or_rejected_at_the_op(build_fn, inputs, torch_fn):
    """The shape rule either rejects the operands (DtypeError/ShapeError at the op), or evaluate runs and
    agrees with torch. Accepting them and failing later inside evaluate is the bug."""
    fd = ed.FusionDefinition()
    tvs = {k: fd.define_tensor(tuple(v.shape), dtype=v.dtype, name=k) for k, v in inputs.items()}
    try:
        out = build_fn(fd.ops, tvs)
    except ShapeError:
        return
    fd.add_output(out, name="y")
    got = ed.evaluate(fd, inputs)["y"]
    want = torch_fn(inputs)
    assert got.dtype == out.dtype
    torch.testing.assert_close(got, want.to(got.dtype))


def test_cross_entropy_with_int32_targets_is_rejected_at_the_op_or_evaluates():
    inputs = {"logits": rand(6, 5, dtype=F32), "target": ints(6, high=5, dtype=torch.int32)}
    _accepted_or_rejected_at_the_op(lambda o, t: o.cross_entropy(t["logits"], t["target"]), inputs,
                                    lambda v: F.cross_entropy(v["logits"], v["target"].long()))


def test_take_along_axis_with_int32_index_is_rejected_at_the_op_or_evaluates():
    inputs = {"x": rand(3, 5, dtype=F32), "i": ints(3, 2, high=5, dtype=torch.int32)}
    _accepted_or_rejected_at_the_op(lambda o, t: o.take_along_axis(t["x"], t["i"], 1), inputs,
                                    lambda v: torch.take_along_dim(v["x"], v["i"].long(), 1))


@pytest.mark.parametrize("op", ["neg", "abs", "relu"])
def test_unary_op_on_bool_is_rejected_at_the_op_or_evaluates(op):
    inputs = {"x": torch.tensor([True, False, True])}
    _accepted_or_rejected_at_the_op(lambda o, t: getattr(o, op)(t["x"]), inputs, lambda v: getattr(torch, op)(v["x"]))


@pytest.mark.parametrize("lhs", ["tensor", "int"])
def test_sub_with_a_bool_tensor_is_rejected_at_the_op_or_evaluates(lhs):
    inputs = {"a": torch.tensor([True, False]), "b": torch.tensor([False, False])}
    if lhs == "tensor":
        _accepted_or_rejected_at_the_op(lambda o, t: o.sub(t["a"], t["b"]), inputs, lambda v: v["a"] ^ v["b"])
    else:
        del inputs["a"]
        _accepted_or_rejected_at_the_op(lambda o, t: o.sub(1, t["b"]), inputs, lambda v: 1 - v["b"].long())


def test_sum_over_an_empty_axis_tuple_is_rejected_at_the_op_or_evaluates():
    inputs = {"x": rand(3, 4, dtype=F32)}
    fd = ed.FusionDefinition()
    x = fd.define_tensor((3, 4), name="x")
    try:
        y = fd.ops.sum(x, ())
    except ShapeError:
        return
    fd.add_output(y, name="y")
    got = ed.evaluate(fd, inputs)["y"]
    assert got.shape == y.shape


# ---------------------------------------------------------------- evaluate input checks

def _relu_fusion():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((2, 3), dtype=F32, name="x")
        w = fd.define_tensor((4, 3), dtype=F32, name="w")
        fd.add_output(fd.ops.relu(fd.ops.linear(x, w)), name="y")
    return fd, {"x": rand(2, 3, dtype=F32), "w": rand(4, 3, dtype=F32, seed=1)}


def test_evaluate_matches_torch_on_a_small_fusion():
    fd, v = _relu_fusion()
    assert torch.equal(ed.evaluate(fd, v)["y"], torch.relu(F.linear(v["x"], v["w"])))


def test_evaluate_with_a_missing_input_raises_naming_it():
    fd, v = _relu_fusion()
    del v["w"]
    with pytest.raises(ShapeError, match=r"missing input 'w' of shape \(4, 3\)"):
        ed.evaluate(fd, v)


def test_evaluate_with_the_wrong_shape_raises():
    fd, v = _relu_fusion()
    v["x"] = rand(2, 4, dtype=F32)
    with pytest.raises(ShapeError, match=r"input 'x': declared shape \(2, 3\), got \(2, 4\)"):
        ed.evaluate(fd, v)


def test_evaluate_with_the_wrong_dtype_raises_and_suggests_a_cast():
    fd, v = _relu_fusion()
    v["x"] = v["x"].double()
    with pytest.raises(ShapeError, match=r"input 'x': declared dtype torch.float32, got torch.float64; cast"):
        ed.evaluate(fd, v)


def test_evaluate_with_an_unknown_input_name_raises():
    fd, v = _relu_fusion()
    v["bias"] = rand(4, dtype=F32)
    with pytest.raises(ShapeError, match=r"unknown input\(s\) \['bias'\]"):
        ed.evaluate(fd, v)


def test_evaluate_with_a_non_tensor_input_raises():
    fd, v = _relu_fusion()
    v["x"] = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    with pytest.raises(ShapeError, match="expected a torch.Tensor"):
        ed.evaluate(fd, v)


def test_evaluate_without_outputs_raises():
    fd = ed.FusionDefinition()
    fd.define_tensor((2,), name="x")
    with pytest.raises(ShapeError, match="add_output"):
        ed.evaluate(fd, {"x": torch.zeros(2)})


def test_fusion_of_outputs_keeps_definition_order_and_names():
    fd, _ = _relu_fusion()
    assert [str(e) for e in fd.fusion.exprs] == ["linear_0 = linear(x, w)", "y = relu(linear_0)"]
    assert list(fd.fusion.outputs) == ["y"]


def test_cat_of_mismatched_shapes_names_the_axis_they_join_along():
    fd, (a, b) = fdef(("a", (2, 3)), ("b", (4, 2)))
    with pytest.raises(ShapeError, match=r"cat\(a, b\): shapes \(2, 3\) and \(4, 2\) must be equal on every axis"):
        fd.ops.cat(a, b, 0)


def test_cat_of_two_dtypes_asks_for_a_cast():
    fd, (a, b) = fdef(("a", (2, 3), F32), ("b", (2, 3), F64))
    with pytest.raises(DtypeError, match="float32 and float64 differ; cast"):
        fd.ops.cat(a, b, 1)


def test_where_needs_a_bool_condition():
    fd, (c, x) = fdef(("c", (3,), F32), ("x", (3,)))
    with pytest.raises(DtypeError, match=r"where\(c, x, 0.0\): the condition must be bool, got float32"):
        fd.ops.where(c, x, 0.0)


def test_slice_of_an_axis_out_of_range_names_the_tensor():
    fd, (x,) = fdef(("x", (3, 4)))
    with pytest.raises(ShapeError, match=r"slice\(x\): axis 2 out of range"):
        fd.ops.slice(x, 2, 0, 1)


# ---------------------------------------------------------------- mixture of experts: bad offsets and ranges

def _grouped(offsets, dtype=torch.int64, w=(4, 3, 5)):
    fd = ed.FusionDefinition()
    x, wt = fd.define_tensor((7, 3), name="x"), fd.define_tensor(w, name="w")
    o = fd.define_tensor(tuple(offsets), dtype=dtype, name="offsets")
    return fd, fd.ops.grouped_mm(x, wt, o)


def test_grouped_mm_refuses_offsets_that_are_not_ints_or_not_one_per_expert():
    with pytest.raises(DtypeError, match="offsets must be int32 or int64"):
        _grouped((4,), torch.float32)
    with pytest.raises(ShapeError, match=r"offsets offsets has shape \(3,\), expected \(4,\): one end row per expert"):
        _grouped((3,))
    with pytest.raises(ShapeError, match=r"w's axis 1 is 5 but x's last axis is 3.*transpose\(w, 1, 2\)"):
        _grouped((4,), w=(4, 5, 3))


def test_grouped_mm_refuses_decreasing_offsets_or_offsets_past_the_rows_naming_the_group():
    fd, y = _grouped((4,))
    fd.add_output(y, name="y")
    args = {"x": torch.zeros(7, 3), "w": torch.zeros(4, 3, 5)}
    with pytest.raises(ShapeError, match=r"got \[2, 1, 5, 6\] \(group 1: 2\.\.1\)"):
        ed.evaluate(fd, {**args, "offsets": torch.tensor([2, 1, 5, 6])})
    with pytest.raises(ShapeError, match=r"within the 7 rows, got \[2, 2, 5, 9\]"):
        ed.evaluate(fd, {**args, "offsets": torch.tensor([2, 2, 5, 9])})


def _count_grouped_calls(monkeypatch) -> list:
    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    return calls


@pytest.mark.parametrize("start, total, e_lo, experts", [(0, None, 0, 4), (3, 12, 0, 4), (4, 12, 1, 2), (8, 12, 2, 2)])
def test_grouped_mm_blocks_run_as_one_grouped_call_with_the_loops_numbers(monkeypatch, start, total, e_lo, experts):
    """A rank's block (its rows start.. of total, its experts e_lo..) in float32 with 16-byte rows runs as one
    torch._grouped_mm over the rows its experts hold, bit for bit the expert-by-expert loop (float64 runs it)."""
    from egraph_did.ops import _grouped_mm_block, _grouped_wgrad_block
    offsets = torch.tensor([2, 2, 7, 11])  # expert 1 empty, row 11 past the end
    rows = 12 - start if total is None else 4
    x, w, g = (rand(*sh, dtype=torch.float32, seed=k) for k, sh in enumerate([(rows, 8), (experts, 8, 4), (rows, 4)]))
    calls = _count_grouped_calls(monkeypatch)
    y = _grouped_mm_block(x, w, offsets, start, total, e_lo)
    dw = _grouped_wgrad_block(x, g, offsets, start, total, e_lo, e_lo + experts)
    loop_y = _grouped_mm_block(x.double(), w.double(), offsets, start, total, e_lo)
    loop_dw = _grouped_wgrad_block(x.double(), g.double(), offsets, start, total, e_lo, e_lo + experts)
    held = sum(1 for r in range(start, start + rows) for e in range(e_lo, e_lo + experts)
               if (offsets[e - 1] if e else 0) <= r < offsets[e])
    assert len(calls) == (2 if held else 0)  # one call each, none where the block holds no row of its experts
    assert torch.allclose(y.double(), loop_y, atol=1e-6) and torch.allclose(dw.double(), loop_dw, atol=1e-6)
    outside = [r for r in range(rows) if not any((offsets[e - 1] if e else 0) <= start + r < offsets[e]
                                                 for e in range(e_lo, e_lo + experts))]
    assert not y[outside].any()  # rows of other experts and past the end stay zero (torch leaves them unset)


def test_grouped_mm_with_unaligned_rows_runs_expert_by_expert(monkeypatch):
    """Rows of 3 floats (12 bytes) are no 16-byte matrix for torch._grouped_mm: the loop runs them."""
    from egraph_did.ops import _grouped_mm_block
    calls = _count_grouped_calls(monkeypatch)
    x, w = rand(7, 3, dtype=torch.float32), rand(4, 3, 5, dtype=torch.float32, seed=1)
    offsets = torch.tensor([2, 2, 5, 6])
    assert torch.allclose(_grouped_mm_block(x, w, offsets), grouped_mm_ref(x, w, offsets)) and not calls


def test_histc_needs_its_range():
    from egraph_did.ops import TensorSpec, histc
    x = TensorSpec("ids", (6,), F32, ("s",))
    with pytest.raises(ShapeError, match="min < max.*differs per shard"):
        histc(x, 4)
    with pytest.raises(ShapeError, match="bins must be an int >= 1"):
        histc(x, 0, 0, 3)
    with pytest.raises(DtypeError, match="x is bool"):
        histc(TensorSpec("ids", (6,), torch.bool, ("s",)), 4, 0, 3)


def test_histc_counts_integers_in_their_dtype():
    """transformers' experts count int32 ids off the CPU (torch's CUDA histc takes integers, its CPU one not)."""
    from egraph_did.ops import OPS, TensorSpec, histc
    assert histc(TensorSpec("ids", (6,), torch.int32, ("s",)), 4, 0, 3)[0].dtype == torch.int32
    ids = torch.tensor([0, 3, 3, 1, 4, 2, 3], dtype=torch.int32)
    got = OPS["histc"].reference(ids, 4, 0, 3)
    assert got.dtype == torch.int32 and got.tolist() == [1, 1, 1, 3]
