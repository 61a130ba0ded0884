"""Plans: pins on intermediate tensors are materialized exactly, plan JSON is validated on load and says its
format version, and every step describes itself once."""
import json
from pathlib import Path

import pytest
import torch

import egraph_did as ed
from egraph_did import models, runtime
from egraph_did import plan as plan_module
from egraph_did.explain import STEP_WIDTH, step_row
from egraph_did.layout import Layout, S
from egraph_did.lowering.segment import eager_segments
from egraph_did.pins import apply_layout
from egraph_did.plan import FORMAT_VERSION

MESH = ed.DeviceMesh.arange(4)


def pinned_mlp():
    fd = models.mlp(32, 8192, torch.bfloat16)
    fd["x"].set_device_mesh(MESH)
    fd["y"].set_device_mesh(MESH)
    return fd


def test_a_pinned_intermediate_is_materialized_in_its_pin():
    fd = pinned_mlp()
    apply_layout(fd["gelu_1"], Layout((S(0),)), MESH)  # the hidden activation, pinned token-sharded
    plan = ed.optimize(fd, MESH)
    assert "gelu_1:S0" in plan.values
    produced = {v for s in plan.steps for v in s.writes}
    assert "gelu_1:S0" in produced
    assert plan.predicted_time > ed.optimize(pinned_mlp(), MESH).predicted_time  # the pin costs something


def test_plan_json_is_plain_and_validated():
    plan = ed.optimize(pinned_mlp(), MESH)
    d = json.loads(plan.to_json())
    assert d["format"] == "egraph-did-plan/2" and d["mesh"]["shape"] == [4]
    with pytest.raises(ed.PlanError, match="not an egraph-did plan"):
        ed.Plan.from_json(json.dumps({**d, "format": "other"}))
    with pytest.raises(ed.PlanError, match="does not parse"):
        ed.Plan.from_json("{")
    bad = json.loads(plan.to_json())
    bad["steps"][0]["op"] = "frobnicate"
    with pytest.raises(ed.PlanError, match="unknown op 'frobnicate'"):
        ed.Plan.from_json(json.dumps(bad))
    bad = json.loads(plan.to_json())
    bad["steps"][-1]["src"] = "nowhere:R"
    with pytest.raises(ed.PlanError, match="unknown value"):
        ed.Plan.from_json(json.dumps(bad))
    bad = json.loads(plan.to_json())
    bad["steps"] = bad["steps"][1:]  # the first linear's output is read before anything produces it
    with pytest.raises(ed.PlanError, match="before any step produces it"):
        ed.Plan.from_json(json.dumps(bad))


def test_explain_names_every_collective_with_bytes_time_and_reason():
    plan = ed.optimize(pinned_mlp(), MESH)
    text = plan.explain()
    (c,) = plan.collectives
    assert f"allreduce[{c.mesh_axis_name}] y" in text and f"{c.bytes:.0f}" in text
    assert f"{c.time * 1e6:.2f}" in text and c.why in text
    assert "linear_column_parallel" in text and "linear_row_parallel" in text


def test_unknown_extractor_and_missing_outputs_are_errors():
    with pytest.raises(ed.PlanError, match="extractor"):
        ed.optimize(pinned_mlp(), MESH, extractor="magic")
    with ed.FusionDefinition() as fd:
        fd.define_tensor((4,), name="x")
    with pytest.raises(ed.PlanError, match="no outputs"):
        ed.optimize(fd, MESH)


def test_chained_multi_output_ops_are_emitted_in_dependency_order():
    mesh = ed.DeviceMesh.arange(2)
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((4, 6, 8), torch.float64, name="x")
        _, m = fd.ops.var_mean(x, 2)
        v2, _ = fd.ops.var_mean(m, 1)  # reads an output of the first var_mean
        fd.add_output(fd.ops.exp(v2), name="y")
    apply_layout(x, Layout((S(0),)), mesh)
    plan = ed.optimize(fd, mesh)  # validate() inside raises if a step reads a value before it exists
    X = torch.randn(4, 6, 8, dtype=torch.float64)
    torch.testing.assert_close(ed.simulate(plan, {"x": X})["y"], ed.evaluate(fd, {"x": X})["y"])


def test_simplified_removes_cancelling_collectives_and_fuses_reduce_scatter_allgather():
    from egraph_did.plan import Collective, Value
    small = models.mlp(8, 16, torch.float64)
    small["x"].set_device_mesh(MESH)
    small["y"].set_device_mesh(MESH)
    plan = ed.optimize(small, MESH, like=ed.optimize(pinned_mlp(), MESH))
    (ar,) = plan.collectives
    values = dict(plan.values)
    values["y:S0"] = Value("y:S0", "y", (8, 16), "float64", "S0", ("s", "h"))
    values["x:S1"] = Value("x:S1", "x", (8, 16), "float64", "S1", ("s", "h"))
    values["x:R2"] = Value("x:R2", "x", (8, 16), "float64", "R", ("s", "h"))
    steps = []
    for s in plan.steps:
        if s is ar:  # the allreduce as reduce_scatter then allgather
            steps += [Collective("reduce_scatter", "y", ar.src, "y:S0", 0, "x", ar.bytes, 1e-5),
                      Collective("allgather", "y", "y:S0", ar.dst, 0, "x", ar.bytes, 1e-5)]
        elif isinstance(s, ed.ComputeStep) and s.op == "linear" and "x:R" in s.reads:  # x sliced, then gathered
            steps += [Collective("slice", "x", "x:R", "x:S1", 0, "x", 0, 1e-6),
                      Collective("allgather", "x", "x:S1", "x:R2", 0, "x", 512, 1e-5),
                      ed.ComputeStep(s.op, tuple((k, "x:R2" if v == "x:R" else v) for k, v in s.args),
                                     s.tensor_params, s.outputs, s.flags, s.rules, s.time, s.key)]
        else:
            steps.append(s)
    detour = ed.Plan(plan.mesh, plan.cost_model, values, steps, plan.inputs, plan.outputs)
    detour.validate()
    assert [c.kind for c in detour.collectives] == ["allgather", "reduce_scatter", "allgather"]
    clean = detour.simplified()
    assert [c.kind for c in clean.collectives] == ["allreduce"]
    g = torch.Generator().manual_seed(3)
    inputs = {t.name: torch.randn(t.shape, generator=g, dtype=torch.float64) for t in small.fusion.inputs}
    ref = ed.evaluate(small, inputs)["y"]
    for p in (detour, clean):
        torch.testing.assert_close(ed.simulate(p, inputs)["y"], ref)


# ---------------------------------------------------------------------------- format version

BENCH_PLANS = sorted((Path(__file__).resolve().parents[2] / "bench" / "plans").glob("*.json"))


def test_plan_files_say_format_version_2_and_a_file_without_the_field_reads_as_version_1():
    d = json.loads(ed.optimize(models.row_sum(8, 64), MESH).to_json())
    assert d["format"] == f"egraph-did-plan/{FORMAT_VERSION}" == "egraph-did-plan/2"
    assert {v["layout"] for v in d["values"].values()} == {"[S(0)]"}  # version 2: str(layout)
    del d["format"]  # a hand-written plan from before files said their version
    again = ed.Plan.from_json(json.dumps(d))
    assert [str(s) for s in again.steps] == [str(s) for s in ed.optimize(models.row_sum(8, 64), MESH).steps]


def test_a_version_1_plan_with_layout_codes_reads_as_the_same_plan():
    plan = ed.optimize(models.row_sum(8, 64), MESH)
    d = json.loads(plan.to_json())
    d["format"] = "egraph-did-plan/1"
    for v in d["values"].values():
        v["layout"] = Layout.parse(v["layout"]).code()  # version 1 wrote "S0"
    again = ed.Plan.from_json(json.dumps(d))
    assert again.values == plan.values and isinstance(again.values["x:S0"].layout, Layout)


def test_a_plan_of_a_newer_format_version_is_refused_naming_the_version_and_what_to_do():
    d = json.loads(ed.optimize(models.row_sum(8, 64), MESH).to_json())
    d["format"] = f"egraph-did-plan/{FORMAT_VERSION + 1}"
    with pytest.raises(ed.PlanError, match=rf"format version {FORMAT_VERSION + 1}: this egraph-did reads versions "
                                           rf"up to {FORMAT_VERSION}.*upgrade egraph-did, or re-optimize"):
        ed.Plan.from_json(json.dumps(d))
    for other in ("egraph-did-plan/0", "egraph-did-plan/x", 1, None):
        with pytest.raises(ed.PlanError, match="not an egraph-did plan"):
            ed.Plan.from_json(json.dumps({**d, "format": other}))


@pytest.mark.parametrize("path", BENCH_PLANS, ids=lambda p: p.name)
def test_the_benchmark_plans_load_and_explain(path):
    plan = ed.Plan.from_json(path.read_text())
    assert plan.collectives, "a tensor-parallel GPT layer communicates"
    rows = plan.explain().splitlines()[-len(plan.steps):]
    assert [r.split()[0] for r in rows] == [str(i) for i in range(len(plan.steps))]


def test_there_are_benchmark_plans_to_load():
    assert len(BENCH_PLANS) >= 6


# ---------------------------------------------------------------------------- steps describe themselves

def test_a_step_describes_itself_once_and_every_describer_uses_that():
    plan = ed.optimize(pinned_mlp(), MESH)
    (ar,) = plan.collectives
    assert str(ar) == f"allreduce[x] {ar.src} -> {ar.dst}" and ar.reads == [ar.src] and ar.writes == [ar.dst]
    first = plan.compute_steps[0]
    assert str(first) == f"{first.writes[0]} = linear({first.reads[0]}, {first.reads[1]})"
    rows = plan.explain().splitlines()
    for i, s in enumerate(plan.steps):
        assert rows[-len(plan.steps) + i].startswith(f"{i:>3}  {s}")
    assert [seg.describe() for seg in eager_segments(plan)] == [
        f"{'comm' if isinstance(s, ed.Collective) else 'aten'} {s}" for s in plan.steps]


def test_a_long_step_is_cut_in_the_table_and_its_row_keeps_the_columns():
    long = ed.ComputeStep("sdpa", tuple((f"q{i}", f"query_{i}:S1") for i in range(8)), tuple(f"q{i}" for i in range(8)),
                          ("out:S1",), (), ("sdpa_heads",), 1e-6)
    row = step_row(7, long)
    assert len(str(long)) > STEP_WIDTH and "…" in row and row.endswith("1.00  sdpa_heads")
    assert row.index("1.00") == step_row(7, ed.ComputeStep("relu", (("x", "x:S1"),), ("x",), ("y:S1",), (), ("r",),
                                                            1e-6)).index("1.00")


def test_plan_run_without_a_registered_runner_says_what_to_do(monkeypatch):
    monkeypatch.setattr(plan_module, "_runner", None)
    plan = ed.optimize(models.row_sum(8, 64), MESH)
    with pytest.raises(ed.PlanError, match="no runner is registered; import egraph_did"):
        plan.run({"x": torch.zeros(8, 64)})


def test_importing_egraph_did_registers_the_runtime_as_the_runner():
    assert plan_module._runner is runtime.run_plan


def test_plan_replay_at_shapes_that_leave_a_rank_empty():
    """A plan replayed (like=) at shapes where its layouts leave a rank empty: sum over the rows of x split on
    its columns, 4096 columns over 4 ranks, then 3 (the last rank holds none). The problem gives a reduction
    no strategy on a layout that leaves a rank empty, so the replay, restricted to the plan's strategies,
    found no route ('y: no layout in ['[S(0)]'] is reachable'); a sum that keeps the emptied axis computes
    nothing there, and the plan's own strategy now replays (the long-context attention step's key blocks did
    this on a head dim of 3: tests/optimizer/test_context_parallel.py)."""
    def row_sums(rows, cols, dtype):
        with ed.FusionDefinition() as fd:
            x = fd.define_tensor((rows, cols), dtype, name="x")
            fd.add_output(fd.ops.sum(fd.ops.exp(x), 0), name="y")
        apply_layout(fd["x"], Layout((S(1),)), MESH)
        apply_layout(fd["y"], Layout((S(0),)), MESH)
        return fd
    plan = ed.optimize(row_sums(64, 4096, torch.float32), MESH)
    assert not plan.collectives, plan.explain()
    small = row_sums(5, 3, torch.float64)
    replayed = ed.optimize(small, MESH, like=plan)
    assert [(s.op, s.rules) for s in replayed.compute_steps] == [(s.op, s.rules) for s in plan.compute_steps]
    assert not replayed.collectives, replayed.explain()
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ed.simulate(replayed, {"x": x})["y"], ed.evaluate(small, {"x": x})["y"])


def test_plan_replay_refuses_a_matmul_on_a_rank_left_empty_by_name():
    """The same at a matmul: w split on its 4096 columns, then 3. A matmul computes only on shards that hold
    data, so the replay reaches no layout of y; the refusal names the plan's step and the emptied tensor
    rather than the unreachable output alone."""
    def project(cols, dtype):
        with ed.FusionDefinition() as fd:
            x = fd.define_tensor((5, 4), dtype, name="x")
            w = fd.define_tensor((4, cols), dtype, name="w")
            fd.add_output(fd.ops.matmul(x, w), name="y")
        apply_layout(fd["w"], Layout((S(1),)), MESH)
        apply_layout(fd["y"], Layout((S(1),)), MESH)
        return fd
    plan = ed.optimize(project(4096, torch.float32), MESH)
    with pytest.raises(ed.PlanError, match=r"the like plan's y:\[S\(1\)\] = matmul\(x:\[R\], w:\[S\(1\)\]\) leaves a "
                                           r"rank with no element of w \[4, 3\]"):
        ed.optimize(project(3, torch.float64), MESH, like=plan)
