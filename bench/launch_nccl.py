"""ed.launch with NCCL on the GPUs of this machine: the ranks fork from the launcher's forkserver (which has
imported torch but never touched CUDA), each initializes CUDA and NCCL, all-reduces a tensor, runs a plan's
Triton kernel on its GPU, and hands CUDA tensors back; twice, so the second launch reuses the server.

    python bench/launch_nccl.py            # on the GPU machine: one rank per GPU

Prints per launch: ranks, seconds, the all-reduce's value and the plan's result against torch on the GPU.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import egraph_did as ed  # noqa: E402


def _rank(rank: int, plan_json: str) -> dict:
    """All-reduce rank + 1 over the world, then run the plan (a 1-device relu of x @ w) on this rank's GPU."""
    import torch.distributed as dist
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    got = torch.full((4,), float(rank + 1), device=dev)
    dist.all_reduce(got)
    x = torch.randn(64, 32, device=dev, generator=torch.Generator(dev).manual_seed(0))
    w = torch.randn(32, 16, device=dev, generator=torch.Generator(dev).manual_seed(1))
    out = ed.Plan.from_json(plan_json).run({"x": x, "w": w})["y"]
    return {"allreduce": got.cpu(), "error": (out - torch.relu(x @ w)).abs().max().item(), "device": str(out.device)}


def plan_json() -> str:
    """The plan both launches run: relu(x @ w) on a mesh of one device."""
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((64, 32), name="x")
        w = fd.define_tensor((32, 16), name="w")
        fd.add_output(fd.ops.relu(fd.ops.matmul(x, w)), name="y")
    return ed.optimize(fd, ed.DeviceMesh.arange(1)).to_json()


def main() -> None:
    n = torch.cuda.device_count()
    if n == 0:
        raise SystemExit("no CUDA device: this bench runs NCCL ranks on GPUs")
    print(f"{torch.cuda.get_device_name(0)} x{n} | torch {torch.__version__}")
    plan = plan_json()
    for attempt in range(2):
        t0 = time.perf_counter()
        rows = ed.launch(_rank, nprocs=n, backend="nccl", args=(plan,), timeout=300)
        s = time.perf_counter() - t0
        want = n * (n + 1) / 2
        ok = all(r["allreduce"].eq(want).all().item() and r["error"] < 1e-3 for r in rows)
        print(f"launch {attempt}: {n} NCCL ranks in {s:.2f} s; all-reduce {rows[0]['allreduce'][0].item():g} "
              f"(want {want:g}); plan vs torch max error {max(r['error'] for r in rows):.2e} on {rows[0]['device']}; "
              f"{'ok' if ok else 'WRONG'}")


if __name__ == "__main__":
    main()
