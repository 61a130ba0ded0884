"""Run a long fuzz campaign (bench/fuzz.py) sharded over P processes under a wall-clock deadline, resume
it where the last run stopped, and merge the shards' results into one summary.

    python3 bench/fuzz_parallel.py run --seed 7 --cases 10000 --procs 16 --deadline 450 --dir /tmp/r \\
        -- --minimize-budget 60            # (arguments after -- go to every bench/fuzz.py)
    python3 bench/fuzz_parallel.py run ... --dir /tmp/r   # again: each shard resumes after its last case
    python3 bench/fuzz_parallel.py merge --dir /tmp/r [--out summary.txt]

Shard k of P covers cases [start + k*ceil(N/P), ...). Each bench/fuzz.py process writes its report
(markdown) and its state (JSON: cases run, failures, refusals, per-case greedy-vs-exact gaps) every few
cases, so a shard stopped at the deadline keeps what it finished and the next run starts after it.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shards(start: int, cases: int, procs: int) -> list[tuple[int, int]]:
    per = math.ceil(cases / procs)
    return [(start + k * per, min(start + cases, start + (k + 1) * per)) for k in range(procs)
            if start + k * per < start + cases]


def _states(d: str) -> list[dict]:
    out = []
    for p in sorted(glob.glob(os.path.join(d, "r*_*.json"))):
        m = re.search(r"r(\d+)_(\d+)\.json$", p)
        with open(p) as f:
            st = json.load(f)
        st["_first"], st["_path"] = int(m.group(2)), p
        out.append(st)
    return out


def _done(d: str, lo: int, hi: int) -> int:
    """The first case of [lo, hi) that no earlier run finished."""
    missing = _missing(_states(d), lo, hi)
    return missing[0][0] if missing else hi


def _missing(states: list[dict], lo: int, hi: int) -> list[tuple[int, int]]:
    """The ranges of [lo, hi) that no run finished, whatever shards the runs had (campaigns resumed with
    another --procs or --start cut the cases differently).

    >>> _missing([{"_first": 0, "n_cases": 5}, {"_first": 8, "n_cases": 2}], 0, 12)
    [(5, 8), (10, 12)]
    """
    out, nxt = [], lo
    for first, n in sorted((s["_first"], s["n_cases"]) for s in states):
        if first > nxt:
            out.append((nxt, min(first, hi)))
        nxt = max(nxt, first + n)
    if nxt < hi:
        out.append((nxt, hi))
    return [(a, b) for a, b in out if a < b and a < hi]


def run(args, extra: list[str]) -> None:
    os.makedirs(args.dir, exist_ok=True)
    procs = []
    for k, (lo, hi) in enumerate(_shards(args.start, args.cases, args.procs)):
        nxt = _done(args.dir, lo, hi)
        if nxt >= hi:
            continue
        cmd = [sys.executable, os.path.join(ROOT, "bench", "fuzz.py"), "--seed", str(args.seed), "--start", str(nxt),
               "--cases", str(hi - nxt), "--report", os.path.join(args.dir, f"r{lo}_{nxt}.md"), "--quiet", *extra]
        log = open(os.path.join(args.dir, f"log{lo}_{nxt}.txt"), "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        print(f"shard {k}: cases {nxt}..{hi - 1}", flush=True)
    deadline = time.monotonic() + args.deadline
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(2)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # its session: the campaign, its worker and any gloo ranks
    for p in procs:
        p.wait()
    print(merge(args.dir, args.start, args.cases))


def merge(d: str, start: int | None = None, cases: int | None = None) -> str:
    states = _states(d)
    n = sum(s["n_cases"] for s in states)
    fails: dict[str, list] = defaultdict(list)
    mins: dict[str, list] = defaultdict(list)
    ref: Counter = Counter()
    gaps: list[dict] = []
    ct: list[float] = []
    seeds = {s["seed"] for s in states}
    for s in states:
        for cls, items in s["failures"].items():
            fails[cls] += items
        for cls, ms in s["minimized"].items():
            mins[cls] += ms
        ref.update(s["refusals"])
        gaps += s["gaps"]
        ct += s["case_times"]
    lines = [f"egraph-did fuzz, merged: seed(s) {sorted(seeds)}, {n} cases from {len(states)} shard runs, "
             f"{sum(len(v) for v in fails.values())} failing cases in {len(fails)} classes"]
    if start is not None:
        missing = _missing(states, start, start + cases)
        lines.append("cases not yet run: " + (", ".join(f"{lo}..{hi - 1}" for lo, hi in missing) or "none"))
    if ct:
        cs = sorted(ct)
        lines.append(f"seconds per case (one process): median {statistics.median(cs):.2f}, p99 "
                     f"{cs[int(0.99 * (len(cs) - 1))]:.1f}, max {cs[-1]:.1f}, total {sum(cs):.0f}")
    lines.append("failures by class:")
    for cls, items in sorted(fails.items(), key=lambda kv: -len(kv[1])):
        cs = sorted(i["case"] for i in items)
        lines.append(f"  {len(items):5d}  {cls}   (cases {', '.join(map(str, cs[:10]))}{', ...' if len(cs) > 10 else ''})")
    if not fails:
        lines.append("      0")
    g = sorted(x["gap"] for x in gaps)
    if g:
        q = lambda p: g[min(len(g) - 1, int(math.ceil(p * len(g))) - 1)]  # noqa: E731
        lines.append(f"greedy vs exact over {len(g)} cases where both planned: {sum(x <= 0.01 for x in g) / len(g):.2%} "
                     f"within 1%, {sum(abs(x) < 1e-9 for x in g) / len(g):.2%} equal; gap median {statistics.median(g):.2%}, "
                     f"p90 {q(0.9):.2%}, p99 {q(0.99):.2%}, max {g[-1]:.2%}, min {g[0]:.2%}")
        big = sorted((x for x in gaps if x["gap"] > 0.01), key=lambda x: -x["gap"])
        lines.append(f"cases with greedy > 1% worse than exact: {len(big)}")
        for x in big:
            lines.append(f"  case {x['case']:5d}  {x['gap']:+7.2%}  mesh {x['mesh']}  cost {x['cost'].get('preset')}"
                         f"{' mem ' + format(x['cost']['memory_frac'], '.2f') if x['cost'].get('memory_frac') else ''}"
                         f"  ops {' '.join(x['ops'])}")
    if ref:
        lines.append(f"refusals (an egraph_did error naming the tensor; not failures): {sum(ref.values())}")
        for k, c in ref.most_common(15):
            lines.append(f"  {c:5d}  {k[:170]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("run", "merge"))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--procs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--deadline", type=float, default=450.0, help="seconds; shards still running are stopped")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", default=None, help="merge: also write the summary here")
    args = ap.parse_args(argv)
    if args.what == "run":
        run(args, extra)
    else:
        text = merge(args.dir, args.start, args.cases)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
