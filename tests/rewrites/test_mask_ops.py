"""The ops of masks and positions (issue 11: logic and bit ops, amin/prod/any/all, cumsum) shard correctly:
every strategy the optimizer offers for them runs rank by rank to the single-device value (the machinery of
tests/rewrites/test_rules.py), the e-graph derives exactly the Python rules' rows for them, no strategy
splits an axis they cannot compute locally (a reduced axis without a partial, the scanned axis), and the
logical ops' Triton templates compute what torch does.
"""
from __future__ import annotations

import os
import zlib

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything defines a Triton kernel

import pytest  # noqa: E402
import torch  # noqa: E402

import egraph_did as ed  # noqa: E402
from egraph_did import evaluate  # noqa: E402
from egraph_did.lowering import schedulers  # noqa: E402
from egraph_did.lowering.segment import spec_from_fusion  # noqa: E402
from egraph_did.problem import build_problem  # noqa: E402
from egraph_did.rewrites import Case, indices  # noqa: E402

from tests.rewrites.test_egglog_rules import assert_same_rows  # noqa: E402
from tests.rewrites.test_rules import check_strategy, mesh_of, random_inputs, user_strategies  # noqa: E402


def _bits(o, x, i):
    """bit and logic ops on a mask made of x and on integers, with numbers and broadcasting"""
    m, k = o.gt(x, 0.0), o.lt(o.slice(x, 0, 0, 1), 0.5)  # k: [1, n], broadcast along the rows
    return (o.bitwise_and(m, k), o.bitwise_or(m, True), o.bitwise_xor(i, 5), o.bitwise_and(3, i),
            o.logical_not(m), o.logical_not(x), o.logical_and(x, k), o.logical_or(0, i))


def _reductions(o, x, i):
    m = o.ge(x, 0.0)
    return (o.any(m, 1), o.all(o.ne(i, 0), 0, keepdim=True), o.amin(i, -1), o.prod(o.add(i, 1), 0),
            o.cumsum(m, 0), o.cumsum(i, -1), o.amin(x, None), o.prod(x, (0, 1), keepdim=True))


CASES = [
    Case("bits-uneven", (3,), {"x": (5, 7), "i": indices((5, 7), 16)}, _bits),
    Case("bits-mesh2x2", (2, 2), {"x": (4, 6), "i": indices((4, 6), 16)}, _bits),
    Case("bits-mesh2x2x2", (2, 2, 2), {"x": (4, 6), "i": indices((4, 6), 16)}, _bits),
    Case("reductions-uneven", (3,), {"x": (5, 7), "i": indices((5, 7), 4)}, _reductions),
    Case("reductions-mesh2x4", (2, 4), {"x": (4, 8), "i": indices((4, 8), 4)}, _reductions),
]
NEW_OPS = {"bitwise_and", "bitwise_or", "bitwise_xor", "logical_and", "logical_or", "logical_not", "any", "all",
           "amin", "prod", "cumsum"}


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)
def test_every_strategy_of_the_new_ops_runs_to_the_reference(c):
    g = torch.Generator().manual_seed(zlib.crc32(c.name.encode()))
    fd, problem, mesh, pairs = user_strategies(c)
    inputs = random_inputs(c, g)
    env = dict(inputs) | evaluate(fd, inputs)
    sharded = set()
    for e, s in pairs:
        if e.op.name in NEW_OPS:
            check_strategy(e, s, env, mesh, g)
            if any(p.is_shard for lay in s.inputs for p in lay):
                sharded.add(e.op.name)
    used = {e.op.name for e in fd.fusion.exprs} & NEW_OPS
    assert sharded == used, f"ops never run sharded: {sorted(used - sharded)}"


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)
def test_the_egraph_derives_the_python_rows_of_the_new_ops(c):
    assert_same_rows(build_problem(_build(c), mesh_of(c.mesh)))


def _build(c: Case):
    from tests.rewrites.test_rules import build
    return build(c)


def _axes_split(s) -> set[int]:
    return {p.axis for p in s.inputs[0] if p.is_shard}


@pytest.mark.parametrize("c", CASES[3:], ids=lambda c: c.name)
def test_no_strategy_splits_a_reduced_or_scanned_axis_or_reads_a_partial(c):
    """There is no pending min, product, or, and, nor a local cumsum of a split scanned axis: every
    strategy of these ops reads the axis they reduce or scan whole, and no partial."""
    _, _, _, pairs = user_strategies(c)
    seen = 0
    for e, s in pairs:
        if e.op.name not in NEW_OPS:
            continue
        x = e.inputs[0]
        args = dict(e.args)
        if e.op.name == "cumsum":
            whole = {args["dim"] % x.ndim}
        else:
            dims = args["dims"]
            whole = set(range(x.ndim)) if dims is None else {d % x.ndim for d in ((dims,) if isinstance(dims, int)
                                                                                  else dims)}
        assert not _axes_split(s) & whole, f"{e} under {[str(v) for v in s.inputs]}"
        partial = any(p.is_partial for p in s.inputs[0])
        assert not partial or e.op.name == "cumsum", f"{e} reads a partial: {[str(v) for v in s.inputs]}"
        seen += 1
    assert seen


def test_cumsum_of_a_partial_is_a_partial_and_stays_one():
    c = Case("partial", (2,), {"x": (3, 4), "w": (5, 4)}, lambda o, x, w: o.cumsum(o.linear(x, w), 0))
    _, _, _, pairs = user_strategies(c)
    partial = [s for e, s in pairs if e.op.name == "cumsum" and s.outputs[0][0].is_partial]
    assert partial and all(s.inputs[0][0].is_partial for s in partial)


def test_the_logical_templates_compute_torch_s_values_in_one_kernel():
    """logical_not/and/or of floats (NaN is true, -0.0 false) and of a Python number run as one Triton
    pointwise kernel (interpreted on a CPU) equal to torch."""
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 5), torch.float32, name="x")
        y = fd.define_tensor((5,), torch.float32, name="y")
        outs = (fd.ops.logical_not(x), fd.ops.logical_and(x, y), fd.ops.logical_or(y, x),
                fd.ops.logical_and(x, 0.5), fd.ops.logical_or(0, x), fd.ops.logical_and(x, 0))
        for k, o in enumerate(outs):
            fd.add_output(fd.ops.cast(o, torch.float32), name=f"o{k}")
    spec = spec_from_fusion(fd.fusion)
    kernel = schedulers.compile_kernel(spec)  # Unsupported would mean the ops fell back to torch
    X = torch.tensor([[0.0, -0.0, 1.5, float("nan"), -2.0]] * 4)
    X[1:] = torch.randn(3, 5).round()
    Y = torch.tensor([0.0, 1.0, float("nan"), -0.0, 3.0])
    got = kernel({"x": X, "y": Y})
    want = evaluate(fd, {"x": X, "y": Y})
    for k in range(len(outs)):
        assert torch.equal(got[f"o{k}"], want[f"o{k}"]), k
    assert torch.equal(want["o0"], X.logical_not().float()) and torch.equal(want["o1"], X.logical_and(Y).float())


def test_bit_ops_of_floats_are_refused_as_torch_refuses_them():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((3,), torch.float32, name="x")
        m = fd.ops.gt(x, 0.0)
        with pytest.raises(ed.DtypeError, match=r"bitwise_and\(x, gt_\d+\): x is float32; bitwise_and takes bool "
                                                r"and integer operands"):
            fd.ops.bitwise_and(x, m)
        with pytest.raises(ed.DtypeError, match=r"bitwise_or\(gt_\d+, 0.5\): 0.5 is float64"):
            fd.ops.bitwise_or(m, 0.5)
