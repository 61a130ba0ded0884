"""Triton schedulers against torch eager and torch.compile, at sizes that fill an H200.

Every case is written once as a fusion; our kernel is what lowering/ generates for it (the scheduler
named in the table). Times are medians of triton.testing.do_bench (CUDA events); bandwidth counts each
input read once and each output written once; "copy" is a device-to-device copy of one bf16 [M, N]
tensor measured in the same run (read + write), the ceiling for memory-bound kernels.

    python bench/kernel_speed.py                 # on the GPU: bf16 [16384, 12288]
    python bench/kernel_speed.py --small         # anywhere: tiny shapes, correctness only (TRITON_INTERPRET on CPU)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import egraph_did as ed  # noqa: E402
from egraph_did.lowering.schedulers import classify, compile_kernel  # noqa: E402
from egraph_did.lowering.segment import spec_from_fusion  # noqa: E402


def cases(m: int, n: int, dtype):
    """name -> (build(fd, define) returning outputs, torch function, input shapes)."""
    mn, row = (m, n), (n,)
    return {
        "pointwise gelu(x)*b+a": (lambda o, t: [o.add(o.mul(o.gelu(t["x"]), t["b"]), t["a"])],
                                  lambda x, a, b: F.gelu(x) * b + a, {"x": mn, "a": mn, "b": mn}),
        "layer_norm": (lambda o, t: [o.layer_norm(t["x"], weight=t["w"], bias=t["b"])],
                       lambda x, w, b: F.layer_norm(x, (n,), w, b), {"x": mn, "w": row, "b": row}),
        "rms_norm": (lambda o, t: [o.rms_norm(t["x"], weight=t["w"])],
                     lambda x, w: F.rms_norm(x, (n,), w, 1e-6), {"x": mn, "w": row}),
        "softmax": (lambda o, t: [o.softmax(t["x"], -1)], lambda x: torch.softmax(x, -1), {"x": mn}),
        "add+layer_norm": (lambda o, t: (lambda h: [h, o.layer_norm(h, weight=t["w"], bias=t["b"])])(
                               o.add(t["x"], t["r"])),
                           lambda x, r, w, b: (lambda h: (h, F.layer_norm(h, (n,), w, b)))(x + r),
                           {"x": mn, "r": mn, "w": row, "b": row}),
        "row sum": (lambda o, t: [o.sum(t["x"], 1)], lambda x: x.sum(1), {"x": mn}),
        "column sum": (lambda o, t: [o.sum(t["x"], 0)], lambda x: x.sum(0), {"x": mn}),
        "transpose": (lambda o, t: [o.transpose(o.mul(t["x"], 1.0), 0, 1)],
                      lambda x: (x * 1.0).t().contiguous(), {"x": mn}),
    }


def build(body, shapes, dtype):
    with ed.FusionDefinition() as fd:
        t = {k: fd.define_tensor(s, dtype, name=k) for k, s in shapes.items()}
        for i, out in enumerate(body(fd.ops, t)):
            fd.add_output(out, name=f"y{i}")
    return fd


def rel_err(got, ref):
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--n", type=int, default=12288)
    ap.add_argument("--small", action="store_true", help="tiny shapes, correctness only")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    m, n = (64, 96) if args.small else (args.m, args.n)
    dtype = torch.bfloat16
    dev = "cuda" if gpu else "cpu"
    timing = gpu and not args.small
    if timing:
        from triton.testing import do_bench

        def bench(fn):
            return do_bench(fn, warmup=50, rep=300, return_mode="median")  # ms
        src = torch.randn(m, n, device=dev, dtype=dtype)
        dst = torch.empty_like(src)
        copy_ms = bench(lambda: dst.copy_(src))
        copy_bw = 2 * src.numel() * src.element_size() / copy_ms / 1e6  # GB/s (bytes per ms / 1e6)
        print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 [{m}, {n}] | "
              f"copy {copy_ms:.3f} ms = {copy_bw:.0f} GB/s")
    header = (f"{'case':<24}{'scheduler':<12}{'rel err':>9}{'ours ms':>9}{'eager ms':>9}{'compile ms':>11}"
              f"{'ours GB/s':>10}{'% copy':>8}{'compile/ours':>13}")
    rows = [header, "-" * len(header)]
    for name, (body, torch_fn, shapes) in cases(m, n, dtype).items():
        fd = build(body, shapes, dtype)
        spec = spec_from_fusion(fd.fusion)
        sched = classify(spec)
        kernel = compile_kernel(spec)
        g = torch.Generator(device=dev).manual_seed(0)
        inputs = {k: torch.randn(s, device=dev, dtype=dtype, generator=g) for k, s in shapes.items()}
        ours = lambda: kernel(inputs)  # noqa: E731
        out = [ours()[k] for k in spec.outputs]
        ref = torch_fn(*[inputs[k].double() for k in shapes])
        ref = list(ref) if isinstance(ref, tuple) else [ref]
        err = max(rel_err(o, r) for o, r in zip(out, ref))
        cells = f"{name:<24}{sched or 'eager':<12}{err:>9.1e}"
        if timing:
            moved = sum(t.numel() * t.element_size() for t in inputs.values()) + \
                sum(o.numel() * o.element_size() for o in out)
            ours_ms = bench(ours)
            eager_ms = bench(lambda: torch_fn(*inputs.values()))
            comp_ms = float("nan")
            if not args.no_compile:
                compiled = torch.compile(torch_fn)
                compiled(*inputs.values())
                comp_ms = bench(lambda: compiled(*inputs.values()))
            bw = moved / ours_ms / 1e6
            cells += (f"{ours_ms:>9.3f}{eager_ms:>9.3f}{comp_ms:>11.3f}{bw:>10.0f}{100 * bw / copy_bw:>7.0f}%"
                      f"{comp_ms / ours_ms:>13.2f}")
        rows.append(cells)
        print(cells, flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
