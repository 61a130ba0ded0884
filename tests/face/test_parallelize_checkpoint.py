"""ed.parallelize with the tools training jobs use around it: torch.distributed.checkpoint saves a
parallelized module's state_dict (DTensors in the plan's placements) and loads it into another one on 4
gloo processes, giving the same parameters and the same next step; and a parallelized module trains
under torchrun (not only ed.launch), equal to the unsharded module (float32, relative 1e-5).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

os.environ.setdefault("TRITON_INTERPRET", "1")  # torch.export imports Triton, whose jit reads this once

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import egraph_did as ed  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
LIMIT = 14_000  # bytes per device for the step: the MLP's weights shard (Megatron), as in test_parallelize


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 8))


def step(model, x) -> torch.Tensor:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


def work(rank: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    mesh = ed.DeviceMesh.arange(4)
    saved = ed.parallelize(make_mlp(0), mesh, (x,), memory_limit=LIMIT)
    step(saved, x)  # the state to save is one step in
    dcp.save(saved.state_dict(), checkpoint_id=path)
    loaded = ed.parallelize(make_mlp(7), mesh, (x,), memory_limit=LIMIT)  # other weights, same placements
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=path)
    loaded.load_state_dict(state)
    # cloned: a replicated DTensor's full_tensor() is its local tensor, which the next step updates in place
    whole = {n: p.full_tensor().clone() for n, p in saved.named_parameters()}
    return {"saved": whole, "loaded": {n: p.full_tensor().clone() for n, p in loaded.named_parameters()},
            "placements": {n: tuple(str(q) for q in p.placements) for n, p in loaded.named_parameters()},
            "next": (step(saved, x), step(loaded, x))}


def test_a_checkpoint_saved_by_one_parallelized_module_loads_into_another():
    with tempfile.TemporaryDirectory() as d:
        ranks = ed.launch(work, nprocs=4, args=(os.path.join(d, "ckpt"),), backend="gloo", timeout=300)
    for r in ranks:
        assert any(q.startswith(("S(", "Shard")) for pl in r["placements"].values() for q in pl)
        for name, w in r["saved"].items():
            torch.testing.assert_close(r["loaded"][name], w, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(r["next"][1], r["next"][0], rtol=0, atol=0, msg=lambda m: f"next step: {m}")


TORCHRUN_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, {tests!r})
    import egraph_did as ed
    from test_parallelize_checkpoint import LIMIT, make_mlp, step
    dist.init_process_group("gloo")
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    model = ed.parallelize(make_mlp(0), ed.DeviceMesh.arange(dist.get_world_size()), (x,), memory_limit=LIMIT)
    losses = torch.stack([step(model, x) for _ in range(3)])
    params = {{n: p.full_tensor() for n, p in model.named_parameters()}}
    if dist.get_rank() == 0:
        torch.save({{"losses": losses, "params": params,
                    "placements": [str(q) for p in model.parameters() for q in p.placements]}}, {out!r})
    # every rank past rank 0's save before any tears down: a rank that leaves early broke its peers' gloo
    # connections, and they aborted ("terminate called without an active exception", 1 run in 2-4 here)
    dist.barrier()
    dist.destroy_process_group()
""")


def test_a_parallelized_module_trains_under_torchrun():
    with tempfile.TemporaryDirectory() as d:
        out, script = os.path.join(d, "result.pt"), os.path.join(d, "train.py")
        with open(script, "w") as f:
            f.write(TORCHRUN_SCRIPT.format(tests=os.path.dirname(__file__), out=out))
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                              script], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
        got = torch.load(out)
    reference = make_mlp(0)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    want = torch.stack([step(reference, x) for _ in range(3)])
    torch.testing.assert_close(got["losses"], want, **TOL)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got["params"][name], p.detach(), **TOL)
    assert any(q.startswith(("S(", "Shard")) for q in got["placements"]), got["placements"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
