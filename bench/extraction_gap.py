"""Plan quality of greedy-DAG extraction against the exact 0/1 program on random fusions.

Each case is a random fusion (linear, matmul, pointwise, residual adds, reductions, softmax, norms,
transposes) on a 1-, 2- or 3-D mesh with random pins on the input (replicated, sharded on any axis,
or partial on one mesh axis) and sometimes the output; seeded, so a run is reproducible. For each,
`optimize(..., extractor="exact")` runs greedy and the 0/1 program on the same graph; the gap is
greedy's cost over the proven optimum, minus one. Prints the gap distribution (fraction equal,
within 1%, median / p90 / max gap), the exact solve times, and the unproven cases.

    .venv/bin/python bench/extraction_gap.py --cases 200 --seed 0 [--time-limit 60] [--show 5]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import egraph_did as ed
from egraph_did.layout import Layout, P, R, S
from egraph_did.pins import apply_layout

EXTENTS = (64, 512, 4096)
MESHES = ((2,), (4,), (2, 2), (2, 4), (2, 2, 2))
OPS = ("linear", "gelu", "relu", "add", "mul", "sum", "matmul", "softmax", "layer_norm", "rms_norm",
       "transpose")


def random_fusion(rng: random.Random):
    """One random case: (fusion, mesh, a one-line description)."""
    shape = rng.choice(MESHES)
    mesh = ed.DeviceMesh(torch.arange(int(torch.tensor(shape).prod())).reshape(shape))
    m, k = rng.choice(EXTENTS), rng.choice(EXTENTS)
    ops = []
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((m, k), torch.bfloat16, name="x")
        live = [x]
        for i in range(rng.randint(2, 7)):
            t = rng.choice(live)
            op = rng.choice(OPS)
            two_d = len(t.shape) == 2
            if op == "linear":
                w = fd.define_tensor((rng.choice(EXTENTS), t.shape[-1]), torch.bfloat16, name=f"w{i}")
                out = fd.ops.linear(t, w)
            elif op in ("gelu", "relu"):
                out = getattr(fd.ops, op)(t)
            elif op in ("add", "mul"):
                out = getattr(fd.ops, op)(t, rng.choice([u for u in live if u.shape == t.shape]))
            elif op == "sum" and two_d:
                out = fd.ops.sum(t, rng.choice((0, 1)), keepdim=True)
            elif op == "matmul" and two_d:
                b = fd.define_tensor((t.shape[1], rng.choice(EXTENTS)), torch.bfloat16, name=f"b{i}")
                out = fd.ops.matmul(t, b)
            elif op == "softmax" and two_d:
                out = fd.ops.softmax(t, 1)
            elif op in ("layer_norm", "rms_norm") and two_d:
                out = getattr(fd.ops, op)(t, (t.shape[1],))
            elif op == "transpose" and two_d:
                out = fd.ops.transpose(t, 0, 1)
            else:
                continue
            ops.append(op)
            live.append(out)
        fd.add_output(live[-1], name="y")
    choices = [R, S(0), S(1)]
    lay = Layout(tuple(rng.choice(choices) for _ in shape))
    if rng.random() < 0.2:  # partial on one mesh axis
        lay = lay.replace(rng.randrange(len(shape)), P)
    try:
        apply_layout(x, lay, mesh)
    except ed.PlanError:  # e.g. one tensor axis split over two mesh axes the wrong way round
        x.set_device_mesh(mesh)
        lay = Layout(tuple(R for _ in shape))
    pinned_y = rng.random() < 0.5
    if pinned_y:
        fd["y"].set_device_mesh(mesh)
    return fd, mesh, f"mesh {shape} x{list(x.shape)} pin {lay}{' y:R' if pinned_y else ''} ops {ops}"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=60.0, help="exact: HiGHS time limit per case (s)")
    ap.add_argument("--show", type=int, default=5, help="print the worst N cases")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows, failed = [], []
    t_start = time.perf_counter()
    for i in range(args.cases):
        fd, mesh, desc = random_fusion(rng)
        try:
            t0 = time.perf_counter()
            greedy = ed.optimize(fd, mesh)
            t1 = time.perf_counter()
            plan = ed.optimize(fd, mesh, extractor="exact", time_limit=args.time_limit)
        except ed.PlanError as e:
            failed.append((i, desc, str(e)[:120]))
            continue
        st = plan.stats
        best = st["extract_cost"]
        gcost = st["greedy_cost"]
        gap = gcost / best - 1 if best > 0 else 0.0
        rows.append(dict(i=i, desc=desc, gap=gap, proven=st["exact_proven"], exact_s=st["extract_s"],
                         greedy_s=t1 - t0, classes=st["classes"], greedy_plan=greedy.predicted_time,
                         method=plan.method))
    elapsed = time.perf_counter() - t_start
    gaps = [r["gap"] for r in rows]
    proven = [r for r in rows if r["proven"]]
    print(f"{len(rows)} cases (seed {args.seed}, {len(failed)} raised PlanError), {elapsed:.0f} s")
    if not rows:
        return
    n = len(rows)
    print(f"greedy == exact (rel 1e-9): {sum(g <= 1e-9 for g in gaps) / n:.1%}   within 1%: "
          f"{sum(g <= 0.01 for g in gaps) / n:.1%}")
    worse = [g for g in gaps if g > 1e-9]
    print(f"gap over all cases: median {statistics.median(gaps):.2%}  p90 {pct(gaps, 0.9):.2%}  "
          f"p99 {pct(gaps, 0.99):.2%}  max {max(gaps):.2%}")
    if worse:
        print(f"gap where greedy is worse ({len(worse)}): median {statistics.median(worse):.2%}  "
              f"p90 {pct(worse, 0.9):.2%}  max {max(worse):.2%}")
    times = [r["exact_s"] for r in rows]
    print(f"exact extraction s (greedy + 0/1 program): median {statistics.median(times):.3f}  p90 "
          f"{pct(times, 0.9):.3f}  max {max(times):.3f};  greedy optimize s median "
          f"{statistics.median(r['greedy_s'] for r in rows):.3f}")
    print(f"proven optimal: {len(proven)}/{n}; classes median {statistics.median(r['classes'] for r in rows):.0f}"
          f" max {max(r['classes'] for r in rows)}")
    for r in sorted(rows, key=lambda r: -r["gap"])[:args.show]:
        if r["gap"] > 1e-9:
            print(f"  case {r['i']}: gap {r['gap']:.2%} ({r['classes']} classes) {r['desc']}")
    for r in rows:
        if not r["proven"]:
            print(f"  case {r['i']}: NOT PROVEN in {r['exact_s']:.1f} s ({r['classes']} classes) {r['desc']}")
    for i, desc, err in failed[:args.show]:
        print(f"  case {i}: PlanError {err} | {desc}")


if __name__ == "__main__":
    main()
