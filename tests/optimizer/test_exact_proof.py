"""How the exact extractor's 0/1 program proves a training step's plan optimal (issue 10): optimize hands it the
plan that keeps every saved value as its start, the cuts' LP dual (recomputed by weak duality) is a lower bound
that fixes columns no cheaper plan uses, and where that bound reaches the start no MIP runs at all. Every proof
is checked against another method's optimum (the DP over tensors, or the MIP without fixing)."""
import sys

import numpy as np
import pytest
import torch
from scipy.sparse import csr_matrix

import egraph_did as ed
from egraph_did import extract, models
from egraph_did.errors import MemoryBoundError
from egraph_did.layout import Layout, S
from egraph_did.pins import apply_layout


def _without_dp(monkeypatch):
    monkeypatch.setattr(extract, "_exact_dp", lambda *a, **k: {"exact_dp": "off: the 0/1 program proves it"})


def _mlp_step():
    return models.mlp_training_step(64, 32), ed.DeviceMesh.arange(2)


def test_the_dual_bound_is_a_lower_bound_even_from_a_dual_of_the_wrong_sign():
    """min x0 + 2 x1 + 5 x2 with x0 + x1 + x2 >= 1 and x0 <= 0.5: the LP optimum is 1.5, and the recomputed
    dual bound says so; a dual HiGHS reports for a row's infinite side is dropped, never trusted."""
    solver = extract._Solver(np.array([1.0, 2.0, 5.0]), csr_matrix([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),
                             np.array([1.0, -np.inf]), np.array([np.inf, 0.5]))
    _, value = solver.lp()
    bound, reduced = solver.dual_bound()
    assert value == pytest.approx(1.5) and bound == pytest.approx(1.5)
    assert reduced[2] == pytest.approx(3.0)  # x2 = 1 costs 3 more than the LP: fixed under any start below 4.5

    class WrongSigns:  # row 0 (>= 1) given a negative dual, row 1 (<= 0.5) a positive one: both forbidden
        def getModelStatus(self):  # a solved LP's: dual_bound trusts no other
            return solver.core.HighsModelStatus.kOptimal

        def getSolution(self):
            return type("Solution", (), {"row_dual": [-1.0, 7.0]})()
    solver.highs = WrongSigns()
    bound, _ = solver.dual_bound()
    assert bound <= 1.5 + 1e-9  # both dropped: the bound of no dual, min over [0, 1] of the costs, 0
    assert bound == pytest.approx(0.0)


def test_the_relaxation_keeps_its_callers_time_limit_and_trusts_no_unsolved_lp():
    """The cut loop hands HiGHS what is left of its budget (one LP of fuzz seed 49 case 7837's memory-priced graph ran
    24 s of a 3 s budget); an LP stopped by that limit gives no solution and no dual bound."""
    solver = extract._Solver(np.array([1.0, 2.0]), csr_matrix([[1.0, 1.0]]), np.array([1.0]), np.array([np.inf]))
    assert solver.lp(0.5)[1] == pytest.approx(1.0) and solver.highs.getOptionValue("time_limit")[1] == 0.5
    assert solver.lp()[1] == pytest.approx(1.0) and solver.highs.getOptionValue("time_limit")[1] == np.inf
    status = solver.core.HighsModelStatus

    class StoppedByTime:  # what HiGHS reports for an LP its time limit ended
        def setOptionValue(self, name, value):
            pass

        def run(self):
            pass

        def getModelStatus(self):
            return status.kTimeLimit
    solver.highs = StoppedByTime()
    assert solver.lp(0.01) == (None, None)
    assert not solver.solved() and not solver.infeasible() and solver.dual_bound() is None


def test_reduced_cost_fixing_keeps_the_starts_columns_and_drops_only_dearer_ones():
    solver = extract._Solver(np.array([1.0, 2.0, 5.0]), csr_matrix([[1.0, 1.0, 1.0]]), np.array([1.0]),
                             np.array([np.inf]))
    solver.lp()
    program = extract._Program([], [], {}, np.zeros(1, dtype=np.int64), solver.cost, solver)
    cols, bound = extract._reduced_cost_columns(program, np.array([0.0, 1.0, 0.0]))  # start costs 2
    assert bound == pytest.approx(1.0)
    assert list(cols) == [True, True, False]  # x2 = 1 costs at least 1 + 4 > 2
    cols, _ = extract._reduced_cost_columns(program, np.array([0.0, 0.0, 1.0]))  # a start keeps its own columns
    assert list(cols) == [True, True, True]


def test_exact_proves_a_small_training_step_by_the_lp_dual_alone(monkeypatch):
    """The MLP training step on 2 ranks: with the DP off, the cuts' LP dual reaches the keep-everything plan's
    cost, so the 0/1 program proves it with no MIP; the DP proves the same optimum."""
    fd, mesh = _mlp_step()
    by_dp = ed.optimize(fd, mesh, extractor="exact")
    _without_dp(monkeypatch)
    fd, mesh = _mlp_step()
    plan = ed.optimize(fd, mesh, extractor="exact")
    st = plan.stats
    assert plan.method == "exact" and st["exact_proven"] is True
    assert (st["exact_method"], st["exact_proof"], st["exact_incumbent"]) == ("ilp", "lp", "start")
    assert st["exact_solve_s"] == 0.0 and st["exact_dual_bound"] >= plan.stats["extract_cost"] * (1 - 1e-9)
    assert by_dp.stats["exact_method"] == "dp" and by_dp.method == "exact"
    assert plan.predicted_time == pytest.approx(by_dp.predicted_time, rel=1e-9)


def test_a_mip_after_reduced_cost_fixing_proves_the_same_optimum_as_without_fixing(monkeypatch):
    """A small GPT training step on 2 ranks (x and target sequence-sharded): the LP dual falls short, so HiGHS
    proves the optimum over the columns reduced-cost fixing left; without fixing it proves the same cost."""
    def step():
        fd = models.gpt_training_step(1, 64, 64, 4, torch.float32, layers=1)
        mesh = ed.DeviceMesh.arange(2)
        for name in ("x", "target"):
            apply_layout(fd[name], Layout((S(1),)), mesh)
        return fd, mesh

    _without_dp(monkeypatch)
    fixed = ed.optimize(*step(), extractor="exact")
    st = fixed.stats
    assert fixed.method == "exact" and st["exact_proven"] is True
    assert (st["exact_method"], st["exact_proof"], st["exact_incumbent"]) == ("ilp", "mip", "start")
    assert st["exact_fixed"] > 0
    monkeypatch.setattr(extract, "_reduced_cost_columns", lambda p, start: (None, None))
    unfixed = ed.optimize(*step(), extractor="exact")
    assert unfixed.stats["exact_proven"] is True and unfixed.stats["exact_fixed"] == 0
    assert fixed.predicted_time == pytest.approx(unfixed.predicted_time, rel=1e-9)


def test_cuts_one_pass_needed_start_the_next_passes_cut_loop_and_prove_the_same_optimum(monkeypatch):
    """exact's `cuts`: the first pass puts in the keys of the cuts its LP needed, and a later pass (here the
    same graph again) adds those cuts before its first LP, leaving the set as it was: fewer LP rounds, the
    same proven optimum. The cover rows are off: on this step they leave the cut loop no cut to find."""
    monkeypatch.setattr(extract, "_add_cover_rows", lambda *a, **k: None)
    _without_dp(monkeypatch)
    graph, roots, bound, start = _small_gpt_step_pass(monkeypatch)
    cuts = set()
    first = extract.exact(graph, roots, bound, start=start, cuts=cuts)
    assert cuts and first.stats["exact_hinted_cuts"] == 0
    hinted = set(cuts)
    again = extract.exact(graph, roots, bound, start=start, cuts=hinted)
    assert again.stats["exact_hinted_cuts"] == len(cuts) and hinted == cuts
    assert again.stats["exact_cut_rounds"] < first.stats["exact_cut_rounds"]
    assert first.proven and again.proven and again.cost == pytest.approx(first.cost, rel=1e-9)


def _components_by_walks(graph, outs):
    """The definition _components implements in one walk: outputs whose reachable classes meet are grouped."""
    reach = [set(extract._topo_order(graph, [o])) for o in outs]
    parent = list(range(len(outs)))

    def find(i):
        while parent[i] != i:
            i = parent[i]
        return i
    for i in range(len(outs)):
        for j in range(i):
            if reach[i] & reach[j]:
                parent[find(j)] = find(i)
    groups = {}
    for i, o in enumerate(outs):
        groups.setdefault(find(i), []).append(o)
    return sorted(sorted(g) for g in groups.values())


def test_components_in_one_walk_group_outputs_as_walks_per_output_do():
    """Random DAGs (some classes shared through a second alternative only, some outputs alone): the one-walk
    grouping equals grouping by the overlap of each output's own walk."""
    from egraph_did.physgraph import Node, PhysGraph
    rng = np.random.default_rng(5)
    for _ in range(40):
        n = int(rng.integers(3, 30))
        classes = {}
        for k in range(n):
            nodes = [Node("Load", (), f"c{k}")]
            for _alt in range(int(rng.integers(0, 3))):
                if k:
                    kids = rng.choice(k, size=int(rng.integers(1, min(k, 3) + 1)), replace=False)
                    nodes.append(Node("Apply", tuple(f"c{j}" for j in kids), f"c{k}"))
            classes[f"c{k}"] = nodes
        graph = PhysGraph(classes)
        picked = rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False)
        roots = extract.with_roots(graph, {f"c{k}": [f"c{k}"] for k in picked})
        outs = list(graph.classes[extract.ROOT][0].children)
        got = sorted(sorted(g) for g in extract._components(graph, roots))
        assert got == _components_by_walks(graph, outs)


def test_exact_pauses_the_collector_and_restores_it():
    import gc
    from egraph_did.physgraph import Node, PhysGraph
    seen = []
    real = extract._exact

    def spy(*a, **k):
        seen.append(gc.isenabled())
        return real(*a, **k)
    g = PhysGraph({"x": [Node("Load", (), "x")], "y": [Node("Apply", ("x",), "y", 0, cost=1e-6)]})
    roots = extract.with_roots(g, {"y": ["y"]})
    extract._exact, was = spy, gc.isenabled()
    try:
        extract.exact(g, roots)
    finally:
        extract._exact = real
    assert seen == [False] and gc.isenabled() == was


def _small_gpt_step_pass(monkeypatch):
    """(graph, roots, memory bound, start) of the first graph optimize hands exact on a small GPT training step."""
    import importlib
    optimize_module = importlib.import_module("egraph_did.optimize")
    got = []
    monkeypatch.setattr(optimize_module, "exact", lambda *a, **k: got.append((a, k)) or extract.exact(*a, **k))
    fd = models.gpt_training_step(1, 64, 64, 4, torch.float32, layers=1)
    mesh = ed.DeviceMesh.arange(2)
    for name in ("x", "target"):
        apply_layout(fd[name], Layout((S(1),)), mesh)
    ed.optimize(fd, mesh, extractor="exact")
    (graph, roots, bound), kwargs = got[0]
    return graph, roots, bound, kwargs["start"]


def test_prove_false_returns_the_restricted_plan_unproven_with_the_lps_bound(monkeypatch):
    """exact(prove=False), for a caller that reads only a plan's layouts: where the cut loop's LP falls short of
    the plan in hand, no MIP runs and the restricted MIP's plan comes back unproven, between the LP's bound and
    the start's cost; with prove=True the same graph is proven by the MIP."""
    _without_dp(monkeypatch)
    graph, roots, bound, start = _small_gpt_step_pass(monkeypatch)
    proven = extract.exact(graph, roots, bound, start=start)
    quick = extract.exact(graph, roots, bound, start=start, prove=False)
    assert proven.proven and proven.stats["exact_proof"] == "mip"
    assert (quick.method, quick.proven, quick.stats["exact_proof"]) == ("exact-unproven", False, "none")
    assert quick.stats["exact_solve_s"] == 0.0 and quick.stats["exact_status"] == "not proven (prove=False)"
    assert quick.stats["exact_bound"] <= proven.cost * (1 + 1e-9) <= quick.cost * (1 + 1e-9) <= start.cost * (1 + 1e-9)


def test_a_training_steps_first_exact_pass_is_proven_only_where_its_plan_is_a_loop(monkeypatch):
    """optimize(extractor="exact") on a training step: the first pass's plan gives the loops' pins and is left
    unproven (its MIP was 1.0-1.3 s of one GPT-3 layer's 1.5 s pass); the loop passes are proven. Where the
    unproven plan is a loop already it may be optimize's plan, so that pass proves it after all."""
    import importlib
    opt = importlib.import_module("egraph_did.optimize")
    fd = models.gpt_training_step(1, 128, 128, 4, torch.float32, layers=1)
    mesh = ed.DeviceMesh.arange(4)
    calls = []
    real = opt.exact
    monkeypatch.setattr(opt, "exact", lambda *a, **k: calls.append(k.get("prove", True)) or real(*a, **k))
    plan = ed.optimize(fd, mesh, extractor="exact")  # inputs free: the first plan is no loop
    passes = plan.stats["passes"]
    assert passes[0]["proof"] == "none" and passes[0]["method"] == "exact-unproven"
    assert calls[0] is False and all(calls[1:]) and len(calls) == len(passes) > 1
    assert plan.method == "exact" and all(p["method"] == "exact" for p in passes[1:] if p["proof"] != "bound above upper")
    calls.clear()
    monkeypatch.setattr(opt, "loop_pins", lambda *a, **k: [])  # every plan taken for a loop: the first is proven
    looped = ed.optimize(fd, mesh, extractor="exact")
    assert calls == [False, True] and len(looped.stats["passes"]) == 1
    assert looped.method == "exact" and looped.stats["exact_proved_loop"] is True
    assert looped.stats["passes"][0]["proof"] in ("lp", "mip")


def test_cover_rows_reach_the_cut_loops_lp_bound_before_any_cut_and_prove_the_same_optimum(monkeypatch):
    """A small GPT training step, the DP off: with the cover rows (some class of every tensor-level a root must
    pass through is needed) the first LP already has the bound the cut loop reaches without them after many
    rounds; both prove the same optimum."""
    _without_dp(monkeypatch)
    graph, roots, bound, start = _small_gpt_step_pass(monkeypatch)
    covered = extract.exact(graph, roots, bound, start=start)
    monkeypatch.setattr(extract, "_add_cover_rows", lambda *a, **k: None)
    plain = extract.exact(graph, roots, bound, start=start)
    assert covered.proven and plain.proven
    assert covered.cost == pytest.approx(plain.cost, rel=1e-9)
    assert covered.stats["exact_lp_bound"] >= plain.stats["exact_lp_bound"] * (1 - 1e-9)
    assert covered.stats["exact_cut_rounds"] < plain.stats["exact_cut_rounds"]
    assert covered.stats["exact_cuts"] < plain.stats["exact_cuts"]


def test_a_cover_row_asks_for_one_layout_of_a_tensor_every_derivation_reads():
    """y is made from x in layout R or in layout S (each a class of tensor x at level 1, both from x0): the
    cover rows say y, x0, and one of x's two level-1 layouts are needed, and nothing else."""
    from egraph_did.physgraph import Node, PhysGraph
    ident = {"x0": ("x", "S", 0), "xR": ("x", "R", 1), "xS": ("x", "S", 1), "y": ("y", "R", 0)}
    g = PhysGraph({"x0": [Node("Load", (), "x")],
                   "xR": [Node("Coll", ("x0",), "allgather", 0, cost=5e-6)],
                   "xS": [Node("Keep", ("x0",), cost=3e-6)],
                   "y": [Node("Apply", ("xR",), "y", 0, cost=1e-6), Node("Apply", ("xS",), "y", 1, cost=2e-6)]},
                  ident=ident, index={v: k for k, v in ident.items()})
    roots = extract.with_roots(g, {"y": ["y"]})
    p = extract._program(g, roots, None)
    n_base = p.solver.a.shape[0]
    _, _, lp_bound, _ = extract._separate(g, p, 10.0, None, roots)
    covers = p.solver.a[n_base:n_base + p.n_cover].toarray()
    assert not covers[:, :p.nn].any() and (p.solver.lo[n_base:n_base + p.n_cover] == 1).all()
    assert {frozenset(p.order[ci] for ci in np.nonzero(row[p.nn:])[0]) for row in covers} == {
        frozenset({"y"}), frozenset({"x0"}), frozenset({"xR", "xS"})}
    assert lp_bound == pytest.approx(5e3)  # y by S: 3 + 2 us, in ns


def test_a_training_step_gets_the_cheapest_loop_plan_with_the_replicated_loop_among_its_pins():
    """The exact extractor's plan of a training step is the cheapest loop plan of the whole graph, as the 0/1
    program with every tie (x, next.x) held to one layout proves it (bench/exact_hard_cases.py's tied_program).
    On mlp_training_step(64, 32) over 2 ranks the free optimum takes w1 replicated and sharded at once, and the
    two pin sets read from it (as taken, as delivered) gave loops of 110.2 us; the replicated loop (every tie
    replicated, optimize.loop_pins' third set, tried second) is 100.2 us, the proven optimum. The delivered
    pass runs bounded by it (its MIP skipped where its LP bound is above)."""
    from bench.exact_hard_cases import capture_training, tied_program
    fd, mesh = _mlp_step()
    graphs, plan = capture_training(fd=fd, mesh=mesh)  # optimize(extractor="exact"), each pass's graph kept
    passes = plan.stats["passes"]
    assert len(passes) == 4 and all(p["method"] == "exact" for p in passes[:3])  # free, taken, replicated, delivered
    taken, replicated, delivered = passes[1:]
    assert plan.predicted_time == pytest.approx(replicated["cost"], rel=1e-12)
    assert plan.predicted_time < min(taken["cost"], delivered["cost"]) * (1 - 0.05)
    graph, roots, bound, *_ = graphs[0]  # the free pass's
    res, _, held = tied_program(graph, roots, bound, 60.0)
    assert res["status"] == "optimal" and set(held.values()) == {"R"}
    assert plan.predicted_time == pytest.approx(res["fun"] / 1e9, rel=1e-9)
    assert all(plan.layout_of(f"next.{x}").code() == "R" for x in held)


def test_greedy_screens_its_loops_and_runs_only_the_passes_near_the_best_screen(monkeypatch):
    """The greedy extractor's loops of a training step: as taken, replicated, as delivered (110.2, 100.2, 110.2 us on
    mlp_training_step(64, 32) over 2 ranks). Each is screened on the first pass's graph (greedy's plan of it with
    every tie held in the loop's layout), and only the replicated loop's pass runs: the exact extractor's plan,
    100.2 us. Before session 14 greedy tried the two loops read from its plan only and stayed at 110.2 us. With
    the screens off every loop's pass runs, to the same plan."""
    opt = sys.modules["egraph_did.optimize"]
    fd, mesh = _mlp_step()
    plan = ed.optimize(fd, mesh)
    screens, costs = plan.stats["loop_screens"], [p["cost"] for p in plan.stats["passes"]]
    assert len(screens) == 3 and min(screens) < min(screens[0], screens[2]) * (1 - 0.05)
    assert len(costs) == 2 and plan.stats["loops_tried"] == 1  # the free pass, then the replicated loop's
    assert screens[1] == pytest.approx(costs[1], rel=1e-9) and plan.predicted_time == pytest.approx(costs[1], rel=1e-12)
    assert plan.predicted_time == pytest.approx(ed.optimize(fd, mesh, extractor="exact").predicted_time, rel=1e-9)
    assert all(plan.layout_of(x).code() == plan.layout_of(f"next.{x}").code() == "R"
               for x in ("w1", "w2", "exp_avg.w1", "exp_avg_sq.w2"))
    monkeypatch.setattr(opt, "loop_screen", lambda *a: None)  # no screen decides: every loop's pass runs
    unscreened = ed.optimize(fd, mesh)
    assert len(unscreened.stats["passes"]) == 4 and unscreened.stats["loops_tried"] == 3
    assert [p["cost"] for p in unscreened.stats["passes"]][1:] == pytest.approx(screens, rel=1e-9)
    assert unscreened.predicted_time == pytest.approx(plan.predicted_time, rel=1e-12)
    real = opt.loop_pins  # the loops greedy tried before: the two read from its plan
    monkeypatch.setattr(opt, "loop_pins", lambda plan, problem, always=False, replicated=False:
                        real(plan, problem, always, False))
    assert ed.optimize(fd, mesh).predicted_time > plan.predicted_time * 1.05


def test_greedy_runs_the_loops_its_screens_held_back_where_the_chosen_ones_do_not_fit(monkeypatch):
    """A loop's screen is greedy's plan of the first pass's graph, its pass the plan of a graph with the loop's
    pins: where the pass of the best screen's loop raises MemoryBoundError, the loops held back run in turn until
    one fits, and the plan is still a loop (here as taken, 110.2 us, since the replicated loop is refused)."""
    opt = sys.modules["egraph_did.optimize"]
    real = opt._optimize_once

    def refuse_replicated(fd, mesh, cm, pins, *a, **k):
        if pins and all(pins.get(name) is not None and pins[name].code() == "R" for name in ("w1", "exp_avg.w1")):
            raise MemoryBoundError("the replicated loop does not fit (this test's refusal)")
        return real(fd, mesh, cm, pins, *a, **k)
    monkeypatch.setattr(opt, "_optimize_once", refuse_replicated)
    fd, mesh = _mlp_step()
    plan = ed.optimize(fd, mesh)
    passes = plan.stats["passes"]  # the refused pass is not listed: it made no plan
    assert plan.stats["loops_tried"] == 2 and len(passes) == 2  # replicated refused, then the first held back
    assert plan.predicted_time == pytest.approx(110.24e-6, rel=1e-3)
    assert all(plan.layout_of(x) == plan.layout_of(f"next.{x}") for x in ("w1", "w2", "exp_avg.w1"))


def test_a_bound_above_upper_skips_the_mip_and_says_so(monkeypatch):
    """upper: the caller holds a plan this cheap already (optimize's cheapest loop so far). Where the 0/1
    program's LP bound is above it, no MIP runs: the start comes back unproven, and the stats say why; at or
    below it the proof runs as always."""
    from egraph_did.physgraph import Node, PhysGraph
    _without_dp(monkeypatch)

    def solved(upper):  # y by node 0 (3 us) or node 1 (5 us), from the start that takes node 1
        g = PhysGraph({"x": [Node("Load", (), "x")],
                       "y": [Node("Apply", ("x",), "y", 0, cost=3e-6), Node("Apply", ("x",), "y", 1, cost=5e-6)]},
                      ident={"x": ("x", "R", 0), "y": ("y", "R", 0)})  # (tensor, layout, level): the cut loop's LP runs
        roots = extract.with_roots(g, {"y": ["y"]})
        start = {c: g.classes[c][0] for c in ("x", "__out__:y", "__root__")}
        start["y"] = g.classes["y"][1]
        return extract.exact(g, roots, start=extract.Selection(start, 5e-6, 0.0, "greedy-dag"), upper=upper)
    above = solved(2e-6)
    assert (above.method, above.proven, above.cost) == ("exact-unproven", False, 5e-6)
    assert above.stats["exact_status"] == "above upper" and above.stats["exact_solve_s"] == 0.0
    assert above.stats["exact_proof"] == "bound above upper" and above.stats["exact_bound"] > 2e-6
    assert "above upper" in above.stats["exact_note"]
    below = solved(4e-6)
    assert (below.method, below.proven) == ("exact", True) and below.cost == pytest.approx(3e-6)


def test_the_exact_extractors_bucket_pass_is_offered_greedys_pairs_too():
    """Fuzz seed 48 case 7199, reduced: exact's proven first plan reduces t0 and t2 over two mesh axes (no pair to
    bucket, 62 us), greedy's over one, whose bucket makes greedy's plan 54 us; optimize offers exact's bucket pass
    greedy's pairs of the same graph, so exact finds that plan (was 62 us, above greedy's)."""
    DIDx, DIDy = ed.ParallelType.DIDx, ed.ParallelType.DIDy
    mesh = ed.DeviceMesh(torch.arange(4).reshape(1, 2, 2), axis_names=("pp", "dp", "tp"))
    with ed.FusionDefinition() as fd:
        x0 = fd.define_tensor((2, 4), torch.float64, name="x0")
        x1 = fd.define_tensor((1, 3), torch.float64, name="x1")
        x2 = fd.define_tensor((1, 4), torch.int64, name="x2")
        x3 = fd.define_tensor((1, 4), torch.float64, name="x3")
        t0 = fd.ops.mean(x=x0, dims=None)
        t2 = fd.ops.scatter_add(x=fd.ops.amin(x=x1, dims=(0, 1), keepdim=True), dim=1, index=x2, src=x3)
        fd.add_output(t0, name="t0")
        fd.add_output(t2, name="t2")
    x0.set_device_mesh(mesh).outer_split(1, 2).parallelize(1, DIDx).outer_split(0, 2).parallelize(0, DIDy)
    for x in (x2, x3):
        x.set_device_mesh(mesh).outer_split(1, 2).parallelize(1, DIDy)
    for t in fd.fusion.tensors.values():
        if t.mesh is None:
            t.set_device_mesh(mesh)
    cm = ed.CostModel.h200(memory_limit=180.0)  # 0.9 of the unbounded plan's 200 B
    greedy, exact = (ed.optimize(fd, mesh, cost_model=cm, extractor=ex) for ex in ("greedy", "exact"))
    assert greedy.buckets == [["t0", "t2"]] and exact.buckets == [["t0", "t2"]]
    assert exact.predicted_time <= greedy.predicted_time * (1 + 1e-12)
    assert exact.predicted_time == pytest.approx(54e-6, rel=1e-3) and exact.memory <= 180.0
