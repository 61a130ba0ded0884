"""Optimizer scaling: build, encode, saturate (egglog), read back, extract and total seconds, and e-graph
sizes and saturation iterations, for 1, 8, 32 and 96 GPT-3-shaped layers (hidden 12288, 96 heads,
sequence 2048, bf16) on 8 H200s, tensor+sequence parallel pins (x and y sequence-sharded), greedy-DAG
extraction. template_s: declaring the sorts and compiling the rulesets, once per mesh shape and process
(the first row pays it; optimize_s includes it). The stage columns are those of the pass whose plan was
kept; optimize_s is the whole call: where bucket_pairs > 0, optimize ran a second pass offering those
pairs to the bucket_pair rewrite (optimize.py). Where optimize ran more than one pass (or with --extractor
exact), a line under the row gives each pass's extraction seconds (wall, and this process's CPU), method, proof ("dp", "lp": the cuts' LP
dual reached the start, "mip": HiGHS after reduced-cost fixing) and predicted ms (plan.stats["passes"]).

    .venv/bin/python bench/optimizer.py [--layers 1 8 32 96] [--mesh 8] [--rewrites sum_partials_first]
    .venv/bin/python bench/optimizer.py --training --layers 1 [--extractor exact] [--no-recompute] [--no-chain]

chain: the layers the plan was stamped on (optimize's default for 5 or more identical layers: a window of four
planned, its middle layer's plan stamped, egraph_did/chain.py; the stage columns are then the window's), "-" for
a whole-graph plan (--no-chain, or fewer layers). optimize_cpu_s: this process's CPU seconds for optimize.

--rewrites: the program rewrites optimize may apply, by name (default: all of them; `--rewrites` alone: none).
--training: the whole training step instead (models.gpt_training_step: forward, MSE loss, backward and AdamW
of every weight; x and target sequence-sharded, weights, moments and their next values free): optimize then
plans it as a loop (loops_tried: the extra passes that tie x to next.x), so optimize_s covers those passes;
the stage columns are the kept pass's. The backward reads the forward through saved markers (ed.training_step's
default, recompute=None); without a memory bound the plan keeps every value. --no-recompute: without markers
(recompute=False).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

# this tree's egraph_did, not whichever is installed (a copy of the tree measured beside main imported main's)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import egraph_did as ed
from egraph_did import models
from egraph_did.layout import Layout, S
from egraph_did.pins import apply_layout


def run(layers: int, ndev: int, seq: int, hidden: int, heads: int, extractor: str, rewrites=None,
        training: bool = False, recompute: bool | None = None, chain: bool = True) -> dict:
    mesh = ed.DeviceMesh.arange(ndev)
    t0 = time.perf_counter()
    if training:
        fd = models.gpt_training_step(1, seq, hidden, heads, torch.bfloat16, layers=layers, recompute=recompute)
        sharded = ("x", "target")
    else:
        fd = models.gpt_layer(1, seq, hidden, heads, torch.bfloat16, layers=layers)
        sharded = ("x", "y")
    for name in sharded:
        apply_layout(fd[name], Layout((S(1),)), mesh)
    t1 = time.perf_counter()
    c1 = time.process_time()
    plan = ed.optimize(fd, mesh, extractor=extractor, rewrites=rewrites, chain=chain)
    t2, c2 = time.perf_counter(), time.process_time()
    st = plan.stats
    kinds = {}
    for c in plan.collectives:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    return {"layers": layers, "exprs": len(fd.fusion.exprs), "define_s": t1 - t0, "build_s": st["build_s"],
            "template_s": st["template_s"], "encode_s": st["encode_s"], "iterations": st["iterations"], "saturate_s": st["saturate_s"], "serialize_s": st["serialize_s"],
            "extract_s": st["extract_s"], "optimize_s": t2 - t1, "optimize_cpu_s": c2 - c1,
            "chain": st.get("chain", {}).get("layers", "-"), "facts": st["facts"], "classes": st["classes"],
            "nodes": st["nodes"], "bucket_pairs": st.get("bucket_pairs_offered", 0), "collectives": kinds,
            "loops_tried": st.get("loops_tried", 0), "passes": st.get("passes", []),
            "predicted_ms": plan.predicted_time * 1e3}


def _pass_text(q: dict) -> str:
    """One pass's extraction: seconds (wall, CPU), method, how it was proven (exact) and the plan's predicted ms.

    >>> _pass_text({"extract_s": 1.25, "extract_cpu_s": 1.0, "method": "exact", "proof": "mip", "cost": 7.16e-3})
    '1.250 s (CPU 1.000 s) exact (mip) 7.160 ms'
    """
    how = f" ({q['proof']})" if q.get("proof") else ""
    return f"{q['extract_s']:.3f} s (CPU {q['extract_cpu_s']:.3f} s) {q['method']}{how} {q['cost'] * 1e3:.3f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 8, 32, 96])
    ap.add_argument("--mesh", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=12288)
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--extractor", default="greedy", choices=["greedy", "exact"])
    ap.add_argument("--rewrites", nargs="*", default=None, help="program rewrites by name (default: all)")
    ap.add_argument("--training", action="store_true", help="the training step (forward, backward, AdamW)")
    ap.add_argument("--no-recompute", dest="recompute", action="store_false", default=None,
                    help="--training without saved markers (recompute=False)")
    ap.add_argument("--no-chain", dest="chain", action="store_false",
                    help="plan the whole graph (optimize(chain=False)), not a window of four layers stamped")
    args = ap.parse_args()
    cols = ["layers", "exprs", "facts", "iterations", "classes", "nodes", "build_s", "template_s", "encode_s",
            "saturate_s", "serialize_s", "extract_s", "bucket_pairs", "loops_tried", "chain", "optimize_s",
            "optimize_cpu_s", "predicted_ms"]
    what = "GPT training steps (AdamW), x/target" if args.training else "GPT layers, x/y"
    print(f"{what} sequence-sharded, seq {args.seq}, hidden {args.hidden}, {args.heads} heads, bf16, {args.mesh} ranks, "
          f"{args.extractor} extraction, rewrites "
          f"{'all' if args.rewrites is None else ', '.join(args.rewrites) or 'none'}"
          f"{', no saved markers (recompute=False)' if args.training and args.recompute is False else ''}")
    print(" | ".join(f"{c:>11}" for c in cols) + " | collectives")
    for n in args.layers:
        r = run(n, args.mesh, args.seq, args.hidden, args.heads, args.extractor, args.rewrites, args.training,
                args.recompute, args.chain)
        cells = [f"{r[c]:>11.3f}" if isinstance(r[c], float) else f"{r[c]:>11}" for c in cols]
        print(" | ".join(cells) + " | " + ", ".join(f"{v} {k}" for k, v in sorted(r["collectives"].items())),
              flush=True)
        if len(r["passes"]) > 1 or args.extractor == "exact":
            print("    extraction by pass: " + "; ".join(_pass_text(q) for q in r["passes"]), flush=True)


if __name__ == "__main__":
    main()
