"""What a 2-D mesh costs the planner: the training step ed.parallelize plans (its joint plan: forward, gradients
of every parameter; parallelize.optimize_joint, as rank 0 runs it) for a tiny transformers model on a flat mesh
of 4 ranks and on a 2x2 (dp, tp) mesh of the same ranks, with and without a memory bound, greedy extraction.

One row per (model, bound, mesh): optimize_joint's CPU seconds (this process's; wall beside it), the passes and
each pass's stages summed over them (problem, e-graph, pricing, extraction: plan.stats["passes"]), the kept
pass's e-graph size and the predicted step time; the 2x2 row ends with its CPU ratio to the flat row of the same
model and bound, both measured in this run.

    .venv/bin/python bench/mesh_2d.py [--models qwen2 llama] [--layers 2] [--bounds none 450000]
    .venv/bin/python bench/mesh_2d.py --parallelize [--models qwen2 llama] [--repeats 2]

--parallelize: what a user waits for instead, ed.parallelize end to end (export, the joint plan, its split, the
parameters' shards) on rank 0 of 4 gloo processes (ed.launch; rank 0 plans, the others wait for its broadcast),
then the first training call (forward and backward: the plans' lowering), per mesh; the 2x2 row's ratios are to
the flat row's parallelize seconds (wall, and rank 0's CPU) of the same repeat.

Needs transformers (pip install -e '.[models]'). Nothing is downloaded: random weights, tiny configs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

# this tree's egraph_did, not whichever is installed (a copy of the tree measured beside main imported main's)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import egraph_did as ed
from egraph_did.ops import FLOAT_DTYPES
from egraph_did.parallelize import optimize_joint

MESHES = {"flat4": lambda: ed.DeviceMesh.arange(4),
          "2x2": lambda: ed.DeviceMesh(torch.arange(4).reshape(2, 2), axis_names=("dp", "tp"))}


def model(name: str, layers: int) -> torch.nn.Module:
    import transformers
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))


def run(name: str, layers: int, bound: float | None, mesh_name: str) -> dict:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    fd = ed.from_torch(model(name, layers), (ids,), {"use_cache": False})
    mesh = MESHES[mesh_name]()
    for out in fd.fusion.outputs:
        fd[out].set_device_mesh(mesh)  # delivered whole, as parallelize pins them
    diff = [n for n, t in fd.fusion.outputs.items() if t.dtype in FLOAT_DTYPES]
    t0, c0 = time.perf_counter(), time.process_time()
    split = optimize_joint(fd, diff, list(fd.params), mesh, ed.CostModel.h200(memory_limit=bound))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = split.joint.stats
    passes = st.get("passes", [])
    stage = {k: sum(p.get(k, 0.0) for p in passes) for k in ("build_s", "egraph_s", "price_s", "extract_cpu_s")}
    return dict(cpu=cpu, wall=wall, passes=len(passes), classes=st["classes"], nodes=st["nodes"],
                predicted_ms=split.joint.predicted_time * 1e3, **stage)


def _parallelize_rank(rank: int, name: str, layers: int, mesh_name: str) -> tuple[float, float, float]:
    """(wall s, CPU s) of ed.parallelize on this rank, and the wall s of the first forward + backward."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    module = model(name, layers)
    t0, c0 = time.perf_counter(), time.process_time()
    module = ed.parallelize(module, MESHES[mesh_name](), (ids,), kwargs={"use_cache": False})
    t1, c1 = time.perf_counter(), time.process_time()
    module(ids, use_cache=False).logits.square().mean().backward()
    return t1 - t0, c1 - c0, time.perf_counter() - t1


def parallelize_rows(models: list[str], layers: int, repeats: int) -> None:
    """ed.parallelize's seconds on rank 0 (see the module docstring), flat4 then 2x2, `repeats` times."""
    print(f"{'model':7} {'mesh':>6} {'repeat':>6} {'wall_s':>7} {'cpu_s':>7} {'first_step_s':>12}  ratio")
    for name in models:
        seen: dict[str, list] = {m: [] for m in MESHES}
        for r in range(repeats):
            flat = None
            for mesh_name in MESHES:
                wall, cpu, step = ed.launch(_parallelize_rank, nprocs=4, args=(name, layers, mesh_name), timeout=900)[0]
                seen[mesh_name].append((wall, cpu))
                flat = flat or (wall, cpu)
                ratio = "" if mesh_name == "flat4" else f"{wall / flat[0]:.2f}x flat (CPU {cpu / flat[1]:.2f}x)"
                print(f"{name:7} {mesh_name:>6} {r:6d} {wall:7.2f} {cpu:7.2f} {step:12.2f}  {ratio}", flush=True)
        (fw, fc), (tw, tc) = [[statistics.median(x) for x in zip(*seen[m])] for m in MESHES]
        print(f"{name:7} medians of {repeats}: flat4 {fw:.2f} s wall, {fc:.2f} s CPU; 2x2 {tw:.2f} s, {tc:.2f} s: "
              f"{tw / fw:.2f}x flat (CPU {tc / fc:.2f}x)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2"], choices=["qwen2", "llama"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--bounds", nargs="+", default=["none", "450000"], help="bytes per device, or none")
    ap.add_argument("--parallelize", action="store_true", help="time ed.parallelize end to end on 4 gloo ranks")
    ap.add_argument("--repeats", type=int, default=2, help="--parallelize: rounds of (flat4, 2x2)")
    a = ap.parse_args()
    if a.parallelize:
        return parallelize_rows(a.models, a.layers, a.repeats)
    print(f"{'model':7} {'bound':>8} {'mesh':>6} {'cpu_s':>7} {'wall_s':>7} {'passes':>6} {'problem':>7} {'egraph':>7} "
          f"{'price':>6} {'extract':>7} {'classes':>7} {'nodes':>7} {'pred_ms':>8}  ratio")
    for name in a.models:
        for b in a.bounds:
            bound = None if b == "none" else float(b)
            flat = None
            for mesh_name in MESHES:
                r = run(name, a.layers, bound, mesh_name)
                flat = flat or r
                ratio = "" if r is flat else f"{r['cpu'] / flat['cpu']:.1f}x flat"
                print(f"{name:7} {b:>8} {mesh_name:>6} {r['cpu']:7.2f} {r['wall']:7.2f} {r['passes']:6d} {r['build_s']:7.2f} "
                      f"{r['egraph_s']:7.2f} {r['price_s']:6.2f} {r['extract_cpu_s']:7.2f} {r['classes']:7d} "
                      f"{r['nodes']:7d} {r['predicted_ms']:8.4f}  {ratio}", flush=True)


if __name__ == "__main__":
    main()
