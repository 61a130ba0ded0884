"""Plans at the edges (issue 12): each test states one claim; numerics are checked with ed.simulate
against ed.evaluate in float64."""
import pytest
import torch

import egraph_did as ed
from egraph_did.ir import ParallelType

F64 = torch.float64
DIDx, DIDy = ParallelType.DIDx, ParallelType.DIDy
MESH4 = ed.DeviceMesh.arange(4)


def shard(tv, mesh, axis, ptype=DIDx, ways=None):
    """Pin tv on mesh: logical axis `axis` outer-split by the size of the mesh axis ptype binds."""
    tv.set_device_mesh(mesh)
    ways = ways or mesh.shape[ptype.mesh_axis(mesh)]
    return tv.outer_split(axis, ways).parallelize(axis, ptype)


def random_inputs(fd, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {tv.name: torch.randn(tv.shape, generator=g, dtype=tv.dtype) for tv in fd.fusion.inputs}


def assert_simulates(plan, fd, inputs=None):
    inputs = inputs or random_inputs(fd)
    got, want = ed.simulate(plan, inputs), ed.evaluate(fd, inputs)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-10, msg=k)


# ---------------------------------------------------------------------- 1. welford_merge, negative dim

def test_welford_merge_with_negative_dim_keeps_only_shards_of_unmerged_axes_and_runs():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((12, 8), F64, name="x")
        var, mean = fd.ops.welford_merge(fd.ops.welford_blocks(x, -2, 4), -2)
        fd.add_output(var, name="v")
        fd.add_output(mean, name="m")
    shard(x, MESH4, 0)
    shard(var, MESH4, 0)  # the merged result's only axis is x's axis 1: rows of stats must be gathered
    plan = ed.optimize(fd, MESH4)
    merge = next(s for s in plan.compute_steps if s.op == "welford_merge")
    assert plan.values[dict(merge.args)["stats"]].layout != "S0"  # axis 0 of the stats is the merged one
    assert_simulates(plan, fd)
