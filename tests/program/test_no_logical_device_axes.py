"""The suite-wide check (conftest.py) must be able to fail: a logical DID axis is caught."""
import dataclasses

import egraph_did as ed
from egraph_did.fusion import ALL_TENSORS

from conftest import logical_device_axes


def test_sharding_touches_only_the_loop_domain():
    mesh = ed.DeviceMesh(list(range(4)))
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((8, 6), name="x")
        fd.add_output(fd.ops.relu(x), name="y")
    before = x.logical_domain
    x.set_device_mesh(mesh).outer_split(0, 4).axis(0).parallelize(ed.ParallelType.DIDx)
    y = fd.fusion.outputs["y"]
    y.set_device_mesh(mesh).add_partial(ed.ParallelType.DIDx)
    assert x.logical_domain == before
    assert logical_device_axes(x) == [] and logical_device_axes(y) == []
    assert y.loop_str() == "[8, 6, rDIDx{4}]"
    assert x in set(ALL_TENSORS)


def test_a_logical_device_axis_is_detected():
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((8,), name="x")
    bad = dataclasses.replace(x.logical_domain[0], parallel_type=ed.ParallelType.DIDx)
    saved = x.logical_domain
    x.logical_domain = (bad,)
    try:
        assert logical_device_axes(x) == [bad]
    finally:
        x.logical_domain = saved
