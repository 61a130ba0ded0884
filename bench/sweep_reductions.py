"""Sweep of the source-level choices and launch configurations of the persistent and reduction
schedulers (issue 13, item 4), against torch.compile in the same run (GPU only).

Each variant is a schedule (split, hints: dataclasses.replace of the scheduler's own) and a
LaunchConfig; every variant's output is checked against torch in float64 before it is timed. Times are
medians of triton.testing.do_bench; torch.compile is timed before and after a case's variants (its
spread is the noise floor of the comparison).

    python bench/sweep_reductions.py [--quick] [--inductor-dump DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from bench.kernel_speed import build, cases, rel_err  # noqa: E402
from egraph_did.lowering import schedulers as sch  # noqa: E402
from egraph_did.lowering.segment import spec_from_fusion  # noqa: E402


def bench(fn):
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def cdiv(a, b):
    return -(-a // b)


def persistent_variants(m, sms):
    """(label, schedule changes, BLOCK_M, warps, grid or None for one row block a program)."""
    return [(f"BM {bm} w{w} hints {h}", dict(hints=h), bm, w, None)
            for bm in (1, 2) for w in (8, 16) for h in (False, True)] + \
        [("BM 1 w4 hints False", dict(hints=False), 1, 4, None)]


def column_variants(quick):
    """(label, split, BLOCK_N, BLOCK_K, warps, BLOCK_F, hints)."""
    out = [("old: 1 pass 256x32", 1, 32, 256, 8, 0, False), ("1 pass 256x32 hints", 1, 32, 256, 8, 0, True)]
    splits = (4, 8, 16) if quick else (4, 8, 16, 32)
    for split in splits:
        for bn in ((64, 128) if quick else (64, 128, 256)):
            for tile in (4096, 8192, 16384):
                for w in (4, 8):
                    if tile // bn < 8 or (quick and w == 4 and tile > 4096):
                        continue
                    out.append((f"split {split} {tile // bn}x{bn} w{w}", split, bn, tile // bn, w, 256, True))
    for split, bn, bk in ((8, 64, 128),):
        out.append((f"split {split} {bk}x{bn} w8 no hints", split, bn, bk, 8, 256, False))
        for bf in (128, 512, 1024):
            out.append((f"split {split} {bk}x{bn} w8 BLOCK_F {bf}", split, bn, bk, 8, bf, True))
    return out


def dump_inductor(out_dir):
    """Copy the Triton kernels torch.compile wrote in this run to out_dir/inductor_kernels.py."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or f"/tmp/torchinductor_{os.environ.get('USER', 'root')}"
    texts = []
    for path in sorted(glob.glob(f"{root}/**/*.py", recursive=True)):
        with open(path) as f:
            t = f.read()
        if "@triton.jit" in t and "def triton_" in t:
            texts.append(f"# ==== {path}\n{t}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "inductor_kernels.py"), "w") as f:
        f.write("\n\n".join(texts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--inductor-dump", default=None)
    ap.add_argument("--cases", default="rms_norm,column sum,layer_norm,softmax,add+layer_norm,row sum")
    args = ap.parse_args()
    m, n, dtype = 16384, 12288, torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    src = torch.randn(m, n, device="cuda", dtype=dtype)
    dst = torch.empty_like(src)
    print(f"{torch.cuda.get_device_name()} ({sms} SMs) | torch {torch.__version__} | copy {bench(lambda: dst.copy_(src)):.4f} ms",
          flush=True)
    del src, dst
    table = cases(m, n, dtype)
    summary = []
    for name in args.cases.split(","):
        body, torch_fn, shapes = table[name]
        spec = spec_from_fusion(build(body, shapes, dtype).fusion)
        base = sch.schedule(spec)
        g = torch.Generator(device="cuda").manual_seed(1)
        inputs = {k: torch.randn(s, device="cuda", dtype=dtype, generator=g) for k, s in shapes.items()}
        ref = torch_fn(*[inputs[k].double() for k in shapes])
        ref = list(ref) if isinstance(ref, tuple) else [ref]
        compiled = torch.compile(torch_fn)
        compiled(*inputs.values())
        comp = [bench(lambda: compiled(*inputs.values()))]
        rows = []
        if base.kind == "persistent":
            variants = [(lbl, ch, {"BLOCK_M": bm, "BLOCK_N": sch._p2(n)}, w, grid)
                        for lbl, ch, bm, w, grid in persistent_variants(m, sms)]
            variants = [(lbl, ch, c, w, grid if grid is not None else cdiv(m, c["BLOCK_M"]))
                        for lbl, ch, c, w, grid in variants]
        elif base.kind == "reduction" and base.outer:
            variants = []
            for lbl, split, bn, bk, w, bf, hints in column_variants(args.quick):
                c = {"BLOCK_K": bk, "BLOCK_N": bn} | ({"BLOCK_F": bf} if split > 1 else {})
                variants.append((lbl, dict(split=split, hints=hints), c, w, cdiv(n, bn) * split))
        else:
            cfg = sch.heuristics(spec, base, False)
            variants = [(f"hints {h}", dict(hints=h), dict(cfg.constexprs), cfg.num_warps, cfg.grid)
                        for h in (False, True)]
        default = sch.heuristics(spec, base, False)
        variants.append((f"DEFAULT split {base.split} hints {base.hints}",
                         {}, dict(default.constexprs), default.num_warps, default.grid))
        for lbl, changes, consts, w, grid in variants:
            s = dataclasses.replace(base, **changes)
            try:
                kernel = sch.load_kernel(spec, s)
                kernel._config = sch.LaunchConfig(grid, tuple(consts.items()), w)
                out = kernel(inputs)
                err = max(rel_err(out[k], r) for k, r in zip(spec.outputs, ref))
                t = bench(lambda: kernel(inputs))
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                print(f"  {lbl}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            flag = "" if err < 1e-2 else "  WRONG"
            rows.append((t, lbl, err))
            print(f"  {name:<14} {t:.4f} ms  {lbl:<44} grid {grid:>6} {consts} w{w} err {err:.1e}{flag}", flush=True)
        comp.append(bench(lambda: compiled(*inputs.values())))
        c = min(comp)
        print(f"{name}: torch.compile {comp[0]:.4f} / {comp[1]:.4f} ms", flush=True)
        for t, lbl, err in sorted(rows)[:6]:
            summary.append(f"{name:<14} {t:.4f} ms  compile/ours {c / t:.3f}  {lbl}")
        dflt = [r for r in rows if r[1].startswith("DEFAULT")]
        if dflt:
            summary.append(f"{name:<14} {dflt[0][0]:.4f} ms  compile/ours {c / dflt[0][0]:.3f}  (default)")
        summary.append("")
        del inputs, ref
        torch.cuda.empty_cache()
    if args.inductor_dump:
        dump_inductor(args.inductor_dump)
    print("\n".join(summary))


if __name__ == "__main__":
    main()
