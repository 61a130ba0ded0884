"""tests/file_order.py on a toy suite under pytest-xdist (--dist loadfile): a file listed slow runs before the
files xdist itself would hand out first (those of more tests), the others keep xdist's order."""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

TOY = """
import os

def test_{name}_{i}():
    with open(os.environ["TOY_LOG"], "a") as f:
        f.write("{name}\\n")
"""


def test_the_slow_files_run_first_then_xdists_order(tmp_path):
    (tmp_path / "conftest.py").write_text("import file_order\nfrom file_order import pytest_xdist_make_scheduler\n"
                                          "file_order.SLOW.clear()\nfile_order.SLOW.update({'test_b.py': 9})\n")
    for name, n in (("a", 3), ("b", 1), ("c", 2)):  # xdist's own order: a (3 tests), c (2), b (1)
        (tmp_path / f"test_{name}.py").write_text("".join(TOY.format(name=name, i=i) for i in range(n)))
    log = tmp_path / "log.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(TOY_LOG=str(log), PYTHONPATH=str(TESTS))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1", "--dist",
                          "loadfile", "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert log.read_text().split() == ["b", "a", "a", "a", "c", "c"]
