"""min and max: elementwise minimum/maximum and amin/amax reductions over sharded axes.

amin over floats is held beside -amax(-x) (its decomposition), so a min over a sharded axis is a local
max of the negation and one allreduce(max), as amax's; maximum passes a pending max
(rewrites/pointwise.py maximum_of_pending_maxes). Each plan simulates to the single-device reference.
"""
import torch

import egraph_did as ed
from egraph_did.layout import Layout
from egraph_did.pins import apply_layout

F64 = torch.float64
MESH = ed.DeviceMesh.arange(4)


def simulate_equals_reference(fd, plan, seed=0):
    """plan's layouts replayed on the small fusion fd, simulated against the reference."""
    plan = ed.optimize(fd, MESH, like=plan)
    g = torch.Generator().manual_seed(seed)
    inputs = {t.name: torch.randn(t.shape, generator=g, dtype=t.dtype) for t in fd.fusion.inputs}
    ref = ed.evaluate(fd, inputs)
    got = ed.simulate(plan, inputs)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-12, atol=1e-12)


def row_extremum(op, rows=8, cols=1 << 20):
    """y = op(x, 1) with x split on the reduced axis and y pinned replicated."""
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((rows, cols), F64, name="x")
        fd.add_output(getattr(fd.ops, op)(x, 1), name="y")
    apply_layout(fd["x"], Layout.parse("[S(1)]"), MESH)
    fd["y"].set_device_mesh(MESH)
    return fd


def test_amin_over_a_sharded_axis_is_a_local_max_of_the_negation_and_one_allreduce():
    for op in ("amin", "amax"):
        fd = row_extremum(op)
        plan = ed.optimize(fd, MESH)
        assert [(c.kind, c.reduce) for c in plan.collectives] == [("allreduce", "max")], (op, plan.explain())
        assert all(c.bytes == 8 * 8 for c in plan.collectives)  # the reduced rows only, never x
        simulate_equals_reference(row_extremum(op, 3, 10), plan)


def test_amin_of_integers_gathers_its_reduced_axis():
    """-x overflows at an integer type's least value: amin of integers keeps its own rules (no partial)."""
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 8), torch.int64, name="x")
        fd.add_output(fd.ops.amin(x, 1), name="y")
    apply_layout(fd["x"], Layout.parse("[S(1)]"), MESH)
    fd["y"].set_device_mesh(MESH)
    plan = ed.optimize(fd, MESH)
    assert "allreduce" not in [c.kind for c in plan.collectives]
    x = torch.tensor([[torch.iinfo(torch.int64).min] + [5] * 7] * 4)
    torch.testing.assert_close(ed.simulate(plan, {"x": x})["y"], x.amin(1))


def two_maxima(rows, cols):
    with ed.FusionDefinition() as fd:
        a = fd.define_tensor((rows, cols), F64, name="a")
        b = fd.define_tensor((rows, cols), F64, name="b")
        m = fd.ops.maximum(fd.ops.amax(a, 1), fd.ops.amax(b, 1))
        fd.add_output(m, name="m")
        fd.add_output(fd.ops.minimum(a, b), name="lo")
    for t in ("a", "b", "lo"):
        apply_layout(fd[t], Layout.parse("[S(1)]"), MESH)
    fd["m"].set_device_mesh(MESH)
    return fd


def test_maximum_of_two_row_maxima_waits_for_one_allreduce_and_minimum_runs_sharded():
    plan = ed.optimize(two_maxima(8, 1 << 20), MESH)
    assert [(c.kind, c.reduce) for c in plan.collectives] == [("allreduce", "max")], plan.explain()
    simulate_equals_reference(two_maxima(3, 10), plan)
