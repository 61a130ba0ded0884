"""The command line: every subcommand on a tiny input (outputs and exit codes), bad arguments exit 2 with
a usage message, user errors exit 1 with one line on stderr and no traceback, sweeps resume from their
cache, and the plan families a sweep names."""
import csv
import json
import os
import subprocess
import sys

import pytest

import egraph_did as ed
from egraph_did import cli, sweep
from egraph_did.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def plan_file(tmp_path, capsys):
    path = tmp_path / "plan.json"
    rc, out, _ = run(capsys, "optimize", "mlp", "--tokens", "16", "--hidden", "4096", "--io", "S",
                     "-o", str(path), "-q")
    assert rc == 0 and "TP+SP" in out
    return path


def test_optimize_named_model_writes_the_plan_and_explains_it(tmp_path, capsys):
    path = tmp_path / "plan.json"
    rc, out, err = run(capsys, "optimize", "mlp", "--tokens", "32", "--hidden", "8192", "--mesh", "4",
                       "--io", "R", "-o", str(path))
    assert rc == 0, err
    plan = ed.Plan.from_json(path.read_text())
    assert [c.kind for c in plan.collectives] == ["allreduce"]  # Megatron column then row parallel
    assert "allreduce[x] y" in out and "plan family: TP" in out


def test_optimize_takes_mesh_names_links_memory_and_pins(tmp_path, capsys):
    path = tmp_path / "plan.json"
    rc, _, err = run(capsys, "optimize", "mlp", "--tokens", "64", "--hidden", "1024", "--mesh", "2x4",
                     "--axis-names", "dp,tp", "--bandwidth", "45e9:370e9", "--alpha", "20e-6:10e-6",
                     "--memory-limit", "80GiB", "--pin", "x=S0.R", "--pin", "y=S0.R", "--extractor", "exact",
                     "-o", str(path), "-q")
    assert rc == 0, err
    plan = ed.Plan.from_json(path.read_text())
    assert plan.mesh.axis_names == ("dp", "tp") and plan.cost_model.links[0].bandwidth == 45e9
    assert plan.cost_model.memory_limit == 80 * 2**30 and plan.layout_of("x").code() == "S0.R"


def test_optimize_a_python_file_uses_its_fusion_and_mesh(tmp_path, capsys):
    src = tmp_path / "fusion.py"
    src.write_text("import egraph_did as ed\n"
                   "mesh = ed.DeviceMesh.arange(4)\n"
                   "def fusion():\n"
                   "    with ed.FusionDefinition() as fd:\n"
                   "        x = fd.define_tensor((64, 65536), name='x')\n"
                   "        fd.add_output(fd.ops.sum(x, 1), name='y')\n"
                   "    x.set_device_mesh(mesh).outer_split(1, 4).axis(1).parallelize(ed.ParallelType.DIDx)\n"
                   "    fd['y'].set_device_mesh(mesh)\n"
                   "    return fd\n")
    rc, out, err = run(capsys, "optimize", str(src), "-o", str(tmp_path / "p.json"))
    assert rc == 0, err
    assert "DeviceMesh(x=4)" in out and "allreduce[x] y" in out


def test_explain_prints_the_plan_and_draws_png_and_svg(plan_file, tmp_path, capsys):
    png, svg = tmp_path / "plan.png", tmp_path / "plan.svg"
    rc, out, err = run(capsys, "explain", str(plan_file), "--png", str(png), "--svg", str(svg))
    assert rc == 0, err
    assert "reduce_scatter[x] y" in out and "plan family: TP+SP" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert "<svg" in svg.read_text()[:2000]


def test_sweep_writes_tables_and_plot_and_names_the_crossover(tmp_path, capsys):
    out_dir = tmp_path / "sw"
    rc, out, err = run(capsys, "sweep", "--model", "mlp", "--tokens", "16,4096", "--hidden", "4096",
                       "--mesh", "8", "--io", "S", "--out-dir", str(out_dir), "--jobs", "2")
    assert rc == 0, err
    rows = list(csv.DictReader(open(out_dir / "sweep.csv")))
    assert [(r["tokens"], r["family"]) for r in rows] == [("16", "TP+SP"), ("4096", "DP")]
    assert json.load(open(out_dir / "sweep.json"))["rows"][1]["bytes_moved"] == 0
    assert "TP+SP -> DP between tokens=16 and 4096" in out
    assert (out_dir / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "sweep [" in err  # the progress bar


def test_sweep_resumes_from_its_cache(tmp_path, capsys, monkeypatch):
    calls = []
    real = sweep.run_point
    monkeypatch.setattr(sweep, "run_point", lambda p: calls.append(p["tokens"]) or real(p))
    argv = ["sweep", "--tokens", "16,64,256", "--hidden", "256", "--mesh", "4", "--out-dir", str(tmp_path),
            "--jobs", "1", "--no-plot"]
    rc, out, _ = run(capsys, *argv, "--limit", "2")  # interrupted after two points
    assert rc == 0 and calls == [16, 64] and "1 point(s) not yet optimized" in out
    rc, out, err = run(capsys, *argv)
    assert rc == 0 and calls == [16, 64, 256]  # only the missing point ran
    assert "(2 cached)" in err and len(list(csv.DictReader(open(tmp_path / "sweep.csv")))) == 3
    assert len(os.listdir(tmp_path / "cache")) == 3


def test_sweep_records_an_impossible_point_as_an_error_row(tmp_path, capsys):
    rc, out, _ = run(capsys, "sweep", "--tokens", "4,64", "--hidden", "256", "--mesh", "8", "--io", "S",
                     "--out-dir", str(tmp_path), "--jobs", "1", "--no-plot", "-q")
    assert rc == 0 and "1 point(s) have no plan" in out
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert "a rank would hold nothing" in rows[0]["error"] and rows[1]["family"]


def test_calibrate_fits_a_link_on_gloo_and_saves_a_preset(tmp_path, capsys):
    out = tmp_path / "preset.json"
    rc, text, err = run(capsys, "calibrate", "--nprocs", "2", "--sizes", "4096,65536", "--iters", "2",
                        "--out", str(out))
    assert rc == 0, err
    from egraph_did.calibrate import load_preset
    model = load_preset(str(out))
    assert model.links[0].name == "calibrated" and model.links[0].alpha >= 0
    assert "fitted link calibrated" in text
    rc, _, err = run(capsys, "optimize", "mlp", "--tokens", "16", "--hidden", "256", "--mesh", "2",
                     "--cost-model", str(out), "-q")
    assert rc == 0, err


@pytest.mark.parametrize("argv", [
    [],
    ["frobnicate"],
    ["optimize"],
    ["optimize", "mlp", "--mesh", "3y"],
    ["optimize", "mlp", "--tokens", "-4"],
    ["optimize", "mlp", "--io", "sideways"],
    ["sweep", "--tokens", "16,abc"],
    ["sweep", "--memory-limit", "lots"],
    ["explain"],
])
def test_bad_arguments_exit_2_with_a_usage_message(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: egraph-did") and "error:" in err


@pytest.mark.parametrize("argv, message", [
    (["explain", "missing.json"], "missing.json: no such file"),
    (["optimize", "transformer9000"], "unknown model 'transformer9000'"),
    (["optimize", "mlp", "--pin", "q=S0"], "no tensor named 'q'"),
    (["optimize", "mlp", "--pin", "x=S0.S1"], "2 placement(s) for a 1-D mesh"),
    (["optimize", "mlp", "--tokens", "3", "--io", "S"], "a rank would hold nothing"),
    (["optimize", "mlp", "--cost-model", "nope.json"], "cost model 'nope.json'"),
    (["optimize", "nofusion.py"], "nofusion.py: no such file"),
    (["sweep", "--model", "bert"], "unknown model 'bert'"),
])
def test_user_errors_exit_1_with_one_line_naming_the_problem(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, _, err = run(capsys, *argv)
    assert rc == 1
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_bad_plan_file_and_a_file_without_a_fusion_are_user_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    rc, _, err = run(capsys, "explain", str(bad))
    assert rc == 1 and "not an egraph-did plan" in err
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    rc, _, err = run(capsys, "optimize", str(empty))
    assert rc == 1 and "defines no fusion" in err
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('oops')\n")
    rc, _, err = run(capsys, "optimize", str(broken))
    assert rc == 1 and "RuntimeError: oops" in err and "Traceback" not in err


def test_console_script_and_python_m_are_the_same_command(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "egraph-did")
    for cmd in ([exe], [sys.executable, "-m", "egraph_did"]):
        r = subprocess.run(cmd + ["explain", str(tmp_path / "none.json")], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 1 and "none.json: no such file" in r.stderr and r.stdout == ""
    r = subprocess.run([sys.executable, "-m", "egraph_did", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and all(c in r.stdout for c in ("optimize", "explain", "sweep", "calibrate"))


@pytest.mark.parametrize("point, family", [
    ({"model": "mlp", "tokens": 32, "hidden": 8192, "mesh": "4", "io": "R"}, "TP"),
    ({"model": "mlp", "tokens": 16, "hidden": 4096, "mesh": "8", "io": "S"}, "TP+SP"),
    ({"model": "mlp", "tokens": 4096, "hidden": 4096, "mesh": "8", "io": "S"}, "DP"),
    ({"model": "mlp", "tokens": 16384, "hidden": 1024, "mesh": "8", "io": "fsdp"}, "FSDP"),
    ({"model": "gpt", "seq": 16384, "hidden": 4096, "heads": 32, "mesh": "8", "io": "S"}, "Ulysses"),
    ({"model": "mlp", "tokens": 4096, "hidden": 4096, "mesh": "2x4", "io": "S"}, "y:DP | x:DP"),
])
def test_plan_family_names_the_known_layouts(point, family):
    assert sweep.plan_family(sweep.optimize_point(point)) == family
