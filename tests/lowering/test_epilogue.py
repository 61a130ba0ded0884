"""Matmul epilogues (lowering/epilogue.py): a linear and the pointwise steps after it become one GEMM call
where cuBLASLt computes the same function (bias, bias + tanh gelu, bias + relu, a dead residual in
place), and the fused program equals the unfused one: float64 to 1e-12, bf16 to 1e-2 of the float64
reference (relative norm; bf16 rounds once in the GEMM instead of twice). What would change the function
(exact gelu) or cost a copy (a residual still read, or a program input) stays apart."""
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors: fused kernels through the interpreter, also on a GPU machine

import pytest  # noqa: E402
import torch  # noqa: E402

import egraph_did as ed  # noqa: E402
from conftest import stand_in  # noqa: E402
from egraph_did.lowering.epilogue import epilogue_plan, fuse_epilogues  # noqa: E402
from egraph_did.lowering.execute import run_rank  # noqa: E402
from egraph_did.lowering.program import prepare, program_inputs  # noqa: E402
from egraph_did.lowering.segment import lowered_plan  # noqa: E402
from egraph_did.shards import Operand, RankContext  # noqa: E402

ONE = ed.DeviceMesh.arange(1)


def linear_then(epilogue, *, bias: bool, dtype=torch.float64, tokens=8, hin=16, hout=32, mesh=ONE,
                residual_first=False):
    """y = epilogue(linear(x, w[, b]), b, a, x) as a plan on mesh (a = linear(a, wr) if residual_first)."""
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((tokens, hin), dtype, name="x")
        w = fd.define_tensor((hout, hin), dtype, name="w")
        b = fd.define_tensor((hout,), dtype, name="b")
        a = fd.define_tensor((tokens, hout), dtype, name="a")
        if residual_first:  # a residual made by a GEMM of its own (a sum of two linears)
            a = fd.ops.linear(a, fd.define_tensor((hout, hout), dtype, name="wr"))
        y = fd.ops.linear(x, w, b) if bias else fd.ops.linear(x, w)
        fd.add_output(epilogue(fd.ops, y, b, a, x), name="out")
    return ed.optimize(fd, mesh)


def kinds(plan):
    return [s.describe() for s in epilogue_plan(plan).segments if s.kind == "gemm"]


def inputs(plan, rank=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = RankContext(plan.mesh, rank)
    out = []
    for v in program_inputs(plan):
        val = plan.values[v]
        out.append(torch.randn(ctx.local_shape(Operand(val.shape, val.layout)), generator=g, dtype=torch.float64)
                   .to(getattr(torch, val.dtype)))
    return out


def fused_and_unfused(plan, rank=0, seed=0):
    ins = inputs(plan, rank, seed)
    fused = prepare(plan, rank, ins, stand_in).run([t.clone() for t in ins])
    plain = prepare(plan, rank, ins, stand_in, segments=lowered_plan(plan).segments).run([t.clone() for t in ins])
    return fused, plain, ins


CASES = {  # name: (epilogue, linear has a bias, the gemm segment expected)
    "bias add": (lambda o, y, b, a, x: o.add(y, b), False, "gemm/bias linear+add"),
    "bias add + tanh gelu": (lambda o, y, b, a, x: o.gelu(o.add(y, b), approximate="tanh"), False,
                             "gemm/bias+gelu linear+add+gelu"),
    "linear bias + tanh gelu": (lambda o, y, b, a, x: o.gelu(y, approximate="tanh"), True,
                                "gemm/bias+gelu linear+gelu"),
    "linear bias + relu": (lambda o, y, b, a, x: o.relu(y), True, "gemm/bias+relu linear+relu"),
    "dead residual": (lambda o, y, b, a, x: o.add(y, a), False, "gemm/residual linear+add"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_epilogue_fuses_and_equals_the_unfused_program_in_float64(name):
    epilogue, bias, expected = CASES[name]
    plan = linear_then(epilogue, bias=bias, residual_first="residual" in name)
    assert kinds(plan) == [expected]
    for seed in range(3):  # fresh inputs each time: the same function, not the same numbers
        fused, plain, _ = fused_and_unfused(plan, seed=seed)
        torch.testing.assert_close(fused[0], plain[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(CASES))
def test_epilogue_in_bf16_is_within_bf16_rounding_of_float64(name):
    epilogue, bias, expected = CASES[name]
    first = "residual" in name
    plan16 = linear_then(epilogue, bias=bias, dtype=torch.bfloat16, residual_first=first)
    plan64 = linear_then(epilogue, bias=bias, residual_first=first)
    assert kinds(plan16) == [expected]
    fused, plain, ins = fused_and_unfused(plan16, seed=5)
    ref = prepare(plan64, 0, [t.double() for t in ins], stand_in).run([t.double() for t in ins])[0]
    for got in (fused[0], plain[0]):
        assert got.dtype == torch.bfloat16
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2


NOT_FUSED = {  # name: (epilogue, linear has a bias): why each stays apart is in the module docstring
    "exact gelu (cuBLASLt's is tanh)": (lambda o, y, b, a, x: o.gelu(y), True),
    "residual is a program input (ATen would copy it)": (lambda o, y, b, a, x: o.add(y, a), False),
    "residual read again later": (lambda o, y, b, a, x: o.mul(o.add(y, a), a), False),
    "linear output read twice": (lambda o, y, b, a, x: o.mul(o.add(y, b), y), False),
    "bias without an activation after the linear's own": (lambda o, y, b, a, x: o.exp(y), True),
}


@pytest.mark.parametrize("name", sorted(NOT_FUSED))
def test_epilogue_stays_apart_where_fusing_changes_the_function_or_costs_a_copy(name):
    epilogue, bias = NOT_FUSED[name]
    plan = linear_then(epilogue, bias=bias, residual_first="later" in name)
    assert kinds(plan) == []
    fused, plain, _ = fused_and_unfused(plan)
    assert torch.equal(fused[0], plain[0])


def test_dead_residual_is_accumulated_in_place_and_inputs_are_untouched():
    plan = linear_then(CASES["dead residual"][0], bias=False, residual_first=True)
    ins = inputs(plan)
    kept = [t.clone() for t in ins]
    prog = prepare(plan, 0, ins, stand_in)
    assert prog.run(ins)[0].shape == (8, 32)
    assert all(torch.equal(a, b) for a, b in zip(ins, kept))


def test_a_cut_is_taken_only_where_it_moves_fewer_bytes_and_the_rest_stays_one_kernel():
    # add(y, b) opening a fused add + layer_norm: in the GEMM, the add's result is still written once and
    # read once by the layer_norm: as many bytes as before, so the segment stays whole
    plan = linear_then(lambda o, y, b, a, x: o.layer_norm(o.add(y, b)), bias=False, dtype=torch.float32)
    assert kinds(plan) == []
    # a pre-norm residual (h = r + linear, out = layer_norm(h), h handed on): the GEMM accumulates into r,
    # one pass over y fewer; the layer_norm stays one kernel (TP+SP's add + layer_norm after the wo linear)
    with ed.FusionDefinition() as fd:
        x, w = fd.define_tensor((8, 16), name="x"), fd.define_tensor((32, 16), name="w")
        r = fd.ops.linear(fd.define_tensor((8, 32), name="a"), fd.define_tensor((32, 32), name="wr"))
        h = fd.ops.add(r, fd.ops.linear(x, w))
        fd.add_output(h, name="h")
        fd.add_output(fd.ops.layer_norm(h), name="out")
    plan = ed.optimize(fd, ONE)
    segs = [s.describe() for s in epilogue_plan(plan).segments]
    assert segs[-2:] == ["gemm/residual linear+add", "fused/persistent layer_norm"]
    fused, plain, _ = fused_and_unfused(plan)
    for got, want in zip(fused, plain):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32, Triton's layer_norm


def test_column_parallel_bias_gelu_fuses_on_every_rank_of_a_tp_mlp():
    # Megatron's MLP with biases and GPT-2's tanh gelu on 4 ranks: w1 and b1 column-split, so each rank's
    # GEMM applies its bias shard and the gelu; run_rank (segment by segment) and the program agree
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((8, 16), torch.float64, name="x")
        w1, b1 = fd.define_tensor((64, 16), torch.float64, name="w1"), fd.define_tensor((64,), torch.float64, name="b1")
        w2 = fd.define_tensor((16, 64), torch.float64, name="w2")
        fd.add_output(fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh"), w2), name="y")
    mesh = ed.DeviceMesh.arange(4)
    _ = fd["w1"].set_device_mesh(mesh).outer_split(0, 4).axis(0).parallelize(ed.ParallelType.DIDx)
    plan = ed.optimize(fd, mesh)
    assert "gemm/bias+gelu linear+gelu" in kinds(plan)
    for rank in mesh.ranks:
        fused, plain, ins = fused_and_unfused(plan, rank)
        torch.testing.assert_close(fused[0], plain[0], rtol=1e-12, atol=1e-12)
        env = run_rank(plan, dict(zip(program_inputs(plan), ins)), rank, stand_in)
        assert torch.equal(env[plan.outputs["y"]], fused[0])


@pytest.mark.parametrize("sp", [False, True], ids=["TP", "TP+SP"])
def test_gpt3_rank_programs_have_no_cublaslt_epilogue(sp):
    """The 8-way GPT-3 plans (bench/plans): no linear has a bias, the MLP's gelu is exact, and every
    residual add reads either the layer's input x or a collective's result (after the reduce-scatter of
    a partial sum): nothing cuBLASLt can apply without changing the function or copying x first."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    import multigpu
    plan = multigpu.load_plan(8, sp)
    assert fuse_epilogues(plan, lowered_plan(plan).segments) == lowered_plan(plan).segments
    gelu = [s for s in plan.compute_steps if s.op == "gelu"]
    assert [dict(s.args)["approximate"] for s in gelu] == ["none"]
    assert not any(s.operands.get("bias") for s in plan.compute_steps if s.op == "linear")


def test_a_residual_that_autograd_records_is_not_overwritten():
    # in place would break the residual's own backward (exp's gradient reads its output): out of place
    plan = linear_then(CASES["dead residual"][0], bias=False, residual_first=True)
    seg = next(s for s in epilogue_plan(plan).segments if s.kind == "gemm")
    from egraph_did.lowering.epilogue import gemm_fn
    x, w = torch.randn(8, 16, dtype=torch.float64), torch.randn(32, 16, dtype=torch.float64)
    a = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    r = a.exp()
    out = gemm_fn(plan, seg, 0)(x, w, r)[0]
    out.sum().backward()
    torch.testing.assert_close(a.grad, a.exp().detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.detach(), (x @ w.t() + a.exp()).detach(), rtol=1e-12, atol=1e-12)
