"""The typed e-graph (egraph_typed: sorts, pointwise ruleset, generated mesh joins and resharding) builds
exactly the physical graph of the fact-writing path (egraph.saturate): same classes (tensor, layout,
level) and the same nodes in each, on 1-D and 2-D meshes."""
import pytest

import egraph_did as ed
from egraph_did import models
from egraph_did.egraph import saturate
from egraph_did.egraph_typed import saturate_typed
from egraph_did.problem import build_problem


def signature(g):
    """Each named class's nodes, children named by their classes' (tensor, layout, level)."""
    name = lambda c: g.ident.get(c, ("tuple",) + tuple(sorted((n.op, n.key, n.sid) for n in g.classes[c])))  # noqa: E731
    return {g.ident[c]: sorted((n.op, n.key, n.sid, tuple(name(ch) for ch in n.children)) for n in ns)
            for c, ns in g.classes.items() if c in g.ident}


MODELS = {"row_sum": lambda: models.row_sum(8, 64), "mlp": lambda: models.mlp(8, 16),
          "layer_norm": lambda: models.layer_norm(8, 16), "gpt_layer": lambda: models.gpt_layer(2, 8, 16, 4),
          "mlp_with_backward": lambda: models.mlp_with_backward(8, 16)}


@pytest.mark.parametrize("mesh", [(4,), (2, 4)])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_typed_egraph_equals_fact_path(model, mesh):
    devices = ed.DeviceMesh.arange(4) if mesh == (4,) else ed.DeviceMesh([[0, 1, 2, 3], [4, 5, 6, 7]])
    problem = build_problem(MODELS[model](), devices)
    assert signature(saturate_typed(problem)) == signature(saturate(problem))
