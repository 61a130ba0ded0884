"""grouped_mm's local kernel on a GPU: one torch._grouped_mm call against the expert-by-expert loop, forward and
weight gradient, for Mixtral-8x7B-shaped experts (d 4096, f 14336, 8 experts, top-2 routing) at a few token
counts, skewed routing. What ops runs on a GPU follows it: the weight gradient as one call, the forward as the
loop (bench/results_grouped_mm_h100.txt).

    python bench/grouped_mm.py          # a GPU: triton.testing.do_bench medians, us, and the ratio loop / one call
    python bench/grouped_mm.py --small  # anywhere: tiny float32 shapes, numerics only
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from egraph_did import ops  # noqa: E402


def loop(x, w, offsets):
    """The expert-by-expert loop (ops._grouped_mm_block where one call does not serve)."""
    out, start = torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device), 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def loop_wgrad(x, g, offsets):
    out, start = torch.zeros(offsets.shape[0], x.shape[1], g.shape[1], dtype=x.dtype, device=x.device), 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[e] = x[start:end].T @ g[start:end]
        start = end
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    d, f, experts = (4096, 14336, 8) if cuda else (64, 128, 8)
    share = torch.tensor([0.30, 0.05, 0.20, 0.10, 0.15, 0.02, 0.08, 0.10])  # skewed routing
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'} | torch {torch.__version__} | d {d} f {f} experts {experts}")
    for tokens in ((1024, 4096, 16384) if cuda else (64,)):
        rows = 2 * tokens
        counts = (share * rows).long()
        counts[0] += rows - counts.sum()
        offsets = torch.cumsum(counts, 0).to(dev)
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(rows, d, device=dev, generator=g).to(dt)
        w = (torch.randn(experts, d, f, device=dev, generator=g) / d ** 0.5).to(dt)
        dy = torch.randn(rows, f, device=dev, generator=g).to(dt)
        ends = offsets.to(torch.int32)
        pairs = {"forward": (lambda: torch._grouped_mm(x, w, offs=ends), lambda: loop(x, w, offsets)),
                 "weight grad": (lambda: ops._grouped_wgrad_block(x, dy, offsets), lambda: loop_wgrad(x, dy, offsets))}
        for name, (one, each) in pairs.items():
            a, b = one().float(), each().float()
            err = ((a - b).abs().max() / b.abs().max()).item()
            assert err < 2e-2, f"{name}: one call differs from the loop by {err:.2e} of the largest output"
            if cuda:
                import triton.testing
                t1 = triton.testing.do_bench(one, warmup=10, rep=200, return_mode="median") * 1e3
                t2 = triton.testing.do_bench(each, warmup=10, rep=200, return_mode="median") * 1e3
                print(f"{tokens:6d} tokens  {name:<12} one call {t1:9.1f} us  loop {t2:9.1f} us  loop/one {t2 / t1:5.2f}x")
    if not cuda:
        print("numerics: one call equals the expert-by-expert loop")


if __name__ == "__main__":
    main()
