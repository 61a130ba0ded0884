"""Runtime overhead: rank 0's program of the 8-way GPT-3 TP and TP+SP plans (bench/plans) on one GPU,
collectives replaced by stand-ins of the right shape (as bench/multigpu.py's single-GPU report), through
egraph-did's three executors and against the same local computation in torch.

    python bench/runtime.py               # on a GPU: GPT-3 shapes (batch 1, sequence 2048, hidden 12288, bf16)
    python bench/runtime.py --cpu-smoke   # anywhere: tiny shapes, float32, numerics only (CI runs it)

Rows: egraph-did through the segment-by-segment executor (lowering/execute.run_rank), the prepared
program (lowering/program.py), the prepared program replayed as a CUDA graph (lowering/graphs.py,
outputs not copied, as torch's own graphs); torch eager, torch.compile and torch.compile
mode="reduce-overhead" (CUDA graphs) of the local program of Megatron TP / torchtitan TP+SP (what
DTensor runs on each rank: bench/dtensor_baseline.py's layer on rank 0's weight shards). Every
collective's input is computed and its output is a ready tensor, in both: the torch functions return
each collective's input beside y, so torch.compile cannot drop the work that feeds a collective.

Columns: GPU ms / iter (CUDA events around back-to-back iterations, median of repetitions), host ms /
iter (wall time to enqueue 8 iterations back to back on an idle GPU, over 8, median), host µs per segment, kernels (CUDA
kernels the profiler sees in one iteration), and the speed of torch.compile over each row's GPU time
(above 1: faster than torch.compile) in the same run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import egraph_did as ed  # noqa: E402
from egraph_did.lowering.execute import run_rank  # noqa: E402
from egraph_did.lowering.graphs import run_graphed  # noqa: E402
from egraph_did.lowering.program import prepare, program_inputs  # noqa: E402
from egraph_did.lowering.epilogue import epilogue_plan  # noqa: E402
from egraph_did.lowering.segment import lowered_plan  # noqa: E402
from egraph_did.shards import Operand, RankContext  # noqa: E402

import multigpu  # noqa: E402

SMALL = dict(batch=1, seq=16, hidden=64, heads=8)


def big_plan(sp: bool, megatron: bool):
    """The 8-way plan at GPT-3 shapes: the optimizer's (bench/plans) or Megatron's (multigpu.megatron_plan)."""
    return multigpu.megatron_plan(8, sp, **multigpu.GPT3) if megatron else multigpu.load_plan(8, sp)


def smoke_plan(sp: bool, megatron: bool = False):
    """The 8-way plan's layouts replayed at tiny float32 shapes (optimize(..., like=plan))."""
    fd, mesh = multigpu.gpt_fusion(8, sp, dtype=torch.float32, **SMALL)
    return ed.optimize(fd, mesh, like=big_plan(sp, megatron))


# ---------------------------------------------------------------------------- egraph-did

def egraph_runs(plan, device, g):
    """{row: fn} for the three executors over rank 0's program with stand-ins, and the segment count."""
    rank = plan.mesh.ranks[0]
    ctx = RankContext(plan.mesh, rank)

    def local_random(value):
        v = plan.values[value]
        shape = ctx.local_shape(Operand(v.shape, v.layout))
        return torch.randn(shape, device=device, dtype=getattr(torch, v.dtype), generator=g) * 0.02

    names = program_inputs(plan)
    ins = [local_random(v) for v in names]
    env0 = dict(zip(names, ins))
    stand_ins = {c.dst: local_random(c.dst) for c in plan.steps if isinstance(c, ed.Collective)}

    def stand_in(plan_, c, local, rank_):
        return stand_ins[c.dst]
    lowered = epilogue_plan(plan)  # what prepare() runs: linears with their epilogues where one pays
    lean, graphed = prepare(plan, rank, ins, stand_in), prepare(plan, rank, ins, stand_in)
    y = plan.outputs["y"]
    runs = {
        "breakdown": lambda: host_by_call(lean, ins),
        "egraph-did run_rank": lambda: run_rank(plan, dict(env0), rank, stand_in, lowered)[y],
        "egraph-did lean": lambda: lean.run(ins)[0],
        "egraph-did lean + CUDA graph": lambda: run_graphed(graphed, ins, copy_outputs=False)[0],
    }
    return runs, len(lowered.segments)


# ---------------------------------------------------------------------------- torch

def torch_runs(plan, sp: bool, shape: dict, device, dtype, g, compile_: bool):
    """{row: fn} for rank 0's local program of Megatron TP / torchtitan TP+SP in torch."""
    n = plan.mesh.size
    b, s, h, heads = shape["batch"], shape["seq"], shape["hidden"], shape["heads"]
    hd = h // heads

    def r(*sh):
        return torch.randn(sh, device=device, dtype=dtype, generator=g) * 0.02
    w = dict(ln1_w=r(h) + 1, ln1_b=r(h), ln2_w=r(h) + 1, ln2_b=r(h), wq=r(h // n, h), wk=r(h // n, h),
             wv=r(h // n, h), wo=r(h, h // n), w1=r(4 * h // n, h), w2=r(h, 4 * h // n))
    x = r(b, s // n, h) if sp else r(b, s, h)
    full, part = r(b, s, h), r(b, s // n, h) if sp else r(b, s, h)  # stand-ins: gathered, reduced

    def attention(hn, w):
        def heads_first(t):
            return t.view(b, s, -1, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(heads_first(F.linear(hn, w["wq"])), heads_first(F.linear(hn, w["wk"])),
                                           heads_first(F.linear(hn, w["wv"])), is_causal=True)
        return F.linear(o.transpose(1, 2).reshape(b, s, -1), w["wo"])

    def tp(x, w, reduced1, reduced2):  # Megatron: allreduce after each row-parallel linear
        p1 = attention(F.layer_norm(x, (h,), w["ln1_w"], w["ln1_b"]), w)
        x = x + reduced1
        p2 = F.linear(F.gelu(F.linear(F.layer_norm(x, (h,), w["ln2_w"], w["ln2_b"]), w["w1"])), w["w2"])
        return x + reduced2, p1, p2

    def tpsp(x, w, gathered1, reduced1, gathered2, reduced2):  # sequence-parallel norms, allgather / reduce-scatter
        n1 = F.layer_norm(x, (h,), w["ln1_w"], w["ln1_b"])
        p1 = attention(gathered1, w)
        x = x + reduced1
        n2 = F.layer_norm(x, (h,), w["ln2_w"], w["ln2_b"])
        p2 = F.linear(F.gelu(F.linear(gathered2, w["w1"])), w["w2"])
        return x + reduced2, n1, p1, n2, p2

    fn, args = (tpsp, (x, w, full, part, full, part)) if sp else (tp, (x, w, part, part))
    runs = {"torch eager": lambda: fn(*args)[0]}
    if compile_:
        # every argument is the same tensor each iteration, as weights are: reduce-overhead's graphs read
        # them in place (as ours do) instead of copying each into a static buffer per replay
        for t in (x, full, part, *w.values()):
            torch._dynamo.mark_static_address(t)
        compiled = torch.compile(fn)
        graphs = torch.compile(fn, mode="reduce-overhead")
        runs["torch.compile"] = lambda: compiled(*args)[0]
        runs["torch.compile reduce-overhead"] = lambda: graphs(*args)[0]
    return runs


# ---------------------------------------------------------------------------- timing

def gpu_ms(fn, iters: int, reps: int) -> float:
    """Median over reps of CUDA-event ms per iteration, `iters` iterations back to back."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def host_ms(fn, reps: int, cuda: bool, iters: int = 8) -> float:
    """Median wall ms per iteration to enqueue `iters` iterations back to back on an idle device (few
    enough that the launch queue never fills; on a CPU: to run them)."""
    return statistics.median(_host_batches({"fn": fn}, reps, cuda, iters)["fn"])


def host_ms_interleaved(runs: dict, reps: int, cuda: bool, iters: int = 8) -> dict[str, float]:
    """host_ms of every row, the rows taking turns repetition by repetition after one untimed round (the
    first batches a process enqueues run up to 2x slow: seen on an H200 host, lean 360 us then 205 us): a
    host that speeds up or slows down during the run moves every row alike.

    >>> sorted(host_ms_interleaved({"a": lambda: None, "b": lambda: None}, 3, cuda=False))
    ['a', 'b']
    """
    return {name: statistics.median(ts) for name, ts in _host_batches(runs, reps, cuda, iters).items()}


def _host_batches(runs: dict, reps: int, cuda: bool, iters: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(reps + 1):
        for name, fn in runs.items():
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            if rep:  # round 0 warms the host path up
                times[name].append((time.perf_counter() - t0) * 1e3 / iters)
    if cuda:
        torch.cuda.synchronize()
    return times


GEMM_KERNELS = ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")
ATTENTION_KERNELS = ("flash", "fmha", "attention", "cudnn")


def kernel_kind(name: str) -> str:
    """'gemm', 'attention' or 'other' for a CUDA kernel's name (cuBLAS, flash/cuDNN attention, the rest).

    >>> kernel_kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT"), kernel_kind("pytorch_flash::flash_fwd_kernel")
    ('gemm', 'attention')
    >>> kernel_kind("triton_per_fused_native_layer_norm_0")
    'other'
    """
    low = name.lower()
    if any(k in low for k in ATTENTION_KERNELS):
        return "attention"
    return "gemm" if any(k in low for k in GEMM_KERNELS) else "other"


def kernels(fn) -> tuple[int | None, dict[str, float]]:
    """CUDA kernels the profiler sees in one iteration (None where it sees none: no GPU), and their GPU
    ms by kernel_kind: the GEMMs and attention are the libraries' (cuBLAS, flash) in every program, so
    they bound how far any executor can pull ahead of another."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and not e.name.lower().startswith(("memcpy", "memset"))]
    ms = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for e in events:
        ms[kernel_kind(e.name)] += e.device_time / 1e3
    return len(events) or None, ms


def host_by_call(prog, ins, reps: int = 20) -> list[tuple[str, str, float]]:
    """(kind, segment, median host µs) of each call of a prepared program, in program order, enqueue
    time only (the device drained before each repetition): where the lean executor's host time goes.
    A fused call's segment names how its kernel launches (lowering/program.launch_path)."""
    per: list[list[float]] = [[] for _ in prog.calls]
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        slots = [None] * prog.nslots
        slots[:len(ins)] = ins
        for k, call in enumerate(prog.calls):
            args = [slots[a] for a in call.args]
            t0 = time.perf_counter()
            out = call.fn(*args)
            per[k].append((time.perf_counter() - t0) * 1e6)
            for o, t in zip(call.outs, out):
                slots[o] = t
    def what(c):
        path = getattr(c.fn, "launch_path", None)
        return prog.described[c.segment] + (f" [{path()}]" if path is not None else "")
    return [(prog.segments[c.segment].kind, what(c), statistics.median(us)) for c, us in zip(prog.calls, per)]


def host_by_kind(calls: list[tuple[str, str, float]]) -> dict[str, float]:
    """Host µs per iteration spent in each kind of call (fused kernels, ATen steps, collectives): the
    sums of host_by_call's medians.

    >>> host_by_kind([("aten", "a", 2.0), ("fused", "b", 1.0), ("aten", "c", 3.0)])
    {'aten (2 calls)': 5.0, 'fused (1 calls)': 1.0}
    """
    kinds = [kind for kind, _, _ in calls]
    return {f"{k} ({kinds.count(k)} calls)": sum(us for kind, _, us in calls if kind == k) for k in dict.fromkeys(kinds)}


# ---------------------------------------------------------------------------- report

def setup(sp: bool, smoke: bool, megatron: bool = False):
    """(title, segments, {row: fn}, host breakdown fn) for one plan, every row warmed up (kernels
    compiled, graphs captured) and the egraph-did rows checked against each other bit for bit.
    megatron: Megatron's plan pinned (the torch rows' own per-device work) instead of the optimizer's."""
    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    plan = smoke_plan(sp, megatron) if smoke else big_plan(sp, megatron)
    shape = SMALL if smoke else multigpu.GPT3
    dtype = torch.float32 if smoke else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    ours, nseg = egraph_runs(plan, device, g)
    breakdown = ours.pop("breakdown")
    runs = {**ours, **torch_runs(plan, sp, shape, device, dtype, g, compile_=cuda)}
    outs = {}
    for name, fn in runs.items():
        for _ in range(3):
            outs[name] = fn()
    for name in ours:  # every executor computes the same tensor, bit for bit
        if not torch.equal(outs[name], outs["egraph-did run_rank"]):
            raise SystemExit(f"{'TP+SP' if sp else 'TP'}: {name} differs from run_rank's output")
    pred = sum(s.time for s in plan.compute_steps) * 1e3
    which = "Megatron's plan pinned" if megatron else "the optimizer's plan"
    return (f"{'TP+SP' if sp else 'TP'} 8-way, {which}, rank 0 (predicted compute {pred:.3f} ms, "
            f"step {plan.predicted_time * 1e3:.3f} ms on 8 GPUs)"), nseg, runs, breakdown


def measure(smoke: bool, iters: int, reps: int) -> list[tuple]:
    """Both plans: host times, then GPU times, then (last: the profiler may slow later launches) kernel
    counts. Returns [(title, segments, [(row, GPU ms, host ms, segments or None, kernels)])]."""
    cuda = torch.cuda.is_available() and not smoke
    plans = [setup(sp, smoke, megatron) for sp, megatron in ((False, False), (True, False), (True, True))]
    tables = []
    for title, nseg, runs, breakdown in plans:
        host = host_ms_interleaved(runs, max(reps, 5), cuda)
        rows = {name: [name, float("nan"), host[name], nseg if name.startswith("egraph") else None, None, None]
                for name, fn in runs.items()}
        if cuda:
            for name, fn in runs.items():
                rows[name][1] = gpu_ms(fn, iters, reps)
            calls = breakdown()
            print(f"{title.split(', rank 0')[0]}: lean host us by call kind: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in host_by_kind(calls).items()))
            for kind, what, us in calls:
                print(f"    {us:7.1f} us  {kind:<6} {what[:110]}")
        tables.append((title, nseg, runs, rows))
    if cuda:
        for _, _, runs, rows in tables:
            for name, fn in runs.items():
                rows[name][4], rows[name][5] = kernels(fn)
    return [(title, nseg, list(rows.values())) for title, nseg, _, rows in tables]


def print_table(title, nseg, rows) -> None:
    """The table of one plan; the last three columns are one profiled iteration's kernel ms by kernel_kind.
    Under it, the ratio to torch.compile the lean program would reach with every kernel but the library
    GEMMs and attention free (how far any fusion can take it)."""
    compiled = next((ms for name, ms, *_ in rows if name == "torch.compile"), float("nan"))
    print(f"\n{title}")
    print(f"{'program':<32}{'GPU ms/iter':>12}{'host ms/iter':>14}{'host us/seg':>13}{'kernels':>9}"
          f"{'compile/this':>14}{'gemm ms':>9}{'attn ms':>9}{'other ms':>9}")
    for name, ms, host, segs, k, kinds in rows:
        per_seg = f"{host * 1e3 / segs:.1f}" if segs else "-"
        split = "".join(f"{kinds[c]:>9.3f}" if kinds else f"{'-':>9}" for c in ("gemm", "attention", "other"))
        print(f"{name:<32}{ms:>12.3f}{host:>14.3f}{per_seg:>13}{k if k is not None else '-':>9}"
              f"{compiled / ms:>14.2f}{split}")
    lean = next((kinds for name, *_, kinds in rows if name == "egraph-did lean"), None)
    if lean:
        floor = lean["gemm"] + lean["attention"]
        print(f"bound: torch.compile {compiled:.3f} ms / lean's GEMMs + attention {floor:.3f} ms = "
              f"{compiled / floor:.2f}x (compile/this with every other kernel free)")


def epilogue_table(iters: int, reps: int) -> None:
    """GPU ms of a GPT-2-style column-parallel MLP half at GPT-3 shapes (rank 0 of 8: x [2048, 12288],
    w1 [6144, 12288] with bias, tanh gelu; bf16) through the prepared program with the bias+gelu epilogue
    in the GEMM (lowering/epilogue.py) and without it (the gelu a Triton kernel), beside torch eager; and
    each one's error against a float32 reference. The GPT-3 plans above have no epilogue cuBLASLt can
    apply (no biases, exact gelu), so this is where the epilogue's worth is measured."""
    from egraph_did.lowering.epilogue import epilogue_plan
    dev, dt = torch.device("cuda"), torch.bfloat16
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((2048, 12288), dt, name="x")
        w, b = fd.define_tensor((6144, 12288), dt, name="w"), fd.define_tensor((6144,), dt, name="b")
        fd.add_output(fd.ops.gelu(fd.ops.linear(x, w, b), approximate="tanh"), name="y")
    plan = ed.optimize(fd, ed.DeviceMesh.arange(1))
    g = torch.Generator(device=dev).manual_seed(1)
    ins = [torch.randn(t.shape, device=dev, dtype=dt, generator=g) * s for t, s in
           zip((x, w, b), (1.0, 0.01, 0.1))]
    ref = F.gelu(F.linear(*(t.float() for t in ins)), approximate="tanh")
    fused = prepare(plan, 0, ins, None)
    plain = prepare(plan, 0, ins, None, segments=lowered_plan(plan).segments)
    print("\nepilogue: " + " | ".join(s.describe() for s in epilogue_plan(plan).segments) + "  vs  "
          + " | ".join(s.describe() for s in lowered_plan(plan).segments))
    rows = {"egraph-did lean, bias+gelu in the GEMM": lambda: fused.run(ins)[0],
            "egraph-did lean, gelu a kernel": lambda: plain.run(ins)[0],
            "torch eager": lambda: F.gelu(F.linear(*ins), approximate="tanh")}
    print(f"{'MLP half, bf16 [2048,12288]x[6144,12288]^T':<44}{'GPU ms/iter':>12}{'rel err vs fp32':>17}")
    for name, fn in rows.items():
        for _ in range(3):
            out = fn()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        print(f"{name:<44}{gpu_ms(fn, iters, reps):>12.4f}{err:>17.2e}")


def launch_floor(reps: int = 50) -> list[tuple[str, float]]:
    """(call, median host µs) of single plain-torch calls on this host, each enqueued on a drained device
    (as host_by_call times ours): the floor under which no executor's per-call host time can go here. The
    host ms column of the tables above is bounded below by roughly the sum of these over a program's calls;
    it varies from machine to machine (a virtualised GPU host pays more per launch)."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    small = torch.randn(1024, device=dev)
    x, w = torch.randn(2048, 12288, device=dev, dtype=dt), torch.randn(1536, 12288, device=dev, dtype=dt)
    q = torch.randn(1, 12, 2048, 128, device=dev, dtype=dt)
    calls = {"view (no kernel)": lambda: x.view(2048, 96, 128),
             "add, 1024 floats (1 kernel)": lambda: small + 1.0,
             "F.linear [2048,12288]x[1536,12288]^T": lambda: F.linear(x, w),
             "sdpa causal [1,12,2048,128]": lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)}
    out = []
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        us = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            us.append((time.perf_counter() - t0) * 1e6)
        out.append((name, statistics.median(us)))
    torch.cuda.synchronize()
    return out


def kernel_gaps(fn, iters: int = 4) -> list[tuple[str, float, float]]:
    """(kernel, GPU us, idle us before it) of the last of `iters` iterations run back to back under the
    profiler (the earlier ones fill the queue, so what idles the GPU is the device's, not a late host):
    where the time between a program's kernels goes."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    per = len(ev) // iters
    last = ev[-per:]
    out, end = [], ev[-per - 1].time_range.end
    for e in last:
        out.append((e.name, e.time_range.end - e.time_range.start, max(0.0, e.time_range.start - end)))
        end = max(end, e.time_range.end)
    return out


def print_gaps() -> None:
    """kernel_gaps of lean, its CUDA graph and torch.compile, both plans."""
    device = torch.device("cuda")
    for sp in (False, True):
        plan = multigpu.load_plan(8, sp)
        g = torch.Generator(device=device).manual_seed(0)
        runs, _ = egraph_runs(plan, device, g)
        runs.pop("breakdown")
        runs.update(torch_runs(plan, sp, multigpu.GPT3, device, torch.bfloat16, g, compile_=True))
        for name in ("egraph-did run_rank", "egraph-did lean", "egraph-did lean + CUDA graph", "torch.compile"):
            for _ in range(3):
                runs[name]()
            rows = kernel_gaps(runs[name])
            print(f"\n{'TP+SP' if sp else 'TP'} {name}: {len(rows)} kernels, {sum(r[1] for r in rows):.1f} us busy, "
                  f"{sum(r[2] for r in rows):.1f} us idle between them")
            for k, us, idle in rows:
                print(f"    {idle:7.1f} idle  {us:8.1f} us  {k[:100]}")


def profile_lean(sp: bool, calls: int = 200, top: int = 30) -> None:
    """cProfile of `calls` runs of the prepared program (enqueue only, the GPU drained every 8 runs, as
    host_ms measures): where the lean executor's host time goes, function by function."""
    import cProfile
    import pstats
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    plan = multigpu.load_plan(8, sp) if cuda else smoke_plan(sp)
    runs, _ = egraph_runs(plan, device, torch.Generator(device=device).manual_seed(0))
    lean, title = runs["egraph-did lean"], f"{'TP+SP' if sp else 'TP'} 8-way, rank 0"
    for _ in range(3):  # compiled, first (checked) run done
        lean()
    prof = cProfile.Profile()
    calls = calls if cuda else 4  # the interpreter dominates a CPU profile: just check it runs
    for k in range(calls):
        if cuda and k % 8 == 0:
            torch.cuda.synchronize()
        prof.enable()
        lean()
        prof.disable()
    print(f"\n{title}: cProfile of {calls} lean runs, top {top} by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, numerics only")
    ap.add_argument("--iters", type=int, default=20, help="iterations back to back per GPU timing")
    ap.add_argument("--reps", type=int, default=15, help="repetitions (medians)")
    ap.add_argument("--profile", action="store_true", help="cProfile the prepared program's host loop (TP, TP+SP)")
    ap.add_argument("--gaps", action="store_true", help="each kernel's GPU time and the idle time before it (GPU)")
    ap.add_argument("--epilogue-only", action="store_true", help="only the matmul epilogue table (GPU)")
    args = ap.parse_args()
    if args.gaps:
        return print_gaps()
    if args.profile or args.epilogue_only:
        for sp in (False, True) if args.profile else ():
            profile_lean(sp)
        if args.epilogue_only and torch.cuda.is_available():
            epilogue_table(args.iters, args.reps)
        return
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("no GPU: pass --cpu-smoke")
    if torch.cuda.is_available() and not args.cpu_smoke:
        print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}")
    for title, nseg, rows in measure(args.cpu_smoke, args.iters, 2 if args.cpu_smoke else args.reps):
        print_table(title, nseg, rows)
    if not args.cpu_smoke:
        epilogue_table(args.iters, args.reps)
        print("\nlaunch floor of this host (plain torch, one call on a drained device, median host us):")
        for name, us in launch_floor():
            print(f"    {us:7.1f} us  {name}")
    if args.cpu_smoke:
        print("\ncpu smoke: GPU columns not measured (no CUDA); host ms is the whole interpreted run; "
              "the egraph-did executors agree bit for bit")


if __name__ == "__main__":
    main()
