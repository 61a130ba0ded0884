"""Suite-wide checks.

No logical device axes: sharding lives in the loop domain only (DESIGN.md, seed issue). Every
TensorView any test builds is registered in egraph_did.fusion.ALL_TENSORS; after each test, every one
still alive must have a logical domain free of DID-parallel and partial axes, and its logical domain
must be what its shape says.

Tests marked `serial` run alone under pytest-xdist (`pytest -n 2`): they assert against the wall clock (exact
proving a plan inside its time limit, a stalled collective ending inside its timeout), so a second worker's load
beside them would fail them, not the code. The other workers wait at a gate while one runs.
"""
import fcntl
import os
import tempfile
from pathlib import Path

import pytest

from egraph_did import collectives
from egraph_did.fusion import ALL_TENSORS


def logical_device_axes(tv):
    """The logical iter domains of tv that are bound to a mesh axis (must be none)."""
    return [d for d in tv.logical_domain if d.is_device or d.is_reduction]


@pytest.fixture(autouse=True)
def no_logical_device_axes():
    yield
    bad = {tv.name: [str(d) for d in logical_device_axes(tv)] for tv in list(ALL_TENSORS)
           if logical_device_axes(tv)}
    assert not bad, f"tensors with a device or partial axis in their logical domain: {bad}"


def stand_in(plan, c, t, rank):
    """A deterministic collective without host syncs, for single-process runs of one rank's program: the
    registry entry's semantics as if rank i of c's group held t * (1 + 0.25 i)."""
    group = plan.mesh.ranks_along(c.mesh_axis, rank)
    return collectives.get(c.kind, str(c)).simulate(plan.move(c), [t * (1 + 0.25 * i) for i, _ in enumerate(group)],
                                                   rank).contiguous()


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: runs alone under pytest-xdist (it asserts against the wall clock); "
                                       "other workers wait until it ends")


_LOCKS: list = []


def _xdist_locks():
    """(gate, run): the lock files this run's xdist workers share (opened once per worker); None outside xdist."""
    if _LOCKS:
        return _LOCKS[0]
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is None:
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
