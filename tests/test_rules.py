"""Every sharding rule states an identity; here each one is evaluated on random data, both sides.

For every case in RULE_CASES (a small fusion on a small mesh) and every user expr in it, each full-mesh
strategy the optimizer would offer (egraph_did.problem.build_problem -> problem.strategies) whose per-axis
rules include the rule under test is run the way a plan runs it: every operand's global random value is
laid out in the strategy's input layout (shards from the loop domain; a partial as random summands per
rank whose sum, or max, is the value), egraph_did.local.run_local computes every rank's part with the
strategy's flags, and the outputs are assembled back (S: placed by the loop domain, P: summed, Pmax: maxed,
R: every replica equal) and compared with egraph_did.evaluate on float64 inputs.

The registry test fails when a rule of egraph_did.rewrites.ALL_RULES has no case here, or when its cases
never produce a strategy naming it.
"""
from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from egraph_did import DeviceMesh, FusionDefinition, evaluate
from egraph_did.cost import CostModel
from egraph_did.fusion import Fusion
from egraph_did.ir import TensorView
from egraph_did.layout import Layout, R
from egraph_did.pins import apply_layout
from egraph_did.shards import Operand, RankContext
from egraph_did.local import run_local
from egraph_did.problem import build_problem, expr_strategies
from egraph_did.rewrites import ALL_RULES
from egraph_did.sharding import local_indices, local_shape, shard_tensor

# float64 inputs; a local kernel differs from the global one only in summation order (partials, local
# reductions), i.e. by a few ulps of values of order 1, far below this bound.
TOL = 1e-10

F64, F32, I64 = torch.float64, torch.float32, torch.int64
M2, M3, M22 = (2,), (3,), (2, 2)


# ---------------------------------------------------------------------- cases

@dataclass(frozen=True)
class Spec:
    """An input: shape, dtype and, for an integer input, the exclusive upper bound of its values."""

    shape: tuple[int, ...]
    dtype: torch.dtype = F64
    high: int = 0


def I(shape, high):  # noqa: E743  (an index input)
    return Spec(tuple(shape), I64, high)


@dataclass(frozen=True)
class Case:
    name: str
    mesh: tuple[int, ...]
    inputs: dict
    body: Callable  # body(ops, **inputs) -> output TensorView or tuple of them
    marks: tuple = field(default=())

    def build(self) -> FusionDefinition:
        with FusionDefinition() as fd:
            ts = {}
            for n, s in self.inputs.items():
                s = s if isinstance(s, Spec) else Spec(tuple(s))
                ts[n] = fd.define_tensor(s.shape, s.dtype, n)
            outs = self.body(fd.ops, **ts)
            for i, o in enumerate(outs if isinstance(outs, tuple) else (outs,)):
                fd.add_output(o, name=f"out{i}")
        return fd

    def specs(self) -> dict[str, Spec]:
        return {n: s if isinstance(s, Spec) else Spec(tuple(s)) for n, s in self.inputs.items()}


def case(name, mesh, inputs, body, *marks) -> Case:
    return Case(name, mesh, inputs, body, marks)


RULE_CASES: dict[str, list[Case]] = {
    # ---------------------------------------------------------------- pointwise
    "replicated": [
        case("exp", M2, {"x": (3, 4)}, lambda o, x: o.exp(x)),
        case("var_mean-two-outputs", M3, {"x": (5, 4)}, lambda o, x: o.var_mean(x, 1)),
        case("linear-mesh2x2", M22, {"x": (3, 4), "w": (5, 4)}, lambda o, x, w: o.linear(x, w)),
    ],
    "elementwise_sharded": [
        case("add-broadcast-uneven", M3, {"a": (4, 5), "b": (5,)}, lambda o, a, b: o.add(a, b)),
        case("unary-chain-uneven", M3, {"x": (5, 7)}, lambda o, x: (
            o.neg(x), o.log(o.exp(x)), o.tanh(x), o.sigmoid(x), o.relu(x), o.rsqrt(o.exp(x)),
            o.sqrt(o.exp(x)), o.erf(x), o.abs(x), o.cast(x, F32), o.gelu(x), o.gelu(x, approximate="tanh"),
            o.silu(x))),
        case("binary", M2, {"a": (3, 4), "b": (3, 4)}, lambda o, a, b: (
            o.sub(a, b), o.mul(a, b), o.div(a, o.exp(b)), o.maximum(a, b), o.pow(o.exp(a), b))),
        case("with-numbers", M2, {"x": (3, 5)}, lambda o, x: (
            o.mul(x, 2.0), o.add(1.5, x), o.sub(x, 1.0), o.div(x, 4.0), o.maximum(x, 0.25))),
        case("causal_mask", M2, {"x": (2, 3, 4, 4)}, lambda o, x: o.causal_mask(x)),
        case("causal_mask-offset-uneven", M3, {"x": (5, 3, 3)}, lambda o, x: o.causal_mask(x, 1)),
        case("mesh2x2", M22, {"a": (4, 6), "b": (4, 1), "c": (7,), "d": (3, 7)}, lambda o, a, b, c, d: (
            o.add(a, b), o.mul(d, c))),
        case("mesh2x2-nested-uneven", M22, {"a": (13, 3), "b": (13, 3)}, lambda o, a, b: o.mul(a, b)),
    ],
    "sum_of_partials": [
        case("add-sub", M2, {"a": (3, 5), "b": (3, 5)}, lambda o, a, b: (o.add(a, b), o.sub(a, b))),
        case("broadcast", M3, {"a": (4, 5), "b": (5,)}, lambda o, a, b: o.add(a, b)),
        case("mesh2x2", M22, {"a": (2, 3), "b": (2, 3)}, lambda o, a, b: o.sub(a, b)),
    ],
    "partial_scaled": [
        case("mul-div", M3, {"a": (4, 5), "b": (4, 5), "c": (5,)}, lambda o, a, b, c: (
            o.mul(a, b), o.mul(a, 3.0), o.mul(2.0, a), o.div(a, o.exp(c)), o.div(a, 4.0))),
        case("mesh2x2", M22, {"a": (2, 3), "b": (2, 3)}, lambda o, a, b: o.mul(a, b)),
    ],
    "partial_through_linear_unary": [
        case("neg-cast", M2, {"x": (3, 4), "h": Spec((3, 4), F32)}, lambda o, x, h: (
            o.neg(x), o.cast(h, F64), o.cast(x, F64), o.cast(h, "float64"))),
        case("mesh2x2", M22, {"x": (2, 3)}, lambda o, x: o.neg(x)),
    ],
    # ---------------------------------------------------------------- reductions
    "reduce_other_axis": [
        case("sum-mean-amax-uneven", M3, {"x": (5, 4), "y": (4, 5)}, lambda o, x, y: (
            o.sum(x, 1), o.mean(x, 1, keepdim=True), o.amax(y, 0))),
        case("var_mean", M2, {"x": (5, 6)}, lambda o, x: o.var_mean(x, 1)),
        case("var_mean-keepdim", M3, {"x": (5, 6)}, lambda o, x: o.var_mean(x, 1, correction=0, keepdim=True)),
        case("mesh2x2", M22, {"x": (4, 6, 3)}, lambda o, x: o.sum(x, 2)),
    ],
    "sum_over_sharded_axis": [
        case("uneven", M3, {"x": (3, 7)}, lambda o, x: o.sum(x, 1)),
        case("all-axes", M3, {"x": (5, 4)}, lambda o, x: o.sum(x)),
        case("mesh2x2", M22, {"x": (4, 6)}, lambda o, x: o.sum(x, (0, 1), keepdim=True)),
        case("mesh2x2-nested-uneven", M22, {"x": (2, 13)}, lambda o, x: o.sum(x, 1)),
    ],
    "mean_over_sharded_axis": [
        case("uneven", M3, {"x": (3, 7)}, lambda o, x: o.mean(x, 1)),
        case("all-axes-keepdim", M3, {"x": (5, 4)}, lambda o, x: o.mean(x, None, keepdim=True)),
        case("mesh2x2", M22, {"x": (4, 6)}, lambda o, x: o.mean(x, (0, 1))),
        case("mesh2x2-nested-uneven", M22, {"x": (2, 13)}, lambda o, x: o.mean(x, 1)),
    ],
    "reduce_partial": [
        case("sum-mean", M2, {"x": (3, 4)}, lambda o, x: (o.sum(x, 0), o.mean(x, 1))),
        case("mesh2x2", M22, {"x": (2, 3)}, lambda o, x: o.sum(x)),
    ],
    "amax_over_sharded_axis": [
        case("uneven", M3, {"x": (3, 7)}, lambda o, x: o.amax(x, 1)),
        case("all-axes", M3, {"x": (5, 4)}, lambda o, x: o.amax(x)),
        case("mesh2x2-keepdim", M22, {"x": (4, 6)}, lambda o, x: o.amax(x, (0, 1), keepdim=True)),
    ],
    "welford_blocks_sharded": [
        case("dim-uneven", M2, {"x": (4, 5)}, lambda o, x: o.welford_blocks(x, 1, 2)),
        case("dim-uneven-3", M3, {"x": (2, 7)}, lambda o, x: o.welford_blocks(x, -1, 3)),
        case("other-axis", M3, {"x": (5, 6)}, lambda o, x: o.welford_blocks(x, 1, 2)),
        case("mesh2x2", M22, {"x": (4, 6)}, lambda o, x: o.welford_blocks(x, 1, 2)),
    ],
    "welford_merge_other_axis": [
        case("uneven", M3, {"x": (5, 6)}, lambda o, x: o.welford_merge(o.welford_blocks(x, 1, 2), 1)),
        case("keepdim", M2, {"x": (4, 3, 6)}, lambda o, x: o.welford_merge(
            o.welford_blocks(x, 2, 2), 2, correction=0, keepdim=True)),
        case("negative-dim", M3, {"x": (6, 5)}, lambda o, x: o.welford_merge(o.welford_blocks(x, -2, 3), -2)),
        case("negative-dim-keepdim", M2, {"x": (3, 4, 6)}, lambda o, x: o.welford_merge(
            o.welford_blocks(x, -1, 2), -1, keepdim=True)),
    ],
    "softmax_other_axis": [
        case("uneven", M3, {"x": (5, 4)}, lambda o, x: o.softmax(x, 1)),
        case("dim0", M2, {"x": (3, 5, 4)}, lambda o, x: o.softmax(x, 0)),
    ],
    "norm_batch_axis": [
        case("layer_norm-uneven", M3, {"x": (5, 3, 4), "w": (4,), "b": (4,)},
             lambda o, x, w, b: o.layer_norm(x, weight=w, bias=b)),
        case("rms_norm-2d-weight", M2, {"x": (3, 4, 6), "w": (4, 6)}, lambda o, x, w: o.rms_norm(x, weight=w)),
        case("layer_norm-normalized_shape", M2, {"x": (3, 4, 6)}, lambda o, x: o.layer_norm(x, (4, 6))),
        case("mesh2x2", M22, {"x": (4, 6, 5)}, lambda o, x: o.rms_norm(x, 5)),
    ],
    "cross_entropy_batch_sharded": [
        case("uneven", M3, {"logits": (5, 4), "t": I((5,), 4)}, lambda o, logits, t: (
            o.cross_entropy(logits, t, "none"), o.cross_entropy(logits, t, "sum"), o.cross_entropy(logits, t))),
        case("mesh2x2", M22, {"logits": (7, 3), "t": I((7,), 3)}, lambda o, logits, t: o.cross_entropy(logits, t)),
    ],
    # ---------------------------------------------------------------- views
    "view_of_partial": [
        case("every-view", M2, {"a": (2, 6), "b": (2, 3, 4), "c": (3, 1), "d": (3,)},
             lambda o, a, b, c, d: (
                 o.reshape(a, (3, 4)), o.permute(b, (2, 0, 1)), o.transpose(b, 0, 2), o.unsqueeze(d, 0),
                 o.expand(c, (3, 4)), o.broadcast_in_dim(d, (2, 3), (1,)))),
        case("mesh2x2", M22, {"a": (2, 6)}, lambda o, a: (o.reshape(a, (4, 3)), o.unsqueeze(a, 1))),
    ],
    "permute_sharded": [
        case("permute-uneven", M3, {"x": (2, 3, 5)}, lambda o, x: o.permute(x, (2, 0, 1))),
        case("transpose", M2, {"x": (5, 3, 4)}, lambda o, x: o.transpose(x, 0, -1)),
        case("mesh2x2", M22, {"x": (4, 6)}, lambda o, x: o.permute(x, (1, 0))),
    ],
    "reshape_sharded": [
        case("split-merge", M2, {"x": (2, 6, 4)}, lambda o, x: o.reshape(x, (12, 2, 2))),
        case("split", M3, {"x": (6, 4)}, lambda o, x: o.reshape(x, (3, 2, 4))),
        case("unit-axis", M3, {"x": (1, 6, 5)}, lambda o, x: o.reshape(x, (6, 5))),
        case("merge-rows", M2, {"x": (4, 3)}, lambda o, x: o.reshape(x, (2, 6))),
        case("mesh2x2", M22, {"x": (4, 6)}, lambda o, x: o.reshape(x, (2, 2, 6))),
        case("identity-uneven", M3, {"x": (5, 4)}, lambda o, x: o.reshape(x, (5, 4))),
        case("sharded-axis-left-alone-uneven", M3, {"x": (5, 6)}, lambda o, x: o.reshape(x, (5, 2, 3))),
        case("merge-uneven-same-flat-blocks", (4,), {"x": (7, 2)}, lambda o, x: o.reshape(x, (14,))),
    ],
    "unsqueeze_sharded": [
        case("uneven", M3, {"x": (5, 3)}, lambda o, x: (o.unsqueeze(x, 1), o.unsqueeze(x, -1))),
        case("front", M2, {"x": (3, 4)}, lambda o, x: o.unsqueeze(x, 0)),
    ],
    "broadcast_sharded": [
        case("expand-uneven", M3, {"x": (5, 1), "y": (3,)}, lambda o, x, y: (
            o.expand(x, (5, 4)), o.expand(y, (2, 3)))),
        case("broadcast_in_dim-uneven", M3, {"x": (5,)}, lambda o, x: o.broadcast_in_dim(x, (5, 4), (0,))),
        case("mesh2x2", M22, {"x": (4, 1)}, lambda o, x: o.expand(x, (4, 6))),
        case("mesh2x2-nested-uneven", M22, {"x": (13, 1)}, lambda o, x: o.expand(x, (13, 2))),
    ],
    # ---------------------------------------------------------------- aten
    "linear_column_parallel": [
        case("bias", M2, {"x": (3, 4), "w": (6, 4), "b": (6,)}, lambda o, x, w, b: o.linear(x, w, b)),
        case("uneven-bias", M3, {"x": (2, 3, 4), "w": (5, 4), "b": (5,)}, lambda o, x, w, b: o.linear(x, w, b)),
        case("mesh2x2-bias", M22, {"x": (2, 4), "w": (8, 4), "b": (8,)}, lambda o, x, w, b: o.linear(x, w, b)),
        case("mesh2x2-nested-uneven", M22, {"x": (2, 3), "w": (13, 3)}, lambda o, x, w: o.linear(x, w)),
    ],
    "linear_row_parallel": [
        case("bias", M2, {"x": (3, 6), "w": (4, 6), "b": (4,)}, lambda o, x, w, b: o.linear(x, w, b)),
        case("uneven-bias", M3, {"x": (2, 7), "w": (3, 7), "b": (3,)}, lambda o, x, w, b: o.linear(x, w, b)),
        case("no-bias", M3, {"x": (2, 6), "w": (3, 6)}, lambda o, x, w: o.linear(x, w)),
        case("mesh2x2-bias", M22, {"x": (3, 8), "w": (5, 8), "b": (5,)}, lambda o, x, w, b: o.linear(x, w, b)),
    ],
    "linear_batch_parallel": [
        case("uneven-bias", M3, {"x": (5, 3, 4), "w": (2, 4), "b": (2,)}, lambda o, x, w, b: o.linear(x, w, b)),
        case("mesh2x2", M22, {"x": (4, 6, 3), "w": (5, 3)}, lambda o, x, w: o.linear(x, w)),
    ],
    "linear_of_partial": [
        case("bias", M2, {"x": (3, 4), "w": (5, 4), "b": (5,)}, lambda o, x, w, b: o.linear(x, w, b)),
        case("uneven", M3, {"x": (5, 4), "w": (7, 4)}, lambda o, x, w: o.linear(x, w)),
        case("mesh2x2-bias", M22, {"x": (2, 3), "w": (4, 3), "b": (4,)}, lambda o, x, w, b: o.linear(x, w, b)),
    ],
    "matmul_sharded": [
        case("batched-uneven", M3, {"a": (3, 5, 4), "b": (4, 7)}, lambda o, a, b: o.matmul(a, b)),
        case("broadcast-batch", M3, {"a": (2, 1, 5, 4), "b": (3, 4, 7)}, lambda o, a, b: o.matmul(a, b)),
        case("mesh2x2", M22, {"a": (4, 6, 3), "b": (3, 8)}, lambda o, a, b: o.matmul(a, b)),
    ],
    "matmul_contraction_sharded": [
        case("uneven", M3, {"a": (3, 7), "b": (7, 2)}, lambda o, a, b: o.matmul(a, b)),
        case("batched", M2, {"a": (2, 3, 4), "b": (2, 4, 5)}, lambda o, a, b: o.matmul(a, b)),
        case("mesh2x2", M22, {"a": (3, 8), "b": (8, 2)}, lambda o, a, b: o.matmul(a, b)),
        case("mesh2x2-nested-uneven", M22, {"a": (2, 13), "b": (13, 3)}, lambda o, a, b: o.matmul(a, b)),
    ],
    "matmul_of_partial": [
        case("2d", M2, {"a": (3, 4), "b": (4, 5)}, lambda o, a, b: o.matmul(a, b)),
        case("mesh2x2", M22, {"a": (2, 3), "b": (3, 2)}, lambda o, a, b: o.matmul(a, b)),
    ],
    "sdpa_batch_or_heads": [
        case("heads-uneven", M2, {"q": (2, 3, 4, 5), "k": (2, 3, 6, 5), "v": (2, 3, 6, 3)},
             lambda o, q, k, v: o.sdpa(q, k, v)),
        case("causal", M3, {"q": (3, 5, 4, 2), "k": (3, 5, 4, 2), "v": (3, 5, 4, 3)},
             lambda o, q, k, v: o.sdpa(q, k, v, is_causal=True)),
    ],
    "sdpa_query_sequence": [
        case("causal-uneven", M3, {"q": (1, 2, 5, 4), "k": (1, 2, 5, 4), "v": (1, 2, 5, 3)},
             lambda o, q, k, v: o.sdpa(q, k, v, is_causal=True)),
        case("noncausal-scale", M2, {"q": (1, 2, 5, 4), "k": (1, 2, 6, 4), "v": (1, 2, 6, 3)},
             lambda o, q, k, v: o.sdpa(q, k, v, scale=0.3)),
        case("causal-mesh2x2", M22, {"q": (1, 1, 7, 2), "k": (1, 1, 7, 2), "v": (1, 1, 7, 2)},
             lambda o, q, k, v: o.sdpa(q, k, v, is_causal=True)),
        case("causal-mesh2x2-nested-uneven", M22, {"q": (1, 1, 13, 2), "k": (1, 1, 13, 2), "v": (1, 1, 13, 2)},
             lambda o, q, k, v: o.sdpa(q, k, v, is_causal=True)),
    ],
    "sdpa_value_dim": [
        case("causal", M2, {"q": (1, 2, 3, 4), "k": (1, 2, 3, 4), "v": (1, 2, 3, 5)},
             lambda o, q, k, v: o.sdpa(q, k, v, is_causal=True)),
        case("uneven", M3, {"q": (1, 1, 2, 4), "k": (1, 1, 3, 4), "v": (1, 1, 3, 7)},
             lambda o, q, k, v: o.sdpa(q, k, v)),
    ],
    "embedding_sharded": [
        case("uneven", M3, {"idx": I((3, 5), 10), "w": (10, 7)}, lambda o, idx, w: o.embedding(idx, w)),
        case("mesh2x2", M22, {"idx": I((2, 4), 6), "w": (6, 4)}, lambda o, idx, w: o.embedding(idx, w)),
    ],
    "embedding_vocab_parallel": [
        case("uneven", M3, {"idx": I((2, 6), 7), "w": (7, 3)}, lambda o, idx, w: o.embedding(idx, w)),
        case("even", M2, {"idx": I((2, 3), 8), "w": (8, 3)}, lambda o, idx, w: o.embedding(idx, w)),
        case("mesh2x2-nested-uneven", M22, {"idx": I((20,), 13), "w": (13, 2)},
             lambda o, idx, w: o.embedding(idx, w)),
    ],
    "take_along_other_axis": [
        case("dim1", M2, {"x": (4, 6), "i": I((4, 3), 6)}, lambda o, x, i: o.take_along_axis(x, i, 1)),
        case("dim0-uneven", M3, {"x": (4, 5), "i": I((2, 5), 4)}, lambda o, x, i: o.take_along_axis(x, i, 0)),
        case("mesh2x2", M22, {"x": (4, 6), "i": I((4, 3), 6)}, lambda o, x, i: o.take_along_axis(x, i, -1)),
    ],
    "take_along_sharded_axis": [
        case("uneven", M3, {"x": (3, 7), "i": I((3, 4), 7)}, lambda o, x, i: o.take_along_axis(x, i, 1)),
        case("dim0", M2, {"x": (5, 3), "i": I((4, 3), 5)}, lambda o, x, i: o.take_along_axis(x, i, 0)),
        case("mesh2x2", M22, {"x": (2, 8), "i": I((2, 6), 8)}, lambda o, x, i: o.take_along_axis(x, i, 1)),
        case("mesh2x2-nested-uneven", M22, {"x": (2, 13), "i": I((2, 20), 13)},
             lambda o, x, i: o.take_along_axis(x, i, 1)),
    ],
}


# ---------------------------------------------------------------------- shard, run, assemble

def mesh_of(shape: tuple[int, ...]) -> DeviceMesh:
    return DeviceMesh(torch.arange(int(torch.tensor(shape).prod())).reshape(shape).tolist())


def view(shape, dtype, layout: Layout, mesh: DeviceMesh) -> TensorView:
    """A scratch TensorView whose loop domain is `layout` (as Plan.value_view builds one)."""
    return apply_layout(TensorView("t", tuple(shape), dtype, None, Fusion()), layout, mesh)


def without_partials(layout: Layout) -> Layout:
    return Layout(tuple(R if p.is_partial else p for p in layout))


def _noise(like: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if like.dtype.is_floating_point and like.dtype != F64:
        # dyadic values: summands of a float32 value add up exactly, so the partial is exactly the value
        return (torch.randint(-32, 32, like.shape, generator=g) / 8).to(like.dtype)
    if not like.dtype.is_floating_point:
        return torch.randint(-3, 4, like.shape, generator=g).to(like.dtype)
    return torch.randn(like.shape, generator=g, dtype=F64)


def distribute(value: torch.Tensor, layout: Layout, mesh: DeviceMesh, g: torch.Generator) -> dict[int, torch.Tensor]:
    """Every rank's local tensor of `value` in `layout`. Along partial mesh axes the ranks hold random
    summands that add up to the shard (for a pending max: values <= the shard, one rank per element
    holding it), so a kernel that mishandles a summand shows."""
    tv = view(value.shape, value.dtype, without_partials(layout), mesh)
    base = {r: shard_tensor(value, tv, r) for r in mesh.ranks}
    pax = [m for m, p in enumerate(layout) if p.is_partial]
    if not pax:
        return base
    kinds = {layout[m].reduce for m in pax}
    assert len(kinds) == 1, f"layout {layout} mixes a pending sum and a pending max"
    rax = [m for m, p in enumerate(layout) if p.kind == "R"]
    out = {}
    for r in mesh.ranks:
        c = mesh.coords(r)
        if any(c[m] for m in pax + rax):
            continue
        group = [_moved(mesh, c, pax, sub) for sub in itertools.product(*(range(mesh.shape[m]) for m in pax))]
        shard = base[r]
        if kinds == {"sum"}:
            parts = [_noise(shard, g) for _ in group[1:]]
            first = shard - sum(parts) if parts else shard
            for q, part in zip(group, [first] + parts):
                out[q] = part.contiguous()
        else:
            owner = torch.randint(0, len(group), shard.shape, generator=g)
            for i, q in enumerate(group):
                below = _noise(shard, g).abs() + 1
                out[q] = torch.where(owner == i, shard, shard - below.to(shard.dtype)).contiguous()
    for r in mesh.ranks:  # replicas along R mesh axes hold the same summand
        if r not in out:
            out[r] = out[mesh.rank_at([0 if m in rax else x for m, x in enumerate(mesh.coords(r))])]
    return out


def _moved(mesh: DeviceMesh, coords, axes, sub) -> int:
    """The rank at `coords` with mesh axes `axes` moved to positions `sub`."""
    cc = list(coords)
    for m, i in zip(axes, sub):
        cc[m] = i
    return mesh.rank_at(cc)


def assemble(locals_by_rank: dict[int, torch.Tensor], layout: Layout, global_shape, mesh: DeviceMesh
             ) -> torch.Tensor:
    """The global tensor every rank's local result stands for: shards placed by the loop domain, partial
    mesh axes summed (Pmax: maxed), replicas checked equal."""
    first = next(iter(locals_by_rank.values()))
    tv = view(global_shape, first.dtype, without_partials(layout), mesh)
    rax = [m for m, p in enumerate(layout) if p.kind == "R"]
    pax = [m for m, p in enumerate(layout) if p.is_partial]
    out = torch.zeros(tuple(global_shape), dtype=first.dtype)
    for r in mesh.ranks:
        got = locals_by_rank[r]
        assert tuple(got.shape) == local_shape(tv, r), (
            f"rank {r} computed a local shape {tuple(got.shape)}; layout {layout} gives it {local_shape(tv, r)}")
        c = mesh.coords(r)
        if any(c[m] for m in rax):
            twin = mesh.rank_at([0 if m in rax else x for m, x in enumerate(c)])
            assert torch.equal(got, locals_by_rank[twin]), f"replicas {twin} and {r} differ under {layout}"
            continue
        if any(c[m] for m in pax):
            continue
        acc = got.clone()
        for sub in itertools.product(*(range(mesh.shape[m]) for m in pax)):
            if not any(sub):
                continue
            other = locals_by_rank[_moved(mesh, c, pax, sub)]
            acc = torch.maximum(acc, other) if layout[pax[0]].reduce == "max" else acc + other
        if out.ndim == 0:
            out = acc
        else:
            idx = local_indices(tv, r)
            n = len(idx)
            out[tuple(torch.from_numpy(ix).reshape([-1 if k == a else 1 for k in range(n)])
                      for a, ix in enumerate(idx))] = acc
    return out


def random_inputs(c: Case, g: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for n, s in c.specs().items():
        if s.dtype == I64:
            out[n] = torch.randint(0, s.high, s.shape, generator=g)
        elif s.dtype == F32:
            out[n] = (torch.randint(-32, 32, s.shape, generator=g) / 8).to(F32)
        else:
            out[n] = torch.randn(s.shape, generator=g, dtype=F64)
    return out


def expose_every_tensor(fd: FusionDefinition) -> None:
    """Make every intermediate an output, so the reference gives each expr's operands and results."""
    f = fd.fusion
    for e in f.exprs:
        for tv in e.outputs:
            if not any(t is tv for t in f.outputs.values()):
                fd.add_output(tv)


def flag_axes(strategy) -> dict[str, list[int]]:
    flags: dict[str, list[int]] = {}
    for m, fs in enumerate(strategy.flags):
        for f in fs:
            flags.setdefault(f, []).append(m)
    return flags


def user_strategies(c: Case):
    """(problem, mesh, [(expr, strategy)]) for every user expr of the case and every strategy."""
    fd = c.build()
    expose_every_tensor(fd)
    mesh = mesh_of(c.mesh)
    problem = build_problem(fd, mesh)
    pairs = []
    for e in fd.fusion.exprs:
        key = e.outputs[0].name
        pe = problem.exprs[key]
        pairs += [(pe, s) for s in problem.strategies[key]]
    return fd, problem, mesh, pairs


def check_strategy(e, s, env, mesh: DeviceMesh, g: torch.Generator) -> None:
    """Run expr e under strategy s on every rank and compare the assembled outputs with the reference."""
    tensor_args = [(k, v) for k, v in e.args if isinstance(v, TensorView)]
    local = {k: distribute(env[v.name], lay, mesh, g) for (k, v), lay in zip(tensor_args, s.inputs)}
    operands = {k: Operand(v.shape, lay) for (k, v), lay in zip(tensor_args, s.inputs)}
    outputs = [Operand(o.shape, lay) for o, lay in zip(e.outputs, s.outputs)]
    flags = flag_axes(s)
    results: list[dict[int, torch.Tensor]] = [{} for _ in e.outputs]
    for r in mesh.ranks:
        args = {k: local[k][r] if isinstance(v, TensorView) else v for k, v in e.args}
        outs = run_local(e.op.name, args, operands, outputs, flags, RankContext(mesh, r))
        assert len(outs) == len(e.outputs)
        for i, o in enumerate(outs):
            results[i][r] = o
    for o, lay, res in zip(e.outputs, s.outputs, results):
        got = assemble(res, lay, o.shape, mesh)
        want = env[o.name]
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, msg=lambda m: (
            f"{e} under {[str(x) for x in s.inputs]} -> {[str(x) for x in s.outputs]} "
            f"(rules {s.rules}, flags {flags}) on mesh {mesh.shape}:\n{m}"))


def _params():
    for rule_name, cases in RULE_CASES.items():
        for c in cases:
            yield pytest.param(rule_name, c, id=f"{rule_name}-{c.name}", marks=c.marks)


# ---------------------------------------------------------------------- tests

@pytest.mark.parametrize("rule_name, c", list(_params()))
def test_rule_identity_holds_on_random_data(rule_name, c):
    g = torch.Generator().manual_seed(zlib.crc32(f"{rule_name}-{c.name}".encode()))
    fd, problem, mesh, pairs = user_strategies(c)
    inputs = random_inputs(c, g)
    env = dict(inputs)
    env.update(evaluate(fd, inputs))
    checked = 0
    for e, s in pairs:
        if rule_name in s.rules:
            check_strategy(e, s, env, mesh, g)
            checked += 1
    assert checked, f"case {c.name} offers no strategy by rule {rule_name}"


def test_every_rule_has_a_numeric_case():
    names = [r.name for r in ALL_RULES]
    missing = sorted(set(names) - set(RULE_CASES))
    assert not missing, f"rules without a numeric case in tests/test_rules.py RULE_CASES: {missing}"
    stale = sorted(set(RULE_CASES) - set(names))
    assert not stale, f"RULE_CASES names rules that no longer exist: {stale}"


def test_every_rule_is_exercised_by_its_cases():
    """A case only counts when the optimizer offers a strategy named after the rule (axis_strategies
    names a strategy after the first rule that finds it)."""
    idle = []
    for r in ALL_RULES:
        hits = 0
        for c in RULE_CASES.get(r.name, []):
            _, _, _, pairs = user_strategies(c)
            hits += sum(r.name in s.rules for _, s in pairs)
        if not hits:
            idle.append(r.name)
    assert not idle, f"rules no case exercises: {idle}"


@pytest.mark.parametrize("r", ALL_RULES, ids=lambda r: r.name)
def test_rule_states_its_identity(r):
    assert r.identity.strip(), f"rule {r.name} has an empty identity (docstring first line)"


def test_problem_strategies_are_expr_strategies():
    """The strategies checked above are exactly those expr_strategies prices for the optimizer."""
    c = RULE_CASES["linear_row_parallel"][0]
    _, problem, mesh, _ = user_strategies(c)
    key = next(k for k, e in problem.exprs.items() if e.op.name == "linear")
    again = expr_strategies(problem.exprs[key], mesh, CostModel.h200(), problem)
    assert [(s.inputs, s.outputs, s.flags, s.rules) for s in again] == \
        [(s.inputs, s.outputs, s.flags, s.rules) for s in problem.strategies[key]]
