"""Communication lowering on real processes: every collective the e-graph offers, run over gloo by four
processes (its registry entry's `run`), gives each rank exactly what egraph_did.simulate.collective (the
entry's `simulate`) gives it on the same data.

Shapes are chosen to be uneven (7 over 4 is 2, 2, 2, 1; 13 on 2x2 nests 7 | 6 then 4, 3 | 4, 2) and
3-D, so sharded axes are inner as often as outer; some leave a rank empty (3 over 4 is 1, 1, 1, 0; 5 on 2x2
nests 3 | 2 then 2, 1 | 2, 0; 1 over 2 is 1, 0), so the backend moves zero-size pieces too (padded like the others). Values are small integers in float32: the backend's
sums and simulate's are then equal bit for bit. One launch runs every case on every rank (process
start-up dominates), each rank reporting the cases where it differs.
"""
from __future__ import annotations

import itertools
import zlib

import torch

from egraph_did import DeviceMesh
from egraph_did.cost import CostModel
from egraph_did.launcher import launch
from egraph_did.layout import Layout, empty_rank, valid_layouts
from egraph_did.lowering import communication as comm
from egraph_did.collectives import KINDS
from egraph_did.plan import Collective, Plan, Value
from egraph_did.simulate import collective

# The 2x2 meshes list their ranks out of order on purpose: the backend orders a group by rank, the
# plan by mesh coordinate.
MESHES = {
    "mesh4": DeviceMesh.arange(4),
    "mesh2x2": DeviceMesh([[0, 1], [2, 3]]),
    "mesh4-shuffled": DeviceMesh([2, 0, 3, 1]),
    "mesh2x2-shuffled": DeviceMesh([[3, 1], [0, 2]]),
}
SHAPES = {
    "mesh4": [(3, 7, 10), (11, 14)],
    "mesh2x2": [(13, 7), (3, 5, 6), (1, 5, 3)],  # (1, ...): a pending sum beside an empty split
    "mesh4-shuffled": [(2, 7, 10)],
    "mesh2x2-shuffled": [(3, 13, 5)],
}


def cases():
    """(mesh name, shape, src, dst, kind, mesh axis) for every collective the registry connects: one mesh
    axis changes, as a registry entry connects, and no inner mesh axis splits the tensor axis it moves (the rule
    of egraph_did.egraph.transitions, restated here so that this test needs no egglog)."""
    for mname, mesh in MESHES.items():
        for shape in SHAPES[mname]:
            lays = list(valid_layouts(shape, mesh, partial=True, allow_empty=True))
            for src, dst in itertools.product(lays, repeat=2):
                diff = [m for m in range(mesh.ndim) if src[m] != dst[m]]
                if len(diff) != 1:
                    continue
                m = diff[0]
                if any(p.is_shard and p in src.placements[m + 1:] for p in (src[m], dst[m])):
                    continue
                for k in KINDS.values():  # every registry entry, those the e-graph offers and to_partial
                    if k.connects(src[m], dst[m]):
                        yield mname, shape, src.code(), dst.code(), k.name, m


def plan_for(mesh: DeviceMesh, shape, src: str, dst: str, dtype: str = "float32") -> Plan:
    values = {"src": Value("src", "t", tuple(shape), dtype, src), "dst": Value("dst", "t", tuple(shape), dtype, dst)}
    return Plan(mesh, CostModel.h200(), values, [], {}, {})


def local_inputs(plan: Plan, seed, dtype=torch.float32) -> dict[int, torch.Tensor]:
    """Every rank's input, of the source layout's local shape; the same on every process."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))
    out = {}
    for r in sorted(plan.mesh.ranks):
        shape = plan.local_shape("src", r)
        out[r] = torch.randint(-50, 50, shape, generator=g).to(dtype)
    return out


def check(plan: Plan, c: Collective, local: dict[int, torch.Tensor], rank: int) -> str | None:
    want = collective(plan, c, local)[rank]
    got = comm.run_collective(plan, c, local[rank], rank)
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        return (f"rank {rank}: {c.kind}@{c.mesh_axis} {plan.values['src'].layout}->{plan.values['dst'].layout} "
                f"{plan.values['src'].shape} {plan.values['src'].dtype}: got {tuple(got.shape)} want "
                f"{tuple(want.shape)}")
    if not got.is_contiguous():
        return f"rank {rank}: {c.kind} result is not contiguous"
    return None


def every_collective(rank: int) -> tuple[int, list[str], set]:
    """Each rank checks its result of every case; returns (cases run, failures, kinds seen)."""
    failures, n, seen = [], 0, set()
    for mname, shape, src, dst, kind, m in cases():
        mesh = MESHES[mname]
        plan = plan_for(mesh, shape, src, dst)
        reduce = "max" if kind == "allreduce" and Layout.from_code(src)[m].reduce == "max" else "sum"
        c = Collective(kind, "t", "src", "dst", m, mesh.axis_names[m], 0.0, 0.0, reduce)
        bad = check(plan, c, local_inputs(plan, (mname, shape, src, dst, kind, m)), rank)
        failures += [bad] if bad else []
        n += 1
        seen.add((mname, kind))
    # other dtypes travel as they are (bool as bytes), on an inner uneven axis
    mesh = MESHES["mesh4"]
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.int64, "int64"), (torch.bool, "bool")):
        for kind, src, dst in (("allgather", "S1", "R"), ("alltoall", "S1", "S2"), ("slice", "R", "S2")):
            plan = plan_for(mesh, (3, 7, 10), src, dst, name)
            local = {r: (t > 0 if dtype == torch.bool else t.to(dtype))
                     for r, t in local_inputs(plan, (kind, name)).items()}
            bad = check(plan, Collective(kind, "t", "src", "dst", 0, "x", 0.0, 0.0), local, rank)
            failures += [bad] if bad else []
            n += 1
    # a 0-d partial (a sum over every axis): pending sum and pending max
    for src in ("P", "M"):
        plan = plan_for(mesh, (), src, "R")
        c = Collective("allreduce", "t", "src", "dst", 0, "x", 0.0, 0.0, "max" if src == "M" else "sum")
        bad = check(plan, c, local_inputs(plan, ("scalar", src)), rank)
        failures += [bad] if bad else []
        n += 1
    return n, failures, seen


def test_every_collective_matches_simulate_exactly_on_gloo():
    results = launch(every_collective, nprocs=4, backend="gloo", timeout=180)
    n_cases = len(list(cases()))
    kinds = {kind for *_, kind, _ in cases()}
    assert kinds == set(KINDS)  # every registry entry is offered somewhere, and run here
    empty = {kind for mname, shape, src, dst, kind, _ in cases()  # ... and with a rank holding nothing
             if any(empty_rank(Layout.from_code(lay), shape, MESHES[mname]) is not None for lay in (src, dst))}
    assert empty == set(KINDS)
    for rank, (n, failures, seen) in enumerate(results):
        assert not failures, "\n".join(failures[:20])
        assert n == n_cases + 11
        assert {(mname, k) for mname in MESHES for k in kinds} == seen, f"rank {rank} skipped a case"
