"""CUDA graphs of prepared programs (needs a GPU; skipped elsewhere): replays give the lean run's
tensors bit for bit, with fresh input values copied in and in-place weight updates seen; a program that
checks indices on the host is not captured and says why once."""
import os
import warnings

import pytest
import torch

import egraph_did as ed
from conftest import stand_in
from egraph_did import models
from egraph_did.layout import Layout, S
from egraph_did.lowering.graphs import Captured, NotCaptured, run_graphed
from egraph_did.lowering.program import prepare, program_inputs
from egraph_did.pins import apply_layout
from egraph_did.shards import Operand, RankContext

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU"),
              # another module of the session set TRITON_INTERPRET=1 (CPU tensors): Triton's interpreter copies
              # CUDA tensors to the host, which no capture allows; run this file in a session of its own
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="TRITON_INTERPRET=1 in this session: run tests/execution/test_cuda_graphs.py alone")]
MESH = ed.DeviceMesh.arange(4)


def gpt_plan():
    fd = models.gpt_layer(1, 64, 128, 4)
    for name in ("x", "y"):
        apply_layout(fd[name], Layout((S(1),)), MESH)
    return ed.optimize(fd, MESH)


def inputs(plan, rank, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ctx = RankContext(plan.mesh, rank)
    return [torch.randn(ctx.local_shape(Operand(plan.values[v].shape, plan.values[v].layout)), generator=g,
                        device="cuda") for v in program_inputs(plan)]


def test_replays_equal_lean_runs_with_fresh_inputs_and_updated_weights():
    plan = gpt_plan()
    weights = inputs(plan, 1, 0)
    x_at = program_inputs(plan).index(plan.inputs["x"][0])
    lean, graphed = prepare(plan, 1, weights, stand_in), prepare(plan, 1, weights, stand_in)
    for seed in range(4):
        ins = list(weights)
        ins[x_at] = inputs(plan, 1, 100 + seed)[x_at]  # a fresh x each run: copied into the graph's buffer
        if seed == 3:
            weights[x_at - 1 if x_at else 1].mul_(1.5)  # an in-place update of a weight the graph reads in place
        want = lean.run(ins)
        got = run_graphed(graphed, ins)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"run {seed}"
    assert isinstance(graphed.graph, Captured) and not graphed.graph.in_place[x_at]
    assert sum(graphed.graph.in_place) == len(weights) - 1


def test_a_program_that_checks_indices_runs_without_a_graph_and_says_why():
    with ed.FusionDefinition() as fd:
        ids = fd.define_tensor((3,), torch.int64, name="ids")
        wte = fd.define_tensor((5, 4), name="wte")
        fd.add_output(fd.ops.embedding(ids, wte), name="y")
    plan = ed.optimize(fd, ed.DeviceMesh.arange(2))
    table = plan.values[program_inputs(plan)[1]]
    ins = [torch.tensor([0, 4, 1], device="cuda"),
           torch.randn(RankContext(plan.mesh, 0).local_shape(Operand(table.shape, table.layout)), device="cuda")]
    prog = prepare(plan, 0, ins, stand_in)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            run_graphed(prog, ins)
    assert not isinstance(prog.graph, Captured)
    assert sum("check_indices=False" in str(w.message) for w in caught) == 1
    unchecked = prepare(plan, 0, ins, stand_in, check_indices=False)
    for _ in range(3):
        out = run_graphed(unchecked, ins)
    assert isinstance(unchecked.graph, Captured) and torch.equal(out[0], prog.run(ins)[0])
    assert not isinstance(unchecked.graph, NotCaptured)
