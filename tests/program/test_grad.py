"""Gradients: every op's vjp (egraph_did/ops.py) agrees with torch.autograd in float64 on the op cases of
tests/core/test_ops.py; every op states a vjp or why it has none; ed.grad of whole models agrees with
torch.autograd run through the reference evaluator; bad arguments are refused naming the fix; and the
gradient fusions optimize and simulate on a 4-rank mesh to the single-device numbers.
"""
from __future__ import annotations

import pytest
import torch

import egraph_did as ed
from egraph_did import DtypeError, ShapeError
from egraph_did.errors import UnknownNameError
from egraph_did.models import gpt_layer, mlp
from egraph_did.ops import FLOAT_DTYPES, OPS

from test_ops import CASES, build

F64 = torch.float64
LOW = (torch.float16, torch.bfloat16)


def _grad_dtype(case):
    return F64 if F64 in case.dtypes else case.dtypes[0]


def _float_outputs(case):
    """Names and tensors of the case's floating-point outputs (those a loss can be made of)."""
    fd, inputs, outs, names = build(case, _grad_dtype(case))
    return [(n, o) for n, o in zip(names, outs) if o.dtype in FLOAT_DTYPES]


GRAD_CASES = [c for c in CASES if OPS[c.op].vjp is not None and _float_outputs(c)
              and any(v.dtype in FLOAT_DTYPES for v in c.inputs(_grad_dtype(c)).values())]


def _with_loss(case):
    """(fd, inputs, wrt): the case's fusion with loss = sum_i sum(out_i * cot_i), random cotangents cot_i
    as float64 inputs, so that every output's gradient is a random tensor, not ones."""
    dtype = _grad_dtype(case)
    fd, inputs, outs, names = build(case, dtype)
    terms = []
    for i, (n, o) in enumerate(zip(names, outs)):
        if o.dtype not in FLOAT_DTYPES:
            continue
        g = torch.Generator().manual_seed(100 + i)
        inputs[f"cot{i}"] = torch.randn(o.shape, generator=g, dtype=F64)
        terms.append(fd.ops.sum(fd.ops.mul(o, fd.define_tensor(o.shape, F64, name=f"cot{i}"))))
    loss = terms[0]
    for t in terms[1:]:
        loss = fd.ops.add(loss, t)
    fd.add_output(loss, name="loss")
    wrt = [k for k, v in case.inputs(dtype).items() if v.dtype in FLOAT_DTYPES]
    return fd, inputs, wrt


def _torch_grads(case, inputs, wrt):
    """d loss / d input by torch.autograd through the case's torch function."""
    leaves = {k: v.detach().clone().requires_grad_(k in wrt) for k, v in inputs.items()}
    outs = case.torch_fn(leaves)
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    loss = sum((o * leaves[f"cot{i}"]).sum() for i, o in enumerate(outs) if o.dtype in FLOAT_DTYPES)
    got = torch.autograd.grad(loss, [leaves[w] for w in wrt], allow_unused=True)
    return {w: torch.zeros_like(inputs[w]) if g is None else g for w, g in zip(wrt, got)}


def _tol(tensors) -> float:
    dts = {t.dtype for t in tensors}
    return 2e-2 if dts & set(LOW) else (1e-5 if torch.float32 in dts else 1e-9)


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_every_op_gradient_equals_torch_autograd(case):
    fd, inputs, wrt = _with_loss(case)
    got = ed.evaluate(ed.grad(fd, loss="loss", wrt=wrt), inputs)
    want = _torch_grads(case, inputs, wrt)
    tol = _tol(list(inputs.values()))
    for w in wrt:
        assert got[f"grad_{w}"].dtype == inputs[w].dtype, w
        torch.testing.assert_close(got[f"grad_{w}"], want[w], rtol=tol, atol=tol, msg=lambda m: f"grad_{w}: {m}")


def test_every_op_states_a_vjp_or_why_it_has_none():
    silent = sorted(n for n, d in OPS.items() if d.vjp is None and not d.no_grad)
    assert not silent, f"ops with neither a vjp nor a no_grad reason in egraph_did/ops.py: {silent}"


def test_every_op_with_a_vjp_is_checked_against_torch():
    checked = {c.op for c in GRAD_CASES}
    unchecked = sorted(n for n, d in OPS.items() if d.vjp is not None and n not in checked)
    assert not unchecked, f"ops with a vjp but no float case in tests/core/test_ops.py CASES: {unchecked}"


def test_the_ops_without_a_gradient_are_comparisons_masks_the_rfactor_halves_the_backward_ops_and_routing():
    comparisons = {"gt", "eq", "ne", "lt", "le", "ge"}
    masks = {"bitwise_and", "bitwise_or", "bitwise_xor", "logical_and", "logical_or", "logical_not", "any", "all"}
    routing = {"argsort", "histc"}  # positions and counts: piecewise constant
    assert {n for n, d in OPS.items() if d.no_grad} == comparisons | masks | routing | {
        "welford_blocks", "welford_merge", "attention_blocks", "opaque_grad", "sdpa_backward"}


# ---------------------------------------------------------------------- the program transform


def _fd(shape=(3,)):
    fd = ed.FusionDefinition()
    x = fd.define_tensor(shape, F64, name="x")
    return fd, x


def test_a_tensor_read_twice_gets_the_sum_of_its_gradients():
    fd, x = _fd()
    fd.add_output(fd.ops.sum(fd.ops.add(fd.ops.exp(x), fd.ops.mul(x, 3.0))), name="loss")
    X = torch.tensor([0.0, 1.0, 2.0], dtype=F64)
    torch.testing.assert_close(ed.evaluate(ed.grad(fd, "loss"), {"x": X})["grad_x"], X.exp() + 3.0)


def test_an_input_the_loss_does_not_read_gets_zeros_and_the_outputs_are_kept():
    fd, x = _fd()
    y = fd.define_tensor((3,), F64, name="y")
    fd.add_output(fd.ops.exp(y), name="e")
    fd.add_output(fd.ops.sum(x), name="loss")
    g = ed.grad(fd, "loss", wrt=["x", "y"])
    assert list(g.fusion.outputs) == ["e", "loss", "grad_x", "grad_y"]
    out = ed.evaluate(g, {"x": torch.ones(3, dtype=F64), "y": torch.ones(3, dtype=F64)})
    assert torch.equal(out["grad_y"], torch.zeros(3, dtype=F64)) and torch.equal(out["grad_x"], torch.ones(3, dtype=F64))


def test_value_and_grad_computes_only_the_loss_and_the_gradients():
    fd, x = _fd()
    fd.add_output(fd.ops.tanh(x), name="t")
    fd.add_output(fd.ops.sum(fd.ops.exp(x)), name="loss")
    g = ed.value_and_grad(fd, "loss")
    assert list(g.fusion.outputs) == ["loss", "grad_x"]
    assert "tanh" not in {e.op.name for e in g.fusion.exprs}


def test_the_gradient_of_a_loss_that_is_a_sum_of_an_input_is_ones():
    fd, x = _fd((2, 2))
    fd.add_output(fd.ops.sum(x), name="loss")
    out = ed.evaluate(ed.grad(fd, "loss"), {"x": torch.full((2, 2), float("nan"), dtype=F64)})
    assert torch.equal(out["grad_x"], torch.ones(2, 2, dtype=F64))  # the seed is 1 even where the loss is NaN


def test_gradients_skip_integer_paths():
    with ed.FusionDefinition() as fd:
        ids = fd.define_tensor((5,), torch.int64, name="ids")
        table = fd.define_tensor((4, 3), F64, name="table")
        fd.add_output(fd.ops.sum(fd.ops.embedding(ids, table)), name="loss")
    assert ed.grad(fd, "loss").fusion.outputs.keys() == {"loss", "grad_table"}  # ids is not differentiated
    ids_v = torch.tensor([0, 2, 2, 3, 0])
    got = ed.evaluate(ed.grad(fd, "loss"), {"ids": ids_v, "table": torch.zeros(4, 3, dtype=F64)})["grad_table"]
    assert got[:, 0].tolist() == [2.0, 0.0, 2.0, 1.0]  # each row counts the ids that picked it


# ---------------------------------------------------------------------- errors name the fix


def _loss_fd():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((2, 3), F64, name="x")
        ids = fd.define_tensor((2,), torch.int64, name="ids")
        h = fd.ops.exp(x)
        fd.add_output(h, name="h")
        fd.add_output(fd.ops.sum(fd.ops.mul(h, fd.ops.cast(fd.ops.unsqueeze(ids, 1), F64))), name="loss")
    return fd


@pytest.mark.parametrize("kwargs, error, words", [
    ({"loss": "los"}, UnknownNameError, ["'los' is not an output", "did you mean 'loss'", "['h', 'loss']"]),
    ({"loss": "h"}, ShapeError, ["shape (2, 3)", "scalar", "fd.ops.sum(h)"]),
    ({"loss": "loss", "wrt": ["ids"]}, DtypeError, ["'ids' is int64", "floating-point", "drop 'ids'", "['x']"]),
    ({"loss": "loss", "wrt": ["h"]}, ShapeError, ["computed by the fusion, not an input", "['x']"]),
    ({"loss": "loss", "wrt": ["w"]}, UnknownNameError, ["'w' is not an input", "['x']"]),
    ({"loss": "loss", "wrt": "x"}, ShapeError, ["wrt=['x']"]),
    ({"loss": "loss", "wrt": ["x", "x"]}, ShapeError, ["twice"]),
])
def test_bad_arguments_are_refused_naming_what_to_pass(kwargs, error, words):
    with pytest.raises(error) as e:
        ed.grad(_loss_fd(), **kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_an_intermediate_named_as_the_loss_says_to_output_it():
    fd = _loss_fd()
    with pytest.raises(UnknownNameError, match="not an output: fd.add_output it first"):
        ed.grad(fd, loss="mul_3")


def test_an_integer_loss_is_refused():
    with ed.FusionDefinition() as fd:
        i = fd.define_tensor((3,), torch.int64, name="i")
        fd.add_output(fd.ops.sum(i), name="n")
    with pytest.raises(DtypeError, match="cast it"):
        ed.grad(fd, loss="n", wrt=[])


def test_differentiating_through_an_op_without_a_vjp_names_it_and_why():
    fd, x = _fd((3, 4))
    var, _ = fd.ops.welford_merge(fd.ops.welford_blocks(x, 1, 2), 1)
    fd.add_output(fd.ops.sum(var), name="loss")
    with pytest.raises(ShapeError, match="welford_merge.*var_mean"):
        ed.grad(fd, "loss")


def test_a_gradient_name_taken_by_a_tensor_is_refused():
    fd, x = _fd()
    fd.add_output(fd.ops.exp(x), name="grad_x")
    fd.add_output(fd.ops.sum(x), name="loss")
    with pytest.raises(ShapeError, match="'grad_x'.*rename"):
        ed.grad(fd, "loss")


# ---------------------------------------------------------------------- whole models


def _rand_inputs(fusion, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g, dtype=t.dtype) * (0.5 if t.ndim > 1 else 1.0)
            for t in fusion.inputs}


def _with_cotangent_loss(fd, out="y"):
    """loss = sum(out * cot), cot a new input."""
    y = fd[out]
    cot = fd.define_tensor(y.shape, y.dtype, name="cot")
    fd.add_output(fd.ops.sum(fd.ops.mul(y, cot)), name="loss")
    return fd


def _autograd_through_evaluate(fd, inputs, wrt):
    """torch.autograd through the reference evaluator (each op's torch reference): ground truth."""
    leaves = {k: v.detach().clone().requires_grad_(k in wrt) for k, v in inputs.items()}
    loss = ed.evaluate(fd, leaves)["loss"]
    return dict(zip(wrt, torch.autograd.grad(loss, [leaves[w] for w in wrt])))


MODELS = {
    "mlp": lambda dt: mlp(tokens=6, hidden=8, dtype=dt),
    "gpt_layer": lambda dt: gpt_layer(batch=2, seq=4, hidden=8, heads=2, dtype=dt),
}


@pytest.mark.parametrize("name", MODELS)
def test_model_gradients_equal_torch_autograd(name):
    fd = _with_cotangent_loss(MODELS[name](F64))
    inputs = _rand_inputs(fd.fusion)
    wrt = [t.name for t in fd.fusion.inputs if t.name != "cot"]
    got = ed.evaluate(ed.grad(fd, "loss", wrt), inputs)
    want = _autograd_through_evaluate(fd, inputs, wrt)
    for w in wrt:
        torch.testing.assert_close(got[f"grad_{w}"], want[w], rtol=1e-9, atol=1e-9, msg=lambda m: f"grad_{w}: {m}")


def test_the_mlp_gradient_equals_the_hand_written_backward():
    fd = _with_cotangent_loss(mlp(tokens=6, hidden=8, dtype=F64))
    inputs = _rand_inputs(fd.fusion)
    got = ed.evaluate(ed.grad(fd, "loss", ["x", "w1", "w2"]), inputs)
    hand = ed.evaluate(ed.models.mlp_with_backward(6, 8, F64),
                       {"x": inputs["x"], "w1": inputs["w1"], "w2": inputs["w2"], "dy": inputs["cot"]})
    for w in ("x", "w1", "w2"):
        torch.testing.assert_close(got[f"grad_{w}"], hand[f"d{w}"], rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------- sharded: optimize, then simulate


def _pin(t, mesh, axis):
    """t replicated on mesh (axis None) or split on `axis` over DIDx."""
    t.set_device_mesh(mesh)
    if axis is not None:
        t.outer_split(axis, mesh.size)
        t.axis(axis).parallelize(ed.ParallelType.DIDx)


PLANS = {  # model, then pins on the gradient fusion's tensors: data parallel and tensor parallel
    "mlp-data-parallel": (lambda: mlp(tokens=8, hidden=16), {"x": 0, "cot": 0, "grad_w1": None, "grad_w2": None}),
    "mlp-tensor-parallel": (lambda: mlp(tokens=8, hidden=16), {"w1": 0, "w2": 1, "grad_w1": 0, "grad_w2": 1}),
    "gpt-layer-data-parallel": (lambda: gpt_layer(batch=4, seq=8, hidden=16, heads=4),
                                {"x": 0, "cot": 0, "grad_wq": None, "grad_w1": None}),
    "gpt-layer-free": (lambda: gpt_layer(batch=2, seq=8, hidden=16, heads=4), {}),
}


@pytest.mark.parametrize("name", PLANS)
def test_gradient_fusion_optimized_on_4_ranks_simulates_to_the_single_device_reference(name):
    build_model, pins = PLANS[name]
    fd = _with_cotangent_loss(build_model())
    gfd = ed.grad(fd, "loss", [t.name for t in fd.fusion.inputs if t.name != "cot"])
    mesh = ed.DeviceMesh.arange(4)
    for t, axis in pins.items():
        _pin(gfd[t], mesh, axis)
    plan = ed.optimize(gfd, mesh)
    if pins:  # a split input makes the plan move data: the ranks' pieces must still add up to the reference
        assert plan.collectives, name
    inputs = _rand_inputs(gfd.fusion)
    got, want = ed.simulate(plan, inputs), ed.evaluate(gfd, inputs)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name} {k}: {m}")
