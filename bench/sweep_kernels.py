"""Launch-configuration sweep for the schedulers whose heuristics trail torch.compile (GPU only):
each variant overrides the kernel's LaunchConfig; torch.compile and a copy are timed in the same run.

    python bench/sweep_kernels.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from bench.kernel_speed import build, cases  # noqa: E402
from egraph_did.lowering.schedulers import LaunchConfig, compile_kernel, heuristics, schedule  # noqa: E402
from egraph_did.lowering.segment import spec_from_fusion  # noqa: E402


def bench(fn):
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def main() -> None:
    m, n, dtype = 16384, 12288, torch.bfloat16
    src = torch.randn(m, n, device="cuda", dtype=dtype)
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    print(f"copy {copy_ms:.3f} ms")
    table = cases(m, n, dtype)
    variants = {
        "rms_norm": [("BLOCK_M", bm, w) for bm in (1, 2) for w in (4, 8, 16)],
        "layer_norm": [("BLOCK_M", bm, w) for bm in (1, 2) for w in (8, 16)],
        "column sum": [(bk, bn, w) for bn in (32, 64, 128) for bk in (64, 128, 256) for w in (4, 8)],
    }
    for name, configs in variants.items():
        body, torch_fn, shapes = table[name]
        fd = build(body, shapes, dtype)
        spec = spec_from_fusion(fd.fusion)
        kernel = compile_kernel(spec)
        base = heuristics(spec, schedule(spec), interpret=False)
        inputs = {k: torch.randn(s, device="cuda", dtype=dtype) for k, s in shapes.items()}
        compiled = torch.compile(torch_fn)
        compiled(*inputs.values())
        comp = bench(lambda: compiled(*inputs.values()))
        print(f"{name}: torch.compile {comp:.4f} ms; heuristic {base}")
        results = []
        for cfg in configs:
            c = dict(base.constexprs)
            if name == "column sum":
                bk, bn, w = cfg
                c.update(BLOCK_K=bk, BLOCK_N=bn)
                grid = -(-n // bn)
            else:
                _, bm, w = cfg
                c.update(BLOCK_M=bm)
                grid = -(-m // bm)
            kernel._config = LaunchConfig(grid, tuple(c.items()), w)
            try:
                t = bench(lambda: kernel(inputs))
            except Exception as e:  # a config the compiler rejects (too many registers, ...)
                print(f"   {c} warps {w}: failed {type(e).__name__}")
                continue
            results.append((t, c, w))
        for t, c, w in sorted(results, key=lambda r: r[0])[:4]:
            print(f"   {t:.4f} ms  compile/ours {comp / t:.3f}  {c} warps {w}")


if __name__ == "__main__":
    main()
