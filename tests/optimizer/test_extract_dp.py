"""The exact extractor's dynamic program over tensors (egraph_did/extract_dp.py) against the 0/1 program:
on random fuzz fusions both prove the same optimum, with and without a memory bound; on the seed-7
campaign's hard cases (where the 0/1 program ran 60 s unproven) the DP proves an optimum no worse than
the 0/1 program's incumbent, in seconds."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.exact_hard_cases import capture  # noqa: E402
from egraph_did import extract, extract_dp  # noqa: E402
from egraph_did.errors import PlanError  # noqa: E402
from egraph_did.extract import _total, exact, greedy_dag  # noqa: E402
from egraph_did.physgraph import Node, PhysGraph  # noqa: E402

# fuzz cases (seed 3) small enough for the 0/1 program to prove in a second or two each
SMALL = [(3, i) for i in range(12)]


def _graphs():
    for seed, index in SMALL:
        got = capture(seed, index)
        if got is not None:
            yield (seed, index), got


@pytest.fixture(scope="module")
def graphs():
    return list(_graphs())


def test_the_dp_and_the_0_1_program_prove_the_same_optimum_on_fuzz_cases(graphs):
    compared = 0
    for case, (graph, roots, bound) in graphs:
        ilp = extract._ilp(graph, roots, bound, 60)
        try:
            by_dp = exact(graph, roots, bound, time_limit=60)
        except PlanError:  # no plan fits the pins and bound: the 0/1 program must agree
            assert ilp["proven"] and ilp["choice"] is None, case
            continue
        if set(by_dp.stats.get("exact_method", "").split(",")) != {"dp"} or not ilp["proven"] or ilp["choice"] is None:
            continue
        compared += 1
        assert by_dp.proven and by_dp.method == "exact"
        assert by_dp.cost == pytest.approx(_total(ilp["choice"])[0], rel=1e-9), case
        assert bound is None or by_dp.memory <= bound
    assert compared >= 6, f"only {compared} cases proven by both"


def test_a_memory_bound_is_honoured_exactly_by_the_dp():
    """Two readers of x: the shared allgather (fast, big) or each reader's own local route (slow, small);
    a bound between the two plans' memory makes the DP pick the small one, as the 0/1 program does."""
    g = PhysGraph({"x": [Node("Load", (), "x")],
                   "x:R": [Node("Coll", ("x",), "allgather", 0, cost=10e-6, memory=400.0)],
                   "y": [Node("Apply", ("x:R",), "y", 0, cost=1e-6), Node("Apply", ("x",), "y", 1, cost=12e-6, memory=50.0)],
                   "z": [Node("Apply", ("x:R",), "z", 0, cost=1e-6), Node("Apply", ("x",), "z", 1, cost=12e-6, memory=50.0)]})
    roots = extract.with_roots(g, {"y": ["y"], "z": ["z"]})
    free = exact(g, roots)
    bounded = exact(g, roots, memory_limit=200.0)
    assert free.stats["exact_method"] == "dp" and bounded.stats["exact_method"] == "dp"
    assert round(free.cost * 1e6) == 12 and round(bounded.cost * 1e6) == 24 and bounded.memory == 100.0
    ilp = extract._ilp(g, roots, 200.0, 10)
    assert _total(ilp["choice"])[0] == pytest.approx(bounded.cost, rel=1e-12)


def test_the_dp_gives_up_within_its_budget_and_exact_falls_back_to_the_0_1_program():
    g = PhysGraph({"x": [Node("Load", (), "x")],
                   "y": [Node("Apply", ("x",), "y", 0, cost=1e-6), Node("Apply", ("x",), "y", 1, cost=2e-6)]})
    roots = extract.with_roots(g, {"y": ["y"]})
    order, classes = extract._usable(g, roots, None)
    assert extract_dp.solve(g, roots, classes, order, max_states=0) is None
    assert extract_dp.solve(g, roots, classes, order).cost == pytest.approx(1e-6)


# (case, the 0/1 program's cost after 60 s unproven, in us): bench/results_exact_hard_cases.txt
HARD = [(290, 58.007), (1147, 70.001), (2446, 54.001), (5417, 36.001)]


@pytest.mark.parametrize("index, ilp_us", HARD)
def test_the_dp_proves_the_campaigns_hard_cases_in_seconds(index, ilp_us):
    graph, roots, bound = capture(7, index)
    sel = exact(graph, roots, bound, time_limit=60)  # the DP: 0.1-5 s alone on 2 cores (its limit 20 s)
    assert sel.proven and sel.method == "exact" and "dp" in sel.stats["exact_method"]
    assert sel.cost * 1e6 <= ilp_us + 1e-3 and sel.cost <= greedy_dag(graph, roots, bound).cost * (1 + 1e-12)
