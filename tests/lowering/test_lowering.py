"""Segmentation and the lowered program: fused runs become one kernel each, and simulate() of the
lowered program (Triton kernels under the interpreter) matches the reference in float32 (relative norm
error under 1e-5)."""
import torch

import egraph_did as ed
from egraph_did import models
from egraph_did.layout import Layout, S
from egraph_did.pins import apply_layout
from egraph_did.lowering.segment import lower

MESH = ed.DeviceMesh.arange(4)


def sp_gpt(batch, seq, hidden, heads, dtype):
    fd = models.gpt_layer(batch, seq, hidden, heads, dtype)
    apply_layout(fd["x"], Layout((S(1),)), MESH)
    apply_layout(fd["y"], Layout((S(1),)), MESH)
    return fd


def small_plan():
    big = ed.optimize(sp_gpt(1, 32, 8192, 64, torch.bfloat16), MESH)
    small = sp_gpt(1, 8, 32, 4, torch.float32)
    return small, ed.optimize(small, MESH, like=big)


def test_residual_add_and_layer_norm_are_one_persistent_kernel():
    _, plan = small_plan()
    segs = lower(plan).segments
    fused = [(s.scheduler, tuple(st.op for st in s.steps)) for s in segs if s.kind == "fused"]
    assert ("persistent", ("add", "layer_norm")) in fused
    assert ("persistent", ("layer_norm",)) in fused and ("pointwise", ("gelu",)) in fused
    # every collective of the plan is one comm segment, in order
    assert [s.steps[0] for s in segs if s.kind == "comm"] == plan.collectives


def test_lowered_simulation_matches_the_reference_and_the_eager_simulation():
    small, plan = small_plan()
    g = torch.Generator().manual_seed(1)
    inputs = {t.name: torch.randn(t.shape, generator=g) for t in small.fusion.inputs}
    ref = ed.evaluate(small, inputs)["y"]
    from egraph_did.lowering import schedulers, segment
    schedulers.clear_cache()
    segment._KERNELS.clear()
    lowered = ed.simulate(plan, inputs)["y"]
    # 4 fused segments (layer_norm, add+layer_norm, gelu, add), one kernel each, built once for the 4 ranks
    assert schedulers.cache_info()["cached"] == 4
    eager = ed.simulate(plan, inputs, lowered=False)["y"]
    for got in (lowered, eager):
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5


def test_a_float64_run_falls_back_to_torch_for_every_step():
    _, plan = small_plan()
    f64 = ed.Plan.from_json(plan.to_json().replace('"float32"', '"float64"'))
    assert all(s.kind != "fused" for s in lower(f64).segments)  # no float64 kernels: torch runs them


def _fused_beside_broadcast(build):
    """One-device plan of a reduction and a broadcasting pointwise op that segmentation considers together;
    the lowered simulation must equal the reference (it was silently wrong, even on one device)."""
    with ed.FusionDefinition() as fd:
        inputs = build(fd)
    plan = ed.optimize(fd, ed.DeviceMesh.arange(1))
    g = torch.Generator().manual_seed(0)
    values = {n: torch.randn(s, generator=g) + 1.0 for n, s in inputs.items()}
    ref = ed.evaluate(fd, values)
    got = ed.simulate(plan, values)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-5, msg=name)


def test_sum_beside_a_broadcasting_mul_is_not_counted_once_per_copy():
    def build(fd):
        x, w = fd.define_tensor((4, 1), name="x"), fd.define_tensor((4, 3), name="w")
        fd.add_output(fd.ops.sum(x, keepdim=True), name="s")
        fd.add_output(fd.ops.mul(w, x), name="m")
        return {"x": (4, 1), "w": (4, 3)}
    _fused_beside_broadcast(build)


def test_layer_norm_and_rms_norm_beside_a_broadcasting_neg_equal_the_reference():
    for norm in ("layer_norm", "rms_norm"):
        def build(fd):
            x, z = fd.define_tensor((1, 4), name="x"), fd.define_tensor((2, 1), name="z")
            fd.add_output(getattr(fd.ops, norm)(x, normalized_shape=(1, 4)), name="n")
            fd.add_output(fd.ops.neg(z), name="z2")
            return {"x": (1, 4), "z": (2, 1)}
        _fused_beside_broadcast(build)
