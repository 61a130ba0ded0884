"""bench/ scripts run as `python bench/NAME.py`, which puts bench/ first on sys.path: a script named like a
module of the standard library or of an installed package hides that module from every import in the run
(bench/kernels.py hid transformers 5.25's dependency `kernels`, and `import transformers` failed)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")


def test_there_are_bench_scripts():
    assert "compare_tp" in SCRIPTS and "kernel_speed" in SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_bench_script_shadows_an_importable_module(name):
    assert name not in sys.stdlib_module_names, f"bench/{name}.py hides the standard library's {name}"
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:  # not importable, or a bare folder (a namespace package)
        return
    assert Path(spec.origin).parent == BENCH, \
        f"bench/{name}.py hides the installed module {name} ({spec.origin}): rename the script"
