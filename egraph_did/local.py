"""Local kernels: run one op on one rank's shards, as a plan's compute step says.

Mostly the op's reference on local tensors. A few strategies need the rank's place (their flags), and
ops whose attributes are shapes get the local shapes. Shared by simulate() and the runtime.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .ops import OPS
from .shards import Operand, RankContext


def run_local(op: str, args: dict[str, Any], operands: dict[str, Operand], outputs: list[Operand],
              flags: dict[str, list[int]], ctx: RankContext) -> tuple[torch.Tensor, ...]:
    """One rank's part of a compute step. args holds local tensors (by parameter) and literals.

    >>> import torch
    >>> from egraph_did.layout import Layout
    >>> from egraph_did.mesh import DeviceMesh
    >>> x, y = Operand((2, 8), Layout.from_code("S1")), Operand((2,), Layout.from_code("P"))
    >>> ctx = RankContext(DeviceMesh.arange(2), rank=1)  # it holds 4 of x's 8 columns
    >>> args = {"x": torch.ones(2, 4), "dims": 1, "keepdim": False}
    >>> run_local("mean", args, {"x": x}, [y], {"global_count": [0]}, ctx)  # local sum / global count 8
    (tensor([0.5000, 0.5000]),)
    """
    args = dict(args)
    out_shapes = [ctx.local_shape(o) for o in outputs]
    if op in ("reshape", "expand", "broadcast_in_dim"):
        args["shape"] = out_shapes[0]
    if op == "welford_blocks":
        args["blocks"] = out_shapes[0][args["dim"] % len(out_shapes[0][:-1])]
    if "bias_once" in flags and not ctx.on_first(flags["bias_once"]):
        args["bias"] = None
    special = flags.keys() & {"global_count", "vocab_parallel", "masked_gather", "q_offset"}
    assert len(special) <= 1, f"{op}: strategy flags {sorted(special)} cannot combine in one local kernel"
    if "global_count" in flags:
        return (_global_mean(op, args, operands),)
    if "vocab_parallel" in flags:
        return (_masked_rows(args["weight"], args["indices"], operands["weight"], 0, ctx),)
    if "masked_gather" in flags:
        return (_masked_gather(args, operands["x"], ctx),)
    if "q_offset" in flags:
        return (_sdpa_offset(args, operands["q"], ctx),)
    out = OPS[op].reference(**args)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _global_mean(op: str, args, operands) -> torch.Tensor:
    """A mean over a sharded axis as a partial: local sum / global count."""
    if op == "mean":
        x, dims = args["x"], args["dims"]
        shape = operands["x"].shape
        dims = range(len(shape)) if dims is None else ((dims,) if isinstance(dims, int) else dims)
        n = math.prod(shape[d] for d in dims)
        return torch.sum(x, dim=tuple(d % x.ndim for d in dims), keepdim=args["keepdim"]) / n
    assert op == "cross_entropy", op
    total = OPS[op].reference(args["logits"], args["target"], reduction="sum")
    return total / operands["target"].shape[0]


def _masked_take(table: torch.Tensor, index: torch.Tensor, lo: int, hi: int, take) -> torch.Tensor:
    """take(table, index - lo) where index falls in [lo, hi), else 0 (a summand of a partial). Selected
    with where, not multiplied: an inf or nan the clamped lookup lands on must not leak as 0 * inf."""
    inside = (index >= lo) & (index < hi)
    picked = take(table, (index - lo).clamp(0, max(hi - lo - 1, 0)))
    mask = inside.unsqueeze(-1) if picked.ndim > inside.ndim else inside
    return torch.where(mask, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def _masked_rows(weight, indices, w: Operand, axis: int, ctx: RankContext) -> torch.Tensor:
    lo, hi = ctx.shard_range(w.shape[axis], w.layout, axis)
    return _masked_take(weight, indices, lo, hi, lambda t, i: t[i])


def _masked_gather(args, x: Operand, ctx: RankContext) -> torch.Tensor:
    xl, index, dim = args["x"], args["index"], args["dim"] % len(x.shape)
    lo, hi = ctx.shard_range(x.shape[dim], x.layout, dim)
    return _masked_take(xl, index, lo, hi, lambda t, i: torch.take_along_dim(t, i, dim))


def _sdpa_offset(args, q: Operand, ctx: RankContext) -> torch.Tensor:
    """Causal attention for a shard of the queries: query i of the shard is global row start + i."""
    lo, _ = ctx.shard_range(q.shape[2], q.layout, 2)
    ql, k = args["q"], args["k"]
    rows = torch.arange(ql.shape[2], device=ql.device).unsqueeze(1) + lo
    keep = torch.arange(k.shape[2], device=ql.device).unsqueeze(0) <= rows
    return torch.nn.functional.scaled_dot_product_attention(ql, k, args["v"], attn_mask=keep,
                                                            scale=args.get("scale"))
