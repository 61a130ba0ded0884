"""The typed e-graph (egraph_typed: sorts, the rewrites/ family rulesets, generated mesh joins and
resharding) builds exactly the physical graph of the fact-writing path (egraph.saturate): same classes
(tensor, layout, level) and the same nodes in each, for every model of egraph_did.models and fusions of
attention, embedding and cross entropy, on 1-D, 2-D and 3-D meshes."""
import pytest
import torch

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


def embedding_lm(tokens=6, vocab=16, hidden=8):
    """Token embedding, a projection, logits over the vocabulary and their cross entropy."""
    with ed.FusionDefinition() as fd:
        ids = fd.define_tensor((tokens,), torch.int64, name="ids")
        target = fd.define_tensor((tokens,), torch.int64, name="target")
        table = fd.define_tensor((vocab, hidden), name="table")
        w = fd.define_tensor((hidden, hidden), name="w")
        h = fd.ops.gelu(fd.ops.linear(fd.ops.embedding(ids, table), w))
        fd.add_output(fd.ops.cross_entropy(fd.ops.linear(h, table), target), name="loss")
    return fd


def softmax_rows(rows=6, cols=8):
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((rows, cols), name="x")
        fd.add_output(fd.ops.softmax(x, -1), name="y")
    return fd


MODELS = {"row_sum": lambda: models.row_sum(8, 64), "mlp": lambda: models.mlp(8, 16),
          "layer_norm": lambda: models.layer_norm(8, 16), "gpt_layer": lambda: models.gpt_layer(2, 8, 16, 4),
          "mlp_with_backward": lambda: models.mlp_with_backward(8, 16),
          "attention": lambda: models.attention(2, 6, 16, 4), "embedding_cross_entropy": embedding_lm,
          "softmax": softmax_rows}
MESHES = {(4,): [0, 1, 2, 3], (2, 4): [[0, 1, 2, 3], [4, 5, 6, 7]], (2, 2, 2): [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]}


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_typed_egraph_equals_fact_path(model, mesh):
    problem = build_problem(MODELS[model](), ed.DeviceMesh(MESHES[mesh]))
    assert signature(saturate_typed(problem)) == signature(saturate(problem))
