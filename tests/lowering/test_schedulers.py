"""Triton schedulers on the CPU interpreter: every kernel against run_eager, the op-by-op torch oracle.

Tolerances: float32 kernels match eager to rtol 1e-5 (atol 1e-5 for values near zero). 16-bit kernels
compute in fp32 and round once at the store, while eager rounds after every op, so they are compared
with eager run on the same inputs upcast to fp32 and rounded to the dtype at the end: float16 within
rtol/atol 2e-3 (two ulps), bfloat16 within 1.6e-2 (two ulps).

On a GPU machine, `TRITON_INTERPRET=0 pytest tests/lowering/test_schedulers.py` runs the same claims on CUDA.
"""
from __future__ import annotations

import dataclasses
import math
import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything defines a Triton kernel
os.environ.setdefault("EGRAPH_DID_CACHE", tempfile.mkdtemp(prefix="egraph_did_kernels_"))
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from egraph_did.errors import PlanError, ShapeError  # noqa: E402
from egraph_did.ops import OPS, TensorSpec  # noqa: E402
from egraph_did.lowering import schedulers as sch  # noqa: E402
from egraph_did.lowering.kernel_spec import POINTWISE_BINARY, POINTWISE_UNARY, KernelOp, KernelSpec  # noqa: E402

# Masked-off lanes of interpreted kernels compute on padding (log(0), 0/0): numpy warns, nothing is stored.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


# ------------------------------------------------------------------ building specs by hand

class TV:
    """A tensor of a spec being built."""

    def __init__(self, name, shape, dtype):
        self.name, self.shape, self.dtype = name, tuple(shape), dtype

    @property
    def ndim(self):
        return len(self.shape)


class Build:
    """Emit primitives (composites decompose through the op table, as segmentation does); shapes and
    dtypes come from each op's shape rule. `b.add(x, y)`, `b.layer_norm(x, None, w, bias)`, ..."""

    def __init__(self):
        self.inputs, self.ops, self.tensors, self.n = [], [], {}, 0

    def input(self, name, shape, dtype=torch.float32):
        self.inputs.append(name)
        self.tensors[name] = (tuple(shape), dtype)
        return TV(name, shape, dtype)

    def __getattr__(self, opname):
        opdef = OPS[opname]

        def call(*args, **kwargs):
            if opdef.is_composite:
                return opdef.decompose(self, *args, **kwargs)
            bound = opdef.signature.bind(*args, **kwargs)
            specs = {k: TensorSpec(v.name, v.shape, v.dtype, tuple(f"d{i}" for i in range(len(v.shape))))
                     if isinstance(v, TV) else v for k, v in bound.arguments.items()}
            out = opdef.infer(**specs)[0]
            name = f"t{self.n}"
            self.n += 1
            self.ops.append(KernelOp(name, opname, tuple((k, v.name if isinstance(v, TV) else v)
                                                         for k, v in bound.arguments.items())))
            self.tensors[name] = (out.shape, out.dtype)
            return TV(name, out.shape, out.dtype)

        return call

    def spec(self, *outs) -> KernelSpec:
        return KernelSpec(tuple(self.inputs), tuple(self.ops), tuple(o.name for o in outs),
                          tuple((n, s, d) for n, (s, d) in self.tensors.items()))


def make_inputs(spec, seed=0, positive=()):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in spec.inputs:
        shape, dt = spec.shape(n), spec.dtype(n)
        if dt.is_floating_point:
            t = torch.randn(shape, generator=g)
            out[n] = (t.abs() + 0.5 if n in positive else t).to(dt)
        elif dt == torch.bool:
            out[n] = torch.randint(0, 2, shape, generator=g).bool()
        else:
            out[n] = torch.randint(-50, 50, shape, generator=g).to(dt)
    return {n: t.to(DEVICE) for n, t in out.items()}


def check(spec, inputs=None, kind=None, **kw):
    """compile_kernel(spec) equals run_eager(spec) on the same inputs (see the module's tolerances)."""
    inputs = make_inputs(spec, **kw) if inputs is None else inputs
    if kind is not None:
        assert sch.classify(spec) == kind
    got = sch.compile_kernel(spec)(inputs)
    low = [spec.dtype(n) for n in spec.inputs if spec.dtype(n) in (torch.float16, torch.bfloat16)]
    up = {n: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for n, t in inputs.items()}
    want = sch.run_eager(spec, up if low else inputs)
    assert list(got) == list(dict.fromkeys(spec.outputs))
    for n in spec.outputs:
        assert got[n].dtype == spec.dtype(n) and tuple(got[n].shape) == spec.shape(n), n
        rtol, atol = TOL.get(spec.dtype(n), (0, 0))
        torch.testing.assert_close(got[n], want[n].to(spec.dtype(n)), rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"output {n} of {sch.classify(spec)} kernel: {m}")
    return got


# ------------------------------------------------------------------ specs used below

def gelu_chain(shape, dtype=torch.float32):
    """gelu(x) * b + a, gelu in its erf form."""
    b = Build()
    x, w, a = b.input("x", shape, dtype), b.input("w", shape[-1:], dtype), b.input("a", shape, dtype)
    return b.spec(b.add(b.mul(b.gelu(x), w), a))


def softmax(shape, dtype=torch.float32):
    b = Build()
    return b.spec(b.softmax(b.input("x", shape, dtype), -1))


def layer_norm(shape, dtype=torch.float32, residual=False):
    b = Build()
    x = b.input("x", shape, dtype)
    w, bias = b.input("w", shape[-1:], dtype), b.input("bias", shape[-1:], dtype)
    if residual:
        h = b.add(x, b.input("r", shape, dtype))
        return b.spec(h, b.layer_norm(h, None, w, bias))
    return b.spec(b.layer_norm(x, None, w, bias))


def rms_norm(shape, dtype=torch.float32):
    b = Build()
    x, w = b.input("x", shape, dtype), b.input("w", shape[-1:], dtype)
    return b.spec(b.rms_norm(x, None, w, 1e-6))


def row_reduce(shape, op="sum", keepdim=False, dtype=torch.float32):
    b = Build()
    return b.spec(getattr(b, op)(b.input("x", shape, dtype), -1, keepdim))


def col_reduce(shape, op="sum", keepdim=False, dtype=torch.float32):
    b = Build()
    return b.spec(getattr(b, op)(b.input("x", shape, dtype), 0, keepdim))


def transpose2d_epilogue(shape, dtype=torch.float32):
    """relu(x^T * 2 + bias) with bias broadcast along the output's rows."""
    b = Build()
    x, bias = b.input("x", shape, dtype), b.input("bias", (shape[0],), dtype)
    return b.spec(b.relu(b.add(b.mul(b.transpose(x, 0, 1), 2.0), bias)))


def permute3d(shape, perm, dtype=torch.float32):
    """exp(x) -> permute -> + y (y in the output's layout); the prologue's exp(x) is an output too."""
    b = Build()
    x = b.input("x", shape, dtype)
    e = b.exp(b.mul(x, 0.5))
    y = b.input("y", tuple(shape[p] for p in perm), dtype)
    return b.spec(e, b.sub(b.permute(e, perm), y))


# ------------------------------------------------------------------ classify

@pytest.mark.parametrize("make, kind", [
    (lambda: gelu_chain((7, 13)), "pointwise"),
    (lambda: softmax((7, 13)), "persistent"),
    (lambda: layer_norm((7, 13)), "persistent"),
    (lambda: layer_norm((7, 13), residual=True), "persistent"),
    (lambda: rms_norm((7, 13)), "persistent"),
    (lambda: row_reduce((7, 13)), "reduction"),
    (lambda: row_reduce((3, 100000), keepdim=True), "reduction"),
    (lambda: col_reduce((13, 7), "amax"), "reduction"),
    (lambda: transpose2d_epilogue((7, 13)), "transpose"),
    (lambda: permute3d((3, 5, 7), (2, 0, 1)), "transpose"),
    (lambda: softmax((4, PERSISTENT_TOO_BIG)), None),         # row does not fit, two reductions
    (lambda: permute3d((3, 5, 7), (1, 0, 2)), None),          # keeps the last axis: a strided copy
    (lambda: gelu_chain((4, 8), torch.float64), None),        # float64 runs eager
    (lambda: middle_axis_sum(), None),                        # neither inner nor outer
])
def test_classify_names_the_scheduler_that_takes_each_pattern(make, kind):
    assert sch.classify(make()) == kind


PERSISTENT_TOO_BIG = sch.PERSISTENT_MAX_ROW + 1


def middle_axis_sum():
    b = Build()
    return b.spec(b.sum(b.input("x", (3, 4, 5)), 1))


def test_residual_add_and_layer_norm_is_one_persistent_kernel():
    spec = layer_norm((6, 40), residual=True)
    assert sch.classify(spec) == "persistent" and len(spec.outputs) == 2
    check(spec)


def test_spec_classify_rejects_answers_none_and_compile_says_why():
    spec = softmax((2, PERSISTENT_TOO_BIG))
    assert sch.classify(spec) is None
    with pytest.raises(sch.Unsupported, match="do not fit on chip"):
        sch.compile_kernel(spec)


def test_unsupported_op_is_rejected_with_a_clear_error():
    b = Build()
    x, w = b.input("x", (4, 8)), b.input("w", (3, 8))
    spec = b.spec(b.linear(x, w))
    assert sch.classify(spec) is None
    with pytest.raises(PlanError, match=r"op 'linear' \(producing 't0'\) is not a kernel primitive"):
        sch.compile_kernel(spec)


# ------------------------------------------------------------------ pointwise

@pytest.mark.parametrize("shape", [(7, 13), (300, 301), (5,), ()])
def test_pointwise_gelu_chain_matches_eager_fp32_on_uneven_shapes(shape):
    if shape == ():
        b = Build()
        spec = b.spec(b.gelu(b.input("x", ())))
    else:
        spec = gelu_chain(shape)
    check(spec, kind="pointwise")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pointwise_gelu_chain_in_16_bit_computes_in_fp32_and_rounds_once(dtype):
    check(gelu_chain((9, 33), dtype))


def test_pointwise_broadcasts_rows_columns_and_python_scalars():
    b = Build()
    x, col, row, one = (b.input("x", (7, 13)), b.input("col", (7, 1)), b.input("row", (13,)),
                        b.input("one", (1, 1)))
    y = b.div(b.sub(1.0, b.mul(x, col)), b.add(b.maximum(row, 0.5), one))
    z = b.add(b.mul(b.input("c", (5, 1, 13)), row), 3)   # 3-D against 1-D and a broadcast middle axis
    check(b.spec(y, z), kind="pointwise")


def _takes_one_argument(name):
    return sum(p.default is p.empty for p in OPS[name].signature.parameters.values()) == 1


def test_every_pointwise_primitive_matches_eager():
    """Every kernel primitive of the op table (its template), on any sign and on p > 0 (inside every
    op's domain: NaN outside it must match torch's NaN), plus pow's specialized exponents."""
    b = Build()
    x, p = b.input("x", (6, 11)), b.input("p", (6, 11))
    unary = [name for name in POINTWISE_UNARY if _takes_one_argument(name)]  # cast: its own test below
    terms = [getattr(b, name)(v) for name in unary for v in (x, p)]
    terms += [getattr(b, name)(u, v) for name in POINTWISE_BINARY for u, v in ((x, p), (p, x))]
    terms += [b.pow(p, 2.5), b.pow(x, 3), b.pow(2.0, x), b.pow(x, -0.5), b.tanh(b.mul(x, 1e-3))]
    assert {"exp", "log", "tanh", "pow", "maximum"} <= set(unary + list(POINTWISE_BINARY))
    check(b.spec(*terms), positive=("p",), kind="pointwise")


def test_cast_rounds_through_16_bit_and_handles_int_and_bool():
    b = Build()
    x, i = b.input("x", (5, 9)), b.input("i", (5, 9), torch.int32)
    h = b.mul(b.cast(x, torch.float16), 3.0)             # fp16 result of an fp16 op
    k = b.add(b.cast(b.mul(x, 10.0), torch.int32), i)    # truncation toward zero, int arithmetic
    m = b.cast(b.maximum(x, 0.0), torch.bool)
    f = b.div(i, 4)                                      # int / int is a float division
    check(b.spec(h, k, m, b.cast(m, torch.float32), f), kind="pointwise")


@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float16])
def test_cast_of_bool_and_int_to_a_16_bit_float(dst):
    """bool and int -> bf16/fp16 in a fused kernel (fuzz seed 11 case 70: Triton's interpreter could not cast
    int1 to 16 bits; seed 21 case 3265: it read an int64's bits as a bf16, -2 -> nan); both go through
    float32 (0 and 1 exactly), as torch converts."""
    b = Build()
    x, i = b.input("x", (5, 9)), b.input("i", (5, 9), torch.int64)
    check(b.spec(b.cast(b.gt(x, 0.0), dst), b.add(b.cast(b.gt(x, 0.5), dst), 1.0), b.cast(i, dst),
                 b.cast(b.cast(b.mul(x, 300.0), torch.int32), dst)), kind="pointwise")


def test_output_broadcast_along_the_loop_is_written_once_and_right():
    b = Build()
    x, w = b.input("x", (6, 10)), b.input("w", (10,))
    spec = b.spec(b.mul(x, w), b.exp(w))     # exp(w) is [10] while the loop is [6, 10]
    check(spec, kind="pointwise")


def test_non_contiguous_inputs_are_read_by_value():
    spec = gelu_chain((7, 13))
    ins = make_inputs(spec)
    ins["x"] = torch.randn(13, 7, device=DEVICE).t()          # a transposed view
    ins["a"] = torch.randn(7, 26, device=DEVICE)[:, ::2]      # a strided slice
    assert not ins["x"].is_contiguous() and not ins["a"].is_contiguous()
    check(spec, ins)


def test_zero_size_tensors_return_empty_outputs_without_launching():
    spec = gelu_chain((0, 13))
    kernel = sch.compile_kernel(spec)
    fn, kernel.fn = kernel.fn, None            # a launch would fail
    try:
        out = kernel(make_inputs(spec))
    finally:
        kernel.fn = fn
    assert out[spec.outputs[0]].shape == (0, 13)


def test_sum_over_an_empty_axis_is_zeros_as_in_torch():
    spec = row_reduce((3, 0))
    assert torch.equal(sch.compile_kernel(spec)(make_inputs(spec))["t0"], torch.zeros(3, device=DEVICE))


def test_wrong_input_shape_is_named():
    spec = gelu_chain((7, 13))
    ins = make_inputs(spec)
    ins["x"] = torch.randn(7, 12, device=DEVICE)
    with pytest.raises(ShapeError, match=r"input x has shape \(7, 12\)"):
        sch.compile_kernel(spec)(ins)


# ------------------------------------------------------------------ persistent

@pytest.mark.parametrize("shape", [(7, 13), (5, 1000), (70, 1000), (2, 3, 17)])
def test_softmax_is_persistent_and_matches_eager_fp32(shape):
    check(softmax(shape), kind="persistent")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softmax_and_layer_norm_in_16_bit(dtype):
    check(softmax((5, 1000), dtype), kind="persistent")
    check(layer_norm((7, 13), dtype), kind="persistent")


@pytest.mark.parametrize("shape", [(7, 13), (5, 1000)])
def test_layer_norm_with_weight_and_bias_matches_torch_layer_norm(shape):
    spec = layer_norm(shape)
    ins = make_inputs(spec)
    got = check(spec, ins, kind="persistent")[spec.outputs[0]]
    torch.testing.assert_close(got, F.layer_norm(ins["x"], shape[-1:], ins["w"], ins["bias"]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_weight_matches_torch_rms_norm(dtype):
    spec = rms_norm((9, 300), dtype)
    ins = make_inputs(spec)
    got = check(spec, ins, kind="persistent")[spec.outputs[0]]
    rtol, atol = TOL[dtype]
    want = F.rms_norm(ins["x"].float(), (300,), ins["w"].float(), 1e-6).to(dtype)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_persistent_reads_per_row_operands_and_passes_inputs_through():
    """x * rsqrt(sum(x^2) + s) with s [M, 1]; the input x is also an output (a copy)."""
    b = Build()
    x, s = b.input("x", (9, 50)), b.input("s", (9, 1))
    y = b.mul(x, b.rsqrt(b.add(b.sum(b.mul(x, x), -1, True), s)))
    spec = b.spec(y, x, b.sum(y, -1, True))
    check(spec, kind="persistent", positive=("s",))


def test_persistent_normalizes_over_two_trailing_axes():
    b = Build()
    x, w = b.input("x", (4, 3, 10)), b.input("w", (3, 10))
    check(b.spec(b.layer_norm(x, (3, 10), w, None)), kind="persistent")


# ------------------------------------------------------------------ reduction

@pytest.mark.parametrize("shape", [(7, 13), (5, 1000), (3, 4100), (11,)])
@pytest.mark.parametrize("keepdim", [False, True])
def test_row_sum_matches_eager_for_any_row_length(shape, keepdim):
    check(row_reduce(shape, "sum", keepdim), kind="reduction")


def test_long_rows_loop_over_column_blocks():
    spec = row_reduce((3, 4100))
    cfg = dict(sch.heuristics(spec, sch.schedule(spec)).constexprs)
    assert cfg["BLOCK_K"] < 4100          # the interpreted kernel does loop
    check(spec)


@pytest.mark.parametrize("shape", [(13, 7), (1000, 5), (4100, 3)])
@pytest.mark.parametrize("keepdim", [False, True])
def test_column_sum_is_an_outer_reduction_matching_eager(shape, keepdim):
    spec = col_reduce(shape, "sum", keepdim)
    assert sch.schedule(spec).outer
    check(spec, kind="reduction")


@pytest.mark.parametrize("make", [lambda: row_reduce((7, 13), "amax", True), lambda: col_reduce((9, 5), "amax"),
                                  lambda: row_reduce((3, 4100), "amax")])
def test_amax_matches_eager(make):
    check(make(), kind="reduction")


def test_amax_and_softmax_propagate_nan_as_torch():
    for spec in (row_reduce((4, 300), "amax"), col_reduce((300, 4), "amax"), softmax((4, 300))):
        ins = make_inputs(spec)
        ins["x"][1, 2] = float("nan")
        got = check(spec, ins)[spec.outputs[0]]
        assert got.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_row_and_column_sums_in_16_bit_accumulate_in_fp32(dtype):
    check(row_reduce((5, 1000), dtype=dtype))
    check(col_reduce((1000, 5), dtype=dtype))


def test_reduction_with_prologue_and_epilogue_is_one_kernel():
    """sqrt(mean((x + r) * w)^2 + bias): the residual sum is also an output, stored from inside the loop."""
    b = Build()
    x, r, w, bias = b.input("x", (6, 4100)), b.input("r", (6, 4100)), b.input("w", (4100,)), b.input("bias", (6,))
    h = b.add(x, r)
    m = b.mean(b.mul(h, w), -1)
    spec = b.spec(h, b.sqrt(b.add(b.mul(m, m), bias)))
    check(spec, kind="reduction", positive=("bias",))


def test_column_sum_with_prologue_and_epilogue():
    b = Build()
    x, s = b.input("x", (33, 7)), b.input("s", (33, 1))
    spec = b.spec(b.relu(b.sub(b.sum(b.mul(x, s), 0, True), 1.0)))
    check(spec, kind="reduction")


# ------------------------------------------------------------------ transpose

@pytest.mark.parametrize("shape", [(7, 13), (300, 5)])
def test_2d_transpose_with_epilogue_matches_eager(shape):
    check(transpose2d_epilogue(shape), kind="transpose")


@pytest.mark.parametrize("perm", [(2, 0, 1), (0, 2, 1), (2, 1, 0), (1, 2, 0)])
def test_3d_permute_with_prologue_and_epilogue_matches_eager(perm):
    check(permute3d((3, 5, 7), perm), kind="transpose")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_transpose_in_16_bit(dtype):
    check(transpose2d_epilogue((33, 65), dtype), kind="transpose")


# ------------------------------------------------------------------ large tensors

@pytest.mark.parametrize("make", [lambda: gelu_chain((7, 13)), lambda: softmax((5, 33)),
                                  lambda: row_reduce((3, 4100)), lambda: col_reduce((13, 7)),
                                  lambda: permute3d((3, 5, 7), (2, 0, 1))])
def test_offsets_are_int64_past_two_billion_elements(make, monkeypatch):
    """Every scheduler computes offsets in int64 once a tensor could overflow int32 (here: the
    threshold lowered, so that small tensors take the same path)."""
    spec = make()
    assert ".to(tl.int64)" not in sch.generate_source(spec)
    monkeypatch.setattr(sch, "_BIG", 10)
    assert "tl.program_id(0).to(tl.int64)" in sch.generate_source(spec)
    sch.clear_cache()
    try:
        check(spec)
    finally:
        sch.clear_cache()


# ------------------------------------------------------------------ cache and heuristics

def test_same_spec_compiles_once_per_content_hash():
    sch.clear_cache()
    first = sch.compile_kernel(softmax((3, 7)))
    again = sch.compile_kernel(softmax((3, 7)))          # an equal spec built anew
    other = sch.compile_kernel(softmax((3, 8)))
    assert again is first and other is not first
    assert sch.cache_info()["compiled"] == 2 and sch.cache_info()["hits"] == 1
    assert first.path.name == f"{softmax((3, 7)).key()}.py" and first.path.parent == sch.cache_dir()
    assert first.path.read_text() == first.source


def test_gpu_heuristics_stay_in_the_tuned_ranges():
    big = (16384, 12288)
    pw = sch.heuristics(gelu_chain(big, torch.bfloat16), sch.schedule(gelu_chain(big, torch.bfloat16)), False)
    assert 1024 <= dict(pw.constexprs)["BLOCK"] <= 4096
    spec = layer_norm(big, torch.bfloat16)
    ln = dict(sch.heuristics(spec, sch.schedule(spec), False).constexprs)
    assert ln["BLOCK_N"] == 16384 and ln["BLOCK_M"] == 1
    spec = softmax((16384, 128), torch.bfloat16)
    sm = sch.heuristics(spec, sch.schedule(spec), False)
    assert 4096 <= math.prod(dict(sm.constexprs).values()) <= 16384 and sm.num_warps >= 4
    spec = row_reduce(big, dtype=torch.bfloat16)
    assert 1024 <= dict(sch.heuristics(spec, sch.schedule(spec), False).constexprs)["BLOCK_K"] <= 4096
    spec = transpose2d_epilogue(big, torch.bfloat16)
    tr = dict(sch.heuristics(spec, sch.schedule(spec), False).constexprs)
    assert (tr["BLOCK_A"], tr["BLOCK_B"]) == (64, 64)


def test_interpreter_heuristics_use_large_blocks():
    spec = softmax((70, 1000))
    cfg = sch.heuristics(spec, sch.schedule(spec), True)
    assert dict(cfg.constexprs)["BLOCK_M"] == 64 and cfg.grid == 2


# ------------------------------------------------------------------ reductions beside broadcasts

def test_sum_beside_a_wider_pointwise_op_is_not_counted_once_per_broadcast_copy():
    """sum(x[4, 1]) over all axes with mul(w[4, 3], x) in the same spec: the loop is [4, 3], but the sum
    runs over x's own extents (it came out 3x too large when fused)."""
    b = Build()
    x, w = b.input("x", (4, 1)), b.input("w", (4, 3))
    spec = b.spec(b.sum(x, None, True), b.mul(w, x))
    assert sch.classify(spec) is None  # no single loop holds both: segmentation splits them


def test_layer_norm_beside_a_taller_pointwise_op_is_not_fused_over_the_broadcast():
    """layer_norm(x[1, 4], normalized_shape=(1, 4)) reduces both axes; neg(z[2, 1]) widens axis 0 to 2."""
    b = Build()
    x, z = b.input("x", (1, 4)), b.input("z", (2, 1))
    spec = b.spec(b.layer_norm(x, (1, 4)), b.neg(z))
    assert sch.classify(spec) is None


@pytest.mark.parametrize("xshape, wshape, dims", [
    ((4, 1), (4, 3), None), ((4, 1), (4, 3), 1), ((1, 4), (3, 4), 0), ((2, 1, 5), (2, 3, 5), (1, 2)),
    ((1, 4), (2, 1), (0, 1)), ((5, 1), (1, 6), 0),
])
@pytest.mark.parametrize("op", ["sum", "amax"])
def test_reduction_fused_with_a_broadcasting_op_matches_eager_or_is_declined(xshape, wshape, dims, op):
    """Whatever the scheduler takes of a reduction beside a broadcast, it computes what eager computes."""
    b = Build()
    x, w = b.input("x", xshape), b.input("w", wshape)
    r = getattr(b, op)(x, dims, True)
    spec = b.spec(b.add(b.mul(w, x), 1.0), r)
    if sch.classify(spec) is not None:
        check(spec)


@pytest.mark.parametrize("xshape, eshape", [((4, 8), (4, 8)), ((4, 8), (8,)), ((4, 8), (4, 1)), ((8,), (4, 8)),
                                            ((4, 8), ()), ((), (4, 8)), ((4, 1), (1, 8))])
def test_pow_with_a_tensor_exponent_of_any_broadcast_shape_matches_eager(xshape, eshape):
    """pow(x, e) and pow(|x|, -e) with e a tensor (a 0-d exponent loads as a scalar: it failed under the
    interpreter)."""
    b = Build()
    x, e = b.input("x", xshape), b.input("e", eshape)
    spec = b.spec(b.pow(x, e), b.pow(b.abs(x), b.neg(e)), b.pow(2.0, e))
    check(spec, kind="pointwise")


# ------------------------------------------------------------------ split reductions, cache hints

def check_schedule(spec, s, cfg=None, inputs=None):
    """load_kernel(spec, s) (optionally launched with cfg) equals run_eager, as check does."""
    kernel = sch.load_kernel(spec, s)
    if cfg is not None:
        kernel._config = cfg
    inputs = make_inputs(spec) if inputs is None else inputs
    got = kernel(inputs)
    up = {n: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for n, t in inputs.items()}
    want = sch.run_eager(spec, up)
    for n in spec.outputs:
        rtol, atol = TOL[spec.dtype(n)]
        torch.testing.assert_close(got[n], want[n].to(spec.dtype(n)), rtol=rtol, atol=atol, equal_nan=True)
    return got


def split_schedule(spec, split):
    s = sch.schedule(spec)
    assert s.outer
    return dataclasses.replace(s, split=split)


@pytest.mark.parametrize("shape", [(4100, 7), (1000, 5), (64, 300)])
@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.parametrize("keepdim", [False, True])
def test_split_column_sum_matches_eager(shape, split, keepdim):
    """Row chunks summed apart into the fp32 workspace, then the finishing pass (uneven chunks: 4100 rows
    in 3; a chunk past the rows when 64 rows split 8 with blocks of 64)."""
    spec = col_reduce(shape, "sum", keepdim)
    s = split_schedule(spec, split)
    src = sch.generate_source(spec, s)
    assert "def finish(" in src and "ws" in src
    check_schedule(spec, s)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_column_sum_in_16_bit_keeps_fp32_partials(dtype):
    spec = col_reduce((2000, 33), dtype=dtype)
    check_schedule(spec, split_schedule(spec, 4))


def test_split_column_sum_with_small_blocks_and_many_programs():
    """A GPU-like launch under the interpreter: blocks of 16 x 4 columns, grid = column blocks x chunks."""
    spec = col_reduce((300, 10))
    s = split_schedule(spec, 4)
    cfg = sch.LaunchConfig(-(-10 // 4) * 4, (("BLOCK_K", 16), ("BLOCK_N", 4), ("BLOCK_F", 4)), 4)
    check_schedule(spec, s, cfg)


def test_split_amax_propagates_nan_and_matches_eager():
    spec = col_reduce((900, 6), "amax")
    s = split_schedule(spec, 4)
    check_schedule(spec, s)
    ins = make_inputs(spec)
    ins["x"][700, 2] = float("nan")   # in the last chunk only
    got = check_schedule(spec, s, inputs=ins)[spec.outputs[0]]
    assert got[2].isnan() and not got[3].isnan()


def test_split_column_sum_with_prologue_outputs_and_epilogue():
    """relu(sum(x * s, 0) - 1) with x * s also an output: the prologue output is stored by every chunk's
    programs (each element once), the epilogue runs in the finishing pass."""
    b = Build()
    x, sc = b.input("x", (2100, 7)), b.input("s", (2100, 1))
    h = b.mul(x, sc)
    spec = b.spec(h, b.relu(b.sub(b.sum(h, 0, True), 1.0)))
    check_schedule(spec, split_schedule(spec, 4))


def test_outer_split_is_chosen_by_shape():
    """Long column sums over few column blocks split; short ones, or ones whose columns fill the GPU, do not."""
    assert sch.outer_split(16384, 12288) > 1
    assert sch.outer_split(16384, 12288) * -(-12288 // sch.SPLIT_BLOCK_N) >= sch.SPLIT_PROGRAMS
    assert sch.outer_split(1000, 12288) == 1 and sch.outer_split(16384, 10 ** 6) == 1
    assert 16384 // sch.outer_split(16384, 16) >= sch.SPLIT_MIN_ROWS
    big = col_reduce((16384, 12288), dtype=torch.bfloat16)
    s = sch.schedule(big)
    cfg = sch.heuristics(big, s, False)
    c = dict(cfg.constexprs)
    assert s.split == sch.outer_split(16384, 12288)
    assert cfg.grid == -(-12288 // c["BLOCK_N"]) * s.split and c["BLOCK_K"] * c["BLOCK_N"] <= 16384
    assert sch.schedule(col_reduce((13, 7))).split == 1
    assert "def finish(" not in sch.generate_source(col_reduce((13, 7)))


def test_cache_hints_mark_streamed_loads_evict_first_and_broadcast_operands_evict_last():
    spec = rms_norm((64, 70), torch.bfloat16)
    s = dataclasses.replace(sch.schedule(spec), hints=True)
    src = sch.generate_source(spec, s)
    x_load = next(line for line in src.splitlines() if "v_x = tl.load(" in line)
    w_load = next(line for line in src.splitlines() if "v_w = tl.load(" in line)
    assert 'eviction_policy="evict_first"' in x_load and 'eviction_policy="evict_last"' in w_load
    check_schedule(spec, s)
    assert "eviction_policy" not in sch.generate_source(spec)   # off by default (measured no gain)


# ------------------------------------------------------------------ persistent in passes (looped, pieces)

def in_passes(spec, **changes):
    """spec's persistent schedule with a looped (loop_block=) or pieces (pieces=) row."""
    s = sch.schedule(spec)
    assert s.kind == "persistent" and s.pieces == 1
    return dataclasses.replace(s, **{"loop_block": None, **changes})


def rows_config(rows, block_m):
    return sch.LaunchConfig(-(-rows // block_m), (("BLOCK_M", block_m),), 4)


def run_schedule(spec, s, inputs, cfg=None):
    kernel = sch.load_kernel(spec, s)
    if cfg is not None:
        kernel._config = cfg
    return kernel(inputs)


FORMS = [dict(loop_block=64), dict(loop_block=64, hints=True), dict(loop_block=8), dict(pieces=2),
         dict(pieces=3)]


@pytest.mark.parametrize("cols", [256, 300, 13])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("block_m", [1, 4])
def test_rms_norm_in_passes_equals_one_shot_and_torch_in_float64(cols, form, block_m):
    """Rows that divide the chunk (256 / 64) and not (300, 13); 9 rows, so BLOCK_M 4 masks the last block."""
    spec = rms_norm((9, cols))
    ins = make_inputs(spec)
    got = run_schedule(spec, in_passes(spec, **form), ins, rows_config(9, block_m))[spec.outputs[0]]
    one_shot = sch.compile_kernel(spec)(ins)[spec.outputs[0]]
    want = F.rms_norm(ins["x"].double(), (cols,), ins["w"].double(), 1e-6)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, one_shot, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", [dict(loop_block=64), dict(loop_block=32, hints=True), dict(pieces=2)])
def test_rms_norm_in_passes_in_bf16(form):
    spec = rms_norm((5, 96), torch.bfloat16)
    ins = make_inputs(spec)
    got = run_schedule(spec, in_passes(spec, **form), ins, rows_config(5, 2))[spec.outputs[0]]
    want = F.rms_norm(ins["x"].double(), (96,), ins["w"].double(), 1e-6)
    torch.testing.assert_close(got.double(), want, rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(got, sch.compile_kernel(spec)(ins)[spec.outputs[0]], rtol=1.6e-2, atol=1.6e-2)


def test_looped_source_has_no_column_mask_when_the_chunk_divides_the_row():
    spec = rms_norm((4, 12288), torch.bfloat16)
    src = sch.generate_source(spec, in_passes(spec, loop_block=4096))
    assert "cols_mask" not in src and src.count("for k0 in range(0, 12288, 4096)") == 2
    assert "cols_mask" in sch.generate_source(spec, in_passes(spec, loop_block=8192))
    pieces = sch.generate_source(spec, in_passes(spec, pieces=2))
    assert "tl.arange(0, 8192)" in pieces and "tl.arange(0, 4096)" in pieces and "mask" not in pieces.replace(
        "mask=rows_mask", "").replace("rows_mask =", "")
    assert dict(sch.heuristics(spec, in_passes(spec, loop_block=4096), False).constexprs) == {"BLOCK_M": 1}


def test_looped_hints_keep_the_row_for_the_final_pass_and_stream_it_out():
    spec = rms_norm((4, 256), torch.bfloat16)
    src = sch.generate_source(spec, in_passes(spec, loop_block=64, hints=True))
    first, final = src.split("for k0")[1:]
    assert 'evict_last' in next(line for line in first.splitlines() if "tl.load(in_x" in line)
    assert 'evict_first' in next(line for line in final.splitlines() if "tl.load(in_x" in line)
    assert 'evict_last' in next(line for line in final.splitlines() if "tl.load(in_w" in line)


@pytest.mark.parametrize("make", [lambda d: layer_norm((7, 300), d), lambda d: layer_norm((7, 300), d, residual=True),
                                  lambda d: softmax((7, 300), d)])
@pytest.mark.parametrize("form", [dict(loop_block=64), dict(loop_block=128, hints=True), dict(pieces=2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_residual_and_softmax_in_passes_match_eager(make, form, dtype):
    """Two reduction passes (the mean, then the variance; the max, then the sum of exp), the residual sum
    an output stored once, by the final pass."""
    spec = make(dtype)
    check_schedule(spec, in_passes(spec, **form), rows_config(7, 2))


@pytest.mark.parametrize("form", [dict(loop_block=16), dict(pieces=2)])
def test_passes_store_per_row_outputs_once_and_read_per_row_operands(form):
    """x * rsqrt(sum(x^2) + s) with s [M, 1], x passed through and sum(y) [M, 1] (a second pass) as outputs."""
    b = Build()
    x, s = b.input("x", (9, 50)), b.input("s", (9, 1))
    y = b.mul(x, b.rsqrt(b.add(b.sum(b.mul(x, x), -1, True), s)))
    spec = b.spec(y, x, b.sum(y, -1, True), b.mul(s, 2.0))
    ins = make_inputs(spec, positive=("s",))
    check_schedule(spec, in_passes(spec, **form), rows_config(9, 4), inputs=ins)


@pytest.mark.parametrize("form", [dict(loop_block=8), dict(pieces=3)])
def test_passes_normalize_over_two_trailing_axes(form):
    b = Build()
    x, w = b.input("x", (4, 3, 10)), b.input("w", (3, 10))
    spec = b.spec(b.layer_norm(x, (3, 10), w, None))
    check_schedule(spec, in_passes(spec, **form), rows_config(4, 2))


@pytest.mark.parametrize("form", [dict(loop_block=64), dict(pieces=2)])
def test_softmax_in_passes_propagates_nan(form):
    spec = softmax((4, 300))
    ins = make_inputs(spec)
    ins["x"][1, 200] = float("nan")
    got = check_schedule(spec, in_passes(spec, **form), inputs=ins)[spec.outputs[0]]
    assert got[1].isnan().all() and not got[0].isnan().any()


def test_pieces_cover_the_row_with_powers_of_two():
    assert sch._row_pieces(12288, 2) == [(0, 8192, False), (8192, 4096, False)]
    assert sch._row_pieces(300, 3) == [(0, 256, False), (256, 32, False), (288, 16, True)]
    assert sch._row_pieces(64, 4) == [(0, 64, False)]


def test_loop_block_is_a_dividing_power_of_two_and_bad_forms_are_refused():
    assert sch.persistent_loop_block(12288) == 4096 and sch.persistent_loop_block(12288, 8192) == 4096
    assert sch.persistent_loop_block(3 * 2048 + 1024) == 1024 and sch.persistent_loop_block(1000) == 1024
    spec = rms_norm((4, 96))
    for bad in (dict(loop_block=48), dict(loop_block=32, pieces=2)):
        with pytest.raises(sch.Unsupported):
            sch.generate_source(spec, in_passes(spec, **bad))
    row = row_reduce((4, 96))
    with pytest.raises(sch.Unsupported, match="only the persistent"):
        sch.generate_source(row, dataclasses.replace(sch.schedule(row), loop_block=32))


def test_rows_from_persistent_loop_from_take_the_looped_form(monkeypatch):
    """The switch the sweep's winner is set through: rows of at least PERSISTENT_LOOP_FROM elements loop
    over chunks of persistent_loop_block(row), launched with PERSISTENT_LOOP_TILE and _WARPS on GPU."""
    monkeypatch.setattr(sch, "PERSISTENT_LOOP_FROM", 500)
    big = rms_norm((3, 12288), torch.bfloat16)
    s = sch.schedule(big)
    assert s.loop_block == 4096 and s.hints == sch.PERSISTENT_LOOP_HINTS
    cfg = sch.heuristics(big, s, False)
    assert cfg.constexprs == (("BLOCK_M", 1),) and cfg.num_warps == sch.PERSISTENT_LOOP_WARPS and cfg.grid == 3
    assert sch.schedule(rms_norm((3, 300))).loop_block is None
    spec = rms_norm((6, 520))
    s = sch.schedule(spec)
    assert s.loop_block == 1024
    check_schedule(spec, s)


def test_long_rows_of_one_reduction_level_loop_by_default_and_two_levels_do_not():
    """The sweep's winner (rms_norm [16384, 12288] on an H200: looped 4096, 16 warps, hints = torch.compile,
    one-shot 4% slower) is the default for rows from PERSISTENT_LOOP_FROM with one reduction level;
    layer_norm (mean, then variance: three reads of the row looped) keeps the one-shot row."""
    assert sch.schedule(rms_norm((3, 12288), torch.bfloat16)).loop_block == 4096
    assert sch.schedule(rms_norm((3, 4096), torch.bfloat16)).loop_block is None
    ln = layer_norm((3, 12288))
    assert sch.schedule(ln).kind == "persistent" and sch.schedule(ln).loop_block is None
