"""Sweep of the source-level choices and launch configurations of the persistent and reduction
schedulers (issue 13, item 4), against torch.compile in the same run (GPU; --dry-run anywhere).

Each variant is a schedule (split, hints, loop_block, pieces: dataclasses.replace of the scheduler's
own) and a LaunchConfig; every variant's output is checked against torch in float64 before it is timed.
Times are medians of triton.testing.do_bench; torch.compile is timed before and after a case's variants
(its spread is the noise floor of the comparison).

Persistent cases (rms_norm, layer_norm, softmax, add+layer_norm) sweep the row held in one masked block
of next_pow2(row) (the default; all its configurations without --quick), in power-of-two pieces, and
looped over chunks of 1024/2048/4096 (x warps 4/8/16 x hints x BLOCK_M 1/2).

    python bench/sweep_reductions.py [--quick] [--cases rms_norm] [--inductor-dump DIR]
    python bench/sweep_reductions.py --dry-run --cases rms_norm   # anywhere: builds and checks every
                                                                  # variant on 3 rows, interpreted, untimed
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import time  # noqa: E402

import torch  # noqa: E402

if not torch.cuda.is_available():  # --dry-run: Triton's own jitted helpers (tl.sum) must be interpreted too
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton.testing import do_bench  # noqa: E402

from bench.kernel_speed import build, cases, rel_err  # noqa: E402
from egraph_did.lowering import schedulers as sch  # noqa: E402
from egraph_did.lowering.segment import spec_from_fusion  # noqa: E402


def bench(fn):
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def cdiv(a, b):
    return -(-a // b)


def persistent_variants(quick, n):
    """(label, schedule changes, constexprs, warps) of a persistent case with rows of n elements: the row
    in one block of next_pow2(n) (measured before: without --quick only), in two power-of-two pieces
    (12288 = 8192 + 4096, no masks), and looped over chunks (inductor's form)."""
    bn = sch._p2(n)
    out = [] if quick else [(f"one-shot BM {bm} w{w} hints {h}", dict(hints=h), {"BLOCK_M": bm, "BLOCK_N": bn}, w)
                            for bm in (1, 2) for w in (4, 8, 16) for h in (False, True)]
    out += [(f"pieces 2 BM {bm} w{w}", dict(pieces=2, hints=False), {"BLOCK_M": bm}, w)
            for bm in (1, 2) for w in (8, 16)]
    out += [(f"looped {b} BM {bm} w{w} hints {h}", dict(loop_block=b, hints=h), {"BLOCK_M": bm}, w)
            for b in (1024, 2048, 4096) for w in (4, 8, 16) for h in (False, True) for bm in (1, 2)]
    return out


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


def case_variants(spec, base, m, n, quick):
    """(label, schedule changes, constexprs, warps, grid) of one case, the scheduler's default last."""
    if base.kind == "persistent":
        variants = [(lbl, ch, c, w, cdiv(m, c["BLOCK_M"])) for lbl, ch, c, w in persistent_variants(quick, n)]
    elif base.kind == "reduction" and base.outer:
        variants = []
        for lbl, split, bn, bk, w, bf, hints in column_variants(quick):
            c = {"BLOCK_K": bk, "BLOCK_N": bn} | ({"BLOCK_F": bf} if split > 1 else {})
            variants.append((lbl, dict(split=split, hints=hints), c, w, cdiv(n, bn) * split))
    else:
        cfg = sch.heuristics(spec, base, False)
        variants = [(f"hints {h}", dict(hints=h), dict(cfg.constexprs), cfg.num_warps, cfg.grid)
                    for h in (False, True)]
    default = sch.heuristics(spec, base, False)
    form = f" loop_block {base.loop_block}" if base.loop_block else ""
    variants.append((f"DEFAULT split {base.split} hints {base.hints}{form}",
                     {}, dict(default.constexprs), default.num_warps, default.grid))
    return variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--inductor-dump", default=None)
    ap.add_argument("--cases", default="rms_norm,column sum,layer_norm,softmax,add+layer_norm,row sum")
    ap.add_argument("--dry-run", action="store_true",
                    help="build and check every variant (interpreted without a GPU), time nothing")
    ap.add_argument("--m", type=int, default=None, help="rows (default 16384; 3 with --dry-run)")
    ap.add_argument("--n", type=int, default=12288)
    args = ap.parse_args()
    start = time.perf_counter()
    gpu = torch.cuda.is_available()
    if not gpu and not args.dry_run:
        ap.error("timing needs a GPU; --dry-run builds and checks the variants here")
    dev = "cuda" if gpu else "cpu"
    m, n, dtype = args.m or (3 if args.dry_run else 16384), args.n, torch.bfloat16
    if not args.dry_run:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        src = torch.randn(m, n, device=dev, dtype=dtype)
        dst = torch.empty_like(src)
        print(f"{torch.cuda.get_device_name()} ({sms} SMs) | torch {torch.__version__} | "
              f"copy {bench(lambda: dst.copy_(src)):.4f} ms", flush=True)
        del src, dst
    table = cases(m, n, dtype)
    summary = []
    for name in args.cases.split(","):
        body, torch_fn, shapes = table[name]
        spec = spec_from_fusion(build(body, shapes, dtype).fusion)
        base = sch.schedule(spec)
        g = torch.Generator(device=dev).manual_seed(1)
        inputs = {k: torch.randn(s, device=dev, dtype=dtype, generator=g) for k, s in shapes.items()}
        ref = torch_fn(*[inputs[k].double() for k in shapes])
        ref = list(ref) if isinstance(ref, tuple) else [ref]
        comp = []
        if not args.dry_run:
            compiled = torch.compile(torch_fn)
            compiled(*inputs.values())
            comp.append(bench(lambda: compiled(*inputs.values())))
        rows = []
        for lbl, changes, consts, w, grid in case_variants(spec, base, m, n, args.quick):
            s = dataclasses.replace(base, **changes)
            try:
                kernel = sch.load_kernel(spec, s)
                kernel._config = sch.LaunchConfig(grid, tuple(consts.items()), w)
                out = kernel(inputs)
                err = max(rel_err(out[k], r) for k, r in zip(spec.outputs, ref))
                t = float("nan") if args.dry_run else bench(lambda: kernel(inputs))
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                print(f"  {lbl}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            flag = "" if err < 1e-2 else "  WRONG"
            if not flag:
                rows.append((t, lbl, err))
            print(f"  {name:<14} {t:.4f} ms  {lbl:<44} grid {grid:>6} {consts} w{w} err {err:.1e}{flag}", flush=True)
        print(f"{name}: {len(rows)} variants right, {time.perf_counter() - start:.0f} s so far", flush=True)
        if args.dry_run:
            continue
        comp.append(bench(lambda: compiled(*inputs.values())))
        c = min(comp)
        print(f"{name}: torch.compile {comp[0]:.4f} / {comp[1]:.4f} ms", flush=True)
        for t, lbl, err in sorted(rows)[:8]:
            summary.append(f"{name:<14} {t:.4f} ms  compile/ours {c / t:.3f}  {lbl}")
        dflt = [r for r in rows if r[1].startswith("DEFAULT")]
        if dflt:
            summary.append(f"{name:<14} {dflt[0][0]:.4f} ms  compile/ours {c / dflt[0][0]:.3f}  (default)")
        summary.append("")
        del inputs, ref
        torch.cuda.empty_cache()
    if args.inductor_dump and not args.dry_run:
        dump_inductor(args.inductor_dump)
    print("\n".join(summary))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
