"""The main job: a tensor-parallel MLP on a 4-device CPU mesh, laid out by hand in the loop-domain API.

Megatron's layout: w1 column-parallel (its out axis split over the mesh), w2 row-parallel (its in axis
split), so gelu runs on local columns and the second linear leaves a partial sum (one allreduce).
The demo prints every tensor's loop and allocation domains and every rank's local shard shape, runs
each rank's local program on its shards, resolves the partial and checks the result against the
single-device reference.
"""
from __future__ import annotations

import torch

from . import DeviceMesh, FusionDefinition, ParallelType, evaluate, shard_tensor, unshard_tensor
from .evaluate import run_expr


def build_mlp(tokens: int = 8, hidden: int = 16, dtype=torch.float32):
    """The MLP fusion y = linear(gelu(linear(x, w1)), w2) as for one device."""
    with FusionDefinition() as fd:
        x = fd.define_tensor((tokens, hidden), dtype, name="x", axis_names=("s", "h"))
        w1 = fd.define_tensor((4 * hidden, hidden), dtype, name="w1", axis_names=("4h", "h"))
        w2 = fd.define_tensor((hidden, 4 * hidden), dtype, name="w2", axis_names=("h", "4h"))
        h1 = fd.ops.linear(x, w1)
        g = fd.ops.gelu(h1)
        fd.add_output(fd.ops.linear(g, w2), name="y")
    return fd


def megatron_layout(fd, mesh: DeviceMesh) -> None:
    """Column-parallel w1, row-parallel w2: the hand-written plan the optimizer will have to find."""
    f = fd.fusion
    d = mesh.size
    for tv in f.all_tensors():
        tv.set_device_mesh(mesh)
    for name, axis in (("w1", 0), ("w2", 1)):
        f[name].outer_split(axis, d).axis(axis).parallelize(ParallelType.DIDx)
    for tv in (f.producer(f["y"]).inputs[0], f.producer(f.producer(f["y"]).inputs[0]).inputs[0]):
        tv.outer_split(1, d).axis(1).parallelize(ParallelType.DIDx)  # the hidden activations' 4h axis
    f["y"].add_partial(ParallelType.DIDx)  # row-parallel output: a pending sum over the mesh


def run_local_programs(fd, mesh: DeviceMesh, inputs: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Every rank runs the fusion's ops on its own shards (the layout above needs no collective until y)."""
    f = fd.fusion
    per_rank = {}
    for rank in mesh.ranks:
        env = {id(tv): shard_tensor(inputs[tv.name], tv, rank) for tv in f.inputs}
        for expr in f.exprs:
            for tv, val in zip(expr.outputs, run_expr(expr, env)):
                assert tuple(val.shape) == tv.local_shape(rank), (tv.name, tuple(val.shape), tv.local_shape(rank))
                env[id(tv)] = val
        per_rank[rank] = {tv.name: env[id(tv)] for tv in f.all_tensors()}
    return per_rank


def main(tokens: int = 8, hidden: int = 16, ndev: int = 4) -> int:
    mesh = DeviceMesh.arange(ndev)
    fd = build_mlp(tokens, hidden)
    megatron_layout(fd, mesh)
    f = fd.fusion
    print(f"egraph-did demo: tensor-parallel MLP on {mesh}\n")
    print(f)
    print()
    header = f"{'tensor':<10}{'logical':<12}{'loop domain':<26}{'allocation':<22}local shape per rank"
    print(header)
    print("-" * len(header))
    for tv in f.all_tensors():
        alloc = "[" + ", ".join(str(d.extent) for d in tv.allocation_domain) + "]"
        shapes = " ".join(str(list(tv.local_shape(r))) for r in mesh.ranks)
        print(f"{tv.name:<10}{str(list(tv.shape)):<12}{tv.loop_str():<26}{alloc:<22}{shapes}")

    torch.manual_seed(0)
    inputs = {tv.name: torch.randn(tv.shape, dtype=torch.float64).to(tv.dtype) for tv in f.inputs}
    per_rank = run_local_programs(fd, mesh, inputs)
    y = unshard_tensor([per_rank[r]["y"] for r in sorted(mesh.ranks)], f["y"])  # the allreduce of y's partials
    ref = evaluate(fd, inputs)["y"]
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    print(f"\ny = sum over {ndev} ranks of their partial y (one allreduce); max relative error vs the "
          f"single-device reference: {err:.2e}")
    ok = torch.allclose(y, ref, rtol=1e-5, atol=1e-6)
    print("numerics:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
