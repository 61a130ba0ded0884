"""Each entry of the collective registry (egraph_did/collectives.py) does what it says: its example
placements are ones it connects, its simulate delivers the destination layout's shards of the global
tensor, and it charges the bytes and phases the cost model's alpha-beta formula was written with.
(Every move the e-graph offers is checked exhaustively in test_resharding.py, and `run` on gloo against
`simulate` in test_communication.py.)
"""
from __future__ import annotations

import pytest
import torch

import egraph_did as ed
from egraph_did.collectives import CANCELLATIONS, KINDS, Move, communicating, connecting, get, is_local
from egraph_did.cost import CostModel
from egraph_did.errors import PlanError
from egraph_did.layout import Layout, Placement, S, valid_layouts
from egraph_did.models import row_sum
from egraph_did.shards import shard

MESH = ed.DeviceMesh([2, 0, 3, 1])  # shuffled: mesh order is not rank order
SHAPE = (7, 10)  # 7 rows over 4 ranks: 2, 2, 2, 1

# What each kind charges (the bytes one rank holds before: 'src', or after: 'dst') and its terms on a
# group of 4: (latency phases, total bandwidth factor), as the cost model's docstring states them.
CHARGES = {
    "allgather": ("dst", 1, 3 / 4),
    "reduce_scatter": ("src", 1, 3 / 4),
    "allreduce": ("src", 2, 2 * 3 / 4),
    "alltoall": ("src", 1, 3 / 4),
    "slice": (None, 0, 0.0),
    "to_partial": (None, 0, 0.0),
}


def test_the_claims_below_cover_every_registry_entry():
    assert set(CHARGES) == set(KINDS)


def pieces(x: torch.Tensor, layout: Layout, g: torch.Generator) -> dict[int, torch.Tensor]:
    """Every rank's piece of x under a 1-D layout: a partial sum as random integer summands, a partial
    max as values below x with one rank per element holding x."""
    if not layout[0].is_partial:
        return {r: shard(x, layout, MESH, r) for r in MESH.ranks}
    if layout[0].reduce == "max":
        owner = torch.randint(0, MESH.size, x.shape, generator=g)
        return {r: torch.where(owner == i, x, x - torch.randint(1, 9, x.shape, generator=g).to(x.dtype))
                for i, r in enumerate(MESH.ranks)}
    parts = [torch.randint(-9, 9, x.shape, generator=g).to(x.dtype) for _ in MESH.ranks[1:]]
    return dict(zip(MESH.ranks, [x - sum(parts)] + parts))


@pytest.mark.parametrize("name", list(KINDS))
def test_entry_simulates_its_identity_on_its_example(name):
    entry = KINDS[name]
    src, dst = (Layout((p,)) for p in entry.example)
    assert entry.connects(entry.example[0], entry.example[1]), f"{name}'s example is not a move it makes"
    g = torch.Generator().manual_seed(len(name))
    x = torch.randint(-50, 50, SHAPE, generator=g).to(torch.float64)
    local = pieces(x, src, g)
    move = Move(MESH, SHAPE, src, dst, 0, src[0].reduce)
    for r in MESH.ranks:
        got = entry.simulate(move, [local[q] for q in MESH.ranks_along(0, r)], r)
        assert torch.equal(got, shard(x, dst, MESH, r)), f"{entry.identity}: rank {r} holds the wrong elements"


@pytest.mark.parametrize("name", list(KINDS))
def test_entry_charges_the_bytes_and_phases_of_the_cost_model(name):
    entry, (which, phases, factor) = KINDS[name], CHARGES[name]
    assert entry.nbytes(src_bytes=100.0, dst_bytes=400.0) == {"src": 100.0, "dst": 400.0, None: 0.0}[which]
    assert entry.phases == phases and entry.phases * entry.factor(4) == pytest.approx(factor, rel=1e-15)
    assert entry.communicates == (phases > 0) == (name in communicating()) == (not is_local(name))
    if entry.communicates:  # the cost model prices it with these terms, and nothing else
        link = CostModel.h200().links[0]
        n = 3 * 2**20
        want = phases * link.alpha + factor * n / link.bandwidth
        assert CostModel.h200().collective_time(name, n, 4, 0, 1) == pytest.approx(want, rel=1e-15)


def test_allreduce_is_priced_bit_for_bit_as_before_the_registry():
    """Predicted times do not move: 2 alpha + (2(p-1)/p) n / bw, evaluated as the old table did."""
    cm, link = CostModel.h200(), CostModel.h200().links[0]
    for p in (2, 3, 4, 7, 8):
        for n in (1.0, 12345.0, 3 * 2**20):
            old = 2 * link.alpha + (2 * (p - 1) / p) * n / link.bandwidth
            assert cm.collective_time("allreduce", n, p, 0, 1) == old
            old = 1 * link.alpha + ((p - 1) / p) * n / link.bandwidth
            assert cm.collective_time("alltoall", n, p, 0, 1) == old


def test_every_one_axis_move_has_at_most_one_collective():
    """The kinds partition the moves: a (src, dst) pair names its collective (plans and the e-graph
    rely on it; the egraph's Trans facts would otherwise offer two edges between one pair of classes)."""
    placements = {lay[0] for lay in valid_layouts((4, 4, 4), ed.DeviceMesh.arange(2), partial=True)}
    for src in placements:
        for dst in placements:
            kinds = [k.name for k in connecting(src, dst)]
            assert len(kinds) <= 1, f"{src} -> {dst}: {kinds}"
            assert src != dst or not kinds, f"{kinds} moves {src} to itself"


def test_cancellations_name_registered_kinds():
    for c in CANCELLATIONS:
        assert {c.first, c.second} | ({c.becomes} - {None}) <= set(KINDS), c


def test_an_unknown_kind_is_refused_everywhere_with_the_known_ones():
    with pytest.raises(PlanError, match="unknown collective kind 'broadcast'; kinds are allgather, reduce_scatter"):
        get("broadcast", "simulate")
    with pytest.raises(ed.errors.CostModelError, match="unknown collective 'send_recv'"):
        CostModel.h200().collective_time("send_recv", 1024, 4, 0, 1)
    plan = ed.optimize(row_sum(4, 6), ed.DeviceMesh.arange(2))
    with pytest.raises(PlanError, match=f"kinds are {', '.join(communicating())}$"):
        plan.count("slice")  # a local slice is no communication to count


def test_a_sharded_example_placement_is_a_split_of_axis_0_or_1():
    """Calibration and the tests above build [p, p*k] tensors from the examples: axes 0 and 1 exist."""
    for entry in KINDS.values():
        for p in entry.example:
            assert isinstance(p, Placement) and (not p.is_shard or p in (S(0), S(1))), entry.name


def test_simplified_merges_reduce_scatter_allgather_into_the_allreduce_the_optimizer_prices():
    """The cancellation's result is priced as the optimizer prices it: the same bytes, the same time."""
    from egraph_did.pins import apply_layout
    from egraph_did.plan import Collective, Value

    fd, mesh = row_sum(64, 65536), ed.DeviceMesh.arange(4)  # rows too long to gather x: sum, then allreduce
    apply_layout(fd["x"], Layout((S(1),)), mesh)
    apply_layout(fd["y"], Layout.from_code("R"), mesh)
    plan = ed.optimize(fd, mesh)
    (ar,) = plan.collectives
    assert ar.kind == "allreduce"
    values = {**plan.values, "y:S0": Value("y:S0", "y", (64,), "float32", "S0", plan.values[ar.src].axes)}
    pair = [Collective("reduce_scatter", "y", ar.src, "y:S0", 0, "x", 1.0, 1.0),
            Collective("allgather", "y", "y:S0", ar.dst, 0, "x", 1.0, 1.0)]
    steps = [t for s in plan.steps for t in (pair if s is ar else [s])]
    merged = ed.Plan(mesh, plan.cost_model, values, steps, plan.inputs, plan.outputs).simplified()
    (got,) = merged.collectives
    assert (got.kind, got.src, got.dst, got.bytes, got.time) == (ar.kind, ar.src, ar.dst, ar.bytes, ar.time)
