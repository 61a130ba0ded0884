"""The main job: optimize, explain and run a tensor-parallel MLP on a 4-device CPU mesh.

1. The MLP y = linear(gelu(linear(x, w1)), w2) is written once, as for one device; x and y are pinned
   replicated, the weights are free.
2. ed.optimize lays it out at shapes where tensor parallelism pays (32 tokens, hidden 8192, bf16, H200
   cost model): Megatron's column- then row-parallel plan with one allreduce comes out of the costs.
3. The same layouts are replayed at small float32 shapes (optimize(..., like=plan)), every tensor's
   loop domain and local shard shapes are printed, and the plan runs: simulated in one process, and
   (unless --no-launch) on 4 real gloo processes; both are checked against the single-device reference.
"""
from __future__ import annotations

import torch

from . import DeviceMesh, evaluate, optimize, simulate
from .launcher import launch as launch_ranks
from .models import mlp


def pinned_mlp(tokens: int, hidden: int, mesh: DeviceMesh, dtype=torch.float32):
    fd = mlp(tokens, hidden, dtype)
    fd["x"].set_device_mesh(mesh)  # pinned replicated
    fd["y"].set_device_mesh(mesh)
    return fd


def shard_table(plan) -> str:
    mesh = plan.mesh
    lines = [f"{'tensor':<10}{'shape':<12}{'loop domain':<26}local shape per rank",
             "-" * 78]
    seen = set()
    for v in plan.values.values():
        if v.tensor in seen:
            continue
        seen.add(v.tensor)
        view = plan.value_view(next(n for n, w in plan.values.items()
                                    if w.tensor == v.tensor and w.layout == plan.layout_of(v.tensor)))
        shapes = " ".join(str(list(view.local_shape(r))) for r in mesh.ranks)
        lines.append(f"{v.tensor:<10}{str(list(v.shape)):<12}{view.loop_str():<26}{shapes}")
    return "\n".join(lines)


def _run_rank(rank, plan, inputs):
    return plan.run(inputs, inputs="global", outputs="global")["y"]


def main(tokens: int = 8, hidden: int = 16, ndev: int = 4, launch: bool = True) -> int:
    mesh = DeviceMesh.arange(ndev)
    big = pinned_mlp(32, 8192, mesh, torch.bfloat16)
    print(f"egraph-did demo: tensor-parallel MLP on {mesh}\n")
    print(big.fusion)
    plan = optimize(big, mesh)
    print("\n" + plan.explain())

    small = pinned_mlp(tokens, hidden, mesh)
    small_plan = optimize(small, mesh, like=plan)
    print(f"\nthe same layouts at x [{tokens}, {hidden}] float32:\n")
    print(shard_table(small_plan))

    torch.manual_seed(0)
    inputs = {tv.name: torch.randn(tv.shape) for tv in small.fusion.inputs}
    ref = evaluate(small, inputs)["y"]
    ok = True
    runs = {"simulate (one process, all ranks)": lambda: simulate(small_plan, inputs)["y"]}
    if launch:
        runs[f"{ndev} gloo processes"] = lambda: launch_ranks(_run_rank, ndev, "gloo",
                                                              args=(small_plan, inputs))[0]
    print()
    for what, run in runs.items():
        y = run()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        good = torch.allclose(y, ref, rtol=1e-5, atol=1e-6)
        ok &= good
        print(f"{what}: max relative error vs the single-device reference {err:.2e} -> "
              f"{'OK' if good else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
