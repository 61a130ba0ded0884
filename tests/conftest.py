"""Suite-wide checks.

No logical device axes: sharding lives in the loop domain only (DESIGN.md, seed issue). Every
TensorView any test builds is registered in egraph_did.fusion.ALL_TENSORS; after each test, every one
still alive must have a logical domain free of DID-parallel and partial axes, and its logical domain
must be what its shape says.

Tests marked `serial` run alone under pytest-xdist (`pytest -n 2`): tests/serial_lock.py. Under `--dist loadfile`
the slowest files are handed out first: tests/file_order.py.
"""
import pytest
from file_order import pytest_xdist_make_scheduler  # noqa: F401 - the slow files handed out first
from serial_lock import pytest_configure, pytest_runtest_protocol  # noqa: F401 - its hooks, for the whole suite

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
