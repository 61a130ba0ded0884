"""The TP+SP attention-output GEMM on one GPU, and ways to run it: issue 30's 11 us.

The 8-way TP+SP plan of a GPT-3 layer (bench/plans/gpt3_tpsp_8.json) moves attention's output from heads to
sequence with one all-to-all and then runs wo whole on 256 rows: x [256, 12288] x wo [12288, 12288]^T, where
torch.compile of Megatron's shards runs the row-parallel wo on 2048 rows, K = 1536, then reduce-scatters. The
all-to-all delivers the rows as [source rank, 256, 1536] blocks, so the plan permutes them to [256, 8 x 1536]
(a copy) before the GEMM. Same FLOPs; this bench times each way to do that work, side by side on one card:

    python bench/gemm_shapes.py            # a GPU (bf16, GPT-3 shapes)
    python bench/gemm_shapes.py --small    # anywhere Triton runs: tiny shapes, checks numerics only

Rows: cuBLAS as the plan runs it (permute copy + F.linear), the GEMM alone in three cuBLAS forms, Megatron's
row-parallel GEMM (compile's work), and a Triton GEMM that reads the all-to-all's blocks in place (the permute
folded into its loads), autotuned over a few tile shapes. Times: triton.testing.do_bench medians (us).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

CONFIGS = [
    triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP": 8}, num_stages=s, num_warps=w)
    for bm, bn, bk, s, w in [
        (128, 256, 64, 3, 8), (128, 128, 64, 4, 4), (128, 128, 64, 4, 8), (64, 256, 64, 4, 4),
        (128, 256, 64, 4, 8), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (256, 128, 64, 3, 8),
    ]
]


@triton.jit
def gemm_blocks_kernel(a_ptr, w_ptr, out_ptr, M, N, K, C, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       GROUP: tl.constexpr):
    """out[m, n] = sum over k of A[m, k] w[n, k] where A[m, j C + c] = a[j, m, c] (a: [K / C, M, C]); C = K reads
    a plain row-major A. BK must divide C, so one K tile lies in one block."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    width = GROUP * grid_n
    first_m = (pid // width) * GROUP
    size_m = tl.minimum(grid_m - first_m, GROUP)
    pm = first_m + (pid % width) % size_m
    pn = (pid % width) // size_m
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        j = k0 // C
        c0 = k0 - j * C
        a = tl.load(a_ptr + j * M * C + rm[:, None] * C + (c0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(w_ptr + rn[None, :] * K + (k0 + rk)[:, None], mask=rn[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


gemm_blocks_tuned = triton.autotune(configs=CONFIGS, key=["M", "N", "K", "C"])(gemm_blocks_kernel)


def gemm_blocks(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T where x = a.permute(1, 0, 2).reshape(M, K), without the copy.

    >>> a = torch.randn(2, 4, 64); w = torch.randn(8, 128)
    >>> torch.allclose(gemm_blocks(a, w), a.permute(1, 0, 2).reshape(4, 128) @ w.T, atol=1e-3)
    True
    """
    J, M, C = a.shape
    N, K = w.shape
    assert K == J * C and a.is_contiguous() and w.is_contiguous()
    out = torch.empty(M, N, device=a.device, dtype=a.dtype)
    grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)  # noqa: E731
    if a.is_cuda:
        gemm_blocks_tuned[grid](a, w, out, M, N, K, C)
    else:  # the CPU interpreter has no timer to autotune with
        gemm_blocks_kernel[grid](a, w, out, M, N, K, C, BM=32, BN=32, BK=32, GROUP=8)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny float32 shapes, numerics only")
    ap.add_argument("--compile-autotune", action="store_true", help="also torch.compile(mode='max-autotune') of the mm")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    ranks, seq, hidden = (8, 2048, 12288) if cuda else (2, 64, 128)
    rows, cols = seq // ranks, hidden // ranks
    g = torch.Generator(device=dev).manual_seed(0)
    recv = torch.randn(ranks, rows, cols, device=dev, dtype=dtype, generator=g)   # the all-to-all's output
    wo = torch.randn(hidden, hidden, device=dev, dtype=dtype, generator=g) / hidden ** 0.5
    wo_t = wo.t().contiguous()
    x_tp = torch.randn(seq, cols, device=dev, dtype=dtype, generator=g)          # Megatron's local attention out
    wo_tp = wo[:, :cols].contiguous()

    def plan_now():
        return F.linear(recv.permute(1, 0, 2).reshape(rows, hidden), wo)

    x = recv.permute(1, 0, 2).reshape(rows, hidden).contiguous()
    ref = (x.double() @ wo.double().T)
    variants = {
        "permute copy + F.linear (the plan today)": plan_now,
        "permute copy alone": lambda: recv.permute(1, 0, 2).contiguous(),
        "F.linear(x, wo)": lambda: F.linear(x, wo),
        "torch.mm(wo, x.T).T (transposed problem)": lambda: torch.mm(wo, x.t()).t(),
        "x @ wo_t (weight pre-transposed)": lambda: x @ wo_t,
        "Triton, blocks read in place": lambda: gemm_blocks(recv, wo),
        "Triton, x contiguous": lambda: gemm_blocks(x.unsqueeze(0), wo),
        "Megatron row-parallel [2048,1536]x[12288,1536]^T (compile's)": lambda: F.linear(x_tp, wo_tp),
    }
    if args.compile_autotune and cuda:
        mm = torch.compile(lambda x_, w_: F.linear(x_, w_), mode="max-autotune-no-cudagraphs")
        variants["torch.compile max-autotune F.linear(x, wo)"] = lambda: mm(x, wo)
        fused = torch.compile(lambda r_, w_: F.linear(r_.permute(1, 0, 2).reshape(rows, hidden), w_),
                              mode="max-autotune-no-cudagraphs")
        variants["torch.compile max-autotune permute + F.linear"] = lambda: fused(recv, wo)
    tol = 2e-2 if cuda else 1e-4
    for name, fn in variants.items():
        out = fn()
        if out.shape == ref.shape:
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < tol, f"{name}: max error {err:.2e} over the float64 GEMM (tolerance {tol})"
    if not cuda:
        print("numerics: every variant within 1e-4 of the float64 GEMM")
        return
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    print(f"x [{rows}, {hidden}] x wo [{hidden}, {hidden}]^T, bf16; all-to-all blocks [{ranks}, {rows}, {cols}]")
    base = None
    for name, fn in variants.items():
        us = triton.testing.do_bench(fn, warmup=50, rep=400, return_mode="median") * 1e3
        base = base or us
        tflops = 2 * seq * hidden * cols / (us * 1e-6) / 1e12 if "copy alone" not in name else float("nan")
        print(f"{us:8.1f} us  {base / us:5.2f}x  {tflops:6.0f} TF/s  {name}")
    best = gemm_blocks_tuned.best_config
    print(f"Triton's chosen tile: {best}")


if __name__ == "__main__":
    main()
