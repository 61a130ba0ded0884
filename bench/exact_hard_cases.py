"""The exact extractor on the fuzz campaign's hardest cases (issue 12, class exact-hit-time-limit), one
process, with what the 0/1 program proved: time, method, cost against greedy's, the cut loop's LP bound
and HiGHS's final bound (as a fraction of the returned plan's cost: how far the proof got; "-" where
the DP over tensors proved it, which has no LP), and which method ran ("dp" or "ilp", per part).

Each case's physical graph is captured where optimize hands it to the exact extractor (the fuzz case is
generated from (seed, index) alone, as bench/fuzz.py does, over the campaign's ops: see CAMPAIGN_EXCLUDES),
then `exact` runs on it with --time-limit.

    .venv/bin/python bench/exact_hard_cases.py [--cases 290,1147,5441,6658,2446,5417] [--seed 7] [--time-limit 60]
    .venv/bin/python bench/exact_hard_cases.py --current --seed 41 --cases 4050,4397   (as bench/fuzz.py draws them today)
    .venv/bin/python bench/exact_hard_cases.py --training [--layers 1] [--time-limit 60]
    .venv/bin/python bench/exact_hard_cases.py --loop-proof [--layers 1] [--time-limit 60]
    .venv/bin/python bench/exact_hard_cases.py --blocking-rounds 20 [--layers 1]

--training: instead, every graph optimize(extractor="exact") hands the exact extractor for the GPT-3 training
step of bench/optimizer.py --training (the whole graph, then the loop pins' passes; issue 10's "< 1 s"), each
line with greedy's cost on the same graph, the DP's verdict and the 0/1 program's split (cut loop, MIP).

--loop-proof: how good optimize's loop passes are. optimize plans a training step whole (pass 1), and where
that plan takes some x in one layout and delivers next.x in another, it re-plans under two sets of loop pins
derived from it and keeps the cheaper (optimize.loop_pins): a heuristic over which loops to try. This solves,
on pass 1's graph, the 0/1 program with every tie (x, next.x) held to one layout (a 0/1 variable per tied
input and layout: x loaded in no other, next.x delivered in it), i.e. the cheapest loop plan of all, proven,
and compares optimize's plan with it. A check of the heuristic, not a planner: it took 10 s on one layer.

--blocking-rounds N: research on the first pass's relaxation (issue 10: its MIP is most of exact's time). After
exact's cut loop, N rounds of blocking-set cuts (blocking_cuts: y_c <= the sum of x over a set of nodes that every
derivation of class c uses, valid for every plan), the LP bound after each round, then HiGHS's MIP from the
optimum with the binding cuts and reduced-cost fixing: how much a tighter LP buys the MIP.

The defaults are the 10,000-case campaign's (seed 7) cases over 50 s: 290, 1147, 5441, 6658 in one
process, 2446 and 5417 only under 16-process load. Results: bench/results_exact_hard_cases.txt.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HARD = (290, 1147, 5441, 6658, 2446, 5417)
# ops added to the fuzzer after the seed-7 campaign: leaving them out draws the campaign's cases again (each
# new op shifts the generator's choices, so `bench/fuzz.py --seed 7 --case 290` is another fusion since;
# opaque_grad came at 0ac16b9, after this file's first results, saved with the recomputation work, minimum,
# sdpa_lse and sdpa_backward with issue 28)
CAMPAIGN_EXCLUDES = ("dropout", "opaque_grad", "saved", "minimum", "sdpa_lse", "sdpa_backward")


class _Captured(Exception):
    pass


def capture(seed: int, index: int, exclude: tuple[str, ...] = CAMPAIGN_EXCLUDES, edges: bool = False):
    """(graph, roots, memory_limit) that optimize(extractor="exact") hands the exact extractor for fuzz case
    (seed, index), drawn without the ops in `exclude` (and with issue 29's edges where `edges`: as bench/fuzz.py
    draws it today with exclude=()); None if the case never reaches it (refused before extraction).

    >>> graph, roots, bound = capture(7, 290)  # doctest: +SKIP
    """
    from bench import fuzz
    import egraph_did  # noqa: F401 - loads egraph_did.optimize, whose `exact` is swapped below
    opt = sys.modules["egraph_did.optimize"]
    got = {}

    def grab(graph, roots, memory_limit=None, time_limit=60.0, **_):  # optimize's start= and cuts= unused
        got["args"] = (graph, roots, memory_limit)
        raise _Captured()

    # edges=False: the seed-7 campaign's cases as drawn then, before issue 29's reshape chains and unread inputs
    spec = fuzz.generate_case(seed, index, ops=[o for o in fuzz.default_ops() if o not in exclude], edges=edges)
    spec["extractors"] = ["exact"]
    real, opt.exact = opt.exact, grab
    try:
        fuzz.run_case(spec, checks={"exact"})
    except _Captured:
        pass
    finally:
        opt.exact = real
    return got.get("args")


def run(seed: int, index: int, time_limit: float, current: bool = False) -> str:
    """One line: the case, the exact extractor's time and method, its cost and greedy's, and its bounds.
    current: the case as bench/fuzz.py draws it today (every op, issue 29's edges), not as the seed-7 campaign did.

    >>> print(run(7, 5417, 60))  # doctest: +SKIP
    """
    from egraph_did.extract import exact
    args = capture(seed, index, (), True) if current else capture(seed, index)
    if args is None:
        return f"seed {seed} case {index}: never reaches the exact extractor"
    graph, roots, bound = args
    t0, c0 = time.perf_counter(), time.process_time()
    sel = exact(graph, roots, bound, time_limit)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = sel.stats
    greedy = s.get("greedy_cost")

    def frac(v):
        return "-" if v is None else f"{v / sel.cost:.0%}"
    return (f"seed {seed} case {index}: {dt:5.1f} s ({cpu:5.1f} s CPU) {sel.method:14s} by {s.get('exact_method', '-'):7s}"
            f" cost {sel.cost * 1e6:8.3f} us"
            f" greedy {'-' if greedy is None else f'{greedy * 1e6:8.3f} us'}"
            f"  LP bound {frac(s.get('exact_lp_bound'))}  final bound {frac(s.get('exact_bound'))}"
            f"  classes {len(graph.classes)}  memory bound {'none' if bound is None else f'{bound:.0f} B'}")


def capture_training(layers: int = 1, fd=None, mesh=None) -> tuple[list[tuple], object]:
    """([(graph, roots, memory_limit, start, {prove, upper})] of every exact() call optimize(extractor="exact") makes, and
    optimize's plan) on the GPT-3 training step bench/optimizer.py --training measures (8 ranks, x and target
    sequence-sharded), or on `fd` over `mesh` where given; each graph (and optimize's start= plan) copied before
    exact() runs on it (optimize goes on with the real extractor's plans).

    >>> passes, plan = capture_training(1)  # doctest: +SKIP
    """
    import copy
    import torch
    import egraph_did as ed
    from egraph_did import models
    from egraph_did.layout import Layout, S
    from egraph_did.pins import apply_layout
    opt = sys.modules["egraph_did.optimize"]
    got, real = [], opt.exact

    def grab(graph, roots, memory_limit=None, time_limit=60.0, **kw):  # kw: optimize's start=, cuts=, upper=, prove=
        got.append((copy.deepcopy(graph), list(roots), memory_limit, copy.deepcopy(kw.get("start")),
                    {k: kw[k] for k in ("prove", "upper") if k in kw}))
        return real(graph, roots, memory_limit, time_limit, **kw)

    if fd is None:
        mesh = ed.DeviceMesh.arange(8)
        fd = models.gpt_training_step(1, 2048, 12288, 96, torch.bfloat16, layers=layers)
        for name in ("x", "target"):
            apply_layout(fd[name], Layout((S(1),)), mesh)
    opt.exact = grab
    try:
        plan = ed.optimize(fd, mesh, extractor="exact")
    finally:
        opt.exact = real
    return got, plan


def run_training(layers: int, time_limit: float) -> list[str]:
    """One line per captured pass (capture_training): exact's wall and CPU time, method, cost, greedy's cost
    on the same graph, and where the time went (the DP's verdict, the cut loop, the MIP).

    >>> print("\\n".join(run_training(1, 60)))  # doctest: +SKIP
    """
    from egraph_did.extract import exact, greedy_dag
    lines, cuts = [], set()  # the passes share cut hints, as inside optimize
    for i, (graph, roots, bound, start, kw) in enumerate(capture_training(layers)[0], 1):
        greedy = greedy_dag(graph, roots, bound).cost
        t0, c0 = time.perf_counter(), time.process_time()
        sel = exact(graph, roots, bound, time_limit, start=start, cuts=cuts, **kw)  # as optimize called it
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = sel.stats

        def sec(k):
            return "-" if s.get(k) is None else f"{s[k]:.2f}"
        lp = "-" if s.get("exact_lp_bound") is None else f"{s['exact_lp_bound'] / sel.cost:.1%}"
        lines.append(f"training {layers} layer(s) pass {i}: {dt:5.2f} s ({cpu:5.2f} s CPU) {sel.method:14s} by "
                     f"{s.get('exact_method', '-'):4s} cost {sel.cost * 1e3:7.4f} ms greedy {greedy * 1e3:7.4f} ms "
                     f"(+{greedy / sel.cost - 1:.1%})  greedy_s {sec('greedy_s')} dp_s {sec('exact_dp_s')} "
                     f"cut_s {sec('exact_cut_s')} mip_s {sec('exact_solve_s')}  LP bound {lp}  proof {s.get('exact_proof')}"
                     f"  classes {len(graph.classes)}")
    return lines


def loop_proof(layers: int, time_limit: float, fd=None, mesh=None) -> str:
    """One line: the cheapest plan of pass 1's graph in which every tied pair (x, next.x) shares one layout, as
    the 0/1 program proves it (cut loop, then the tie rows and HiGHS), against optimize's plan.

    >>> print(loop_proof(1, 60))  # doctest: +SKIP
    """
    captured, plan = capture_training(layers, fd, mesh)  # optimize's passes: the whole graph, then the loops
    t0, c0 = time.perf_counter(), time.process_time()
    res, lp, ties = tied_program(*captured[0][:3], time_limit)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    best = None if res["fun"] is None else res["fun"] / 1e6
    return (f"training {layers} layer(s) loop proof: {dt:5.1f} s ({cpu:5.1f} s CPU) {res['status']}: cheapest loop plan "
            f"{'-' if best is None else f'{best:7.4f}'} ms (bound {res['bound'] / 1e6:7.4f}, tied LP {lp / 1e6:7.4f}); "
            f"optimize's plan {plan.predicted_time * 1e3:7.4f} ms; {len(ties)} ties; "
            f"optimize ran {len(captured)} exact pass(es)")


def tied_program(graph, roots, bound, time_limit: float, start: dict | None = None) -> tuple[dict, float, dict]:
    """loop_proof's 0/1 program on one graph: (HiGHS's answer, the tied LP's bound, {tied input: the layout its
    solution holds it and next.x in}). start: a loop plan of this graph ({class: node}), HiGHS's first incumbent.

    >>> res, lp, ties = tied_program(*capture_training(1)[0][0][:3], 60)  # doctest: +SKIP
    """
    import numpy as np
    from egraph_did import extract as X
    from egraph_did.grad import NEXT
    p = X._program(graph, roots, bound)
    X._separate(graph, p, 0.3 * time_limit, None, roots)
    nn, nc = p.nn, len(p.order)
    out = {c[len("__out__:" + NEXT):]: c for c in p.order if c.startswith("__out__:" + NEXT)}
    z: dict[tuple[str, str], int] = {}  # (tied input, layout) -> its column after the program's
    loads: dict[str, list[tuple[int, str]]] = {}
    for ci, c in enumerate(p.order):
        for j in range(p.first[ci], p.first[ci + 1]):
            n = p.nodes[j][1]
            if n.op == "Load" and n.key in out:
                lay = graph.ident[c][1]
                loads.setdefault(n.key, []).append((ci, lay))
                z.setdefault((n.key, lay), nn + nc + len(z))
    rows, cols, vals, lo, hi = [], [], [], [], []

    def row(entries, low, high):
        for col, v in entries:
            rows.append(len(lo)), cols.append(col), vals.append(v)
        lo.append(low), hi.append(high)
    for x, o in out.items():
        row([(col, 1.0) for (name, _), col in z.items() if name == x], 1.0, 1.0)  # one layout per tie
        for ci, lay in loads.get(x, []):  # x loaded only in it
            row([(nn + ci, 1.0), (z[(x, lay)], -1.0)], -np.inf, 0.0)
        oi = p.cidx[o]
        for j in range(p.first[oi], p.first[oi + 1]):  # next.x delivered only in it
            lay = graph.ident[p.nodes[j][1].children[0]][1]
            row([(j, 1.0)] + ([(z[(x, lay)], -1.0)] if (x, lay) in z else []), -np.inf, 0.0)
    n_cols = nn + nc + len(z)
    base = p.solver.a
    widened = X._Rows(base.indptr, base.indices, base.data, (base.shape[0], n_cols))
    a = widened.stack(X._Rows.from_coo(np.array(vals), np.array(rows), np.array(cols), (len(lo), n_cols)))
    solver = X._Solver(np.concatenate([p.cost, np.zeros(len(z))]), a, np.concatenate([p.solver.lo, lo]),
                       np.concatenate([p.solver.hi, hi]))
    _, lp = solver.lp()
    x0 = None
    if start is not None:
        x0 = np.concatenate([p.start(start, roots), np.zeros(len(z))])
        for (name, lay), col in z.items():
            x0[col] = float(any(x0[nn + ci] > 0.5 for ci, held_lay in loads.get(name, []) if held_lay == lay))
        if not solver.feasible(x0):
            x0 = None
    res = solver.mip(np.ones(a.shape[0], dtype=bool), x0, time_limit, search=x0 is None)
    res["start_feasible"] = x0 is not None
    held = {} if res["x"] is None else {x: lay for (x, lay), col in z.items() if res["x"][col] > 0.5}
    return res, lp, held


def blocking_cuts(p, x: "np.ndarray") -> tuple[list[int], list[list[int]]]:
    """For the 0/1 program p at the LP point x: (classes c, node sets S) with y_c > sum of x over S, where S is
    a set of nodes every derivation of c uses (so y_c <= sum of x_S holds for every plan: a plan that needs c
    holds a derivation of it, and that derivation picks a node of S). Each class's set is built bottom-up as
    greedy_dag builds its sets (bitsets, a member shared by several branches counted once): a node is blocked
    by itself or by one child class's set (whichever adds least to what the class holds so far, a child's on a
    tie: deeper sets are shared more often), a class by all its nodes, or by a class every derivation of it
    passes through where that is lighter. A heuristic separation: the least such set is not always found.

    >>> classes, sets = blocking_cuts(p, x)  # doctest: +SKIP
    """
    import numpy as np
    from egraph_did import extract as X
    nn, nc, first = p.nn, len(p.order), p.first
    children = [[p.cidx[c] for c in dict.fromkeys(n.children)] for _, n in p.nodes]
    xs, ys = x[:nn], x[nn:]
    weighted = 0
    for j in np.nonzero(xs > 1e-12)[0]:
        weighted |= 1 << int(j)

    def weight(bits: int) -> float:
        bits &= weighted
        w = 0.0
        while bits:
            low = bits & -bits
            w += xs[low.bit_length() - 1]
            bits ^= low
        return w
    # classes every derivation of a node passes through (extract._blocking, a group per class): a class's
    # dominators are those of all its nodes
    through = X._blocking(p, np.arange(nc), nc)
    dominators = np.logical_and.reduceat(through, first[:-1], axis=0)
    sets, weights = [0] * nc, np.zeros(nc)
    for ci in range(nc):
        held, held_w = 0, 0.0
        for j in range(first[ci], first[ci + 1]):
            best, best_w = 1 << j, (0.0 if (held >> j) & 1 else xs[j])
            for d in children[j]:
                added = weight(sets[d] & ~held)
                if added <= best_w + 1e-12:
                    best, best_w = sets[d], added
            held |= best
            held_w += best_w
        for d in np.nonzero(dominators[ci])[0]:  # a class every derivation passes through, where lighter
            if weights[d] <= held_w + 1e-12:
                held, held_w = sets[d], weights[d]
        sets[ci], weights[ci] = held, held_w
    out_c, out_s = [], []
    for ci in np.nonzero(ys - weights > 1e-6)[0]:
        bits, members = sets[ci], []
        while bits:
            low = bits & -bits
            members.append(low.bit_length() - 1)
            bits ^= low
        if ys[ci] - xs[members].sum() > 1e-6:
            out_c.append(int(ci))
            out_s.append(members)
    return out_c, out_s


def blocking_rounds(layers: int, rounds: int, time_limit: float) -> list[str]:
    """Lines: the first pass's LP bound after exact's cut loop and after each round of blocking_cuts, then the
    MIP (from the proven optimum, binding cuts, reduced-cost fixing) on the tightened program.

    >>> print("\\n".join(blocking_rounds(1, 20, 60)))  # doctest: +SKIP
    """
    import numpy as np
    from egraph_did import extract as X
    graph, roots, bound, start, _ = capture_training(layers)[0][0]
    best = X.exact(graph, roots, bound, time_limit, start=start)
    t0 = time.perf_counter()
    p = X._program(graph, roots, bound)
    n_base = p.solver.a.shape[0]
    _, _, lp, x = X._separate(graph, p, 0.3 * time_limit, None, roots)
    n_kept = p.solver.a.shape[0]  # base rows, cover rows, the cut loop's cuts
    lines = [f"pass 1: optimum {best.cost * 1e3:.4f} ms; exact's cut loop LP {lp / 1e6:.4f} ms "
             f"({time.perf_counter() - t0:.2f} s)"]
    gap = best.cost * 1e9 - lp
    for r in range(rounds):
        t1 = time.perf_counter()
        cls, sets = blocking_cuts(p, x)
        if not cls:
            lines.append(f"round {r + 1}: no violated blocking set found")
            break
        rows = np.concatenate([np.full(len(s) + 1, k) for k, s in enumerate(sets)])
        cols = np.concatenate([np.array([p.nn + c] + s) for c, s in zip(cls, sets)])
        vals = np.concatenate([np.array([1.0] + [-1.0] * len(s)) for s in sets])
        p.solver.add_rows(X._Rows.from_coo(vals, rows, cols, (len(cls), p.solver.a.shape[1])),
                          np.full(len(cls), -np.inf), np.zeros(len(cls)))
        sep = time.perf_counter() - t1
        x, lp = p.solver.lp()
        lines.append(f"round {r + 1}: {len(cls)} cuts (separation {sep:.2f} s), LP {lp / 1e6:.4f} ms, "
                     f"{(lp - (best.cost * 1e9 - gap)) / gap:.0%} of the gap closed ({time.perf_counter() - t1:.2f} s)")
    act = p.solver.a @ x
    row_dual = np.array(p.solver.highs.getSolution().row_dual)
    keep = ((p.solver.hi - act) < 1e-7) & (np.abs(row_dual) > 1e-9)
    keep[:n_kept] = True
    keep[:n_base] = True
    opt = p.start(best.choice, roots)
    cols, dual = X._reduced_cost_columns(p, opt)
    t1 = time.perf_counter()
    res = p.solver.mip(keep, opt, time_limit, cols=cols, search=False)
    lines.append(f"MIP from the optimum: {res['status']} in {time.perf_counter() - t1:.2f} s, {int((~cols).sum())} "
                 f"columns fixed by reduced cost, {int(keep[n_kept:].sum())} blocking cuts kept")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(map(str, HARD)))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--current", action="store_true",
                    help="the cases as bench/fuzz.py draws them today (every op, issue 29's edges): e.g. --seed 41 --cases 4050,4397")
    ap.add_argument("--training", action="store_true", help="the GPT-3 training step's exact passes instead")
    ap.add_argument("--loop-proof", action="store_true",
                    help="the cheapest loop plan of the training step's first pass, proven, against optimize's")
    ap.add_argument("--blocking-rounds", type=int, default=0,
                    help="rounds of blocking-set cuts on the training step's first pass, then its MIP")
    ap.add_argument("--layers", type=int, default=1, help="--training, --loop-proof, --blocking-rounds: the step's layers")
    a = ap.parse_args(argv)
    if a.blocking_rounds:
        for line in blocking_rounds(a.layers, a.blocking_rounds, a.time_limit):
            print(line, flush=True)
        return 0
    if a.loop_proof:
        print(loop_proof(a.layers, a.time_limit), flush=True)
        return 0
    if a.training:
        for line in run_training(a.layers, a.time_limit):
            print(line, flush=True)
        return 0
    for index in (int(c) for c in a.cases.split(",")):
        print(run(a.seed, index, a.time_limit, a.current), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
