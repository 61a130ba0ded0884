"""The runtime's prepared program on four gloo processes: every rank's outputs are bit-identical to the
segment-by-segment executor (lowering/execute.run_rank with real collectives), on its first (checked)
run and on later (lean) runs, with uneven shards; out-of-range ids are refused on every run unless
check_indices=False; cuda_graph has no effect on CPU tensors (gloo never captures)."""
from __future__ import annotations

import pytest
import torch

import egraph_did as ed
from egraph_did import models
from egraph_did.errors import ShapeError
from egraph_did.launcher import launch
from egraph_did.layout import Layout, R, S
from egraph_did.lowering.communication import run_collective
from egraph_did.lowering.execute import run_rank
from egraph_did.pins import apply_layout
from egraph_did.plan import Plan
from egraph_did.runtime import run_plan
from egraph_did.sharding import shard_tensor

MESH = ed.DeviceMesh.arange(4)
MESH2 = ed.DeviceMesh([[0, 1], [2, 3]], axis_names=("dp", "tp"))


def pinned(fd, layout, mesh=MESH):
    for name in ("x", "y"):
        apply_layout(fd[name], layout, mesh)
    return fd


def embedding(rows: int):
    with ed.FusionDefinition() as fd:
        ids = fd.define_tensor((6,), torch.int64, name="ids")
        wte = fd.define_tensor((rows, 4), name="wte")
        fd.add_output(fd.ops.embedding(ids, wte), name="y")
    return fd


def plans():
    sp = Layout((S(1),))
    return {
        "gpt_uneven": ed.optimize(pinned(models.gpt_layer(1, 7, 32, 4), sp), MESH),  # 7 tokens: 2, 2, 2, 1
        "layer_norm_uneven": ed.optimize(pinned(models.layer_norm(6, 18), sp), MESH),
        "mlp_2d": ed.optimize(pinned(models.mlp(7, 16), Layout((S(0), R)), MESH2), MESH2,
                              ed.CostModel.h200_multinode()),
        "embedding": ed.optimize(embedding(8), MESH),
    }


def inputs_of(plan: Plan, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, vals in plan.inputs.items():
        val = plan.values[vals[0]]
        if val.dtype == "int64":
            out[name] = torch.randint(0, plan.values[plan.inputs["wte"][0]].shape[0], val.shape, generator=g)
        else:
            out[name] = torch.randn(val.shape, generator=g, dtype=getattr(torch, val.dtype))
    return out


def each_rank(rank: int, jobs: dict):
    out = {}
    for name, plan_json in jobs.items():
        plan = Plan.from_json(plan_json)
        runs = []
        for seed in (0, 1, 2):
            glob = inputs_of(plan, seed)
            local = {k: shard_tensor(v, plan.value_view(plan.inputs[k][0]), rank) for k, v in glob.items()}
            lean = run_plan(plan, local, inputs_kind="local", outputs_kind="local", cuda_graph=seed == 2)
            env = {vals[0]: local[k] for k, vals in plan.inputs.items()}
            for k, vals in plan.inputs.items():  # inputs loaded in a second layout: as the runtime binds them
                for v in vals[1:]:
                    env[v] = shard_tensor(glob[k], plan.value_view(v), rank)
            old = run_rank(plan, env, rank, lambda p, c, t, r: run_collective(p, c, t, r))
            runs.append({k: (lean[k], old[v]) for k, v in plan.outputs.items()})
        out[name] = runs
    plan = Plan.from_json(jobs["embedding"])
    bad = inputs_of(plan, 0)
    bad["ids"][3] = 11
    errors = []
    for _ in range(2):  # the first (checked) run and a later (lean) one both refuse
        try:
            run_plan(plan, bad)
            errors.append(None)
        except ShapeError as e:
            errors.append(str(e))
    bad["ids"][3] = 7  # in range: the unchecked program runs
    out["unchecked"] = run_plan(plan, bad, check_indices=False)["y"]
    return out, errors


@pytest.fixture(scope="module")
def results():
    jobs = {name: plan.to_json() for name, plan in plans().items()}
    return launch(each_rank, nprocs=4, backend="gloo", args=(jobs,), timeout=120)


@pytest.mark.parametrize("name", ["gpt_uneven", "layer_norm_uneven", "mlp_2d", "embedding"])
def test_prepared_runs_are_bit_identical_to_the_segment_executor_on_every_rank(name, results):
    for rank, (res, _) in enumerate(results):
        for run, outs in enumerate(res[name]):
            for out, (lean, old) in outs.items():
                assert lean.shape == old.shape and torch.equal(lean, old), f"{name}.{out} rank {rank} run {run}"


def test_out_of_range_ids_are_refused_on_every_run(results):
    for rank, (res, errors) in enumerate(results):
        assert all(e and "ids holds 11" in e and f"on rank {rank}" in e for e in errors), errors
        assert res["unchecked"].shape == (6, 4)


# ---------------------------------------------------------------------------- in one process: the call path

def heads_split_gpt() -> Plan:
    """A GPT layer whose attention runs head-parallel (Megatron): every rank's sdpa is a plain one (no
    query offset), the prepared program's direct sdpa call; q, k, v's reshape and permute fold into views."""
    fd = models.gpt_layer(1, 8, 32, 4)
    for w in ("wq", "wk", "wv", "w1"):
        apply_layout(fd[w], Layout((S(0),)), MESH)
    for w in ("wo", "w2"):
        apply_layout(fd[w], Layout((S(1),)), MESH)
    return ed.optimize(fd, MESH)


def stand_in_collectives(plan: Plan, seed: int) -> dict[str, torch.Tensor]:
    from egraph_did.shards import Operand, RankContext
    ctx, g = RankContext(plan.mesh, 0), torch.Generator().manual_seed(seed)
    out = {}
    for c in plan.steps:
        if isinstance(c, ed.Collective):
            v = plan.values[c.dst]
            out[c.dst] = torch.randn(ctx.local_shape(Operand(v.shape, v.layout)), generator=g)
    return out


def test_a_head_parallel_layer_runs_sdpa_directly_with_the_segment_executors_bits():
    from egraph_did.lowering.program import prepare, program_inputs
    plan = heads_split_gpt()
    assert any(s.op == "sdpa" and not s.flags for s in plan.compute_steps)
    stand_ins = stand_in_collectives(plan, 3)
    collective = lambda p, c, t, r: stand_ins[c.dst]  # noqa: E731
    glob = inputs_of(plan, 0)
    env = {v: shard_tensor(glob[k], plan.value_view(v), 0) for k, vals in plan.inputs.items() for v in vals}
    ins = [env[v] for v in program_inputs(plan)]
    prog = prepare(plan, 0, ins, collective)
    expected = run_rank(plan, dict(env), 0, collective)
    for run in range(3):  # checked, then the straight-line function twice (views learned, then replayed)
        outs = prog.run(ins)
        for name, out in zip(prog.outputs, outs):
            assert torch.equal(out, expected[name]), f"run {run}: {name}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("causal,scale", [(False, None), (True, None), (True, 0.3)])
def test_the_direct_cpu_sdpa_computes_attentions_bits(dtype, causal, scale):
    from egraph_did.lowering.program import _direct_op
    from egraph_did.ops import attention
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=g).to(dtype) for _ in range(3))
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # strided, as a permuted view is
    fn = _direct_op("sdpa", ("q", "k", "v"), {"is_causal": causal, "scale": scale}, cuda=False)
    expected = attention(q, k, v, is_causal=causal, scale=scale)
    got = fn(q, k, v)
    assert got.dtype == expected.dtype and got.stride() == expected.stride() and torch.equal(got, expected)


def test_the_cuda_call_path_folds_views_into_linears_and_computes_the_layer(monkeypatch):
    """The calls a GPU host makes (linear as one mm, its views folded in, q/k/v's input flattened once),
    prepared here on CPU tensors: the same values as the segment executor (sdpa takes torch's default
    backend on this path, so up to rounding), and the same bits on every run, as the learned views replay."""
    from egraph_did.lowering import program
    aten_calls = program._aten_calls
    monkeypatch.setattr(program, "_aten_calls", lambda *a, **k: aten_calls(*a[:4], True))
    plan = heads_split_gpt()
    stand_ins = stand_in_collectives(plan, 3)
    collective = lambda p, c, t, r: stand_ins[c.dst]  # noqa: E731
    glob = inputs_of(plan, 0)
    env = {v: shard_tensor(glob[k], plan.value_view(v), 0) for k, vals in plan.inputs.items() for v in vals}
    ins = [env[v] for v in program.program_inputs(plan)]
    prog = program.prepare(plan, 0, ins, collective)
    # the CPU path's 18 calls less q, k, v's views and wo's input view (folded into their linears), plus
    # the one flattening of the norm q, k and v read
    assert len(prog.calls) == 15
    assert sum(" = permute(" in prog.described[c.segment] for c in prog.calls) == 4  # q, k, v's rows, then q, k, v
    expected = run_rank(plan, dict(env), 0, collective)
    runs = [prog.run(ins) for _ in range(3)]  # checked, then learned views, then replayed
    for name, first, second, third in zip(prog.outputs, *runs):
        assert torch.allclose(first, expected[name], atol=1e-5, rtol=1e-5), name
        assert torch.equal(first, second) and torch.equal(second, third), name
