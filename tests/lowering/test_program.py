"""The prepared program (lowering/program.py) computes exactly what run_rank computes: the same
tensors, bit for bit, on every rank of the models' plans (simulated meshes, collectives through a
deterministic stand-in both executors share); it is built once per signature; a failing call names its
segment; index checks still guard user ids unless switched off."""
import pytest
import torch

import egraph_did as ed
from conftest import stand_in
from egraph_did import models
from egraph_did.errors import ShapeError
from egraph_did.layout import Layout, S
from egraph_did.lowering.execute import run_rank
from egraph_did.lowering.program import SegmentFailed, prepare, program_for, program_inputs
from egraph_did.lowering.epilogue import epilogue_plan
from egraph_did.lowering.segment import eager_segments, lowered_plan
from egraph_did.pins import apply_layout
from egraph_did.shards import Operand, RankContext

MESH = ed.DeviceMesh.arange(4)
MESH2 = ed.DeviceMesh([[0, 1], [2, 3]], axis_names=("dp", "tp"))


def sp(build, *args):
    fd = build(*args)
    for name in ("x", "y"):
        apply_layout(fd[name], Layout((S(1),)), MESH)
    return fd


def local_inputs(plan, rank, seed=0):
    g = torch.Generator().manual_seed(seed + rank)
    ctx = RankContext(plan.mesh, rank)
    out = []
    for v in program_inputs(plan):
        val = plan.values[v]
        out.append(torch.randn(ctx.local_shape(Operand(val.shape, val.layout)), generator=g,
                               dtype=getattr(torch, val.dtype)))
    return out


PLANS = {
    "mlp": lambda: ed.optimize(models.mlp(8, 16), MESH),
    "gpt_sp": lambda: ed.optimize(sp(models.gpt_layer, 1, 8, 32, 4), MESH),
    "layer_norm": lambda: ed.optimize(sp(models.layer_norm, 6, 16), MESH),
    "mlp_2d": lambda: ed.optimize(models.mlp(8, 16), MESH2, ed.CostModel.h200_multinode()),
    "mlp_backward": lambda: ed.optimize(models.mlp_with_backward(8, 16), MESH),
    "row_sum_split": lambda: ed.optimize(_row_sum_split(), MESH),
}


def _row_sum_split():
    fd = models.row_sum(8, 64)
    fd["x"].set_device_mesh(MESH).outer_split(1, 4).axis(1).parallelize(ed.ParallelType.DIDx)
    return fd


@pytest.mark.parametrize("name", sorted(PLANS))
@pytest.mark.parametrize("lowered", [True, False])
def test_prepared_program_is_bit_identical_to_run_rank_on_every_rank(name, lowered):
    plan = PLANS[name]()
    segments = epilogue_plan(plan).segments if lowered else eager_segments(plan)
    for rank in plan.mesh.ranks:
        ins = local_inputs(plan, rank)
        env = run_rank(plan, dict(zip(program_inputs(plan), ins)), rank, stand_in,
                       None if lowered else type(lowered_plan(plan))(plan, segments))
        prog = prepare(plan, rank, ins, stand_in, segments=segments)
        for run in range(2):  # the first run takes the checked calls, the second the lean ones
            outs = prog.run(ins)
            for v, got in zip(prog.outputs, outs):
                assert torch.equal(got, env[v]), f"{name} rank {rank} run {run}: {v} differs"


def test_a_program_is_prepared_once_per_signature():
    plan = PLANS["mlp"]()
    ins = local_inputs(plan, 0)
    prog = program_for(plan, 0, ins, stand_in)
    assert program_for(plan, 0, [t.clone() for t in ins], stand_in) is prog
    assert program_for(plan, 0, [t.double() for t in ins], stand_in) is not prog  # another dtype
    assert program_for(plan, 1, ins, stand_in) is not prog


def test_values_are_dropped_after_their_last_reader():
    plan = PLANS["gpt_sp"]()
    prog = prepare(plan, 0, local_inputs(plan, 0), stand_in)
    freed = [s for c in prog.calls for s in c.frees]
    assert len(freed) == len(set(freed))  # each slot dropped once
    out_slots = set(prog.out_slots)
    assert not out_slots & set(freed)
    assert len(freed) == prog.nslots - len(out_slots)  # everything else is dropped at some point


def test_a_failing_call_names_its_segment():
    plan = PLANS["row_sum_split"]()
    ins = local_inputs(plan, 0)

    def broken(plan_, c, t, rank):
        raise RuntimeError("link down")
    prog = prepare(plan, 0, ins, broken)
    index = next(i for i, s in enumerate(prog.segments) if s.kind == "comm")
    with pytest.raises(SegmentFailed) as info:
        prog.run(ins)
    assert info.value.index == index and "reduce_scatter" in info.value.what and "link down" in str(info.value)


def embedding_plan():
    with ed.FusionDefinition() as fd:
        ids = fd.define_tensor((3,), torch.int64, name="ids")
        wte = fd.define_tensor((5, 4), name="wte")
        fd.add_output(fd.ops.embedding(ids, wte), name="y")
    return ed.optimize(fd, ed.DeviceMesh.arange(2))


def test_out_of_range_ids_are_refused_on_every_run_unless_checks_are_off():
    plan = embedding_plan()
    wte = plan.values[program_inputs(plan)[1]]
    table = torch.randn(RankContext(plan.mesh, 0).local_shape(Operand(wte.shape, wte.layout)))
    good = [torch.tensor([0, 4, 1]), table]
    bad = [torch.tensor([0, 9, 1]), good[1]]
    prog = program_for(plan, 0, good, stand_in)
    assert prog.has_index_checks
    prog.run(good)
    prog.run(good)
    with pytest.raises(ShapeError, match="ids holds 9"):  # a later run checks too
        prog.run(bad)
    unchecked = program_for(plan, 0, good, stand_in, check_indices=False)
    assert unchecked is not prog and not unchecked.has_index_checks
    assert all(torch.equal(a, b) for a, b in zip(unchecked.run(good), prog.run(good)))


def test_a_learned_view_replays_as_strided_and_falls_back_when_the_input_is_laid_out_otherwise():
    from egraph_did.lowering.program import _learned_view
    view = _learned_view(lambda x: x.permute(1, 0).reshape(-1), "x")  # a permute then reshape copies
    x = torch.arange(6.).reshape(2, 3)
    assert torch.equal(view(x)[0], x.t().reshape(-1)) and torch.equal(view(x + 1)[0], (x + 1).t().reshape(-1))
    flat = _learned_view(lambda x: x.reshape(3, 2), "x")
    assert torch.equal(flat(x)[0], x.reshape(3, 2))
    assert torch.equal(flat(x * 2)[0], (x * 2).reshape(3, 2))  # replayed as a strided view of the new input
    t = torch.arange(6.).reshape(3, 2).t()  # same shape, other strides: the op runs again, not the replay
    assert torch.equal(flat(t)[0], t.reshape(3, 2))


def test_a_split_collective_finishes_just_before_its_first_reader_with_the_same_results():
    """A binding with start/finish (the runtime's, over torch.distributed) lets independent compute run while
    a collective is in flight: in the data-parallel MLP backward, dw2's all-reduce starts after its matmul
    and finishes at the end, after the whole dx and dw1 computation; the outputs are the unsplit
    program's."""
    def backward(tokens, hidden, dtype):
        fd = models.mlp_with_backward(tokens, hidden, dtype)
        for n in ("x", "dy", "y", "dx"):
            apply_layout(fd[n], Layout((S(0),)), MESH)
        for n in ("dw1", "dw2"):
            fd[n].set_device_mesh(MESH)
        return fd
    big = ed.optimize(backward(8192, 256, torch.bfloat16), MESH, rewrites=())  # no bucket: two all-reduces
    plan = ed.optimize(backward(16, 8, torch.float32), MESH, like=big)
    assert [c.tensor for c in plan.collectives] == ["dw2", "dw1"]
    order = []

    def bind(c):
        fn = lambda t: stand_in(plan, c, t, 0)  # noqa: E731

        def start(t):
            order.append(f"start {c.tensor}")
            out = fn(t)
            return lambda: (order.append(f"finish {c.tensor}"), out)[1]
        return fn, fn, start, start

    ins = local_inputs(plan, 0)
    whole = prepare(plan, 0, ins, lambda p, c, t, r: stand_in(p, c, t, 0))
    split = prepare(plan, 0, ins, None, bind_collective=bind)
    assert len(split.calls) == len(whole.calls) + 2
    for got, want in zip(split.run(ins), whole.run(ins)):
        assert torch.equal(got, want)
    assert order == ["start dw2", "start dw1", "finish dw2", "finish dw1"]
    comm = [i for i, c in enumerate(split.calls) if c.comm]
    assert comm[1] - comm[0] > 5  # dx's and dw1's compute runs while dw2 travels


def test_a_failing_call_names_its_segment_in_later_runs_too():
    # runs after the first go through the generated straight-line function: the same SegmentFailed
    plan = PLANS["row_sum_split"]()
    ins = local_inputs(plan, 0)
    fail = [False]

    def flaky(plan_, c, t, rank):
        if fail[0]:
            raise RuntimeError("link down")
        return stand_in(plan_, c, t, rank)
    prog = prepare(plan, 0, ins, flaky)
    first = prog.run(ins)
    assert all(torch.equal(a, b) for a, b in zip(prog.run(ins), first)) and prog._straight is not None
    fail[0] = True
    index = next(i for i, s in enumerate(prog.segments) if s.kind == "comm")
    with pytest.raises(SegmentFailed) as info:
        prog.run(ins)
    assert info.value.index == index and "link down" in str(info.value)


def test_a_view_of_a_view_is_one_call_and_the_straight_line_run_reports_progress():
    plan = ed.optimize(models.gpt_layer(1, 8, 32, 4), MESH)
    ins = local_inputs(plan, 0)
    prog = prepare(plan, 0, ins, stand_in)
    views = [s for s in plan.compute_steps if s.op in ("reshape", "permute")]
    aten = sum(prog.segments[c.segment].kind == "aten" for c in prog.calls)
    assert views and aten < sum(s.kind == "aten" for s in prog.segments)  # chains folded
    env = run_rank(plan, dict(zip(program_inputs(plan), ins)), 0, stand_in)
    seen = []
    for _ in range(2):
        seen.clear()
        outs = prog.run(ins, before_comm=seen.append)
        assert all(torch.equal(got, env[v]) for v, got in zip(prog.outputs, outs))
        assert seen == [c.segment for c in prog.calls if c.comm]
