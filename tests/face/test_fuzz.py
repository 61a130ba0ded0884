"""The differential fuzzer (bench/fuzz.py): a seeded slice of random cases runs in CI and must pass, and
the fuzzer itself is tested: every op of the op table is generated, cases are valid and reproducible, a
deliberately wrong result or crash is caught, classified and minimized to a small runnable repro, and a
hanging or dying case ends only that case.

The long run is `.venv/bin/python bench/fuzz.py --cases N --seed S` (see its docstring).

What the CI slice (test_seeded_slice_passes) leaves out, and why (the failure classes are the fuzzer's;
see issue 12 and the fuzzer's report for the minimized repros). Each is a known bug or missing feature
that others are fixing; put it back in the slice when its class is fixed:

- mesh axes of size 1 (meshes (4, 1), (1, 4), (2, 1, 2), ...) and the mesh of one rank: a pin that splits
  an axis over a size-1 mesh axis is reported without that split (`pins-reported-differently`; and before
  commit 2857e24's neighbours, `collective-on-size-1-mesh-axis`).
- nothing else of the op table: `expand` of a 0-D tensor to shape () passes the shape rule and crashes
  ed.evaluate (`evaluate-crash: TypeError in ops.py:<lambda>`), rare enough that the slice's seed misses it.
- partial pins (P, Pmax): `replicate -> partial` is missing, so most are refused; where accepted they
  are checked in the long run.
- the h200_multinode cost model (on meshes that are not 2-D it is refused, which ends the case), and
  memory bounds: the exact extractor returns plans over the bound (`memory-bound-exceeded`), greedy
  refuses bounds that exact meets (`greedy-refuses-where-exact-plans`), and the refusal prints both
  sizes as 0.00 GiB (`optimize-error-unreadable: both sizes print as 0.00 GiB`).
- welford_blocks / welford_merge (`simulate-eager-crash: ShardingError in sharding.py:unshard_tensor`:
  a nan in a replicated output, as welford_merge makes of an empty block, is "different data" to
  unshard_tensor's replica check, whose torch.equal is not nan-safe).
- the exact extractor is run (exact <= greedy is checked, and the gap is measured but not bounded: greedy
  is more than 1% worse than exact on about 8% of random cases, `greedy-over-1%-worse-than-exact` with
  --gap-limit 0.01), and gloo processes are not (the long run samples them with --gloo-every).

In the slice: splits that leave a rank empty (5 rows over 4 ranks), with issue 29's reshard probe beside
about a quarter of its cases; non-outermost splits, as of a merged gate/up weight, and nested splits with the
inner mesh axis outside (they plan through a reshaped view where their splits divide the extent, and are
refused saying what to do where not).
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # `python -m pytest` from the root has it; a bare `pytest` may not
    sys.path.insert(0, ROOT)

import egraph_did as ed  # noqa: E402
from egraph_did.layout import empty_rank  # noqa: E402
from bench import fuzz  # noqa: E402

# op families the CI slice draws from: every op but those the docstring excludes
CI_EXCLUDED_OPS = {"welford_blocks", "welford_merge"}
CI_OPS = sorted(set(ed.op_names()) - CI_EXCLUDED_OPS)
CI_MESHES = [[2], [3], [4], [5], [2, 2], [2, 3], [3, 2], [2, 4], [2, 2, 2]]
CI_PROFILE = dict(meshes=CI_MESHES, pin_styles=("outer", "nonouter", "inner-first"), partial_pins=False, empty_shards=True,
                  memory_bounds=False, multinode=False)
CI_SEED, CI_CASES = 2024, 40


# ------------------------------------------------------------------------------ the generator

@pytest.mark.parametrize("op", ed.op_names())
def test_every_op_of_the_op_table_is_generated(op):
    found = [i for i in range(12) if any(o["op"] == op for o in fuzz.generate_case(3, i, ops=[op])["ops"])]
    assert found, f"the fuzzer never generates {op}: add a g_{op} builder to bench/fuzz.py's _Gen"


def test_cases_are_reproducible_and_valid():
    for i in range(60):
        spec = fuzz.generate_case(5, i)
        assert spec == fuzz.generate_case(5, i)
        shapes = fuzz.infer_shapes(spec)
        assert shapes is not None, f"case {i} is not a valid fusion"
        assert spec["ops"] and spec["outputs"]
        assert all(o in shapes for o in spec["outputs"])
        assert set(spec["pins"]) <= set(shapes)


def test_the_generator_covers_meshes_pins_and_cost_models():
    specs = [fuzz.generate_case(9, i) for i in range(200)]
    assert {len(s["mesh"]) for s in specs} == {1, 2, 3}
    assert any(math_prod(s["mesh"]) % 2 and math_prod(s["mesh"]) > 1 for s in specs)  # 3 or 5 ranks
    styles = {p["style"] for s in specs for p in s["pins"].values()}
    assert styles == {"outer", "nonouter", "inner-first"}
    placements = {pl[0] for s in specs for p in s["pins"].values() for pl in p["pl"]}
    assert placements == {"R", "S", "P", "M"}
    assert {s["cost"]["preset"] for s in specs} == {"h200", "h200_multinode"}
    assert any(s["cost"]["memory_frac"] for s in specs)
    extents = {e for s in specs for i in s["inputs"].values() for e in i["shape"]}
    assert 1 in extents and 7 in extents  # size-1 and uneven extents
    assert {s["dtype"] for s in specs} == {"float32", "float64"}


def math_prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


def test_case_source_is_the_case():
    spec = fuzz.generate_case(1, 2, ops=["linear", "gelu", "sum"])
    ns: dict = {}
    exec(fuzz.case_source(spec), ns)
    fd = ns["fd"]
    assert list(fd.fusion.outputs) == spec["outputs"]
    assert [e.op.name for e in fd.fusion.exprs] == [o["op"] for o in spec["ops"]]
    assert set(ns["inputs"]) == set(spec["inputs"])


def test_pin_source_pins_through_the_loop_domain_api():
    mesh = ed.DeviceMesh(torch.arange(4).reshape(2, 2))
    ns = {"mesh": mesh, "DIDx": ed.ParallelType.DIDx, "DIDy": ed.ParallelType.DIDy}
    with ed.FusionDefinition() as fd:
        ns["w"] = fd.define_tensor((8, 6), name="w")
    exec(fuzz.pin_source("w", {"pl": ["S0", "S0"], "style": "inner-first"}, [2, 2]), ns)
    assert ns["w"].loop_str() == "[DIDx{2}, DIDy{2}, 8/2/2, 6]"
    with ed.FusionDefinition() as fd:
        ns["w"] = fd.define_tensor((8, 6), name="w")
    exec(fuzz.pin_source("w", {"pl": ["P", "S1"], "style": "nonouter"}, [2, 2]), ns)
    assert ns["w"].loop_str() == "[8, 2, DIDx{2}, 6/2/2, rDIDy{2}]"


def test_the_fuzzers_docstring_examples_run():
    import doctest
    result = doctest.testmod(fuzz, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 20


# ------------------------------------------------------------------------------ the checks

def test_compare_tolerates_rounding_and_catches_errors():
    x = torch.randn(4, 5, dtype=torch.float64)
    assert fuzz.compare(x + 1e-12, x, 1e-6) is None
    assert "max abs error" in fuzz.compare(x + 1e-3, x, 1e-6)
    assert "shape" in fuzz.compare(x[:3], x, 1e-6)
    nan = x.clone()
    nan[0, 0] = float("nan")
    assert fuzz.compare(nan, nan.clone(), 1e-6) is None
    assert "nan" in fuzz.compare(nan, x, 1e-6)
    assert fuzz.compare(torch.tensor([1, 2]), torch.tensor([1, 3]), 1e-6).startswith("integer")


def test_a_bool_decided_by_rounding_is_not_held_against_the_plan_but_a_steady_one_is():
    """Seed 35 case 8279: logical_and(x1, sum(layer_norm(x0), -1)); the row sums are 0 in exact arithmetic and
    +-1e-7 (or exactly 0) by summation order, so the lowered kernel's True where evaluate says False on row 1
    was a finding of the fuzzer, not of the plan. Entries where the float64 reference disagrees with the
    case's own are not compared; every other entry still is."""
    spec = {"seed": 35, "index": 8279, "dtype": "float32", "mesh": [1], "axis_names": None,
            "inputs": {"x0": {"shape": [4, 13], "dtype": "float32", "data": "randn"},
                       "x1": {"shape": [1], "dtype": "float32", "data": "randn"}},
            "ops": [{"op": "layer_norm", "args": [["x", {"t": "x0"}], ["normalized_shape", [13]]], "outs": ["t0"]},
                    {"op": "sum", "args": [["x", {"t": "t0"}], ["dims", -1]], "outs": ["t2"]},
                    {"op": "logical_and", "args": [["a", {"t": "x1"}], ["b", {"t": "t2"}]], "outs": ["t3"]}],
            "outputs": ["t3"], "pins": {}, "cost": {"preset": "h200", "memory_frac": None},
            "extractors": ["greedy"], "gloo": False}
    g = torch.Generator().manual_seed(0)
    inputs = {"x0": torch.randn((4, 13), generator=g, dtype=torch.float64).float(),
              "x1": torch.randn((1,), generator=g, dtype=torch.float64).float()}
    *_, inputs_src = fuzz._source_parts(spec)
    ns = {"torch": torch}
    exec(inputs_src, ns)  # the case's own inputs are these
    assert all(torch.equal(ns["inputs"][k], v) for k, v in inputs.items())
    head, build = fuzz._source_parts(spec)[:2]
    exec(head + "\n" + build, ns)
    ref = ed.evaluate(ns["fd"], inputs)
    wide = fuzz.reference64(spec, inputs, ed)
    unsteady = wide["t3"] != ref["t3"]
    assert unsteady.any() and not unsteady.all()
    flipped_where_rounding_decides = torch.where(unsteady, ~ref["t3"], ref["t3"])
    assert fuzz.compare_outputs({"t3": flipped_where_rounding_decides}, ref, 2e-4, lambda: wide) == {}
    flipped_where_steady = torch.where(~unsteady, ~ref["t3"], ref["t3"])
    assert "t3" in fuzz.compare_outputs({"t3": flipped_where_steady}, ref, 2e-4, lambda: wide)
    assert "t3" in fuzz.compare_outputs({"t3": flipped_where_rounding_decides}, ref, 2e-4)  # no oracle: strict


def test_a_float_output_the_float32_reference_rounds_off_is_held_to_the_float64_one():
    """Seed 49 case 8629: rms_norm over one element of gelu(x0), x0 = -3.48. float32 gelu there is -8.7e-4 with
    its cancellation's error, which the norm (x / sqrt(x^2 + eps)) amplifies: torch's float32 reference is 8.0e-4
    from the float64 one (-1.29339 for -1.2925865), the plan's kernel 1.9e-5 (-1.29261). The output is held to the
    float64 reference then, not failed; an output off from both still fails. (The case's values.)"""
    wide = {"t3": torch.tensor([0.5, -1.2925865200678073], dtype=torch.float64)}
    ref = {"t3": torch.tensor([0.5, -1.29339])}
    right = {"t3": torch.tensor([0.5, -1.2926050424575806])}
    assert fuzz.compare(right["t3"], ref["t3"], 2e-4) is not None  # the float32 reference alone fails it
    assert fuzz.compare_outputs(right, ref, 2e-4, lambda: wide) == {}
    assert "t3" in fuzz.compare_outputs({"t3": torch.tensor([0.5, -1.2940])}, ref, 2e-4, lambda: wide)
    assert "t3" in fuzz.compare_outputs(right, ref, 2e-4)  # no float64 oracle: strict


def _wrong_exp(monkeypatch):
    """ed.simulate returns exp(x) + 1 wherever the plan computes an exp: a planted bug."""
    real = ed.simulate

    def simulate(plan, inputs, lowered=True):
        out = real(plan, inputs, lowered=lowered)
        if any(s.op == "exp" for s in plan.compute_steps):
            out = {k: v + 1 if v.is_floating_point() else v for k, v in out.items()}
        return out
    monkeypatch.setattr(ed, "simulate", simulate)


def test_a_wrong_result_is_caught_and_minimized_to_the_op_that_is_wrong(monkeypatch):
    _wrong_exp(monkeypatch)
    camp = fuzz.Campaign(seed=4, ops=["exp", "add", "relu", "sum", "linear"], minimize_per_class=1, exact=False,
                         in_process=True, minimize_budget=120, meshes=[[2], [2, 2]], memory_bounds=False,
                         pin_styles=("outer",), partial_pins=False, empty_shards=False)
    camp.run(range(12))
    assert "simulate-eager-mismatch" in camp.failures, camp.summary()
    assert "simulate-lowered-mismatch" not in camp.failures  # the plan is wrong already: not counted twice
    (m,) = camp.minimized["simulate-eager-mismatch"]
    assert [o["op"] for o in m["spec"]["ops"]] == ["exp"], m["repro"]
    assert m["spec"]["mesh"] in ([1], [2]) and not m["spec"]["pins"]
    assert m["size_after"] <= m["size_before"]
    # the repro is a script that fails the same way where simulate is wrong
    ns: dict = {}
    with pytest.raises(AssertionError):
        exec(m["repro"], ns)
    assert "fd.ops.exp(" in m["repro"] and "ed.simulate(plan, inputs, lowered=False)" in m["repro"]
    assert "simulate-eager-mismatch" in camp.summary()


def test_a_crash_in_optimize_is_classified_by_exception_and_place_and_minimized(monkeypatch):
    real = ed.optimize

    def optimize(fd, mesh, *args, **kw):
        if any(e.op.name == "softmax" for e in fd.fusion.exprs):
            raise KeyError("planted")
        return real(fd, mesh, *args, **kw)
    monkeypatch.setattr(ed, "optimize", optimize)
    camp = fuzz.Campaign(seed=6, ops=["softmax", "mul", "neg"], minimize_per_class=1, exact=False,
                         in_process=True, minimize_budget=120, meshes=[[2], [3]], memory_bounds=False,
                         multinode=False)
    camp.run(range(10))
    (cls,) = camp.failures
    assert cls.startswith("optimize-crash: KeyError"), cls
    (m,) = camp.minimized[cls]
    assert [o["op"] for o in m["spec"]["ops"]] == ["softmax"]
    assert 'extractor="greedy")  # optimize-crash: KeyError' in m["repro"]


def test_an_error_that_names_no_tensor_is_a_failure_and_one_that_does_is_a_refusal(monkeypatch):
    real = ed.optimize
    calls = {"n": 0}

    def optimize(fd, mesh, *args, **kw):
        calls["n"] += 1
        if calls["n"] % 2:
            raise ed.PlanError("something went wrong")
        raise ed.PlanError(f"{fd.fusion.inputs[0].name}: cannot be honoured")
    monkeypatch.setattr(ed, "optimize", optimize)
    spec = fuzz.generate_case(0, 1, ops=["relu"], exact=False, memory_bounds=False, multinode=False)
    first, second = fuzz.run_case(spec), fuzz.run_case(spec)
    assert [f["cls"] for f in first["failures"]] == ["optimize-error-unnamed: PlanError"]
    assert second["failures"] == [] and "cannot be honoured" in second["refusal"]


def test_a_hanging_or_dying_case_ends_only_that_case():
    spec = fuzz.generate_case(0, 0, ops=["neg"], exact=False)
    with fuzz.Runner(timeout=60) as runner:
        hung = runner.run({**spec, "_inject": "hang"}, timeout=5)
        assert [f["cls"] for f in hung["failures"]] == ["timeout in build"]
        died = runner.run({**spec, "_inject": "die"})
        assert [f["cls"] for f in died["failures"]] == ["worker-died in build"]
        assert runner.run(spec)["failures"] == []  # a fresh worker takes the next case


def test_the_minimizer_shrinks_the_mesh_extents_and_pins():
    spec = fuzz.generate_case(8, 3, ops=["add", "mul", "exp", "sum", "tanh"], meshes=[[2, 3]])
    spec["pins"] = {n: {"pl": ["S0", "R"], "style": "outer"} for n in list(spec["inputs"])[:1]}
    big = fuzz.case_size(spec)

    def has_exp(s, checks, cls):  # a "failure" that needs an exp and nothing else
        return {"failures": [{"cls": "x"}] if any(o["op"] == "exp" for o in s["ops"]) else []}
    small, _, runs = fuzz.minimize(spec, "x", has_exp)
    assert [o["op"] for o in small["ops"]] == ["exp"] and small["outputs"] and not small["pins"]
    assert small["mesh"] == [1] or len(small["mesh"]) == 1
    assert all(e == 1 for i in small["inputs"].values() for e in i["shape"])
    assert fuzz.case_size(small) < big and runs > 0


# ------------------------------------------------------------------------------ the CI slice

@pytest.mark.serial  # exact gets 10 s a case and a case 120 s
def test_seeded_slice_passes():
    """CI_CASES cases of seed CI_SEED over the families correct today (see the module docstring); any
    failure prints its class and a minimized repro."""
    lines: list[str] = []
    # exact gets 10 s a case here (an unproven exact plan must still be no worse than greedy); whether
    # exact proves optimality within its default 60 s is for the long runs of bench/fuzz.py (issue 12)
    camp = fuzz.Campaign(seed=CI_SEED, ops=CI_OPS, minimize_per_class=1, minimize_budget=60, timeout=120,
                         log=lines.append, exact_time_limit=10.0, **CI_PROFILE)
    try:
        camp.run(range(CI_CASES))
    finally:
        camp.close()
    report = camp.summary() + "\n\n" + "\n\n".join(m["repro"] for ms in camp.minimized.values() for m in ms)
    assert not camp.failures, report
    assert camp.n_cases == CI_CASES
    planned = CI_CASES - sum(camp.refusals.values())
    assert planned >= CI_CASES * 0.7, camp.summary()  # the slice checks plans, it is not all refusals


# ------------------------------------------------------------------------------ issue 29's edges

def test_the_generator_draws_reshape_chains_and_unread_inputs_from_their_own_stream():
    specs = [fuzz.generate_case(5, i, reshards=False) for i in range(60)]  # the reshard probe: the test below
    unread = [s for s in specs if any(i.get("unread") for i in s["inputs"].values())]
    chains = [s for s in specs if any(o["outs"][0].startswith("c") and o["op"] == "reshape" for o in s["ops"])]
    assert len(unread) >= 8 and len(chains) >= 8
    assert any(sum(o.startswith("c") for o in s["outputs"]) >= 2 for s in chains)  # chain tensors as outputs
    for i, s in enumerate(specs):  # edges=False: the case as drawn before the edges (the other draws unchanged)
        plain = fuzz.generate_case(5, i, edges=False, reshards=False)
        assert [o for o in s["ops"] if not o["outs"][0].startswith("c")] == plain["ops"]
        assert {k: p for k, p in s["pins"].items() if k in plain["pins"]} == plain["pins"]


def _edge_case():
    """Issue 29's reshape-chain reproducer as a fuzz case, with an unread input: x[2, 6, 2] split over 4
    ranks, c0 = reshape(x, [24]) pinned as a view, c1 = reshape(c0, [2, 12]) (the view's own term)."""
    return {"seed": 0, "index": 0, "dtype": "float64", "mesh": [4], "axis_names": None,
            "inputs": {"x": {"shape": [2, 6, 2], "dtype": "float64", "data": "randn"},
                       "u0": {"shape": [3], "dtype": "float64", "data": "randn", "unread": True}},
            "ops": [{"op": "reshape", "args": [["x", {"t": "x"}], ["shape", [24]]], "outs": ["c0"]},
                    {"op": "reshape", "args": [["x", {"t": "c0"}], ["shape", [2, 12]]], "outs": ["c1"]}],
            "outputs": ["c0", "c1"],
            "pins": {"x": {"pl": ["S0"], "style": "outer"}, "c0": {"pl": ["S0"], "style": "nonouter"}},
            "cost": {"preset": "h200", "memory_frac": None}, "extractors": ["greedy"], "gloo": False}


def test_the_fuzzer_replays_plans_checks_unread_inputs_and_reports_outputs():
    # each of these failed before issue 29's fixes: simulate refused u0, like= refused the plan, and
    # loop_domain('c1') raised "no value of 'c1'"
    spec = fuzz.prune(_edge_case())
    assert "u0" in spec["inputs"]
    res = fuzz.run_case(spec, checks={"build", "evaluate", "optimize", "pins", "eager", "like"})
    assert res["refusal"] is None and res["failures"] == [], res["failures"]


# ------------------------------------------------------------------------------ issue 29 item 4: uneven reshards

def test_the_generator_draws_uneven_reshards_with_empty_ranks_from_their_own_stream():
    specs = [fuzz.generate_case(5, i) for i in range(80)]
    probes = [s for s in specs if "reshard" in s]
    kinds = {tuple(s["reshard"]["collectives"]) for s in probes}
    assert len(probes) >= 10 and kinds == {("alltoall",), ()}  # an S(a) -> S(b) alltoall, a size-1 view
    def leaves_a_rank_empty(s):
        mesh = ed.DeviceMesh(torch.arange(math.prod(s["mesh"])).reshape(s["mesh"]).tolist())
        return any(empty_rank(ed.Layout.from_code(".".join(s["pins"][t]["pl"])), shape, mesh) is not None
                   for t, shape in (("r0", s["inputs"]["r0"]["shape"]), ("r1", fuzz.infer_shapes(s)["r1"][0])))
    empty = [s for s in probes if leaves_a_rank_empty(s)]
    assert len(empty) >= len(probes) // 2  # mostly a rank left empty
    for i, s in enumerate(specs):  # reshards=False: the same case without the probe
        plain = fuzz.generate_case(5, i, reshards=False)
        assert "reshard" not in plain
        if "reshard" in s:
            assert s["ops"][:-1] == plain["ops"] and s["outputs"][:-1] == plain["outputs"]
            assert {k: v for k, v in s["pins"].items() if k not in ("r0", "r1")} == plain["pins"]
        else:
            assert s == plain


def _reshard_case(shape, src, dst, op="relu", target=None):
    spec = {"seed": 0, "index": 0, "dtype": "float64", "mesh": [4], "axis_names": None,
            "inputs": {}, "ops": [], "outputs": [], "pins": {},
            "cost": {"preset": "h200", "memory_frac": None}, "extractors": ["greedy", "exact"], "gloo": False}
    op = {"op": op, "args": [["x", {"t": "r0"}]] + ([["shape", target]] if target else []), "outs": ["r1"]}
    pins = {"r0": {"pl": [f"S{src}"], "style": "outer"}, "r1": {"pl": [f"S{dst}"], "style": "outer"}}
    spec["inputs"]["r0"] = {"shape": list(shape), "dtype": "float64", "data": "randn"}
    spec["ops"], spec["outputs"], spec["pins"] = [op], ["r1"], dict(pins)
    spec["reshard"] = {"op": op, "pins": pins, "mesh": [4], "shape": list(shape),
                       "collectives": [] if target else ["alltoall"]}
    return spec


@pytest.mark.parametrize("case", [((6, 5), 0, 1), ((1, 6), 1, 0, "reshape", [6])], ids=["alltoall", "view"])
def test_the_reshard_check_passes_now_and_finds_the_allgather_of_before(case, monkeypatch):
    spec = _reshard_case(*case)
    checks = {"build", "evaluate", "optimize", "eager"}
    assert fuzz.reshard_intact(spec)
    res = fuzz.run_case(spec, checks=checks)
    assert res["refusal"] is None and res["failures"] == [], res["failures"]
    # before issue 29's fix no op computed on a layout that leaves a rank empty: it went through R
    monkeypatch.setattr(ed.ops.OpDef, "empty_shards", property(lambda self: False))
    res = fuzz.run_case(spec, checks=checks)
    assert {f["cls"] for f in res["failures"]} == {"optimize-reshard-moves-more-than-needed"}
    assert "allgather" in res["failures"][0]["detail"]
    spec["pins"].pop("r1")  # a minimizer's cut: no longer the probe, no longer checked
    assert not fuzz.reshard_intact(spec)
