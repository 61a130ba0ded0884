"""Two equal terms of a program (the same op on the same operands) are one class of the e-graph, and the plan
holds one value for both: a pin on either is reported by that value."""
import torch

import egraph_did as ed
from egraph_did.layout import Layout, S
from egraph_did.pins import apply_layout


def test_a_pinned_duplicate_reports_the_shared_value():
    mesh = ed.DeviceMesh.arange(4)
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 8), torch.float64, name="x")
        a, b = fd.ops.exp(x), fd.ops.exp(x)
        fd.add_output(fd.ops.add(b, a), name="y")
    apply_layout(b, Layout((S(1),)), mesh)
    plan = ed.optimize(fd, mesh)
    assert plan.loop_domain(b.name) == "[4, DIDx{4}, 8/4]"
    assert plan.values[plan.pins[b.name]].tensor == a.name  # one value holds both
    inputs = {"x": torch.randn(4, 8, dtype=torch.float64)}
    torch.testing.assert_close(ed.simulate(plan, inputs)["y"], ed.evaluate(fd, inputs)["y"])
