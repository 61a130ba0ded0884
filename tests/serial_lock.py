"""The `serial` marker: a test marked serial runs alone under pytest-xdist (`pytest -n 2`). Such tests assert
against the wall clock (exact proving a plan inside its time limit, a stalled collective ending inside its
timeout), so a second worker's load beside them would fail them, not the code. The workers of one run share two
lock files; tests/conftest.py imports the hooks (standard library and pytest only, so that a toy suite can too:
tests/face/test_serial_lock.py).

    @pytest.mark.serial  # exact must prove it inside its time limit
    def test_...(): ...
"""
import fcntl
import os
import tempfile
from pathlib import Path

import pytest

_LOCKS: list = []


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: runs alone under pytest-xdist (it asserts against the wall clock); "
                                       "other workers wait until it ends")


def _xdist_locks():
    """(gate, run): the lock files this run's xdist workers share (opened once per worker); None outside xdist."""
    if _LOCKS:
        return _LOCKS[0]
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is None or os.environ.get("PYTEST_XDIST_WORKER") is None:
        return None
    folder = Path(tempfile.gettempdir()) / f"egraph-did-tests-{uid}"
    folder.mkdir(exist_ok=True)
    _LOCKS.append((open(folder / "gate", "a"), open(folder / "run", "a")))
    return _LOCKS[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A serial test holds `run` alone; every other test holds it shared. A serial test takes `gate` first and
    keeps it until it has `run`, so no new test starts while it waits for the running ones to end (a reader
    that kept `run` busy test after test would starve it otherwise). Setup and teardown are inside: a module
    fixture's work counts as its first and last test's."""
    locks = _xdist_locks()
    if locks is None:
        yield
        return
    gate, run = locks
    mode = fcntl.LOCK_EX if item.get_closest_marker("serial") else fcntl.LOCK_SH
    fcntl.flock(gate, mode)
    fcntl.flock(run, mode)
    fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(run, fcntl.LOCK_UN)
