"""GPT-3-shaped layer (batch 1, sequence 2048, hidden 12288, 96 heads, bf16) across the GPUs of one host:
egraph-did's tensor-parallel and tensor+sequence-parallel plans against PyTorch DTensor
(parallelize_module with ColwiseParallel / RowwiseParallel, SequenceParallel for the SP case), eager
and under torch.compile; forward only (the fusion has no backward yet).

    python bench/multigpu.py --make-plans          # here (needs egglog): optimize, write bench/plans/*.json
    python bench/multigpu.py                       # on the GPU machine: every GPU it has
    python bench/multigpu.py --cpu-smoke           # anywhere: 4 gloo processes at tiny shapes, numerics only

With several GPUs: one process per GPU (ed.launch, NCCL), medians of CUDA-event timings after warm-up,
numerics against a one-GPU reference (bf16: relative error under 2e-2), ratios to each baseline, and
the cost model's prediction beside the measurement. With one GPU: the per-device compute of the 8-way
plans (rank 0's local program, local shapes; collectives replaced by stand-ins of the right shape) is
timed and reported; the multi-GPU parts report that they were not run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import egraph_did as ed  # noqa: E402
from egraph_did.collectives import is_local  # noqa: E402

PLANS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plans")
GPT3 = dict(batch=1, seq=2048, hidden=12288, heads=96)
# 96 layers of GPT-3 hold 348 GB of bf16 weights: on 8 GPUs a layer may keep about 1/8 of its weights
# and its activations; the bound is what makes tensor parallelism the cheapest plan that fits.
MEMORY_PER_LAYER = 1.0 * 2**30


def layer_cost_model(ndev: int) -> ed.CostModel:
    """The H200 model under the per-layer bound of `ndev` GPUs (the bench plans' and Megatron's plan's).

    >>> layer_cost_model(8).memory_limit == 2**30, layer_cost_model(2).memory_limit == 4 * 2**30
    (True, True)
    """
    return ed.CostModel.h200(memory_limit=MEMORY_PER_LAYER * 8 / ndev)


def gpt_fusion(ndev: int, sp: bool, batch, seq, hidden, heads, dtype=torch.bfloat16):
    from egraph_did import models
    from egraph_did.layout import Layout, S
    from egraph_did.pins import apply_layout
    mesh = ed.DeviceMesh.arange(ndev)
    fd = models.gpt_layer(batch, seq, hidden, heads, dtype)
    for name in ("x", "y"):
        if sp:
            apply_layout(fd[name], Layout((S(1),)), mesh)
        else:
            fd[name].set_device_mesh(mesh)
    return fd, mesh


def plan_path(ndev: int, sp: bool) -> str:
    return os.path.join(PLANS, f"gpt3_{'tpsp' if sp else 'tp'}_{ndev}.json")


def make_plans() -> None:
    os.makedirs(PLANS, exist_ok=True)
    for ndev in (2, 4, 8):
        for sp in (False, True):
            fd, mesh = gpt_fusion(ndev, sp, **GPT3)
            plan = ed.optimize(fd, mesh, layer_cost_model(ndev))
            with open(plan_path(ndev, sp), "w") as f:
                f.write(plan.to_json())
            kinds = sorted(c.kind for c in plan.collectives)
            print(f"{ndev} ranks {'TP+SP' if sp else 'TP'}: predicted {plan.predicted_time * 1e3:.3f} ms, "
                  f"{kinds}, {plan.memory / 2**30:.2f} GiB per device -> {plan_path(ndev, sp)}")


def megatron_plan(ndev: int, sp: bool, **shape):
    """Megatron's TP (TP+SP) layer as a plan: wq, wk, wv, w1 column-parallel, wo, w2 row-parallel, no program
    rewrite (no collective matmul ring): the per-device work torch runs on Megatron's shards.

    >>> megatron_plan(2, True, batch=1, seq=8, hidden=16, heads=2).collectives[0].kind
    'allgather'
    """
    from egraph_did.layout import Layout, S
    from egraph_did.pins import apply_layout
    fd, mesh = gpt_fusion(ndev, sp, **shape)
    for w, axis in dict(wq=0, wk=0, wv=0, w1=0, wo=1, w2=1).items():
        apply_layout(fd[w], Layout((S(axis),)), mesh)
    return ed.optimize(fd, mesh, layer_cost_model(ndev), rewrites=())


def load_plan(ndev: int, sp: bool):
    with open(plan_path(ndev, sp)) as f:
        return ed.Plan.from_json(f.read())


# ---------------------------------------------------------------------- one GPU: per-device compute

def per_device_compute(plan, device, iters: int = 20) -> tuple[float, float]:
    """Median ms of rank 0's local program with collectives replaced by stand-ins; and the cost model's
    prediction of the collectives it skipped."""
    from egraph_did.shards import Operand, RankContext
    from egraph_did.lowering.execute import run_rank
    from egraph_did.lowering.segment import lower
    mesh, rank = plan.mesh, plan.mesh.ranks[0]
    ctx = RankContext(mesh, rank)
    g = torch.Generator(device=device).manual_seed(0)

    def local_random(value):
        v = plan.values[value]
        shape = ctx.local_shape(Operand(v.shape, v.layout))
        return torch.randn(shape, device=device, dtype=getattr(torch, v.dtype), generator=g) * 0.02

    env0 = {v: local_random(v) for vals in plan.inputs.values() for v in vals}
    stand_ins = {c.dst: local_random(c.dst) for c in plan.steps if isinstance(c, ed.Collective)}
    lowered = lower(plan)
    skipped = sum(c.time for c in plan.collectives)

    def stand_in(plan_, c, local, rank_):
        return stand_ins[c.dst]

    def once():
        run_rank(plan, dict(env0), rank, stand_in, lowered)
    for _ in range(3):
        once()
    torch.cuda.synchronize()
    per_segment: dict[int, float] = {}  # one more run, each segment timed alone (synchronized)
    env = dict(env0)
    for i, seg in enumerate(lowered.segments):
        from egraph_did.lowering.execute import run_segment
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        env.update(run_segment(plan, seg, env, rank, stand_in))
        e.record()
        torch.cuda.synchronize()
        per_segment[i] = s.elapsed_time(e)
    top = sorted(per_segment.items(), key=lambda kv: -kv[1])[:6]
    print("   slowest segments: " + ", ".join(f"{lowered.segments[i].describe()} {t:.3f} ms" for i, t in top))
    return _time(once, iters, "cuda", barrier=False), skipped * 1e3


def single_gpu_report() -> None:
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} x1 | torch {torch.__version__}")
    print("multi-GPU runs (NCCL plans vs DTensor TP / TP+SP, eager and compiled; calibration of the "
          "NVLink links): NOT RUN, this machine has one GPU; they need nvidia-h200-x2/-x4/-x8")
    print(f"{'plan':<16}{'segments':>9}{'compute ms':>12}{'predicted compute ms':>22}{'predicted comm ms (not run)':>29}")
    for sp in (False, True):
        plan = load_plan(8, sp)
        from egraph_did.lowering.segment import lower
        nseg = len(lower(plan).segments)
        ms, comm_ms = per_device_compute(plan, dev)
        pred = sum(s.time for s in plan.compute_steps) * 1e3
        print(f"{('TP+SP' if sp else 'TP') + ' 8-way':<16}{nseg:>9}{ms:>12.3f}{pred:>22.3f}{comm_ms:>29.3f}")


# ---------------------------------------------------------------------- several processes

def _time(fn, iters: int, device_kind: str, barrier: bool = True) -> float:
    """Median ms over iters CUDA-event timings after warm-up (NaN when not timing); with barrier, every
    rank starts each iteration together."""
    import torch.distributed as dist
    if iters == 0 or device_kind != "cuda":
        fn()
        return float("nan")
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        if barrier:
            dist.barrier()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def _rank_main(rank, plan, inputs, sp, shape, iters, device_kind):
    """One rank: egraph-did's plan, DTensor eager and DTensor compiled; outputs gathered whole."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import dtensor_baseline as dtb

    world = dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if device_kind == "cuda" else torch.device("cpu")
    on_dev = {k: v.to(device) for k, v in inputs.items()}
    res = {"egraph-did": plan.run(on_dev, inputs="global", outputs="global")["y"].cpu()}
    ms = {"egraph-did": _time(lambda: plan.run(on_dev, inputs="global", outputs="local"), iters, device_kind)}
    mesh = init_device_mesh(device_kind, (world,))
    layer = dtb.load_weights(dtb.Layer(shape["hidden"], shape["heads"], on_dev["x"].dtype).to(device), on_dev)
    layer = dtb.parallelize(layer, mesh, sp)
    x = on_dev["x"].chunk(world, dim=1)[rank].contiguous() if sp else on_dev["x"]

    def whole(y):
        if not sp:
            return y
        parts = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(parts, y.contiguous())
        return torch.cat(parts, dim=1)
    with torch.no_grad():
        res["DTensor eager"] = whole(layer(x)).cpu()
        ms["DTensor eager"] = _time(lambda: layer(x), iters, device_kind)
        if iters:  # torch.compile needs a GPU toolchain here; the CPU smoke run checks eager only
            compiled = torch.compile(layer)
            res["DTensor compiled"] = whole(compiled(x)).cpu()
            ms["DTensor compiled"] = _time(lambda: compiled(x), iters, device_kind)
    return res, ms


def multi_process_run(ndev: int, backend: str, small: bool, model=None) -> None:
    shape = dict(batch=1, seq=16, hidden=64, heads=8) if small else GPT3
    device_kind = "cuda" if backend == "nccl" else "cpu"
    dtype = torch.float32 if small else torch.bfloat16
    tol = 1e-4 if small else 2e-2  # relative norm error vs the float64 single-device reference
    rows = []
    for sp in (False, True):
        fd, mesh = gpt_fusion(ndev, sp, dtype=dtype, **shape)
        if small:  # the 8-way plan's structure at tiny shapes: optimize here with a memory bound
            plan = ed.optimize(fd, mesh, ed.CostModel.h200(memory_limit=2**20))
        else:
            plan = load_plan(ndev, sp)
        g = torch.Generator().manual_seed(0)
        inputs = {t.name: (torch.randn(t.shape, generator=g, dtype=torch.float64) * 0.05).to(dtype)
                  for t in fd.fusion.inputs}
        for n in ("ln1_w", "ln2_w"):
            inputs[n] = inputs[n] + 1
        ref = ed.evaluate(gpt_fusion(ndev, sp, dtype=torch.float64, **shape)[0],
                          {k: v.double() for k, v in inputs.items()})["y"]
        results = ed.launch(_rank_main, ndev, backend, timeout=900,
                            args=(plan, inputs, sp, shape, 0 if small else 20, device_kind))
        res, ms = results[0]
        label = f"{'TP+SP' if sp else 'TP'} {ndev}-way"
        for who, y in res.items():
            err = ((y.double() - ref).norm() / ref.norm()).item()
            ratio = ms[who] and ms["egraph-did"] and ms[who] / ms["egraph-did"]
            pred = (repredict(plan, model) if model is not None else plan.predicted_time) * 1e3
            rows.append(f"{label:<12}{who:<18}{ms[who]:>10.3f}{err:>11.1e}{'ok' if err < tol else 'WRONG':>6}"
                        f"{ratio:>12.2f}{pred if who == 'egraph-did' else float('nan'):>14.3f}")
    print(f"{'plan':<12}{'run':<18}{'ms':>10}{'rel err':>11}{'':>6}{'x egraph':>12}{'predicted ms':>14}")
    print("\n".join(rows))


def _calibrate_rank(rank, sizes, iters):
    from egraph_did.calibrate import measure_collectives
    return measure_collectives(sizes=sizes, iters=iters)


def calibration(ndev: int, backend: str, small: bool):
    """Measure the collectives over every rank, fit the link, save a preset, and report predicted
    (default preset and calibrated) against measured for each collective."""
    from egraph_did.calibrate import calibrated, fit_link, predicted, save_preset
    sizes = (1 << 12, 1 << 16, 1 << 20) if small else (1 << 16, 1 << 20, 1 << 24, 1 << 26, 1 << 28)
    ms = ed.launch(_calibrate_rank, ndev, backend, args=(sizes, 3 if small else 20), timeout=900)[0]
    base = ed.CostModel.h200()
    model = calibrated(base, [fit_link(ms, f"{backend}-{ndev}")])
    path = os.path.join(PLANS, f"calibrated_{backend}_{ndev}.json")
    save_preset(model, path)
    link = model.links[0]
    print(f"calibrated link over {ndev} ranks ({backend}): alpha {link.alpha * 1e6:.2f} us, "
          f"bandwidth {link.bandwidth / 1e9:.1f} GB/s -> {path}")
    print(f"{'collective':<16}{'bytes':>12}{'measured us':>13}{'preset us':>11}{'calibrated us':>15}{'cal/meas':>10}")
    for m in ms:
        cal = predicted(model, m)
        print(f"{m.kind:<16}{m.nbytes:>12.0f}{m.seconds * 1e6:>13.1f}{predicted(base, m) * 1e6:>11.1f}"
              f"{cal * 1e6:>15.1f}{cal / m.seconds:>10.2f}")
    return model


def repredict(plan, model) -> float:
    """The plan's predicted seconds with its collectives re-priced under `model`."""
    t = 0.0
    for s in plan.steps:
        if not isinstance(s, ed.Collective) or is_local(s.kind):  # what runs on one device keeps its price
            t += s.time
        else:
            t += model.collective_time(s.kind, s.bytes, plan.mesh.shape[s.mesh_axis], s.mesh_axis, plan.mesh.ndim)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make-plans", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.make_plans:
        make_plans()
    elif args.cpu_smoke:
        model = calibration(4, "gloo", small=True)
        multi_process_run(4, "gloo", small=True, model=model)
    elif torch.cuda.is_available() and torch.cuda.device_count() == 1:
        single_gpu_report()
    elif torch.cuda.is_available():
        n = torch.cuda.device_count()
        model = calibration(n, "nccl", small=False)
        multi_process_run(n, "nccl", small=False, model=model)
    else:
        print("no GPU: use --cpu-smoke or --make-plans")


if __name__ == "__main__":
    main()
