"""The training step on one GPU (issue 30): rank 0's program of the 8-way GPT-3 layer's training step
(forward, loss = mean((y - target)^2), backward, AdamW), collectives replaced by stand-ins of the right
shape, through egraph-did's prepared program and its CUDA graph, against torch eager and torch.compile
of the same per-device work: Megatron TP (or TP+SP) shards of the layer, autograd, and
torch.optim.AdamW(fused=True) over the local parameters.

    python bench/training.py --make-plans   # here (needs egglog): optimize, write bench/plans/gpt3_train_*_8.json
    python bench/training.py                # on a GPU: GPT-3 shapes (batch 1, sequence 2048, hidden 12288, bf16)
    python bench/training.py --cpu-smoke    # anywhere: tiny float32 shapes (tests/execution/test_bench_runtime.py)

The plans are the optimizer's (never hand-edited): models.gpt_training_step with the weights, their
moments and their next values pinned to Megatron's layouts (wq, wk, wv, w1 split by rows, wo, w2 by
columns, the norms' parameters replicated) and x, target replicated (TP) or split along the sequence
(TP+SP), as tests/execution/test_training_gloo.py pins them; every other layout, and the collectives,
are chosen by cost, without the collective-matmul rewrite (its ring steps communicate inside the GEMM,
so no stand-in replaces them on one GPU).

Stand-ins: egraph-did's collectives return a ready tensor of the output's local shape; torch's
Megatron collectives are autograd functions that return a ready tensor or a view of their input (an
all-reduce is the identity, a reduce-scatter rank 0's rows), built so that no work feeding a collective
is dead (torch.compile would drop it). Neither side spends a kernel on a collective.

Columns: GPU ms / step (CUDA events, steps back to back, median of repetitions), host ms / step (wall
time to enqueue, runtime.host_ms_interleaved), kernels in one step, GPU ms by kernel kind (cuBLAS
GEMMs, flash attention, the rest), peak GiB (memory the row holds at its step's peak: its parameters,
moments, data, stand-ins and graph pools, plus the step's transient peak), and torch.compile's GPU
time over the row's. Under each table: the bound (torch.compile over lean's GEMMs + attention, every
other kernel free) and the plan's predicted compute beside lean's measured GPU time.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import egraph_did as ed  # noqa: E402
from egraph_did import models  # noqa: E402
from egraph_did.expand import ALL_REWRITES  # noqa: E402
from egraph_did.layout import Layout, R, S  # noqa: E402
from egraph_did.lowering.graphs import run_graphed  # noqa: E402
from egraph_did.lowering.program import prepare, program_inputs  # noqa: E402
from egraph_did.pins import apply_layout  # noqa: E402
from egraph_did.rewrites import collective_matmul  # noqa: E402
from egraph_did.shards import Operand, RankContext  # noqa: E402

import runtime  # noqa: E402

PLANS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plans")
GPT3 = dict(batch=1, seq=2048, hidden=12288, heads=96)
SMALL = dict(batch=1, seq=16, hidden=64, heads=8)
NDEV = 8
COLUMN, ROW = ("wq", "wk", "wv", "w1"), ("wo", "w2")
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)  # ed.AdamW()'s defaults


# a collective-matmul ring's steps communicate inside the GEMM: no stand-in replaces them on one GPU, so
# the plans measured here are chosen without that rewrite (the ring does the same GEMM work, in chunks)
ONE_GPU_REWRITES = tuple(r for r in ALL_REWRITES if r != collective_matmul.NAME)


def megatron(w: str):
    return S(0) if w in COLUMN else S(1) if w in ROW else R


def step_fusion(sp: bool, batch, seq, hidden, heads, dtype=torch.bfloat16):
    """The 1-layer GPT training step with Megatron's weight layouts pinned (and the data's)."""
    mesh = ed.DeviceMesh.arange(NDEV)
    fd = models.gpt_training_step(batch, seq, hidden, heads, dtype, optimizer=ed.AdamW(**ADAMW))
    for n in ("x", "target"):
        apply_layout(fd[n], Layout((S(1),) if sp else (R,)), mesh)
    for t in list(fd.fusion.inputs):
        if t.name in ("x", "target", "step"):
            continue
        w = t.name.rsplit(".", 1)[-1]  # exp_avg.wq -> wq
        for n in (t.name, "next." + t.name):
            apply_layout(fd[n], Layout((megatron(w),)), mesh)
    return fd, mesh


def plan_path(sp: bool) -> str:
    return os.path.join(PLANS, f"gpt3_train_{'tpsp' if sp else 'tp'}_{NDEV}.json")


def make_plans() -> None:
    for sp in (False, True):
        fd, mesh = step_fusion(sp, **GPT3)
        plan = ed.optimize(fd, mesh, ed.CostModel.h200(), rewrites=ONE_GPU_REWRITES)
        with open(plan_path(sp), "w") as f:
            f.write(plan.to_json())
        print(f"{'TP+SP' if sp else 'TP'}: predicted {plan.predicted_time * 1e3:.3f} ms (compute "
              f"{sum(s.time for s in plan.compute_steps) * 1e3:.3f} ms), {sorted(c.kind for c in plan.collectives)}"
              f" -> {plan_path(sp)}")


def load_plan(sp: bool):
    with open(plan_path(sp)) as f:
        return ed.Plan.from_json(f.read())


def smoke_plan(sp: bool):
    """The 8-way training plan's layouts replayed at tiny float32 shapes."""
    fd, mesh = step_fusion(sp, dtype=torch.float32, **SMALL)
    return ed.optimize(fd, mesh, like=load_plan(sp))


# ---------------------------------------------------------------------------- egraph-did

def state_value(name: str, shape, device, dtype, g) -> torch.Tensor:
    """A plausible training state: weights near 0.02, norms' weights near 1, moments small, v >= 0."""
    if name == "step":
        return torch.tensor(10.0, dtype=torch.float64, device=device)
    v = torch.randn(shape, device=device, dtype=dtype, generator=g)
    base = name.rsplit(".", 1)[-1]
    if name.startswith("exp_avg_sq."):
        return v.abs() * 1e-4
    if name.startswith("exp_avg."):
        return v * 1e-3
    if base in ("ln1_w", "ln2_w"):
        return v * 0.02 + 1
    return v * 0.02


def egraph_runs(plan, device, g, rank: int = 0):
    """{row: fn} for the prepared program of rank 0 and its CUDA graph (stand-in collectives)."""
    ctx = RankContext(plan.mesh, plan.mesh.ranks[rank])

    def local(value):
        v = plan.values[value]
        return ctx.local_shape(Operand(v.shape, v.layout)), getattr(torch, v.dtype)
    names = program_inputs(plan)
    ins = [state_value(plan.values[v].tensor, local(v)[0], device, local(v)[1], g) for v in names]
    stand_ins = {c.dst: torch.randn(local(c.dst)[0], device=device, generator=g).to(local(c.dst)[1]) * 0.02
                 for c in plan.steps if isinstance(c, ed.Collective)}

    def stand_in(plan_, c, t, rank_):
        return stand_ins[c.dst]
    lean, graphed = prepare(plan, ctx.rank, ins, stand_in), prepare(plan, ctx.rank, ins, stand_in)
    loss = list(plan.outputs).index("loss")
    runs = {"egraph-did lean": lambda: lean.run(ins)[loss],
            "egraph-did lean + CUDA graph": lambda: run_graphed(graphed, ins, copy_outputs=False)[loss]}
    return runs, lean, ins


# ---------------------------------------------------------------------------- torch

class _Gather(torch.autograd.Function):
    """An all-gather's stand-in under autograd (SP: [b, s/n, h] -> [b, s, h]): forward returns `full`, a
    ready tensor; backward (a reduce-scatter) returns rank 0's rows of the gradient, a view. No kernel
    either way; the backward reads the gradient, so torch.compile cannot drop the GEMMs that make it."""

    @staticmethod
    def forward(ctx, x, full):
        ctx.rows = x.shape[1]
        return full.view_as(full)

    @staticmethod
    def backward(ctx, g):
        return g.narrow(1, 0, ctx.rows), None


class _Scatter(torch.autograd.Function):
    """A reduce-scatter's stand-in ([b, s, h] -> [b, s/n, h]): forward returns rank 0's rows of x, a
    view (so the GEMM that makes x stays), backward (an all-gather) returns `full`, a ready tensor."""

    @staticmethod
    def forward(ctx, x, rows, full):
        ctx.full = full
        return x.narrow(1, 0, rows)

    @staticmethod
    def backward(ctx, g):
        return ctx.full, None, None


class _Identity(torch.autograd.Function):
    """Megatron's f / g where the collective keeps the shape (all-reduce in one direction, nothing in the
    other): the identity both ways, as a stand-in."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def torch_runs(sp: bool, shape: dict, device, dtype, g, compile_: bool):
    """{row: fn} for rank 0's Megatron training step in torch: forward, loss, backward, fused AdamW."""
    n = NDEV
    b, s, h, heads = shape["batch"], shape["seq"], shape["hidden"], shape["heads"]
    hd = h // heads

    def r(*sh):
        return torch.randn(sh, device=device, dtype=dtype, generator=g) * 0.02

    def params():
        p = dict(ln1_w=r(h) + 1, ln1_b=r(h), ln2_w=r(h) + 1, ln2_b=r(h), wq=r(h // n, h), wk=r(h // n, h),
                 wv=r(h // n, h), wo=r(h, h // n), w1=r(4 * h // n, h), w2=r(h, 4 * h // n))
        return {k: v.requires_grad_() for k, v in p.items()}
    s_loc = s // n if sp else s
    x, target = r(b, s_loc, h), r(b, s_loc, h)
    full = r(b, s, h)  # stand-in: a gathered activation (or gradient)

    def gather(t):  # SP: allgather forward, reduce-scatter backward
        return _Gather.apply(t, full)

    def scatter(t):  # SP: reduce-scatter forward, allgather backward
        return _Scatter.apply(t, s_loc, full)

    def attention(hn, w):
        def heads_first(t):
            return t.view(b, s, -1, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(heads_first(F.linear(hn, w["wq"])), heads_first(F.linear(hn, w["wk"])),
                                           heads_first(F.linear(hn, w["wv"])), is_causal=True)
        return F.linear(o.transpose(1, 2).reshape(b, s, -1), w["wo"])

    def loss_fn(x, target, w):
        """(loss, what each all-gather stand-in reads: returned so that torch.compile computes it)"""
        n1 = F.layer_norm(x, (h,), w["ln1_w"], w["ln1_b"])
        a = scatter(attention(gather(n1), w)) if sp else _Identity.apply(attention(_Identity.apply(n1), w))
        x = x + a
        n2 = F.layer_norm(x, (h,), w["ln2_w"], w["ln2_b"])
        m = F.linear(F.gelu(F.linear(gather(n2) if sp else _Identity.apply(n2), w["w1"])), w["w2"])
        y = x + (scatter(m) if sp else _Identity.apply(m))
        err = y - target
        loss = (err * err).sum() / (b * s * h)  # TP+SP: this rank's part of the mean (an all-reduce: a stand-in)
        return (loss, n1, n2) if sp else (loss,)

    def make(fwd, w):
        opt = torch.optim.AdamW(list(w.values()), fused=True, **ADAMW)

        def step():
            loss = fwd(x, target, w)[0]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step
    runs = {"torch eager": make(loss_fn, params())}
    if compile_:
        for t in (x, target, full):
            torch._dynamo.mark_static_address(t)
        runs["torch.compile"] = make(torch.compile(loss_fn), params())
        runs["torch.compile reduce-overhead"] = make(torch.compile(loss_fn, mode="reduce-overhead"), params())
    return runs


# ---------------------------------------------------------------------------- memory, report

def peak_gib(fn, resident: int) -> float:
    """GiB the row holds at its step's peak: `resident` bytes (what its setup left allocated) plus the
    step's transient peak over what was allocated before it."""
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (resident + torch.cuda.max_memory_allocated() - before) / 2**30


def setup(sp: bool, smoke: bool):
    """(title, plan, {row: fn}, {row: resident bytes}, lean program, its inputs), every row warmed up."""
    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    plan = smoke_plan(sp) if smoke else load_plan(sp)
    shape, dtype = (SMALL, torch.float32) if smoke else (GPT3, torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    runs, resident = {}, {}

    def add(make):
        gc.collect()
        before = torch.cuda.memory_allocated() if cuda else 0
        new = make()
        for name, fn in new.items():
            for _ in range(3):  # compiled, captured, moments created
                fn()
        if cuda:
            torch.cuda.synchronize()
        for name in new:  # rows made together share their state: split it evenly
            resident[name] = ((torch.cuda.memory_allocated() if cuda else 0) - before) / len(new)
        runs.update(new)
        return new
    out = {}
    add(lambda: out.setdefault("ours", egraph_runs(plan, device, g))[0])
    lean, ins = out["ours"][1], out["ours"][2]
    add(lambda: torch_runs(sp, shape, device, dtype, g, compile_=False))
    if cuda:
        for name in ("torch.compile", "torch.compile reduce-overhead"):
            add(lambda name=name: {name: torch_runs(sp, shape, device, dtype, g, compile_=True)[name]})
    losses = {name: fn() for name, fn in runs.items()}
    a, b = losses["egraph-did lean"], losses["egraph-did lean + CUDA graph"]
    if not torch.equal(a, b):
        raise SystemExit(f"{'TP+SP' if sp else 'TP'}: the CUDA graph's loss {b} differs from lean's {a}")
    pred = sum(s.time for s in plan.compute_steps) * 1e3
    title = f"{'TP+SP' if sp else 'TP'} 8-way training step, rank 0 (predicted compute {pred:.3f} ms)"
    return title, plan, runs, resident, lean, ins, pred


def measure(smoke: bool, iters: int, reps: int, sps=(False, True)) -> list[tuple]:
    cuda = torch.cuda.is_available() and not smoke
    tables = []
    for sp in sps:
        title, plan, runs, resident, lean, ins, pred = setup(sp, smoke)
        host = runtime.host_ms_interleaved(runs, max(reps, 5) if cuda else 1, cuda, 8 if cuda else 1)
        rows = {name: dict(gpu=float("nan"), host=host[name], k=None, kinds=None, peak=float("nan")) for name in runs}
        if cuda:
            for name, fn in runs.items():
                rows[name]["gpu"] = runtime.gpu_ms(fn, iters, reps)
            for name, fn in runs.items():
                rows[name]["peak"] = peak_gib(fn, resident[name])
            for name, fn in runs.items():
                rows[name]["k"], rows[name]["kinds"] = runtime.kernels(fn)
            top_kernels(runs, ("egraph-did lean", "torch.compile"))
            gpu_by_call(lean, ins)
        tables.append((title, rows, pred, len(lean.calls)))
        del runs, lean, ins
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return tables


def top_kernels(runs: dict, names, top: int = 14) -> None:
    """Each named row's kernels in one step, summed by name, the slowest first (where the gap is)."""
    from torch.profiler import ProfilerActivity, profile
    for name in names:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runs[name]()
            torch.cuda.synchronize()
        per: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per.setdefault(e.name, []).append(e.device_time)
        print(f"  {name}: top kernels (us, count)")
        for k, us in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]:
            print(f"    {sum(us):9.1f} us  x{len(us):<3} {runtime.kernel_kind(k):<9} {k[:90]}")


def gpu_by_call(prog, ins, top: int = 30) -> None:
    """Each call of the prepared program timed alone (CUDA events, the device drained between calls),
    with the bytes its tensors hold (inputs and outputs, each once) and what that is per second: the
    slowest first, then the sums by call kind."""
    slots = [None] * prog.nslots
    slots[:len(ins)] = ins
    rows = []
    for call in prog.calls:
        args = [slots[a] for a in call.args]
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = call.fn(*args)
        end.record()
        torch.cuda.synchronize()
        for o, t in zip(call.outs, out):
            slots[o] = t
        seen = {id(t): t for t in (*args, *out) if isinstance(t, torch.Tensor)}
        nbytes = sum(t.numel() * t.element_size() for t in seen.values())
        rows.append((start.elapsed_time(end) * 1e3, nbytes, prog.segments[call.segment].kind,
                     prog.described[call.segment]))
    print(f"  lean, call by call: {sum(r[0] for r in rows):.1f} us in {len(rows)} calls; by kind: " + ", ".join(
        f"{k} {sum(r[0] for r in rows if r[2] == k):.1f} us" for k in dict.fromkeys(r[2] for r in rows)))
    for us, nbytes, kind, what in sorted(rows, key=lambda r: -r[0])[:top]:
        print(f"    {us:8.1f} us {nbytes / 1e6:9.1f} MB {nbytes / us / 1e3:6.2f} TB/s  {kind:<5} {what[:88]}")


def print_table(title, rows, pred, ncalls) -> None:
    compiled = rows.get("torch.compile", {}).get("gpu", float("nan"))
    print(f"\n{title}; lean: {ncalls} calls")
    print(f"{'program':<32}{'GPU ms':>9}{'host ms':>9}{'kernels':>9}{'gemm ms':>9}{'attn ms':>9}{'other ms':>9}"
          f"{'peak GiB':>10}{'compile/this':>14}")
    for name, r in rows.items():
        kinds = r["kinds"]
        split = "".join(f"{kinds[c]:>9.3f}" if kinds else f"{'-':>9}" for c in ("gemm", "attention", "other"))
        print(f"{name:<32}{r['gpu']:>9.3f}{r['host']:>9.3f}{r['k'] if r['k'] is not None else '-':>9}{split}"
              f"{r['peak']:>10.2f}{compiled / r['gpu']:>14.2f}")
    lean = rows.get("egraph-did lean", {})
    if lean.get("kinds"):
        floor = lean["kinds"]["gemm"] + lean["kinds"]["attention"]
        print(f"bound: torch.compile {compiled:.3f} ms / lean's GEMMs + attention {floor:.3f} ms = "
              f"{compiled / floor:.2f}x (compile/this with every other kernel free)")
        print(f"predicted compute {pred:.3f} ms vs lean measured {lean['gpu']:.3f} ms "
              f"(predicted/measured {pred / lean['gpu']:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make-plans", action="store_true", help="optimize and write bench/plans/gpt3_train_*.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, numerics only")
    ap.add_argument("--iters", type=int, default=10, help="steps back to back per GPU timing")
    ap.add_argument("--reps", type=int, default=9, help="repetitions (medians)")
    ap.add_argument("--only", choices=("tp", "tpsp"), help="one plan only")
    args = ap.parse_args()
    if args.make_plans:
        return make_plans()
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("no GPU: pass --cpu-smoke")
    if torch.cuda.is_available() and not args.cpu_smoke:
        print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}")
    sps = {"tp": (False,), "tpsp": (True,)}.get(args.only, (False, True))
    for table in measure(args.cpu_smoke, args.iters, 2 if args.cpu_smoke else args.reps, sps):
        print_table(*table)
    if args.cpu_smoke:
        print("\ncpu smoke: GPU columns not measured (no CUDA); the prepared program and its graph row agree")


if __name__ == "__main__":
    main()
