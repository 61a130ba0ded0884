"""shards: the one module that says which elements a rank holds; reassembly edge cases."""
import pytest
import torch

import egraph_did as ed
from egraph_did.errors import ShardingError
from egraph_did.layout import Layout
from egraph_did.shards import shard, unshard

MESH = ed.DeviceMesh.arange(2)


def test_replicas_holding_nan_are_still_replicas():
    """A replicated tensor with NaN/inf (an overflowing reference) reassembles; it is not 'different data'."""
    t = torch.tensor([[1.0, float("nan")], [float("inf"), -float("inf")]])
    got = unshard([shard(t, Layout.from_code("R"), MESH, r) for r in MESH.ranks], Layout.from_code("R"), MESH)
    torch.testing.assert_close(got, t, equal_nan=True)


def test_replicas_that_differ_are_refused_naming_the_ranks():
    a, b = torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])
    with pytest.raises(ShardingError, match="ranks 0 and 1 hold different data"):
        unshard([a, b], Layout.from_code("R"), MESH)
