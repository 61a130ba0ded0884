"""Communication lowering: a plan's collectives on torch.distributed, as one rank runs them.

`run_collective(plan, c, local, rank)` gives this rank exactly what `egraph_did.simulate.collective`
gives it: both call the collective's registry entry (egraph_did.collectives.KINDS), `run` here and
`simulate` there. Sums and maxima are the backend's, so a floating-point sum may round differently
from simulate's left-to-right one.

This module owns the process groups: one per slice of a mesh axis (`axis_group`); every rank creates
every group of a (mesh, axis), in the same order, the first time it is needed, and keeps it for the
life of the default process group. `gather_to_all` assembles global outputs.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from egraph_did import collectives
from egraph_did.collectives import AxisGroup, from_wire, padded, to_wire, wait
from egraph_did.errors import PlanError, ShapeError
from egraph_did.mesh import DeviceMesh
from egraph_did.ops import exchange_all_ranks
from egraph_did.plan import Collective, ComputeStep, Plan
from egraph_did.shards import Operand

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------------------- process groups

_GROUPS: dict[tuple, AxisGroup] = {}


def world_key() -> int:
    """Which default process group is current: groups created under one are never reused under the next.

    Example::

        def work(rank):
            return world_key()  # the same until this process destroys and re-creates its default group

        ed.launch(work, nprocs=2)
    """
    # a new default process group (destroy + init in one process) must not reuse the old groups
    return id(dist.group.WORLD)


def axis_group(mesh: DeviceMesh, axis: int, rank: int) -> AxisGroup:
    """The group of `rank` along mesh axis `axis`. Creating it is collective: the first call for a
    (mesh, axis) must happen on every rank of the world, in the same order (run_plan calls
    ensure_groups up front so that it does).

    Example::

        def work(rank):
            group = axis_group(DeviceMesh.arange(4), 0, rank)  # every rank, in the same order
            return group.size, group.me

        ed.launch(work, nprocs=4)  # [(4, 0), (4, 1), (4, 2), (4, 3)]
    """
    key = (mesh, axis, rank, world_key())
    if key not in _GROUPS:
        if mesh.shape[axis] == 1:
            _GROUPS[key] = AxisGroup((rank,), 0, None)
        else:
            check_world(mesh)
            mine = None
            for members in mesh.groups(axis):  # every rank creates every group, in one order
                whole = len(members) == dist.get_world_size()
                pg = dist.group.WORLD if whole else dist.new_group(sorted(members))
                if rank in members:
                    mine = AxisGroup(tuple(members), members.index(rank), pg)
            assert mine is not None, (mesh, axis, rank)
            _GROUPS[key] = mine
    return _GROUPS[key]


def ensure_groups(mesh: DeviceMesh, rank: int) -> None:
    """Create the process groups of every axis of `mesh` (collective; same order on every rank).

    Example::

        def work(rank, plan, partial):
            ensure_groups(plan.mesh, rank)  # every group of the mesh, before any collective needs one
            return run_collective(plan, plan.collectives[0], partial, rank)

        ed.launch(work, nprocs=plan.mesh.size, args=(plan, partial))
    """
    for axis in range(mesh.ndim):
        axis_group(mesh, axis, rank)


def check_world(mesh: DeviceMesh) -> None:
    """PlanError unless a default process group is up with one process per rank of `mesh`.

    Example::

        def work(rank):
            check_world(DeviceMesh.arange(2))  # fine: two processes
            check_world(DeviceMesh.arange(4))  # PlanError: ... run one process per mesh rank

        ed.launch(work, nprocs=2)  # LaunchError naming the rank that raised, with its PlanError
    """
    if not dist.is_initialized():
        raise PlanError("no default process group: call torch.distributed.init_process_group first "
                        "(egraph_did.launcher.launch does it for every rank)")
    world = dist.get_world_size()
    if sorted(mesh.ranks) != list(range(world)):
        raise PlanError(f"the plan's mesh {mesh} holds ranks {sorted(mesh.ranks)}, but the process group has "
                        f"world size {world}; run one process per mesh rank (launch(..., nprocs={mesh.size}))")


def gather_to_all(t: torch.Tensor, shapes: Sequence[Sequence[int]], timeout: float | None = None
                  ) -> list[torch.Tensor]:
    """Every world rank's tensor, on every rank, in rank order; shapes[r] is rank r's shape (any
    shapes, one dtype). Used to assemble global outputs.

    Example::

        def work(rank):
            shapes = [(1, 2), (3,)]  # any shape per rank
            return gather_to_all(torch.full(shapes[rank], float(rank)), shapes)

        ed.launch(work, nprocs=2)[0]  # [tensor([[0., 0.]]), tensor([1., 1., 1.])]
    """
    world = dist.get_world_size()
    me = dist.get_rank()
    if tuple(t.shape) != tuple(shapes[me]):
        raise ShapeError(f"gather_to_all: rank {me} holds {tuple(t.shape)}, expected {tuple(shapes[me])}")
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    chunk = max(sizes)
    if world == 1:
        return [t.contiguous().clone()]
    flat = to_wire(t.contiguous()).reshape(-1)
    buf = padded(flat, chunk)
    out = buf.new_empty((world * chunk,))
    if out.numel():
        wait(_all_gather_single(out, buf.contiguous(), async_op=True), timeout, "gather to every rank")
    out = from_wire(out, t.dtype)
    return [out[r * chunk: r * chunk + sizes[r]].reshape(tuple(shapes[r])).clone() for r in range(world)]


def run_collective(plan: Plan, c: Collective, local: torch.Tensor, rank: int, *,
                   timeout: float | None = None) -> torch.Tensor:
    """This rank's result of collective `c`, given this rank's shard of c.src: exactly
    egraph_did.simulate.collective(plan, c, every_rank_shard)[rank], computed with the ranks of c's
    mesh axis over torch.distributed. timeout: seconds to wait for the group (None: the process
    group's own timeout).

    Example::

        def work(rank, plan, partial):  # plan: row_sum with x split on its summed axis, 4 ranks
            c = plan.collectives[0]  # reduce_scatter[x] y: P -> S0
            return run_collective(plan, c, partial, rank, timeout=30)

        ed.launch(work, nprocs=4, args=(plan, torch.ones(8)))  # tensor([4., 4.]) on every rank
    """
    entry = collectives.get(c.kind, f"run: {c.kind}[{c.mesh_axis_name}] {c.tensor}")
    check_shard(plan, c, local, rank)
    move = plan.move(c)
    return entry.run(move, local, axis_group(plan.mesh, c.mesh_axis, rank), timeout)


def check_shard(plan: Plan, c: Collective, local: torch.Tensor, rank: int) -> None:
    """ShapeError unless `local` has the shape c.src's layout gives `rank` (what run_collective checks).

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> fd, mesh = row_sum(8, 64), ed.DeviceMesh.arange(4)
    >>> _ = fd["x"].set_device_mesh(mesh).outer_split(1, 4).axis(1).parallelize(ed.ParallelType.DIDx)
    >>> plan = ed.optimize(fd, mesh)
    >>> check_shard(plan, plan.collectives[0], torch.ones(3), rank=0)
    Traceback (most recent call last):
    ...
    egraph_did.errors.ShapeError: reduce_scatter[x] y: rank 0 holds a shard of shape (3,), but y:P's layout gives it (8,)
    """
    want = plan.local_shape(c.src, rank)
    if tuple(local.shape) != want:
        raise ShapeError(f"{c.kind}[{c.mesh_axis_name}] {c.tensor}: rank {rank} holds a shard of shape "
                         f"{tuple(local.shape)}, but {c.src}'s layout gives it {want}")


# ---------------------------------------------------------------------------- expert exchanges

def exchange_of(step) -> tuple[str, int] | None:
    """(the expert exchange a grouped_mm step runs, its mesh axis), or None: a step whose flag names one of
    collectives.EXCHANGES (token dispatch or combine, an all-to-all of uneven counts inside the step). Under
    torch.distributed its local kernel runs it rank by rank (ops.GROUPED_MM_DISPATCH / _COMBINE, calling
    collectives.exchange_run: one all_to_all_single with input and output split sizes, gloo or NCCL);
    simulate runs every rank at once (simulate_exchange).

    >>> from egraph_did.plan import ComputeStep
    >>> step = ComputeStep("grouped_mm", (("x", "x:S0"), ("w", "w:S0"), ("offsets", "o:R")), ("x", "w", "offsets"),
    ...                    ("y:Pe",), (("ep_dispatch", (0,)),), ("expert_dispatch",), 1e-3)
    >>> exchange_of(step)
    ('ep_dispatch', 0)
    """
    if not isinstance(step, ComputeStep):
        return None
    return next(((f, axes[0]) for f, axes in step.flags if f in collectives.EXCHANGE_FLAGS), None)


def simulate_exchange(plan: Plan, step, env) -> dict[str, dict[int, torch.Tensor]]:
    """Every rank's output of an expert-exchange step, given every rank's operands (simulate's env: value ->
    rank -> tensor): ops.exchange_all_ranks, each group of the mesh axis exchanged by
    collectives.exchange_simulate, what the kernel gives each rank under torch.distributed."""
    flag, m = exchange_of(step)
    operands = {k: Operand(plan.values[v].shape, plan.values[v].layout) for k, v in step.operands.items()}
    outputs = [Operand(plan.values[o].shape, plan.values[o].layout) for o in step.writes]
    args = {r: step.bind(lambda v, r=r: env[v][r]) for r in plan.mesh.ranks}
    return {step.writes[0]: exchange_all_ranks(flag, args, operands, outputs, plan.mesh, m)}


__all__ = ["AxisGroup", "axis_group", "ensure_groups", "check_world", "world_key", "gather_to_all",
           "run_collective", "check_shard", "exchange_of", "simulate_exchange"]
