"""tests/serial_lock.py on a toy suite under two pytest-xdist workers: a serial test overlaps no other test,
and the others do run side by side."""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

TOY = """
import os, time, pytest

def run(tag, seconds):
    t0 = time.time()
    time.sleep(seconds)
    with open(os.environ["TOY_LOG"], "a") as f:
        f.write(f"{tag} {t0} {time.time()}\\n")

@pytest.mark.parametrize("i", range(8))
def test_plain(i):
    run(f"p{i}-{__name__}", 0.3)

@pytest.mark.serial
@pytest.mark.parametrize("i", range(3))
def test_alone(i):
    run(f"s{i}-{__name__}", 0.4)
"""


def test_a_serial_test_runs_alone_and_the_others_side_by_side(tmp_path):
    (tmp_path / "conftest.py").write_text("from serial_lock import pytest_configure, pytest_runtest_protocol\n")
    (tmp_path / "test_a.py").write_text(TOY)
    (tmp_path / "test_b.py").write_text(TOY.replace("test_alone", "test_alone_too"))
    log = tmp_path / "log.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(TOY_LOG=str(log), PYTHONPATH=str(TESTS))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "-o", "addopts=",
                          "--rootdir", str(tmp_path), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [(tag, float(a), float(b)) for tag, a, b in (line.split() for line in log.read_text().splitlines())]
    assert len(rows) == 22

    def overlap(x, y):
        return x[0] != y[0] and x[1] < y[2] and y[1] < x[2]
    assert not [(x[0], y[0]) for x in rows if x[0].startswith("s") for y in rows if overlap(x, y)]
    assert any(overlap(x, y) for x in rows for y in rows if x[0].startswith("p") and y[0].startswith("p"))
