"""What exact's speed-ups rest on (issue 10, "exact extraction of one layer's training step in < 1 s"): each
must leave the extractor's answers as they were."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from egraph_did import extract, extract_dp
from egraph_did.physgraph import Node, PhysGraph


def test_highs_loads_without_scipy_optimize_and_scipy_optimize_shares_it_afterwards():
    """exact loads scipy's HiGHS extension from its file (scipy.optimize's __init__ was 0.43 s CPU of the first
    exact pass) and keeps its matrices in numpy (scipy.sparse's import, 0.16 s): the 0/1 program must prove
    without either, and a later `import scipy.optimize` must find the same module (one extension, two copies
    of its types would break milp) and still solve. A fresh interpreter: this one has likely imported both."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from egraph_did import extract
        from egraph_did.physgraph import Node, PhysGraph
        g = PhysGraph({"x": [Node("Load", (), "x")],
                       "y": [Node("Apply", ("x",), "y", 0, cost=2e-6), Node("Apply", ("x",), "y", 1, cost=1e-6)]})
        extract.DP_SHARE = {False: (0.0, 0.0), True: (0.0, 0.0)}  # the 0/1 program proves it
        sel = extract.exact(g, extract.with_roots(g, {"y": ["y"]}))
        assert sel.proven and sel.stats["exact_method"] == "ilp" and sel.choice["y"].sid == 1
        loaded = [m for m in sys.modules if m in ("scipy.optimize", "scipy.sparse")]
        assert not loaded, loaded  # neither import is paid by the first exact call
        core = extract._highs_bindings()
        assert core is not None
        import scipy.optimize
        from scipy.optimize._highspy import _core
        assert _core is core
        res = scipy.optimize.milp(np.array([3.0, 2.0]), integrality=np.ones(2), bounds=scipy.optimize.Bounds(0, 1),
                                  constraints=scipy.optimize.LinearConstraint(np.array([[1.0, 1.0]]), 1, np.inf))
        assert res.status == 0 and res.fun == 2.0
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_highs_bindings_reuse_a_module_scipy_optimize_already_loaded():
    import scipy.optimize  # noqa: F401 - loads scipy.optimize._highspy._core the ordinary way
    from scipy.optimize._highspy import _core
    assert extract._highs_bindings() is _core


def _chain_graph(tensors: int) -> tuple[PhysGraph, list[str]]:
    """A chain of `tensors` tensors, each at one layout and level (so one class a tensor)."""
    classes, ident = {"t0": [Node("Load", (), "t0")]}, {"t0": ("t0", "R", 0)}
    for i in range(1, tensors):
        classes[f"t{i}"] = [Node("Apply", (f"t{i - 1}",), f"t{i}", 0, cost=1e-6),
                            Node("Apply", (f"t{i - 1}",), f"t{i}", 1, cost=2e-6)]
        ident[f"t{i}"] = (f"t{i}", "R", 0)
    graph = PhysGraph(classes, ident=ident, index={v: k for k, v in ident.items()})
    return graph, extract.with_roots(graph, {f"t{tensors - 1}": [f"t{tensors - 1}"]})


@pytest.mark.parametrize("tensors,refused", [(5, False), (40, True)])
def test_the_dp_refuses_a_graph_of_more_tensors_than_its_limit_and_proves_one_within_it(tensors, refused):
    """The DP counts tensors before choosing its walk order: over the limit it refuses (None), within it proves."""
    graph, roots = _chain_graph(tensors)
    order, classes, canon = extract._Usable.of(graph, roots, None)
    res = extract_dp.solve(graph, roots, classes, order, canon, max_tensors=20)
    if refused:
        assert res is None
    else:
        assert res is not None and res.cost == pytest.approx((tensors - 1) * 1e-6)


def test_exact_gives_the_same_plan_with_the_usable_classes_shared_between_the_dp_and_the_0_1_program(monkeypatch):
    """_Usable is computed once a pass and handed to both methods: the 0/1 program alone (the DP's share of
    time 0) must still prove the same optimum as the DP."""
    graph, roots = _chain_graph(6)
    by_dp = extract.exact(graph, roots)
    monkeypatch.setattr(extract, "DP_SHARE", {False: (0.0, 0.0), True: (0.0, 0.0)})
    monkeypatch.setattr(extract_dp, "BEAM_ROUNDS", 0)
    calls = []
    real = extract._Usable.of
    monkeypatch.setattr(extract._Usable, "of", classmethod(lambda cls, *a: calls.append(a) or real(*a)))
    by_ilp = extract.exact(graph, roots)
    assert by_dp.proven and by_ilp.proven
    assert (by_dp.stats["exact_method"], by_ilp.stats["exact_method"]) == ("dp", "ilp")
    assert by_ilp.cost == pytest.approx(by_dp.cost, rel=1e-12)
    assert len(calls) == 1
    assert np.isclose(by_dp.cost, 5e-6)


def test_the_numpy_rows_agree_with_scipy_sparse_entry_for_entry():
    """HiGHS's path depends on the order of the arrays it is handed: _Rows must give exactly what the
    scipy.sparse matrices it replaced gave (CSR rows with columns ascending, CSC columns with rows ascending),
    and the same products."""
    from scipy.sparse import coo_matrix, vstack
    rng = np.random.default_rng(3)
    cells = rng.choice(40 * 30, size=300, replace=False)
    rows, cols = np.divmod(cells, 30)
    vals = rng.normal(size=len(cells))
    ours, theirs = extract._Rows.from_coo(vals, rows, cols, (40, 30)), coo_matrix((vals, (rows, cols)), shape=(40, 30)).tocsr()
    assert np.array_equal(ours.indptr, theirs.indptr) and np.array_equal(ours.indices, theirs.indices)
    assert np.array_equal(ours.data, theirs.data)
    csc = theirs.tocsc()
    assert all(np.array_equal(a, b) for a, b in zip(ours.by_columns(), (csc.indptr, csc.indices, csc.data)))
    x, y = rng.normal(size=30), rng.normal(size=40)
    assert np.allclose(ours @ x, theirs @ x, rtol=1e-14) and np.allclose(ours.rmatvec(y), theirs.T @ y, rtol=1e-14)
    keep = rng.random(40) < 0.5
    assert np.array_equal(ours[keep].toarray(), theirs[keep].toarray())
    both = ours.stack(ours[keep])
    assert np.array_equal(both.toarray(), vstack([theirs, theirs[keep]]).toarray())
    assert np.array_equal(extract._Rows.of(theirs).toarray(), theirs.toarray())


def test_a_start_copied_apart_from_its_graph_is_still_the_0_1_programs_start():
    """_Program.start finds a plan's nodes by identity, else by equality: a deep copy of the start (not of the
    graph with it) gives the same vector, not every class's first node."""
    import copy
    graph = PhysGraph({"x": [Node("Load", (), "x")],
                       "y": [Node("Apply", ("x",), "y", 0, cost=3e-6), Node("Apply", ("x",), "y", 1, cost=1e-6)]})
    roots = extract.with_roots(graph, {"y": ["y"]})
    plan = extract.exact(graph, roots)
    assert plan.choice["y"].sid == 1  # not the class's first node
    p = extract._program(graph, roots, None)
    same, copied = p.start(plan.choice, roots), p.start(copy.deepcopy(plan.choice), roots)
    assert np.array_equal(same, copied) and p.solver.feasible(copied)
    assert p.cost @ copied == pytest.approx(1e3)  # 1 us, in ns: y's second node
