"""sdpa_lse and sdpa_backward on a GPU: the fused kernels (flash for 16-bit, memory-efficient for float32)
against the math from the logsumexp in float64, and their time and peak memory against the math's.

    python bench/attention_backward.py            # on a GPU; on a CPU both sides run the math
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

try:
    import egglog  # noqa: F401
except ImportError:  # a GPU machine without egglog: the op table alone, without the package's optimizer
    import types
    pkg = types.ModuleType("egraph_did")
    pkg.__path__ = [str(ROOT / "egraph_did")]
    sys.modules["egraph_did"] = pkg

from egraph_did.ops import OPS, _fused_backward, _fused_forward, _sdpa_backward_math, attention  # noqa: E402


def check(shape, dtype, causal, dv=None, scale=None):
    """max |fused - float64 math| over out, lse, dq, dk, dv, relative to the largest value."""
    b, h, s, d = shape
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k = (torch.randn(shape, generator=g).to(dev, dtype) for _ in range(2))
    v = torch.randn((b, h, s, dv or d), generator=g).to(dev, dtype)
    go = torch.randn((b, h, s, dv or d), generator=g).to(dev, dtype)
    out, lse = OPS["sdpa_lse"].reference(q, k, v, is_causal=causal, scale=scale)
    grads = OPS["sdpa_backward"].reference(go, q, k, v, out, lse, is_causal=causal, scale=scale)
    d64 = [t.double() for t in (go, q, k, v)]
    want_out = attention(*d64[1:], is_causal=causal, scale=scale)
    s64 = torch.matmul(d64[1], d64[2].transpose(-2, -1)) * (scale or d ** -0.5)
    if causal:
        s64 = s64.masked_fill(torch.ones(s, s, dtype=torch.bool, device=dev).triu(1), float("-inf"))
    want_lse = torch.logsumexp(s64, -1)
    want = _sdpa_backward_math(*d64, want_out, want_lse, causal, scale)
    errs = {"fused": f"{_fused_forward(q, k, v, causal, scale) is not None:d}"
                     f"{_fused_backward(go, q, k, v, out, lse, causal, scale) is not None:d}"}
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + tuple(grads), (want_out, want_lse) + want):
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        errs[name] = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    return errs


def timed(fn, reps=10):
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2 ** 20 if torch.cuda.is_available() else float("nan")
    return (time.perf_counter() - t0) / reps * 1e3, peak


def speed(shape, dtype, causal):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, go = (torch.randn(shape, device=dev, dtype=dtype) for _ in range(4))
    out, lse = OPS["sdpa_lse"].reference(q, k, v, is_causal=causal)
    fused = timed(lambda: OPS["sdpa_backward"].reference(go, q, k, v, out, lse, is_causal=causal))
    math_ = timed(lambda: _sdpa_backward_math(go, q, k, v, out, lse, causal))
    return fused, math_


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape, dv in (((2, 4, 128, 64), None), ((1, 2, 67, 40), None), ((1, 2, 96, 64), 32)):
            for causal in (False, True):
                errs = check(shape, dtype, causal, dv)
                print(f"{str(dtype):15} {str(shape):17} dv={dv or shape[-1]:<3} causal={causal!s:5} "
                      + " ".join(f"{n} {e}" if isinstance(e, str) else f"{n} {e:.1e}" for n, e in errs.items()))
    for dtype in (torch.bfloat16, torch.float32):
        (tf, mf), (tm, mm) = speed((1, 16, 4096, 64), dtype, True)
        print(f"backward [1, 16, 4096, 64] {dtype} causal: fused {tf:.3f} ms peak {mf:.0f} MiB; math {tm:.3f} ms "
              f"peak {mm:.0f} MiB")
