"""Extraction: the greedy DAG extractor finds the exact (0/1 program) optimum on random small fusions,
shared values are paid once, and a memory bound is respected."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import egraph_did as ed
from egraph_did.physgraph import Node, PhysGraph
from egraph_did.extract import exact, greedy_dag, with_roots
from egraph_did.layout import Layout, S, apply_layout

EXTENTS = (64, 512, 4096)


@st.composite
def random_fusions(draw):
    """A random chain-with-branches of linear, gelu, add (residual), sum and matmul ops; random pins."""
    ndev = draw(st.sampled_from((2, 4)))
    mesh = ed.DeviceMesh.arange(ndev)
    m, k = draw(st.sampled_from(EXTENTS)), draw(st.sampled_from(EXTENTS))
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((m, k), torch.bfloat16, name="x")
        live = [x]
        for i in range(draw(st.integers(2, 6))):
            t = draw(st.sampled_from(live))
            op = draw(st.sampled_from(("linear", "gelu", "add", "sum", "matmul")))
            if op == "linear":
                n = draw(st.sampled_from(EXTENTS))
                w = fd.define_tensor((n, t.shape[-1]), torch.bfloat16, name=f"w{i}")
                live.append(fd.ops.linear(t, w))
            elif op == "gelu":
                live.append(fd.ops.gelu(t))
            elif op == "add":
                same = [u for u in live if u.shape == t.shape]
                live.append(fd.ops.add(t, draw(st.sampled_from(same))))
            elif op == "sum" and len(t.shape) == 2:
                live.append(fd.ops.sum(t, draw(st.sampled_from((0, 1))), keepdim=True))
            elif op == "matmul" and len(t.shape) == 2:
                w = fd.define_tensor((t.shape[1], draw(st.sampled_from(EXTENTS))), torch.bfloat16, name=f"b{i}")
                live.append(fd.ops.matmul(t, w))
        fd.add_output(live[-1], name="y")
    x_layout = draw(st.sampled_from((None, Layout((S(0),)), Layout((S(1),)))))
    if x_layout is None:
        x.set_device_mesh(mesh)
    else:
        apply_layout(x, x_layout, mesh)
    if draw(st.booleans()):
        fd["y"].set_device_mesh(mesh)
    return fd, mesh


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_fusions())
def test_greedy_dag_finds_the_exact_optimum_on_random_small_fusions(case):
    fd, mesh = case
    greedy = ed.optimize(fd, mesh)
    best = ed.optimize(fd, mesh, extractor="exact")
    assert greedy.predicted_time == pytest.approx(best.predicted_time, rel=1e-9), (
        f"greedy {greedy.predicted_time * 1e6:.3f} us vs exact {best.predicted_time * 1e6:.3f} us\n"
        f"{greedy.explain()}\n{best.explain()}")


def diamond() -> PhysGraph:
    """a is needed by b and c; a has a cheap-alone node and a node that b and c share."""
    g = PhysGraph()
    g.classes = {
        "shared": [Node("Load", (), cost=0.0)],
        "a": [Node("Apply", ("shared",), cost=3.0)],
        "b": [Node("Apply", ("a",), cost=1.0), Node("Apply", ("shared",), cost=3.5)],
        "c": [Node("Apply", ("a",), cost=1.0), Node("Apply", ("shared",), cost=3.5)],
    }
    return g


def test_a_value_used_twice_is_paid_once():
    g = diamond()
    roots = with_roots(g, {"b": ["b"], "c": ["c"]})
    for sel in (greedy_dag(g, roots), exact(g, roots)):
        # tree cost would price b and c at 4.0 each via a (8.0) and pick 3.5 + 3.5; paying a once costs 5.0
        assert sel.cost == pytest.approx(5.0)
        assert sel.choice["b"].children == ("a",) and sel.choice["c"].children == ("a",)


def test_memory_bound_is_a_constraint_for_both_extractors():
    g = PhysGraph()
    g.classes = {"out": [Node("Apply", (), cost=1.0, memory=100.0), Node("Apply", (), cost=2.0, memory=10.0)]}
    roots = with_roots(g, {"out": ["out"]})
    for extract in (greedy_dag, exact):
        assert extract(g, roots).cost == 1.0
        bounded = extract(g, roots, memory_limit=50.0)
        assert (bounded.cost, bounded.memory) == (2.0, 10.0)
        with pytest.raises(ed.PlanError, match="memory"):
            extract(g, roots, memory_limit=5.0)
