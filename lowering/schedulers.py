"""Triton schedulers: classify a KernelSpec, generate its kernel's source from the spec's IR, compile it
once per content hash and launch it on one rank's local tensors.

Four schedulers, in the spirit of nvFuser's:

- pointwise:  pointwise ops with numpy broadcasting; one flat loop over the broadcast shape.
- persistent: pointwise ops and sum/amax reductions (keepdim) over the same trailing axes whose row
              fits on chip (<= 16384 elements): a row stays in registers between its reductions
              (softmax, layer_norm, rms_norm, residual add + layer_norm in one kernel).
- reduction:  one sum/amax over trailing axes of any length (inner: a loop over column blocks) or over
              leading axes (outer, e.g. a column sum), with a pointwise prologue and epilogue. A long
              outer reduction over few column blocks splits (outer_split): row chunks reduce apart into
              an fp32 workspace, and a second jitted function of the module (`finish`) reduces those
              partials and runs the epilogue (SplitLaunch launches both).
- transpose:  one permute/transpose that moves the last axis, with pointwise ops before and after; tiles
              load along the input's contiguous axis and store along the output's.

Anything else classifies as None and runs in torch eager (run_eager). Kernels compute in fp32 for 16-bit
floats and round once at the store. Under TRITON_INTERPRET=1 (no GPU) the same source runs on the CPU;
blocks are then large, since the interpreter costs per program, not per element.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from egraph_did.errors import DtypeError, PlanError, ShapeError
from egraph_did.ops import OPS

from .codegen import COMPUTE_TYPE, FLOATS, Group, Phase, Writer, align_to, ident, literal
from .kernel_spec import (KERNEL_OPS, POINTWISE_BINARY, REDUCTIONS, TRANSPOSES, KernelOp,
                          KernelSpec)

PERSISTENT_MAX_ROW = 16384  # elements of a row a persistent kernel holds on chip
_BIG = 2**31 - 2**20       # past this many elements, offsets are computed in int64

# Source-level choices, measured on one H200 (bf16 [16384, 12288], bench/sweep_reductions.py, 2026-12-03).
# Eviction hints (inductor's evict_first / evict_last) bought nothing there: rms_norm 0.2049 vs 0.2045 ms,
# softmax 0.2067 vs 0.1993, add+layer_norm 0.4144 vs 0.3938, row sum 0.1026 vs 0.1012; they stay off.
PERSISTENT_HINTS = False     # eviction hints in persistent kernels
# rms_norm [16384, 12288] one-shot (BLOCK_N 16384, a quarter of the lanes masked) 0.2011 ms, torch.compile
# (a looped kernel: the row in chunks, reloaded from L2 for the epilogue) 0.1927 ms = the copy. The looped
# form (Schedule.loop_block), swept over chunk 1024-4096 x warps 4-16 x hints x BLOCK_M 1-2
# (bench/results_sweep_reductions_h200.txt, 2026-12-03 19:30): chunk 4096 (or 2048), BLOCK_M 1, 16 warps,
# hints on: 0.1926 ms = torch.compile; without hints 0.2028, with 8 warps 0.2004. It reads the row once a
# reduction level plus once for the epilogue, so it pays only with one level (rms_norm, a row sum's
# epilogue); layer_norm (two levels) and softmax keep the one-shot form, faster than torch.compile there.
PERSISTENT_LOOP_FROM: int | None = 8192  # rows of at least this many elements loop; None: never
PERSISTENT_LOOP_LEVELS = 1               # ... when the kernel has at most this many reduction levels
PERSISTENT_LOOP_BLOCK = 4096             # the chunk a looped row aims at (persistent_loop_block)
PERSISTENT_LOOP_TILE = 4096              # BLOCK_M x chunk of a looped program on GPU
PERSISTENT_LOOP_WARPS = 16
PERSISTENT_LOOP_HINTS = True             # looped: reduction passes evict_last, the final pass evict_first
REDUCTION_HINTS = False      # eviction hints in reduction kernels
# Column sum [16384, 12288]: one pass 256 x 32 (384 programs) 0.1130 ms; split into row chunks with a
# finishing pass 0.1088-0.1100 ms over 12 configurations (64..128 columns, 1536..6144 programs, 4 warps),
# torch.compile 0.1084 ms.
SPLIT_BLOCK_N = 64           # columns a program of a split outer reduction sums
SPLIT_PROGRAMS = 1536        # a split outer reduction aims at this many programs (~12 per H200 SM)
SPLIT_MIN_ROWS = 1024        # and gives each at least this many rows
SPLIT_TILE = 8192            # elements of a split reduction's tile (BLOCK_K x BLOCK_N)
SPLIT_FINISH_BLOCK = 256     # columns a program of the finishing pass sums


def outer_split(kk: int, cols: int) -> int:
    """Row chunks of an outer reduction over kk rows and cols columns (a column sum), reduced apart into
    an fp32 workspace and then summed by a finishing pass: doubled while SPLIT_BLOCK_N-wide column blocks
    times chunks stay under SPLIT_PROGRAMS and each chunk keeps SPLIT_MIN_ROWS rows; 1 (one pass) when the
    columns alone fill the GPU or the rows are short (up to 512 chunks for a single column: a loss).

    >>> outer_split(16384, 12288), outer_split(16384, 10 ** 6), outer_split(1000, 12288), outer_split(2048 * 12288, 1)
    (8, 1, 1, 512)
    """
    nb = -(-cols // SPLIT_BLOCK_N)
    split, most = 1, 64 if nb > 1 else 512  # one column block (a whole tensor to a scalar): chunks alone fill it
    while nb * split < SPLIT_PROGRAMS and kk // (2 * split) >= SPLIT_MIN_ROWS and split < most:
        split *= 2
    return split


def persistent_loop_block(row: int, target: int = PERSISTENT_LOOP_BLOCK, smallest: int = 512) -> int:
    """The chunk of a looped persistent row: the largest power of two up to target that divides the row
    (no masks), down to smallest; else target, at most next_pow2(row) (the last chunk masked).

    >>> persistent_loop_block(12288), persistent_loop_block(12288, 2048), persistent_loop_block(1000)
    (4096, 2048, 1024)
    """
    target = min(target, _p2(row))
    b = target
    while b >= smallest:
        if row % b == 0:
            return b
        b //= 2
    return target


def persistent_form(row: int, levels: int = 1) -> int | None:
    """The loop_block a persistent schedule takes for rows of `row` elements reduced in `levels` passes
    (layer_norm: the mean, then the variance): None (the row held on chip in one pass) below
    PERSISTENT_LOOP_FROM or above PERSISTENT_LOOP_LEVELS, else persistent_loop_block(row).

    >>> persistent_form(12288), persistent_form(12288, levels=2), persistent_form(4096)
    (4096, None, None)
    """
    if PERSISTENT_LOOP_FROM is None or row < PERSISTENT_LOOP_FROM or levels > PERSISTENT_LOOP_LEVELS:
        return None
    return persistent_loop_block(row)


class Unsupported(PlanError):
    """No Triton scheduler takes this spec (classify answers None; run it with run_eager)."""


# ------------------------------------------------------------------ analysis

@dataclass
class Schedule:
    """What a scheduler needs to know about a spec: the loop shape, the frame of every op (the loop
    axes its operands right-align to) and of every produced tensor, the reduced loop axes, and which ops
    run after the reduction or permute (the epilogue)."""

    kind: str
    loop: tuple[int, ...]
    op_frame: dict[str, tuple[int, ...]] = field(default_factory=dict)
    out_frame: dict[str, tuple[int, ...]] = field(default_factory=dict)
    red_axes: tuple[int, ...] = ()
    after: set[str] = field(default_factory=set)
    pivot: KernelOp | None = None  # the reduction of a reduction kernel, the permute of a transpose
    outer: bool = False            # reduction over leading axes (a column sum)
    split: int = 1                 # outer reduction: row chunks reduced apart, then a finishing pass
    hints: bool = False            # cache hints: streamed loads evict_first, broadcast operands evict_last
    # persistent, source-level alternatives to holding the row as one masked block of next_pow2(row):
    loop_block: int | None = None  # looped: chunks of this many elements, one pass a reduction level
                                   # and a final pass that reloads the row (from L2), as inductor does
    pieces: int = 1                # one-shot, the row held as up to this many power-of-two blocks

    @property
    def base(self) -> tuple[int, ...]:
        return tuple(range(len(self.loop)))


def _args(op: KernelOp) -> dict:
    """The op's arguments with defaults filled in from the op table's signature."""
    bound = OPS[op.op].signature.bind(**dict(op.args))
    bound.apply_defaults()
    return dict(bound.arguments)


def _tensor_args(spec: KernelSpec, op: KernelOp) -> list[str]:
    return [v for _, v in op.args if spec.is_tensor(v)]


def _check_ops(spec: KernelSpec) -> None:
    """Reject what no scheduler can emit: ops outside the primitives, dtypes without a kernel type."""
    for op in spec.ops:
        if not spec.is_tensor(op.out):
            raise Unsupported(f"op {op.op} produces {op.out!r}, which has no (shape, dtype) in spec.tensors")
        if op.op not in KERNEL_OPS:
            raise Unsupported(
                f"op {op.op!r} (producing {op.out!r}) is not a kernel primitive; Triton kernels take "
                f"{', '.join(KERNEL_OPS)}. Decompose it (egraph_did.ops.OPS[{op.op!r}].decompose) or run it "
                f"as an ATen segment")
        try:
            args = _args(op)
        except TypeError as e:
            raise Unsupported(f"op {op.op} (producing {op.out!r}): arguments {dict(op.args)} do not fit its "
                              f"signature {OPS[op.op].signature}: {e}") from None
        for k in ("x", "a", "b"):
            v = args.get(k)
            if k in args and not spec.is_tensor(v) and not (op.op in POINTWISE_BINARY and
                                                             isinstance(v, (int, float, bool))):
                raise Unsupported(f"op {op.op} (producing {op.out!r}): argument {k}={v!r} is neither a tensor "
                                  f"of the spec nor a Python number")
        for v in _tensor_args(spec, op) + [op.out]:
            dt = spec.dtype(v)
            if dt not in COMPUTE_TYPE:
                raise Unsupported(f"tensor {v!r} is {str(dt).replace('torch.', '')}; Triton kernels take "
                                  f"float32, float16, bfloat16, int32, int64 and bool (float64 runs eager)")
        tensors = [spec.dtype(v) for v in _tensor_args(spec, op)]
        if op.op in REDUCTIONS and any(d not in FLOATS for d in tensors):
            raise Unsupported(f"{op.op} producing {op.out!r}: kernels reduce floating-point tensors only")
        if op.op == "pow" and any(d not in FLOATS for d in tensors + [spec.dtype(op.out)]):
            raise Unsupported(f"pow producing {op.out!r}: kernels take pow of floating-point tensors only")
        if op.op != "cast" and torch.bool in tensors:
            raise Unsupported(f"{op.op} producing {op.out!r}: kernels take bool tensors only through cast")
    for n in spec.inputs + spec.outputs:
        if not spec.is_tensor(n):
            raise Unsupported(f"tensor {n!r} is listed as an input or output but has no (shape, dtype) in "
                              f"spec.tensors")


def _reduced_axes(spec: KernelSpec, op: KernelOp, frame: tuple[int, ...]) -> tuple[int, ...]:
    x = _args(op)["x"]
    nd = len(spec.shape(x))
    dims = _args(op)["dims"]
    dims = range(nd) if dims is None else ((dims,) if isinstance(dims, int) else dims)
    off = len(frame) - nd
    return tuple(sorted(frame[off + d % nd] for d in dims))


def _perm(spec: KernelSpec, op: KernelOp) -> tuple[int, ...]:
    args = _args(op)
    n = len(spec.shape(args["x"]))
    return OPS[op.op].permutation(args, n)


def _frames(spec: KernelSpec, s: Schedule) -> None:
    """Give every op the frame its operands align to and every produced tensor its own frame: the base
    loop axes, until a keepdim=False reduction drops axes or a permute reorders them."""
    for op in spec.ops:
        inter = {s.out_frame[v] for v in _tensor_args(spec, op) if v in s.out_frame}
        if len(inter) > 1:
            raise Unsupported(f"{op.op} producing {op.out!r} mixes tensors from before and after a reduction "
                              f"or permute; no single kernel loop holds both")
        frame = inter.pop() if inter else s.base
        for v in _tensor_args(spec, op):
            if align_to(spec.shape(v), frame, s.loop) is None:
                raise Unsupported(f"{op.op} producing {op.out!r}: operand {v!r} of shape {spec.shape(v)} does "
                                  f"not broadcast into the kernel's loop {s.loop}")
        s.op_frame[op.out] = frame
        out = frame
        if op.op in REDUCTIONS:
            red = _reduced_axes(spec, op, frame)
            _check_reduced_operand(spec, op, frame, s.loop, red)
            if not _args(op)["keepdim"]:
                out = tuple(a for a in frame if a not in red)
        elif op.op in TRANSPOSES:
            x = _args(op)["x"]
            if len(spec.shape(x)) != len(frame):
                raise Unsupported(f"{op.op} producing {op.out!r}: {x!r} must span the whole loop {s.loop}")
            out = tuple(frame[p] for p in _perm(spec, op))
        if align_to(spec.shape(op.out), out, s.loop) is None:
            raise Unsupported(f"{op.op} producing {op.out!r} of shape {spec.shape(op.out)}: does not fit the "
                              f"kernel's loop {s.loop}")
        s.out_frame[op.out] = out


def _check_reduced_operand(spec: KernelSpec, op: KernelOp, frame: tuple[int, ...], loop: tuple[int, ...],
                           red: tuple[int, ...]) -> None:
    """A reduction must run over its operand's own extents. Where the operand has extent 1 along a reduced
    loop axis that other tensors of the kernel widen, the kernel would sum each element once per copy of
    the broadcast (sum(x[4, 1]) beside mul(w[4, 3], x) came out 3x too large): no single loop holds both."""
    x = _args(op)["x"]
    al = align_to(spec.shape(x), frame, loop)
    off = len(frame) - len(spec.shape(x))
    for d, a in enumerate(al):
        if a is None and frame[off + d] in red and loop[frame[off + d]] > 1:
            raise Unsupported(f"{op.op} producing {op.out!r} reduces axis {d} of {x!r} (extent 1), which the "
                              f"kernel's loop {loop} broadcasts to {loop[frame[off + d]]}: the reduction would "
                              f"count each element once per copy")


def _downstream(spec: KernelSpec, pivot: KernelOp) -> set[str]:
    after = {pivot.out}
    for op in spec.ops:
        if any(v in after for v in _tensor_args(spec, op)):
            after.add(op.out)
    after.discard(pivot.out)
    return after


def _check_epilogue(spec: KernelSpec, s: Schedule, what: str) -> None:
    """Ops after the pivot may read it, each other and spec inputs, but not tensors computed before it
    (those live inside the loop), and nothing along a reduced axis."""
    for op in spec.ops:
        if op.out not in s.after:
            continue
        for v in _tensor_args(spec, op):
            if v != s.pivot.out and v not in s.after and v not in spec.inputs:
                raise Unsupported(f"{op.op} producing {op.out!r} reads {v!r}, computed before the {what}; a "
                                  f"{s.kind} kernel cannot keep it past the {what}")
        for v in _tensor_args(spec, op) + [op.out]:
            al = align_to(spec.shape(v), s.op_frame[op.out] if v != op.out else s.out_frame[v], s.loop)
            if any(a in s.red_axes for a in al if a is not None):
                raise Unsupported(f"{op.op} producing {op.out!r} needs {v!r} along the reduced axes after the "
                                  f"reduction (a second pass over the row): the persistent scheduler takes rows "
                                  f"of up to {PERSISTENT_MAX_ROW} elements")


def _broadcast_loop(spec: KernelSpec) -> tuple[int, ...]:
    try:
        return tuple(torch.broadcast_shapes(*(s for _, s, _ in spec.tensors)))
    except RuntimeError as e:
        raise Unsupported(f"the spec's tensors do not broadcast to one loop shape: {e}") from None


def _pointwise(spec: KernelSpec) -> Schedule:
    s = Schedule("pointwise", _broadcast_loop(spec))
    _frames(spec, s)
    return s


def _transpose(spec: KernelSpec, p: KernelOp) -> Schedule:
    x = _args(p)["x"]
    s = Schedule("transpose", spec.shape(x), pivot=p)
    n = len(s.loop)
    if n < 2:
        raise Unsupported(f"{p.op} producing {p.out!r}: a transpose needs at least 2 axes")
    perm = _perm(spec, p)
    if perm[-1] == n - 1:
        raise Unsupported(f"{p.op} producing {p.out!r} keeps the last axis in place; the transpose scheduler "
                          f"tiles a permute that moves it")
    _frames(spec, s)
    s.after = _downstream(spec, p)
    _check_epilogue(spec, s, p.op)
    return s


def _reduction(spec: KernelSpec, r: KernelOp) -> Schedule:
    x = _args(r)["x"]
    s = Schedule("reduction", spec.shape(x), pivot=r)
    _frames(spec, s)
    n = len(s.loop)
    s.red_axes = _reduced_axes(spec, r, s.op_frame[r.out])
    k = len(s.red_axes)
    if s.red_axes == tuple(range(n - k, n)) and (k < n or math.prod(s.loop) < SPLIT_MIN_ROWS):
        s.outer = False
    elif s.red_axes == tuple(range(k)):  # a leading run of axes, or all of them (a loss: one output, so
        s.outer = True                    # only a split over row chunks, never one program, fills the GPU)
    else:
        raise Unsupported(f"{r.op} producing {r.out!r} reduces axes {s.red_axes} of {s.loop}: the reduction "
                          f"scheduler takes trailing (inner) or leading (outer) axes")
    s.after = _downstream(spec, r)
    _check_epilogue(spec, s, "reduction")
    if s.outer:
        k = len(s.red_axes)
        s.split = outer_split(math.prod(s.loop[:k]), math.prod(s.loop[k:]))
    s.hints = REDUCTION_HINTS
    return s


def _persistent(spec: KernelSpec, reds: list[KernelOp]) -> Schedule:
    s = Schedule("persistent", _broadcast_loop(spec))
    for r in reds:
        if not _args(r)["keepdim"]:
            raise Unsupported(f"{r.op} producing {r.out!r} has keepdim=False; the persistent scheduler keeps "
                              f"reduced axes (keepdim=True) so later ops broadcast along the row")
    _frames(spec, s)
    n = len(s.loop)
    axes = {_reduced_axes(spec, r, s.op_frame[r.out]) for r in reds}
    if len(axes) != 1:
        raise Unsupported(f"reductions over different loop axes {sorted(axes)}; a persistent kernel reduces "
                          f"one row")
    s.red_axes = axes.pop()
    k = len(s.red_axes)
    if s.red_axes != tuple(range(n - k, n)):
        raise Unsupported(f"reductions over axes {s.red_axes} of {s.loop}: the persistent scheduler reduces "
                          f"trailing axes")
    row = math.prod(s.loop[n - k:])
    if row > PERSISTENT_MAX_ROW:
        raise Unsupported(f"rows of {row} elements do not fit on chip (the persistent scheduler takes up to "
                          f"{PERSISTENT_MAX_ROW})")
    levels = max(_pass_numbers(spec, _varying(spec, s)).values())
    s.loop_block = persistent_form(row, levels)
    s.hints = PERSISTENT_LOOP_HINTS if s.loop_block else PERSISTENT_HINTS
    return s


def schedule(spec: KernelSpec) -> Schedule:
    """The schedule of a spec, or Unsupported saying why no scheduler takes it."""
    _check_ops(spec)
    reds = [op for op in spec.ops if op.op in REDUCTIONS]
    perms = [op for op in spec.ops if op.op in TRANSPOSES]
    if perms:
        if reds or len(perms) > 1:
            raise Unsupported("a transpose kernel holds exactly one permute/transpose and no reduction")
        return _transpose(spec, perms[0])
    if not reds:
        return _pointwise(spec)
    why = None
    if len(reds) == 1:
        try:
            return _reduction(spec, reds[0])
        except Unsupported as e:
            why = e
    try:
        return _persistent(spec, reds)
    except Unsupported as e:
        raise Unsupported(f"{e}" + (f" (and as a reduction: {why})" if why else "")) from None


def classify(spec: KernelSpec) -> str | None:
    """The scheduler that takes spec: "pointwise", "persistent", "reduction", "transpose", or None (the
    caller runs it eagerly).

    >>> from egraph_did.lowering.kernel_spec import KernelOp, KernelSpec
    >>> import torch
    >>> spec = KernelSpec(("x",), (KernelOp("y", "exp", (("x", "x"),)),), ("y",),
    ...                   (("x", (4, 5), torch.float32), ("y", (4, 5), torch.float32)))
    >>> classify(spec)
    'pointwise'
    """
    try:
        return schedule(spec).kind
    except Unsupported:
        return None


# ------------------------------------------------------------------ block and warp heuristics

def _p2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class LaunchConfig:
    grid: int
    constexprs: tuple[tuple[str, int], ...]
    num_warps: int


def heuristics(spec: KernelSpec, s: Schedule, interpret: bool | None = None) -> LaunchConfig:
    """Block sizes and warps from shape and dtype. On GPU: pointwise blocks of 1024 (32-bit) or 2048
    (16-bit), persistent BLOCK_N = next_pow2(row) with BLOCK_M rows up to ~4096 elements a tile and 8
    warps from 8192 elements, reduction loops over 2048..4096 elements, 64x64 (16-bit) or 32x32
    transpose tiles (measured on one H200, bf16 [16384, 12288], in the comments below). Interpreted: the largest blocks that
    stay cheap in numpy (~64K elements), since every program costs Python overhead."""
    interpret = interpreting() if interpret is None else interpret
    L = s.loop
    itemsize = max((t.itemsize for _, _, t in spec.tensors), default=4)
    if s.kind == "pointwise":
        numel = math.prod(L)
        if interpret:
            block, warps = min(_p2(numel), 65536), 4
        else:
            # H200, bf16 [16384, 12288] gelu chain: 2048 x 4 warps 87% of copy, 1024 x 4 85%, 4096 x 16 83%
            block, warps = max(128, min(_p2(numel), 2048 if itemsize <= 2 else 1024)), 4
        return LaunchConfig(-(-numel // block), (("BLOCK", block),), warps)
    if s.kind == "persistent":
        k = len(s.red_axes)
        rows, cols = math.prod(L[:len(L) - k]), math.prod(L[len(L) - k:])
        if s.loop_block:  # the chunk is a literal of the source: only BLOCK_M is free
            bm = min(_p2(rows), max(1, (65536 if interpret else PERSISTENT_LOOP_TILE) // s.loop_block))
            return LaunchConfig(-(-rows // bm), (("BLOCK_M", bm),), 4 if interpret else PERSISTENT_LOOP_WARPS)
        bn = _p2(cols)
        tile = 65536 if interpret else 4096
        bm = min(_p2(rows), max(1, tile // bn))
        # H200, bf16 rows of 12288 (BLOCK_N 16384): 8 warps 96% of copy, 16 warps 86%, 32 warps 50%
        warps = 8 if not interpret and bm * bn >= 8192 else 4
        if s.pieces > 1:  # the pieces are literals of the source: only BLOCK_M is free
            return LaunchConfig(-(-rows // bm), (("BLOCK_M", bm),), warps)
        return LaunchConfig(-(-rows // bm), (("BLOCK_M", bm), ("BLOCK_N", bn)), warps)
    if s.kind == "reduction":
        k = len(s.red_axes)
        if s.outer:
            kk, cols = math.prod(L[:k]), math.prod(L[k:])
            if s.split > 1:
                chunk = -(-kk // s.split)
                if interpret:
                    bn = min(_p2(cols), 1024)
                    bk = min(_p2(chunk), max(1, 65536 // bn))
                    bf = min(_p2(cols), max(1, 65536 // _p2(s.split)))
                else:
                    bn = min(_p2(cols), SPLIT_BLOCK_N)
                    bk = min(_p2(chunk), max(1, SPLIT_TILE // bn))
                    bf = min(_p2(cols), SPLIT_FINISH_BLOCK)
                warps = 4  # H200, split 8, 128 x 64: 4 warps 0.1089 ms, 8 warps 0.1099
                return LaunchConfig(-(-cols // bn) * s.split, (("BLOCK_K", bk), ("BLOCK_N", bn), ("BLOCK_F", bf)),
                                    warps)
            if interpret:
                bn = min(_p2(cols), 1024)
                bk = min(_p2(kk), max(1, 65536 // bn))
            else:
                # H200, bf16 [16384, 12288] column sum: 256 x 32 x 8 warps 88% of copy, 128 x 64 82%
                bn = min(_p2(cols), 64 if cols >= 64 * 264 else 32)
                bk = min(_p2(kk), max(1, 8192 // bn))
            warps = 4 if interpret or bk * bn <= 2048 else 8
            return LaunchConfig(-(-cols // bn), (("BLOCK_K", bk), ("BLOCK_N", bn)), warps)
        rows, kk = math.prod(L[:len(L) - k]), math.prod(L[len(L) - k:])
        if interpret:
            bk = min(_p2(kk), 4096)
            bm = min(_p2(rows), max(1, 65536 // bk))
        else:
            bk = min(_p2(kk), 4096 if itemsize <= 2 else 2048)
            bm = min(_p2(rows), max(1, 4096 // bk))
        warps = 4 if interpret or bm * bk <= 2048 else 8
        return LaunchConfig(-(-rows // bm), (("BLOCK_M", bm), ("BLOCK_K", bk)), warps)
    # transpose
    n = len(L)
    perm = _perm(spec, s.pivot)
    ea, eb = L[n - 1], L[perm[-1]]
    if interpret:
        ba, bb = min(_p2(ea), 256), min(_p2(eb), 256)
    else:
        t = 64 if itemsize <= 2 else 32  # H200 bf16: 64x64 88% of copy, 32x32 74%
        ba, bb = min(_p2(ea), t), min(_p2(eb), t)
    na, nb = -(-ea // ba), -(-eb // bb)
    batch = math.prod(e for i, e in enumerate(L) if i not in (n - 1, perm[-1]))
    return LaunchConfig(na * nb * batch, (("BLOCK_A", ba), ("BLOCK_B", bb), ("NA", na), ("NB", nb)), 4)


# ------------------------------------------------------------------ source generation

def _params(spec: KernelSpec) -> tuple[dict[str, str], dict[str, str], list[str]]:
    used: set[str] = set()

    def fresh(base):
        name, i = base, 1
        while name in used:
            name, i = f"{base}_{i}", i + 1
        used.add(name)
        return name

    ins = {n: fresh(f"in_{ident(n)}") for n in spec.inputs}
    outs = {n: fresh(f"out_{ident(n)}") for n in dict.fromkeys(spec.outputs)}
    return ins, outs, list(ins.values()) + list(outs.values())


def _emit_ops(w: Writer, spec: KernelSpec, s: Schedule, ops: list[KernelOp], phase: Phase, key: str,
              env: dict[str, str], outs: dict[str, str], reduce: Callable | None = None) -> None:
    """Emit ops (pointwise; reductions through `reduce`) in order, storing outputs as they appear."""
    for op in ops:
        frame = s.op_frame[op.out]

        def operand(v, frame=frame):
            return env[v] if v in env else w.load(v, frame, phase, key)

        if op.op in REDUCTIONS:
            env[op.out] = reduce(op, operand)
        elif op.op in TRANSPOSES:
            x = _args(op)["x"]
            env[op.out] = operand(x)  # a permute moves no data here: the output frame reorders the axes
        else:
            env[op.out] = w.pointwise(op, operand)
        if op.out in outs:
            w.store(op.out, env[op.out], s.out_frame[op.out], phase)


def _store_input_outputs(w: Writer, spec: KernelSpec, s: Schedule, phase: Phase, key: str, outs) -> None:
    for n in outs:
        if n in spec.inputs:
            w.store(n, w.load(n, s.base, phase, key), s.base, phase)


def _pid(big: bool) -> str:
    return "tl.program_id(0).to(tl.int64)" if big else "tl.program_id(0)"


class _PassWriter(Writer):
    """A Writer whose loads all evict last while `keep` is set (with hints on): the reduction passes of a
    looped persistent kernel read the row its final pass reads again."""

    keep = False

    def policy(self, shape: tuple[int, ...], loop: tuple[int, ...]) -> str:
        if self.hints and self.keep:
            return ', eviction_policy="evict_last"'
        return super().policy(shape, loop)


def _check_persistent_form(s: Schedule) -> None:
    if not (s.loop_block or s.pieces > 1):
        return
    if s.kind != "persistent":
        raise Unsupported(f"loop_block={s.loop_block}, pieces={s.pieces}: only the persistent scheduler loops "
                          f"over or splits its row; this is a {s.kind} schedule")
    if s.loop_block and s.pieces > 1:
        raise Unsupported(f"loop_block={s.loop_block} and pieces={s.pieces}: a persistent row either loops "
                          f"over chunks or is held in pieces; set one")
    if s.loop_block and (s.loop_block < 1 or s.loop_block & (s.loop_block - 1)):
        raise Unsupported(f"loop_block={s.loop_block}: Triton blocks are powers of two "
                          f"(persistent_loop_block(row) picks one)")


def _varying(spec: KernelSpec, s: Schedule) -> set[str]:
    """Tensors of a persistent spec that vary along the row (the reduced axes): inputs spanning it and
    the pointwise ops reading one. A reduction (keepdim) yields one value a row."""
    out = set()
    for n in spec.inputs:
        if any(a in s.red_axes for a in align_to(spec.shape(n), s.base, s.loop) if a is not None):
            out.add(n)
    for op in spec.ops:
        if op.op not in REDUCTIONS and any(v in out for v in _tensor_args(spec, op)):
            out.add(op.out)
    return out


def _pass_numbers(spec: KernelSpec, varying: set[str]) -> dict[str, int]:
    """For every tensor, the number of passes over the row before it exists: a reduction of a varying
    operand takes one pass more than its operand (layer_norm: the mean 1, the variance 2)."""
    depth = {n: 0 for n in spec.inputs}
    for op in spec.ops:
        d = max((depth[v] for v in _tensor_args(spec, op)), default=0)
        depth[op.out] = d + (op.op in REDUCTIONS and _args(op)["x"] in varying)
    return depth


def _needed_ops(spec: KernelSpec, targets: list[str], varying: set[str], have) -> list[KernelOp]:
    """The varying pointwise ops that targets read (themselves included), transitively, less those in have."""
    need = set(targets)
    for op in reversed(spec.ops):
        if op.out in need and op.out in varying and op.out not in have:
            need.update(_tensor_args(spec, op))
    return [op for op in spec.ops if op.out in need and op.out in varying and op.out not in have]


def _row_pieces(cols: int, most: int) -> list[tuple[int, int, bool]]:
    """(offset, size, masked) of up to `most` power-of-two blocks covering a row: the largest that fit,
    the last rounded up (and masked) when the row has more set bits than that.

    >>> _row_pieces(12288, 2), _row_pieces(13, 2)
    ([(0, 8192, False), (8192, 4096, False)], [(0, 8, False), (8, 8, True)])
    """
    out, off = [], 0
    while off < cols:
        left = cols - off
        size = 1 << (left.bit_length() - 1) if len(out) < most - 1 else _p2(left)
        out.append((off, size, size > left))
        off += size
    return out


def _emit_row_ops(w: Writer, spec: KernelSpec, s: Schedule, phase: Phase, env: dict[str, str],
                  varying: set[str], outs: dict[str, str]) -> None:
    """Emit, outside any pass, the ops yielding one value a row whose operands exist (the rsqrt of
    rms_norm's mean square); store the outputs among them once a row."""
    for op in spec.ops:
        if op.out in env or op.out in varying:
            continue
        args = _tensor_args(spec, op)
        if not all(v in env or (v in spec.inputs and v not in varying) for v in args):
            continue
        if op.op in REDUCTIONS and _args(op)["x"] in varying:
            continue  # a pass reduces it

        def operand(v):
            return env[v] if v in env else w.load(v, s.base, phase, "row")

        if op.op in REDUCTIONS:
            v = operand(_args(op)["x"])
            var = w.fresh(op.out)
            w.emit(f"{var} = {v}  # {op.op} over extent-1 axes")
            w.spans[var] = w.spans[v]
            env[op.out] = var
        else:
            env[op.out] = w.pointwise(op, operand)
        if op.out in outs:
            w.store(op.out, env[op.out], s.out_frame[op.out], phase)


def _emit_persistent_passes(w: _PassWriter, spec: KernelSpec, s: Schedule, outs: dict[str, str]) -> None:
    """A persistent kernel in passes over its row: pass p reduces the reductions whose operands read
    results of p - 1 passes, a final pass computes and stores the row's outputs; between passes, the
    ops on one value a row. Looped (s.loop_block): each pass a loop over chunks, recomputing from the
    inputs (reloaded, from L2) what it needs. In pieces (s.pieces): the row as a few power-of-two blocks
    of the source, each keeping its values from one pass to the next (one read of the row)."""
    L = s.loop
    n, k = len(L), len(s.red_axes)
    rows, cols = math.prod(L[:n - k]), math.prod(L[n - k:])
    w.emit("rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]")
    w.emit(f"rows_mask = rows < {rows}")
    g_rows = Group(tuple(range(n - k)), "rows", "rows_mask")
    row_phase = Phase(L, [g_rows])
    varying = _varying(spec, s)
    passes = _pass_numbers(spec, varying)
    reds = [op for op in spec.ops if op.op in REDUCTIONS and _args(op)["x"] in varying]
    env: dict[str, str] = {}
    row_outs = {m: p for m, p in outs.items() if m not in varying}
    for m in row_outs:
        if m in spec.inputs:
            w.store(m, w.load(m, s.base, row_phase, "row"), s.base, row_phase)
    _emit_row_ops(w, spec, s, row_phase, env, varying, row_outs)

    if s.loop_block:
        b = s.loop_block
        chunks = [("cols", None if cols % b == 0 else "cols_mask", b)]
    else:
        chunks = []
        for i, (off, size, masked) in enumerate(_row_pieces(cols, s.pieces)):
            w.emit(f"cols_{i} = {off} + tl.arange(0, {size})[None, :]")
            if masked:
                w.emit(f"cols_{i}_mask = cols_{i} < {cols}")
            chunks.append((f"cols_{i}", f"cols_{i}_mask" if masked else None, size))
    kept = [dict() for _ in chunks]  # pieces: each block's values, kept across passes

    def over_row(key: str, body) -> None:
        """body(phase, env, mask, i) once a chunk: in a loop (looped) or once a piece."""
        if s.loop_block:
            flat, mask, b = chunks[0]
            w.emit(f"for k0 in range(0, {cols}, {b}):")
            w.indent += 1
            w.emit(f"cols = k0 + tl.arange(0, {b})[None, :]")
            if mask:
                w.emit(f"cols_mask = cols < {cols}")
            body(Phase(L, [g_rows, Group(s.red_axes, flat, mask)]), dict(env), mask, key, 0)
            w.indent -= 1
            return
        for i, (flat, mask, _) in enumerate(chunks):
            kept[i].update(env)
            body(Phase(L, [g_rows, Group(s.red_axes, flat, mask)]), kept[i], mask, f"piece{i}", i)

    def value(name, phase, penv, key):
        return penv[name] if name in penv else w.load(name, s.base, phase, key)

    for p in range(1, max((passes[r.out] for r in reds), default=0) + 1):
        now = [r for r in reds if passes[r.out] == p]
        accs = {r.out: w.fresh(r.out + "_acc") for r in now}
        if s.loop_block:
            for r in now:
                w.emit(f"{accs[r.out]} = tl.full([BLOCK_M, {s.loop_block}], {literal(OPS[r.op].identity)}, "
                       f"tl.float32)")
        spans = {}

        def reduce_pass(phase, penv, mask, key, i):
            _emit_ops(w, spec, s, _needed_ops(spec, [_args(r)["x"] for r in now], varying, penv), phase, key,
                      penv, {})
            for r in now:
                x = _args(r)["x"]
                v = value(x, phase, penv, key)
                fill = literal(OPS[r.op].identity)
                part = f"tl.where({mask}, {v}, {fill})" if mask else v
                spans[r.out] = w.spans[v] & {g_rows}
                acc = accs[r.out]
                if s.loop_block:
                    w.emit(f"{acc} = " + OPS[r.op].template.format(a=acc, b=part))
                elif i == 0:
                    w.emit(f"{acc} = {w.reduce(r.op, part, 1, True, r.out + '_0', f'  # {r.op} of {x}')}")
                else:
                    partial = w.reduce(r.op, part, 1, True, f"{r.out}_{i}", f"  # {r.op} of {x}")
                    w.emit(f"{acc} = " + OPS[r.op].template.format(a=acc, b=partial))

        w.keep = True
        over_row(f"pass{p}", reduce_pass)
        w.keep = False
        for r in now:
            var = accs[r.out]
            if s.loop_block:
                var = w.reduce(r.op, accs[r.out], 1, True, r.out, f"  # {r.op} of {_args(r)['x']}")
            w.spans[var] = frozenset(spans[r.out])
            env[r.out] = var
            if r.out in row_outs:
                w.store(r.out, var, s.out_frame[r.out], row_phase)
        _emit_row_ops(w, spec, s, row_phase, env, varying, row_outs)

    stored = [m for m in outs if m in varying]

    def final_pass(phase, penv, mask, key, i):
        _emit_ops(w, spec, s, _needed_ops(spec, stored, varying, penv), phase, key, penv, {})
        for m in stored:
            w.store(m, value(m, phase, penv, key), s.out_frame.get(m, s.base), phase)

    if stored:
        over_row("final", final_pass)


def generate_source(spec: KernelSpec, s: Schedule | None = None) -> str:
    """The Triton source of spec's kernel: a module defining `kernel(inputs..., outputs..., BLOCKs)`."""
    s = s or schedule(spec)
    _check_persistent_form(s)
    ins, outs, params = _params(spec)
    w = _PassWriter(spec, ins, outs)
    w.hints = s.hints
    L = s.loop
    n = len(L)
    big = max([math.prod(L)] + [math.prod(sh) for _, sh, _ in spec.tensors]) > _BIG
    i64 = ".to(tl.int64)" if big else ""
    env: dict[str, str] = {}
    ops = list(spec.ops)
    finish = None
    w.emit(f"pid = {_pid(big)}")

    if s.kind == "pointwise":
        consts = ["BLOCK"]
        w.emit("offs = pid * BLOCK + tl.arange(0, BLOCK)")
        w.emit(f"offs_mask = offs < {math.prod(L)}")
        phase = Phase(L, [Group(s.base, "offs", "offs_mask")])
        _store_input_outputs(w, spec, s, phase, "main", outs)
        _emit_ops(w, spec, s, ops, phase, "main", env, outs)

    elif s.kind == "persistent" and (s.loop_block or s.pieces > 1):
        consts = ["BLOCK_M"]
        _emit_persistent_passes(w, spec, s, outs)

    elif s.kind == "persistent":
        consts = ["BLOCK_M", "BLOCK_N"]
        k = len(s.red_axes)
        rows, cols = math.prod(L[:n - k]), math.prod(L[n - k:])
        w.emit("rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]")
        w.emit(f"rows_mask = rows < {rows}")
        w.emit("cols = tl.arange(0, BLOCK_N)[None, :]")
        w.emit(f"cols_mask = cols < {cols}")
        g_rows, g_cols = Group(tuple(range(n - k)), "rows", "rows_mask"), Group(s.red_axes, "cols", "cols_mask")
        phase = Phase(L, [g_rows, g_cols])

        def reduce(op, operand):
            x = _args(op)["x"]
            v = operand(x)
            al = align_to(spec.shape(x), s.op_frame[op.out], L)
            if not any(a in s.red_axes for a in al if a is not None):
                var = w.fresh(op.out)
                w.emit(f"{var} = {v}  # {op.op} over extent-1 axes")
                w.spans[var] = w.spans[v]
                return var
            fill = literal(OPS[op.op].identity)
            var = w.reduce(op.op, f"tl.where(cols_mask, {v}, {fill})", 1, True, op.out, f"  # {op.op} of {x}")
            w.spans[var] = w.spans[v] - {g_cols}
            return var

        _store_input_outputs(w, spec, s, phase, "main", outs)
        _emit_ops(w, spec, s, ops, phase, "main", env, outs, reduce)

    elif s.kind == "reduction":
        r = s.pivot
        k = len(s.red_axes)
        fill = literal(OPS[r.op].identity)
        if s.outer:
            consts = ["BLOCK_K", "BLOCK_N"]
            kk, cols = math.prod(L[:k]), math.prod(L[k:])
            if s.split > 1:
                # programs [chunk of rows, column block], column blocks fastest; each sums its chunk
                w.emit(f"nb = ({cols} + BLOCK_N - 1) // BLOCK_N")
                w.emit(f"chunk = ({kk} + {s.split} * BLOCK_K - 1) // ({s.split} * BLOCK_K) * BLOCK_K")
                w.emit("pid_k = pid // nb")
                w.emit("offs_n = (pid % nb) * BLOCK_N + tl.arange(0, BLOCK_N)")
                loop = "range(pid_k * chunk, pid_k * chunk + chunk, BLOCK_K)"
            else:
                w.emit("offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)")
                loop = f"range(0, {kk}, BLOCK_K)"
            w.emit("cols = offs_n[None, :]")
            w.emit(f"cols_mask = cols < {cols}")
            w.emit(f"acc = tl.full([BLOCK_K, BLOCK_N], {fill}, tl.float32)")
            w.emit(f"for k0 in {loop}:")
            w.indent += 1
            w.emit(f"ks = (k0 + tl.arange(0, BLOCK_K)[:, None]){i64}")
            w.emit(f"ks_mask = ks < {kk}")
            pro = Phase(L, [Group(s.red_axes, "ks", "ks_mask"), Group(tuple(range(k, n)), "cols", "cols_mask")])
            epi_group = Group(tuple(range(k, n)), "offs_n", "offs_n_mask")
            red_axis = 0
        else:
            consts = ["BLOCK_M", "BLOCK_K"]
            rows, kk = math.prod(L[:n - k]), math.prod(L[n - k:])
            w.emit("offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)")
            w.emit("rows = offs_m[:, None]")
            w.emit(f"rows_mask = rows < {rows}")
            w.emit(f"acc = tl.full([BLOCK_M, BLOCK_K], {fill}, tl.float32)")
            w.emit(f"for k0 in range(0, {kk}, BLOCK_K):")
            w.indent += 1
            w.emit(f"ks = (k0 + tl.arange(0, BLOCK_K)[None, :]){i64}")
            w.emit(f"ks_mask = ks < {kk}")
            pro = Phase(L, [Group(tuple(range(n - k)), "rows", "rows_mask"), Group(s.red_axes, "ks", "ks_mask")])
            epi_group = Group(tuple(range(n - k)), "offs_m", "offs_m_mask")
            red_axis = 1
        before = [op for op in ops if op.out not in s.after and op is not r]
        _store_input_outputs(w, spec, s, pro, "pro", outs)
        _emit_ops(w, spec, s, before, pro, "pro", env, outs)
        x = _args(r)["x"]
        v = env[x] if x in env else w.load(x, s.op_frame[r.out], pro, "pro")
        w.emit("acc = " + OPS[r.op].template.format(a="acc", b=f"tl.where(ks_mask, {v}, {fill})"))
        w.indent -= 1
        epi = Phase(L, [epi_group])
        epi_ops = [op for op in ops if op.out in s.after]
        w.emit(f"{epi_group.mask} = {epi_group.flat} < {math.prod(L[a] for a in epi_group.axes)}")
        if s.outer and s.split > 1:
            # the chunk's partial result goes to the fp32 workspace [split, cols]; `finish` reduces it
            var = w.reduce(r.op, "acc", red_axis, False, r.out + "_part", f"  # {r.op} of {x}, this chunk")
            w.emit(f"tl.store(ws + pid_k * {cols} + offs_n, {var}, mask=offs_n_mask)")
            params = params + ["ws"]
            f = Writer(spec, ins, outs)
            f.hints = s.hints
            f.emit(f"pid = {_pid(big)}")
            f.emit("offs_n = pid * BLOCK_F + tl.arange(0, BLOCK_F)")
            f.emit(f"offs_n_mask = offs_n < {cols}")
            f.emit(f"parts = tl.arange(0, {_p2(s.split)})[:, None]")
            f.emit(f"v_parts = tl.load(ws + parts * {cols} + offs_n[None, :], "
                   f"mask=(parts < {s.split}) & offs_n_mask[None, :], other={fill})")
            var = f.reduce(r.op, "v_parts", 0, False, r.out, f"  # {r.op} of {x}: the chunks' partials")
            f.spans[var] = frozenset({epi_group})
            env = {r.out: var}
            if r.out in outs:
                f.store(r.out, var, s.out_frame[r.out], epi)
            _emit_ops(f, spec, s, epi_ops, epi, "epi", env, outs)
            finish = (f, "finish", ", ".join(params + ["BLOCK_F: tl.constexpr"]))
        else:
            var = w.reduce(r.op, "acc", red_axis, False, r.out, f"  # {r.op} of {x}")
            w.spans[var] = frozenset({epi_group})
            env[r.out] = var
            if r.out in outs:
                w.store(r.out, var, s.out_frame[r.out], epi)
            _emit_ops(w, spec, s, epi_ops, epi, "epi", env, outs)

    else:  # transpose
        consts = ["BLOCK_A", "BLOCK_B", "NA", "NB"]
        perm = _perm(spec, s.pivot)
        a, b = n - 1, perm[-1]
        batch = tuple(i for i in range(n) if i not in (a, b))
        w.emit("pid_a = pid % NA")
        w.emit("pid_b = (pid // NA) % NB")
        w.emit("bat = pid // (NA * NB)")
        w.emit("ia = (pid_a * BLOCK_A + tl.arange(0, BLOCK_A))[None, :]")
        w.emit(f"ia_mask = ia < {L[a]}")
        w.emit("ib = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B))[:, None]")
        w.emit(f"ib_mask = ib < {L[b]}")
        phase = Phase(L, [Group((b,), "ib", "ib_mask"), Group((a,), "ia", "ia_mask"), Group(batch, "bat", None)])
        _store_input_outputs(w, spec, s, phase, "main", outs)
        _emit_ops(w, spec, s, ops, phase, "main", env, outs)

    sig = ", ".join(params + [f"{c}: tl.constexpr" for c in consts])
    shapes = lambda names: ", ".join(f"{m} {list(spec.shape(m))} {str(spec.dtype(m)).replace('torch.', '')}"
                                     for m in names)
    header = (f"# egraph-did kernel {spec.key()} ({s.kind}), generated by lowering/schedulers.py\n"
              f"# inputs: {shapes(spec.inputs)}\n# outputs: {shapes(dict.fromkeys(spec.outputs))}\n"
              + "".join(f"# {op.out} = {op.op}({', '.join(f'{k}={v}' for k, v in op.args)})\n" for op in ops))
    return w.source(header, sig, finish)


# ------------------------------------------------------------------ compile, cache, launch

_KERNELS: dict[str, "Kernel"] = {}
_STATS = {"compiled": 0, "hits": 0}


def cache_dir() -> Path:
    """Where generated kernel sources live: $EGRAPH_DID_CACHE, else ~/.cache/egraph_did/kernels."""
    root = os.environ.get("EGRAPH_DID_CACHE")
    path = Path(root) if root else Path.home() / ".cache" / "egraph_did" / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_info() -> dict[str, int]:
    """In-process cache counters: kernels compiled (generated and imported) and cache hits."""
    return dict(_STATS, cached=len(_KERNELS))


def clear_cache() -> None:
    """Forget compiled kernels in this process (the source files stay on disk)."""
    _KERNELS.clear()
    _STATS.update(compiled=0, hits=0)


def _ensure_backend() -> None:
    # The jit decorator reads TRITON_INTERPRET when a kernel is defined: set it before importing one.
    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"


def _import(path: Path, key: str):
    name = f"egraph_did_kernel_{key}"
    mod_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    mod_spec.loader.exec_module(module)
    return module


class SplitLaunch:
    """The launch of a split outer reduction, called as a jitted kernel is (`fn[grid](*inputs, *outputs,
    BLOCK_K=, BLOCK_N=, BLOCK_F=, num_warps=)`): the partial pass over a fresh fp32 workspace
    [split, cols] on the grid given, then the finishing pass over column blocks of BLOCK_F."""

    def __init__(self, partial, finish, split: int, cols: int):
        self.partial, self.finish, self.split, self.cols = partial, finish, split, cols

    def __getitem__(self, grid):
        def launch(*args, BLOCK_K: int, BLOCK_N: int, BLOCK_F: int, num_warps: int = 4):
            ws = torch.empty((self.split, self.cols), dtype=torch.float32, device=args[-1].device)
            self.partial[grid](*args, ws, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, num_warps=num_warps)
            self.finish[(-(-self.cols // BLOCK_F),)](*args, ws, BLOCK_F=BLOCK_F, num_warps=4)
        return launch


class Kernel:
    """A compiled spec: call it with {input name: tensor} to get {output name: tensor}."""

    def __init__(self, spec: KernelSpec, s: Schedule, source: str, path: Path, fn):
        self.spec, self.schedule, self.source, self.path, self.fn = spec, s, source, path, fn
        self.kind = s.kind
        self._config: LaunchConfig | None = None

    def __repr__(self) -> str:
        return f"Kernel({self.kind}, {self.spec.key()}, {self.path})"

    def _check(self, inputs: dict[str, torch.Tensor]) -> torch.device:
        spec = self.spec
        missing = [n for n in spec.inputs if n not in inputs]
        if missing:
            raise PlanError(f"kernel {spec.key()} ({self.kind}): missing inputs {missing}; it takes "
                            f"{list(spec.inputs)}")
        for n in spec.inputs:
            t = inputs[n]
            if tuple(t.shape) != tuple(spec.shape(n)):
                raise ShapeError(f"kernel {spec.key()}: input {n} has shape {tuple(t.shape)} but the spec says "
                                 f"{spec.shape(n)}; compile a spec for this local shape")
            if t.dtype != spec.dtype(n):
                raise DtypeError(f"kernel {spec.key()}: input {n} is {t.dtype} but the spec says "
                                 f"{spec.dtype(n)}; cast it first")
        devices = {inputs[n].device for n in spec.inputs}
        if len(devices) > 1:
            raise PlanError(f"kernel {spec.key()}: inputs on several devices {sorted(map(str, devices))}")
        device = devices.pop() if devices else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type != "cuda" and not interpreting():
            raise PlanError(f"kernel {spec.key()}: inputs on {device} need a GPU, or TRITON_INTERPRET=1 set "
                            f"before the first kernel compiles")
        return device

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        spec = self.spec
        device = self._check(inputs)
        names = list(dict.fromkeys(spec.outputs))
        outs = {n: torch.empty(spec.shape(n), dtype=spec.dtype(n), device=device) for n in names}
        if any(math.prod(sh) == 0 for _, sh, _ in spec.tensors):
            if all(o.numel() == 0 for o in outs.values()):
                return outs
            # e.g. a sum over an empty axis: the output is not empty, torch knows its value
            ref = run_eager(spec, inputs)
            return {n: ref[n].contiguous() for n in names}
        if self._config is None:
            self._config = heuristics(spec, self.schedule)
        cfg = self._config
        args = [inputs[n].contiguous() for n in spec.inputs] + [outs[n] for n in names]
        self.fn[(cfg.grid,)](*args, **dict(cfg.constexprs), num_warps=cfg.num_warps)
        return outs


def compile_kernel(spec: KernelSpec) -> Kernel:
    """Generate, write (cache_dir()/<spec.key()>.py), import and wrap spec's kernel; once per content
    hash in this process. Raises Unsupported (a PlanError) naming the reason when no scheduler takes it.

    >>> from egraph_did.lowering.kernel_spec import KernelOp, KernelSpec
    >>> import torch
    >>> spec = KernelSpec(("x",), (KernelOp("y", "relu", (("x", "x"),)),), ("y",),
    ...                   (("x", (3, 5), torch.float32), ("y", (3, 5), torch.float32)))
    >>> x = torch.randn(3, 5)
    >>> torch.equal(compile_kernel(spec)({"x": x})["y"], torch.relu(x))
    True
    """
    key = spec.key()
    hit = _KERNELS.get(key)
    if hit is not None:
        _STATS["hits"] += 1
        return hit
    kernel = load_kernel(spec, schedule(spec))
    _KERNELS[key] = kernel
    _STATS["compiled"] += 1
    return kernel


def load_kernel(spec: KernelSpec, s: Schedule) -> Kernel:
    """A Kernel of spec under schedule s (compile_kernel's, or one with other source-level choices:
    split, hints), written to cache_dir() under its key and a hash of its source; not cached
    in this process."""
    _ensure_backend()
    source = generate_source(spec, s)
    key = spec.key()
    if s != schedule(spec):
        key += "_" + hashlib.sha256(source.encode()).hexdigest()[:8]
    path = cache_dir() / f"{key}.py"
    if not path.exists() or path.read_text() != source:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)  # atomic: concurrent ranks never import a half-written file
    module = _import(path, key)
    fn = module.kernel
    if s.outer and s.split > 1:
        k = len(s.red_axes)
        fn = SplitLaunch(module.kernel, module.finish, s.split, math.prod(s.loop[k:]))
    return Kernel(spec, s, source, path, fn)


# ------------------------------------------------------------------ eager reference

def run_eager(spec: KernelSpec, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Evaluate spec op by op with the op table's torch references: the fallback for specs classify
    rejects, and the oracle kernels are tested against.

    >>> from egraph_did.lowering.kernel_spec import KernelOp, KernelSpec
    >>> import torch
    >>> spec = KernelSpec(("x",), (KernelOp("y", "mul", (("a", "x"), ("b", 2.0))),), ("y",),
    ...                   (("x", (2,), torch.float32), ("y", (2,), torch.float32)))
    >>> run_eager(spec, {"x": torch.tensor([1.0, 3.0])})["y"]
    tensor([2., 6.])
    """
    missing = [n for n in spec.inputs if n not in inputs]
    if missing:
        raise PlanError(f"run_eager: missing inputs {missing}; the spec takes {list(spec.inputs)}")
    env = {n: inputs[n] for n in spec.inputs}
    for op in spec.ops:
        kwargs = {k: env[v] if isinstance(v, str) and v in env else v for k, v in op.args}
        env[op.out] = OPS[op.op].reference(**kwargs)
    return {n: env[n] for n in spec.outputs}


__all__ = ["classify", "compile_kernel", "run_eager", "schedule", "generate_source", "heuristics",
           "cache_dir", "cache_info", "clear_cache", "load_kernel", "outer_split", "Kernel", "LaunchConfig",
           "Schedule", "SplitLaunch", "Unsupported", "PERSISTENT_MAX_ROW", "persistent_form",
           "persistent_loop_block"]
