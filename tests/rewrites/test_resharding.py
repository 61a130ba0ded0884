"""The collectives of the registry (egraph_did/collectives.py) move a tensor between placements on one
mesh axis exactly.

For every pair of layouts that differ on one mesh axis (R, P, Pmax, S(0), S(1) on a 1-D mesh of 3 and a
2x2 mesh, the nesting rule of egraph_did.egraph.transitions respected) and every kind that connects them,
every rank's input is the source layout's local tensor of a random global tensor (a partial: random
summands adding up to it, or for a pending max, values below it with one rank per element holding it),
egraph_did.simulate.collective runs the collective, and every rank must end up with exactly the global
tensor's shard in the destination layout, as the loop domain (shard_tensor) defines it. Values are
integers held in float64, so sums are exact and the comparison is torch.equal.

A partial on another mesh axis is modelled as independent tensors, one per coordinate on that axis: the
collective acts inside each group and must give each group its own tensor's destination shard.
"""
from __future__ import annotations

import itertools
import zlib
from types import SimpleNamespace

import pytest
import torch

from egraph_did import DeviceMesh
from egraph_did.collectives import CANCELLATIONS, KINDS
from egraph_did.cost import CostModel
from egraph_did.egraph import transitions
from egraph_did.fusion import Fusion
from egraph_did.ir import TensorView
from egraph_did.layout import P, PMAX, Layout, R, S, is_valid, valid_layouts
from egraph_did.pins import apply_layout
from egraph_did.shards import RankContext
from egraph_did.plan import Collective, Plan, Value
from egraph_did.sharding import local_indices, shard_tensor
from egraph_did.simulate import collective

MESHES = {
    "mesh3": DeviceMesh.arange(3),
    "mesh2x2": DeviceMesh([[0, 1], [2, 3]]),
}
# Uneven extents on purpose: 5 and 7 over 3 ranks; 3 and 5 over 2; 13 split by both axes of 2x2. Some leave a
# rank empty (a layout every tensor may be held in): 2 over 3 is 1, 1, 0; 5 split by both axes of 2x2 is
# 3 | 2, then 2, 1 | 2, 0.
SHAPES = {
    "mesh3": [(5, 7), (6, 3), (2, 7)],
    "mesh2x2": [(4, 8), (3, 5), (13, 7), (5, 3)],
}
PLACEMENTS = [R, P, PMAX, S(0), S(1)]


def code(layout: Layout) -> str:
    return layout.code().replace(".", "")


def layouts(mesh: DeviceMesh, shape) -> list[Layout]:
    return [lay for lay in map(Layout, itertools.product(PLACEMENTS, repeat=mesh.ndim)) if is_valid(lay, shape, mesh, allow_empty=True)]


def nests_badly(src: Layout, dst: Layout, m: int) -> bool:
    """The nesting rule of transitions(): mesh axis m may not change a shard an inner mesh axis refines."""
    inner = src.placements[m + 1:]
    return any(p.is_shard and p in inner for p in (src[m], dst[m]))


def moves(mesh: DeviceMesh, shape):
    """(src, dst, registry entry, mesh axis) for every one-axis change that a collective implements."""
    lays = layouts(mesh, shape)
    for src, dst in itertools.product(lays, repeat=2):
        diff = [m for m in range(mesh.ndim) if src[m] != dst[m]]
        if len(diff) != 1 or nests_badly(src, dst, diff[0]):
            continue
        for k in KINDS.values():
            if k.offered and k.connects(src[diff[0]], dst[diff[0]]):
                yield src, dst, k, diff[0]


# ---------------------------------------------------------------------- helpers

def view(shape, layout: Layout, mesh: DeviceMesh) -> TensorView:
    return apply_layout(TensorView("t", tuple(shape), torch.float64, None, Fusion()), layout, mesh)


def replace_axes(layout: Layout, axes, placement) -> Layout:
    return Layout(tuple(placement if m in axes else p for m, p in enumerate(layout)))


def ints(shape, g) -> torch.Tensor:
    return torch.randint(-50, 50, tuple(shape), generator=g).to(torch.float64)


class Setup:
    """Global tensors, one per coordinate on the mesh axes other than m where src is partial."""

    def __init__(self, mesh: DeviceMesh, shape, src: Layout, m: int, g: torch.Generator):
        self.mesh, self.shape, self.m, self.src = mesh, tuple(shape), m, src
        self.other = [k for k, p in enumerate(src) if p.is_partial and k != m]
        self.values = {sub: ints(shape, g) for sub in itertools.product(*(range(mesh.shape[k]) for k in self.other))}

    def value_of(self, rank: int) -> torch.Tensor:
        c = self.mesh.coords(rank)
        return self.values[tuple(c[k] for k in self.other)]

    def shards(self, layout: Layout) -> dict[int, torch.Tensor]:
        """Each rank's exact shard of its tensor in `layout` (partials elsewhere read as replicated)."""
        tv = view(self.shape, replace_axes(layout, self.other, R), self.mesh)
        return {r: shard_tensor(self.value_of(r), tv, r) for r in self.mesh.ranks}

    def local_inputs(self, g: torch.Generator) -> dict[int, torch.Tensor]:
        """The source layout's local tensors; along a partial axis m, random summands of the shard."""
        src, m, mesh = self.src, self.m, self.mesh
        if not src[m].is_partial:
            return self.shards(src)
        whole = self.shards(src.replace(m, R))
        out = {}
        for r in mesh.ranks:
            if mesh.coords(r)[m]:
                continue
            group = mesh.ranks_along(m, r)
            shard = whole[r]
            if src[m].reduce == "sum":
                parts = [ints(shard.shape, g) for _ in group[1:]]
                for q, part in zip(group, [shard - sum(parts)] + parts):
                    out[q] = part.contiguous()
            else:
                owner = torch.randint(0, len(group), shard.shape, generator=g)
                for i, q in enumerate(group):
                    below = torch.randint(1, 20, shard.shape, generator=g).to(shard.dtype)
                    out[q] = torch.where(owner == i, shard, shard - below).contiguous()
        return out


def plan_for(mesh: DeviceMesh, shape, src: Layout, dst: Layout) -> Plan:
    values = {"src": Value("src", "t", tuple(shape), "float64", src.code()),
              "dst": Value("dst", "t", tuple(shape), "float64", dst.code())}
    return Plan(mesh, CostModel.h200(), values, [], {}, {})


def run(kind: str, mesh: DeviceMesh, shape, src: Layout, dst: Layout, m: int, local):
    c = Collective(kind, "t", "src", "dst", m, mesh.axis_names[m], 0.0, 0.0,
                   reduce=src[m].reduce)
    return collective(plan_for(mesh, shape, src, dst), c, local)


@pytest.mark.parametrize("mname", sorted(MESHES))
def test_rank_context_shard_range_matches_the_loop_domain(mname):
    """What local kernels and collectives cut (RankContext.shard_range) is what shard_tensor binds,
    nested uneven splits included (13 rows on 2x2 with S(0) on both axes: [0:4] [4:7] [7:11] [11:13])."""
    mesh = MESHES[mname]
    for shape in SHAPES[mname]:
        for layout in valid_layouts(shape, mesh, allow_empty=True):
            tv = view(shape, layout, mesh)
            for r in mesh.ranks:
                idx = local_indices(tv, r)
                for a, n in enumerate(shape):
                    lo, hi = RankContext(mesh, r).shard_range(n, layout, a)
                    assert idx[a].tolist() == list(range(lo, hi)), (shape, str(layout), r, a)


def _reshard_params():
    for mname, mesh in MESHES.items():
        for shape in SHAPES[mname]:
            for src, dst, r, m in moves(mesh, shape):
                yield pytest.param(mname, shape, src, dst, r.name, m, id=f"{mname}-{'x'.join(map(str, shape))}-{code(src)}-{r.name}@{m}-{code(dst)}")


def _seed(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


# ---------------------------------------------------------------------- tests

@pytest.mark.parametrize("mname, shape, src, dst, kind, m", list(_reshard_params()))
def test_collective_delivers_the_destination_shards_exactly(mname, shape, src, dst, kind, m):
    mesh = MESHES[mname]
    g = _seed(mname, shape, src, dst, kind, m)
    setup = Setup(mesh, shape, src, m, g)
    got = run(kind, mesh, shape, src, dst, m, setup.local_inputs(g))
    want = setup.shards(dst)
    for r in mesh.ranks:
        assert tuple(got[r].shape) == tuple(want[r].shape), f"rank {r}: shape {tuple(got[r].shape)}, want {tuple(want[r].shape)}"
        assert torch.equal(got[r], want[r]), f"rank {r} holds the wrong elements after {kind} {src} -> {dst}"


def test_the_moves_are_those_the_egraph_offers():
    """The pairs checked above are exactly transitions() of a problem holding these layouts."""
    for mname, mesh in MESHES.items():
        for shape in SHAPES[mname]:
            fake = SimpleNamespace(layouts={"t": layouts(mesh, shape)})
            offered = {(s, d, k, m) for s, d, k, m in transitions(fake)}
            mine = {(s.code(), d.code(), r.name, m) for s, d, r, m in moves(mesh, shape)}
            assert offered == mine, (mname, shape, sorted(offered ^ mine))


def test_every_registry_entry_is_exercised():
    kinds = {r.name for mname, mesh in MESHES.items() for shape in SHAPES[mname] for _, _, r, _ in moves(mesh, shape)}
    assert kinds == {name for name, k in KINDS.items() if k.offered} == set(KINDS) - {"to_partial"}
    assert all(k.identity.strip() for k in KINDS.values())


@pytest.mark.parametrize("mname", sorted(MESHES))
def test_to_partial_leaves_summands_that_reduce_to_the_value(mname):
    """R -> P (and Pmax) on one mesh axis, which optimize asks only for a pinned partial: the ranks' tensors
    along the axis sum (or max) back to what each held, and only the axis's first rank holds a nonzero sum
    summand."""
    mesh = MESHES[mname]
    for shape in SHAPES[mname]:
        for src in valid_layouts(shape, mesh):
            for m in (m for m, p in enumerate(src) if p == R and mesh.shape[m] > 1):
                for part in (P, PMAX):
                    dst = src.replace(m, part)
                    g = _seed(mname, shape, src.code(), dst.code(), m)
                    local = Setup(mesh, shape, src, m, g).local_inputs(g)
                    got = run("to_partial", mesh, shape, src, dst, m, local)
                    for r in mesh.ranks:
                        group = [got[q] for q in mesh.ranks_along(m, r)]
                        back = torch.stack(group).sum(0) if part == P else torch.stack(group).amax(0)
                        assert torch.equal(back, local[r]), (shape, src.code(), dst.code(), r)
                        first = mesh.coords(r)[m] == 0
                        assert part == PMAX or first or not got[r].any(), (shape, src.code(), r)


def _cancellation_params():
    for c in CANCELLATIONS:
        first, second = c.first, c.second
        for mname, mesh in MESHES.items():
            for shape in SHAPES[mname]:
                steps = list(moves(mesh, shape))
                for (src, mid, r1, m), (mid2, end, r2, m2) in itertools.product(steps, repeat=2):
                    if (r1.name, r2.name, m2) != (first, second, m) or mid2 != mid:
                        continue
                    back = KINDS[c.becomes].connects(src[m], end[m]) if c.becomes else end == src
                    if not back:
                        continue
                    yield pytest.param(c, mname, shape, src, mid, end, m,
                                       id=f"{first}-{second}-{mname}-{'x'.join(map(str, shape))}-"
                                          f"{code(src)}-{code(mid)}-{code(end)}@{m}")


@pytest.mark.parametrize("c, mname, shape, src, mid, end, m", list(_cancellation_params()))
def test_cancelling_pair_is_what_the_registry_says(c, mname, shape, src, mid, end, m):
    """first then second gives back the input, or what the one collective it becomes gives."""
    mesh = MESHES[mname]
    g = _seed(c.first, c.second, mname, shape, src, mid, m)
    local = Setup(mesh, shape, src, m, g).local_inputs(g)
    twice = run(c.second, mesh, shape, mid, end, m, run(c.first, mesh, shape, src, mid, m, local))
    want = run(c.becomes, mesh, shape, src, end, m, local) if c.becomes else local
    for r in mesh.ranks:
        assert torch.equal(twice[r], want[r]), f"rank {r}: {c.identity} does not hold on mesh axis {m}"


def test_every_cancellation_has_a_case():
    covered = {(p.values[0].first, p.values[0].second) for p in _cancellation_params()}
    assert covered == {(c.first, c.second) for c in CANCELLATIONS}


def test_allreduce_moves_twice_the_bytes_of_allgather():
    """On the same bytes the allreduce's bandwidth term is twice the allgather's: 2(p-1)/p n/bw against
    (p-1)/p n/bw on the H200 NVLink preset (alpha 10 us, 370 GB/s). Latency: a ring allreduce is a
    reduce-scatter phase then an allgather phase (cost.py), two alphas, so it costs exactly the pair."""
    cm = CostModel.h200()
    link = cm.link(0, 1)
    assert (link.alpha, link.bandwidth) == (10e-6, 370e9)
    n, p = 3 * 2**20, 4

    def t(kind, nbytes):
        return cm.collective_time(kind, nbytes, group_size=p, mesh_axis=0, mesh_ndim=1)

    ag_bw = t("allgather", n) - t("allgather", 0)
    ar_bw = t("allreduce", n) - t("allreduce", 0)
    assert ag_bw == pytest.approx(0.75 * n / 370e9, rel=1e-12)
    assert ar_bw == pytest.approx(1.5 * n / 370e9, rel=1e-12)
    assert ar_bw == pytest.approx(2 * ag_bw, rel=1e-12)
    assert t("allgather", n) == pytest.approx(10e-6 + 0.75 * n / 370e9, rel=1e-12)
    assert t("allreduce", n) == pytest.approx(t("reduce_scatter", n) + t("allgather", n), rel=1e-12)
    assert cm.collective_time("allreduce", n, 1, 0, 1) == 0.0  # one rank: no communication
