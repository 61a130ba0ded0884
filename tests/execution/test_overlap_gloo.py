"""Issue 13, item 5: a collective and the compute that does not depend on it overlap. The runtime starts
each collective asynchronously (gloo's and NCCL's own threads and streams) and waits for it just before
the first call that reads its result (lowering.program._overlap), so the compute between runs while the
bytes travel. Here a data-parallel MLP backward on two gloo processes: dw2's reduce_scatter starts as soon
as dw2's partial sums exist and is waited for only after dx and dw1's GEMMs, and every output equals the
single-device reference. (Timing the overlap needs several GPUs: bench/multigpu.py.)"""
from __future__ import annotations

import pytest
import torch

import egraph_did as ed
from egraph_did import models
from egraph_did.launcher import launch
from egraph_did.plan import Plan
from egraph_did.runtime import run_plan

MESH = ed.DeviceMesh.arange(2)


def data_parallel_backward():
    """The MLP forward and backward with tokens split over the ranks and weights replicated: each weight
    gradient is a partial sum that one collective completes. Program rewrites off: bucket_pair would send
    both gradients in one collective at the end, leaving nothing to overlap (a choice it makes by cost)."""
    fd = models.mlp_with_backward(8, 8)
    for n in ("x", "dy"):
        fd[n].set_device_mesh(MESH).outer_split(0, 2).axis(0).parallelize(ed.ParallelType.DIDx)
    for n in ("w1", "w2"):
        fd[n].set_device_mesh(MESH)
    return fd, ed.optimize(fd, MESH, rewrites=())


def run_and_trace(rank: int, plan_json: str, inputs: dict) -> tuple[dict, list[tuple[int, bool]]]:
    """This rank's outputs, and its prepared program as (segment index, is a collective's call) per call."""
    plan = Plan.from_json(plan_json)
    out = run_plan(plan, inputs)
    (program,) = plan.__dict__["_programs"].values()
    return out, [(c.segment, c.comm) for c in program.calls]


@pytest.fixture(scope="module")
def ran():
    fd, plan = data_parallel_backward()
    g = torch.Generator().manual_seed(0)
    inputs = {t.name: torch.randn(t.shape, generator=g) for t in fd.fusion.inputs}
    results = launch(run_and_trace, nprocs=2, backend="gloo", args=(plan.to_json(), inputs))
    return plan, results, ed.evaluate(fd, inputs)


def test_the_plan_completes_each_weight_gradient_with_its_own_collective():
    _, plan = data_parallel_backward()
    assert sorted((c.kind, c.tensor) for c in plan.collectives) == [("reduce_scatter", "dw1"),
                                                                       ("reduce_scatter", "dw2")]


def test_a_collective_is_waited_for_only_after_the_compute_that_does_not_need_it(ran):
    plan, results, _ = ran
    for _, calls in results:
        comm_segments = {s for s, comm in calls if comm}
        assert len(comm_segments) == 2  # one per gradient, each a start call and a finish call
        between = {}
        for s in comm_segments:
            start, finish = [k for k, (seg, comm) in enumerate(calls) if seg == s and comm]
            between[s] = [seg for seg, comm in calls[start + 1:finish] if not comm]
        first = min(comm_segments)  # dw2's: its partial sums exist before the rest of the backward
        assert len(between[first]) >= 2, (calls, between)  # dx's and dw1's GEMMs at least


def test_overlapped_outputs_equal_the_single_device_reference(ran):
    _, results, want = ran
    for out, _ in results:
        for name, ref in want.items():
            torch.testing.assert_close(out[name], ref, rtol=1e-5, atol=1e-5)
