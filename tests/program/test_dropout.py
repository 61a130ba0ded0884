"""Dropout's random stream (issue 11 item 2): the keep-mask is a hash of (seed, offset + each element's flat
index in the logical tensor), so one device and every rank of every plan draw the same mask, bit for bit;
the seed is a tensor input; the backward hashes again instead of saving the mask.

The claims: every layout of a small fusion on 1-D and 2-D meshes (uneven and nested shards included)
simulates to the single-device mask exactly; a pending sum passes through dropout and a pending max does
not; the keep fraction is 1 - p within 5 sigma on 100k elements; another seed or offset gives another
mask; the gradient equals torch.autograd's with the mask fixed (float64), on one device and on a mesh; and
from_torch maps an nn.Dropout in training mode onto it under the seed input "rng.seed".
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import egraph_did as ed
from egraph_did.errors import DtypeError, ShapeError
from egraph_did.frontend import SEED_INPUT
from egraph_did.layout import PMAX, Layout, R, S, valid_layouts
from egraph_did.local import run_local
from egraph_did.ops import dropout_mask, global_counters, random_bits
from egraph_did.pins import apply_layout, layout_view
from egraph_did.shards import Operand, RankContext
from egraph_did.rewrites import OpView, axis_strategies
from egraph_did.rewrites.rules import Operand as RuleOperand

import random_reference

F64 = torch.float64
SEED = torch.tensor(-(2 ** 41) + 12345)  # negative, with bits in both words
MESHES = {"1d-3": ed.DeviceMesh.arange(3), "1d-4": ed.DeviceMesh.arange(4),
          "2d-2x2": ed.DeviceMesh(torch.arange(4).reshape(2, 2)), "2d-2x3": ed.DeviceMesh(torch.arange(6).reshape(2, 3))}


def dropout_fusion(shape, p=0.5, offset=0, dtype=F64):
    """(fd, x, y): y = dropout(x, rng.seed, p, offset)."""
    fd = ed.FusionDefinition()
    x = fd.define_tensor(shape, dtype, name="x")
    seed = fd.define_tensor((), torch.int64, name=SEED_INPUT)
    fd.add_output(fd.ops.dropout(x, seed, p, offset), name="y")
    return fd, x, fd["y"]


def inputs_for(shape, seed=SEED, ones=True):
    x = torch.ones(shape, dtype=F64) if ones else torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(0))
    return {"x": x, SEED_INPUT: seed}


# ---------------------------------------------------------------------- the stream itself

def test_the_hash_equals_the_python_integer_reference_bit_for_bit():
    counters = torch.tensor([0, 1, 2, 2 ** 32 - 1, 2 ** 32, 2 ** 32 + 7, 3 * 2 ** 40 + 5, 2 ** 62])
    for seed in (0, 1, -1, 2 ** 40 + 3, -(2 ** 63), 2 ** 63 - 1):
        got = random_bits(torch.tensor(seed), counters).tolist()
        assert got == [random_reference.bits(seed, int(c)) for c in counters], seed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_gpu_draws_the_cpu_s_bits():
    counters = torch.arange(2 ** 32 - 1000, 2 ** 32 + 1000)
    for seed in (SEED, torch.tensor(2 ** 63 - 1)):
        assert torch.equal(random_bits(seed.cuda(), counters.cuda()).cpu(), random_bits(seed, counters))


def test_counters_are_flat_indices_in_the_global_tensor():
    whole = global_counters(((3, 4, 5), (3, 4, 5)), (0, 0, 0), 7)
    assert torch.equal(whole, torch.arange(60).reshape(3, 4, 5) + 7)
    block = global_counters(((3, 4, 5), (2, 2, 3)), (1, 2, 1), 7)
    assert torch.equal(block, whole[1:3, 2:4, 1:4])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_keep_fraction_is_one_minus_p_within_five_sigma_on_100k_elements(p):
    n = 100_000
    keep = dropout_mask(SEED, p, torch.arange(n))
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.double().mean().item() - (1 - p)) < 5 * sigma
    # neighbours are independent: the pairs kept together are (1 - p)^2 of them
    both = (keep[1:] & keep[:-1]).double().mean().item()
    assert abs(both - (1 - p) ** 2) < 5 * math.sqrt((1 - p) ** 2 * (1 - (1 - p) ** 2) / n)


def test_another_seed_or_offset_gives_another_mask_and_the_same_seed_the_same():
    shape = (40, 50)
    fd, _, _ = dropout_fusion(shape)
    y = ed.evaluate(fd, inputs_for(shape))["y"]
    assert torch.equal(y, ed.evaluate(fd, inputs_for(shape))["y"])
    other_seed = ed.evaluate(fd, inputs_for(shape, SEED + 1))["y"]
    other_offset = ed.evaluate(dropout_fusion(shape, offset=1)[0], inputs_for(shape))["y"]
    for other in (other_seed, other_offset):
        agree = (other == y).double().mean().item()
        assert 0.4 < agree < 0.6  # independent masks at p = 0.5 agree on half the elements
    assert set(y.unique().tolist()) == {0.0, 2.0}


def test_p_zero_keeps_everything_and_p_one_drops_everything():
    shape = (3, 5)
    x = inputs_for(shape, ones=False)
    assert torch.equal(ed.evaluate(dropout_fusion(shape, p=0.0)[0], x)["y"], x["x"])
    assert torch.equal(ed.evaluate(dropout_fusion(shape, p=1.0)[0], x)["y"], torch.zeros(shape, dtype=F64))


# ---------------------------------------------------------------------- every plan draws the same mask

def _layout_pairs(shape, mesh):
    """Every layout for x = y, and each layout of y against a replicated x and a different split of x."""
    lays = list(valid_layouts(shape, mesh))
    pairs = [(lay, lay) for lay in lays]
    pairs += [(lays[0], lay) for lay in lays[1:]] + [(lay, lays[-1 - i]) for i, lay in enumerate(lays[1:4])]
    return pairs


@pytest.mark.parametrize("mesh_name, shape", [("1d-3", (5, 7)), ("1d-4", (2, 4, 7)), ("2d-2x2", (5, 7)),
                                              ("2d-2x3", (7, 9))])
def test_every_layout_simulates_to_the_single_device_mask(mesh_name, shape):
    mesh = MESHES[mesh_name]
    fd, _, _ = dropout_fusion(shape, p=0.5, offset=11)
    want = ed.evaluate(fd, inputs_for(shape))["y"]
    kernels = set()
    for lx, ly in _layout_pairs(shape, mesh):
        fd, x, y = dropout_fusion(shape, p=0.5, offset=11)
        apply_layout(x, lx, mesh)
        apply_layout(y, ly, mesh)
        plan = ed.optimize(fd, mesh)
        got = ed.simulate(plan, inputs_for(shape))["y"]
        assert torch.equal(got, want), f"x {lx}, y {ly}:\n{plan.explain()}"
        step = next(s for s in plan.compute_steps if s.op == "dropout")
        kernels |= set(dict(step.flags))
    assert kernels == {"global_index"}  # some plans ran dropout on shards, with the global-index kernel


@st.composite
def sharded_tensors(draw):
    """A mesh, a shape (1-3 axes, extents 1..13) and a layout of it with no rank left empty."""
    mesh = draw(st.sampled_from(list(MESHES.values())))
    shape = tuple(draw(st.integers(1, 13)) for _ in range(draw(st.integers(1, 3))))
    layouts = list(valid_layouts(shape, mesh))
    return mesh, shape, draw(st.sampled_from(layouts)), draw(st.integers(0, 1000))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sharded_tensors())
def test_the_global_index_kernel_on_every_rank_assembles_the_single_device_mask(case):
    """The kernel alone, rank by rank, on the shards the loop domain gives each rank (no optimizer)."""
    mesh, shape, layout, offset = case
    view = layout_view("x", shape, F64, layout, mesh)
    x = torch.ones(shape, dtype=F64)
    want = random_reference.dropout(x, int(SEED), 0.5, offset)
    axes = [m for m, p in enumerate(layout) if p.is_shard] or [0]
    shards = {}
    for rank in mesh.ranks:
        args = {"x": ed.shard_tensor(x, view, rank), "seed": SEED, "p": 0.5, "offset": offset}
        (shards[rank],) = run_local("dropout", args, {"x": Operand(shape, layout)}, [Operand(shape, layout)],
                                    {"global_index": axes}, RankContext(mesh, rank))
    assert torch.equal(ed.unshard_tensor(shards, view), want), f"{shape} as {layout} on {mesh}"


def test_a_pending_sum_passes_through_dropout():
    mesh = ed.DeviceMesh.arange(2)
    fd = ed.FusionDefinition()
    x, w = fd.define_tensor((4, 6), F64, name="x"), fd.define_tensor((3, 6), F64, name="w")
    seed = fd.define_tensor((), torch.int64, name=SEED_INPUT)
    fd.add_output(fd.ops.dropout(fd.ops.linear(x, w), seed, 0.5), name="y")
    apply_layout(x, Layout.from_code("S1"), mesh)
    apply_layout(w, Layout.from_code("S1"), mesh)
    apply_layout(fd["y"], Layout.from_code("P"), mesh)  # row-parallel: the linear's output is a pending sum
    plan = ed.optimize(fd, mesh)
    assert not plan.collectives
    step = next(s for s in plan.compute_steps if s.op == "dropout")
    assert str(plan.values[step.operands["x"]].layout) == "[P]"
    g = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(4, 6, generator=g, dtype=F64), "w": torch.randn(3, 6, generator=g, dtype=F64),
              SEED_INPUT: SEED}
    torch.testing.assert_close(ed.simulate(plan, inputs)["y"], ed.evaluate(fd, inputs)["y"], rtol=1e-12, atol=1e-12)


def test_a_pending_max_does_not_pass_through_dropout():
    e = OpView("dropout", (RuleOperand("x", (4, 6), F64), RuleOperand("seed", (), torch.int64)), (("p", 0.5),),
               (RuleOperand("out", (4, 6), F64),), d=2)
    strategies = axis_strategies(e)
    assert {str(s.inputs[0]) for s in strategies} == {"R", "P", "S(0)", "S(1)"}
    assert all(s.inputs[0] != PMAX and s.outputs[0] != PMAX for s in strategies)
    # the seed is replicated under every strategy, and a shard always runs the global-index kernel
    assert all(str(s.inputs[1]) == "R" for s in strategies)
    assert all(s.flags == {"global_index"} for s in strategies if s.inputs[0].is_shard)


# ---------------------------------------------------------------------- gradient

def _loss_fusion(shape, p):
    fd = ed.FusionDefinition()
    x = fd.define_tensor(shape, F64, name="x")
    cot = fd.define_tensor(shape, F64, name="cot")
    seed = fd.define_tensor((), torch.int64, name=SEED_INPUT)
    y = fd.ops.dropout(fd.ops.tanh(x), seed, p, 5)
    fd.add_output(fd.ops.sum(fd.ops.mul(y, cot)), name="loss")
    return fd


def test_the_gradient_equals_torch_autograd_with_the_mask_fixed():
    shape, p = (6, 10), 0.3
    g = torch.Generator().manual_seed(3)
    inputs = {"x": torch.randn(shape, generator=g, dtype=F64), "cot": torch.randn(shape, generator=g, dtype=F64),
              SEED_INPUT: SEED}
    got = ed.evaluate(ed.grad(_loss_fusion(shape, p), loss="loss", wrt=["x"]), inputs)
    x = inputs["x"].clone().requires_grad_(True)
    loss = (random_reference.dropout(torch.tanh(x), int(SEED), p, 5) * inputs["cot"]).sum()
    loss.backward()
    torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["grad_x"], x.grad, rtol=1e-12, atol=1e-12)
    # the backward reads the seed, not a saved mask
    gfd = ed.grad(_loss_fusion(shape, p), loss="loss", wrt=["x"])
    assert [e.op.name for e in gfd.fusion.exprs].count("dropout") == 2


@pytest.mark.parametrize("mesh_name", ["1d-3", "2d-2x2"])
def test_the_gradient_on_a_mesh_simulates_to_the_single_device_one(mesh_name):
    mesh, shape = MESHES[mesh_name], (7, 10)
    gfd = ed.grad(_loss_fusion(shape, 0.5), loss="loss", wrt=["x"])
    rows = Layout((S(0),) + (R,) * (mesh.ndim - 1))  # uneven rows: 3, 2, 2 or 4, 3
    for name in ("x", "cot", "grad_x"):
        apply_layout(gfd[name], rows, mesh)
    g = torch.Generator().manual_seed(4)
    inputs = {"x": torch.randn(shape, generator=g, dtype=F64), "cot": torch.randn(shape, generator=g, dtype=F64),
              SEED_INPUT: SEED}
    plan = ed.optimize(gfd, mesh)
    assert all(set(dict(s.flags)) == {"global_index"} for s in plan.compute_steps if s.op == "dropout"), plan.explain()
    got, want = ed.simulate(plan, inputs), ed.evaluate(gfd, inputs)
    for name in ("loss", "grad_x"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------- bad input

def test_a_seed_that_is_no_0d_int64_tensor_input_is_refused_saying_how_to_define_one():
    fd = ed.FusionDefinition()
    x = fd.define_tensor((3, 4), name="x")
    with pytest.raises(DtypeError, match=r"seed must be a 0-d int64 tensor input.*define_tensor\(\(\), torch.int64"):
        fd.ops.dropout(x, 1234, 0.5)
    with pytest.raises(DtypeError, match=r"got s, float32 of shape \(\)"):
        fd.ops.dropout(x, fd.define_tensor((), name="s"), 0.5)
    seed = fd.define_tensor((), torch.int64, name="seed")
    with pytest.raises(ShapeError, match=r"p must be a probability in \[0, 1\], got 1.5"):
        fd.ops.dropout(x, seed, 1.5)
    with pytest.raises(ShapeError, match="offset must be an int >= 0"):
        fd.ops.dropout(x, seed, 0.5, -1)
    with pytest.raises(DtypeError, match="needs a floating-point tensor"):
        fd.ops.dropout(fd.define_tensor((3,), torch.int64, name="i"), seed, 0.5)


# ---------------------------------------------------------------------- from_torch

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.drop1, self.drop2 = nn.Dropout(0.25), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop2(self.down(self.drop1(torch.relu(self.up(x)))))


def test_an_exported_dropout_module_in_train_mode_draws_its_masks_from_the_seed_input():
    torch.manual_seed(0)
    block, x = Block().double().train(), torch.randn(6, 8, dtype=F64)
    fd = ed.from_torch(block, (x,))
    assert fd.seed_inputs == (SEED_INPUT,) and fd.fusion[SEED_INPUT].dtype == torch.int64
    drops = [dict(e.args) for e in fd.fusion.exprs if e.op.name == "dropout"]
    assert [(d["p"], d["offset"]) for d in drops] == [(0.25, 0), (0.5, 6 * 16)]  # each its own stream
    inputs = fd.bind(x) | {SEED_INPUT: SEED}
    # the module's own arithmetic with the reference masks at those offsets
    h = random_reference.dropout(torch.relu(block.up(x)), int(SEED), 0.25, 0)
    want = random_reference.dropout(block.down(h), int(SEED), 0.5, 6 * 16)
    ref = ed.evaluate(fd, inputs)["out"]
    torch.testing.assert_close(ref, want.detach(), rtol=1e-12, atol=1e-12)
    for mesh in (ed.DeviceMesh.arange(4), MESHES["2d-2x3"]):
        torch.testing.assert_close(ed.simulate(ed.optimize(fd, mesh), inputs)["out"], ref, rtol=1e-12, atol=1e-12)


def test_bind_draws_a_new_seed_per_call_from_torch_s_generator():
    fd = ed.from_torch(Block().train(), (torch.randn(2, 8),))
    torch.manual_seed(5)
    a = fd.bind(torch.ones(2, 8))[SEED_INPUT]
    b = fd.bind(torch.ones(2, 8))[SEED_INPUT]
    torch.manual_seed(5)
    assert a.shape == () and a.dtype == torch.int64 and a != b and fd.bind(torch.ones(2, 8))[SEED_INPUT] == a


def test_eval_mode_and_p_zero_export_no_dropout_and_no_seed():
    for model in (Block().eval(), nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)).train()):
        x = torch.randn(2, model[0].in_features if isinstance(model, nn.Sequential) else 8)
        fd = ed.from_torch(model, (x,))
        assert "dropout" not in [e.op.name for e in fd.fusion.exprs] and fd.seed_inputs == ()
        assert SEED_INPUT not in fd.fusion.tensors


def test_dropout_of_a_buffer_is_drawn_at_run_time_not_folded_at_export():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.arange(12.0).reshape(3, 4))

        def forward(self, x):
            return x + torch.nn.functional.dropout(self.table, 0.5, True)
    fd = ed.from_torch(Noisy(), (torch.zeros(3, 4),))
    assert [e.op.name for e in fd.fusion.exprs] == ["dropout", "add"] and "const.table" in fd.constants
    got = ed.evaluate(fd, fd.bind(torch.zeros(3, 4)) | {SEED_INPUT: SEED})["out"]
    torch.testing.assert_close(got, random_reference.dropout(torch.arange(12.0).reshape(3, 4), int(SEED), 0.5))


def test_native_dropout_gives_the_output_and_its_keep_mask():
    def f(x):
        out, keep = torch.ops.aten.native_dropout(x, 0.4, True)
        return out, keep
    fd = ed.from_torch(f, (torch.ones(5, 6),))
    got = ed.evaluate(fd, fd.bind(torch.ones(5, 6)) | {SEED_INPUT: SEED})
    keep = random_reference.keep_mask(int(SEED), 0.4, (5, 6))
    assert torch.equal(got["1"], keep)
    torch.testing.assert_close(got["0"], keep.float() / 0.6)


def test_attention_dropout_stays_refused():
    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ed.ExportError, match=r"drops out attention \(dropout_p=0.1\)"):
        ed.from_torch(attend, (q, q, q))


def test_other_random_ops_stay_refused_naming_the_op():
    with pytest.raises(ed.ExportError, match=r"aten.rand_like.default .* is random and has no fusion mapping"):
        ed.from_torch(lambda x: x + torch.rand_like(x), (torch.ones(3),))
    with pytest.raises(ed.ExportError, match=r"aten.rand.default .* is random; export the module in eval mode"):
        ed.from_torch(lambda x: x + torch.rand(3), (torch.ones(3),))
