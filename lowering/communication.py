"""Communication lowering: a plan's collectives on torch.distributed, as one rank runs them.

`run_collective(plan, c, local, rank)` gives this rank exactly what `egraph_did.simulate.collective`
gives it: the same cuts (RankContext.shard_range of the destination layout, nested and uneven splits
included), the same concatenation order (mesh order along the axis). Sums and maxima are the
backend's, so a floating-point sum may round differently from simulate's left-to-right one.

The primitives below work on any tensor axis and any shard sizes: a sharded axis that is not outermost
moves to the front (movedim + contiguous), every member's piece is padded to the largest one, the
backend communicates equal pieces, and the padding is cut off again. One process group per slice of a
mesh axis (`axis_group`); every rank creates every group of a (mesh, axis), in the same order, the first
time it is needed, and keeps it for the life of the default process group.

torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
reduce_scatter_single (the old names warn); torch 2.11 has only the old names. The newest present is
used.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from egraph_did.errors import PlanError, ShapeError
from egraph_did.shards import Operand, RankContext
from egraph_did.mesh import DeviceMesh
from egraph_did.plan import Collective, Plan

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


# ---------------------------------------------------------------------------- process groups

@dataclass(frozen=True)
class AxisGroup:
    """The ranks on one mesh axis through a rank, and the process group that connects them.

    members is in mesh order (coordinate 0 first): the order simulate concatenates in. The backend
    orders a group by ascending global rank, so `slot(r)` is where member r's piece sits in a
    backend buffer. pg is None for a group of one (nothing to communicate).

    Example::

        def work(rank):  # module level: launch pickles it
            group = axis_group(DeviceMesh([[0, 1], [2, 3]]), 1, rank)  # this rank's row of the mesh
            return group.members, group.me

        ed.launch(work, nprocs=4)  # [((0, 1), 0), ((0, 1), 1), ((2, 3), 0), ((2, 3), 1)]
    """

    members: tuple[int, ...]
    me: int  # this rank's index in members
    pg: object | None

    @property
    def size(self) -> int:
        """How many ranks the group holds."""
        return len(self.members)

    def slot(self, member_index: int) -> int:
        """The backend position of members[member_index]."""
        return sorted(self.members).index(self.members[member_index])


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


# ---------------------------------------------------------------------------- helpers

def _wait(work, timeout: float | None, what: str) -> None:
    if work is None:
        return
    if timeout is None:
        work.wait()
        return
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise TimeoutError(f"{what} did not complete within {timeout:g} s ({e}); a rank of its group "
                           f"has not reached it") from None
    if ok is False:
        raise TimeoutError(f"{what} did not complete within {timeout:g} s; a rank of its group has not "
                           f"reached it")


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What the backend moves: bool travels as uint8 (gloo has no bool)."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _unwire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(torch.bool) if dtype == torch.bool else t


def _front(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t with `dim` moved to the front, contiguous (communication cuts along the first axis)."""
    return t.movedim(dim, 0).contiguous() if dim else t.contiguous()


def _padded(t: torch.Tensor, size: int) -> torch.Tensor:
    """t (axis 0 first) zero-padded along axis 0 to `size`."""
    if t.shape[0] == size:
        return t
    out = t.new_zeros((size,) + tuple(t.shape[1:]))
    out[: t.shape[0]] = t
    return out


# ---------------------------------------------------------------------------- primitives

def allgather(t: torch.Tensor, dim: int, group: AxisGroup, sizes: Sequence[int],
              timeout: float | None = None) -> torch.Tensor:
    """Every member's `t` concatenated along `dim`, in mesh order; sizes[i] is members[i]'s extent
    along dim (uneven allowed). Every other axis is the same on every member.

    Example::

        def work(rank):
            group = axis_group(DeviceMesh.arange(2), 0, rank)
            t = torch.full((rank + 1, 3), float(rank))  # rank 0 holds 1 row, rank 1 holds 2
            return allgather(t, 0, group, sizes=[1, 2])

        ed.launch(work, nprocs=2)[0]  # tensor([[0., 0., 0.], [1., 1., 1.], [1., 1., 1.]])
    """
    dim %= max(t.ndim, 1)
    if t.shape[dim] != sizes[group.me]:
        raise ShapeError(f"allgather: this rank holds {t.shape[dim]} along axis {dim}, the plan says "
                         f"{sizes[group.me]}")
    if group.pg is None:
        return t.contiguous().clone()
    front = _front(t, dim)
    chunk = max(sizes)
    rest = tuple(front.shape[1:])
    buf = _wire(_padded(front, chunk))
    out = buf.new_empty((group.size * chunk,) + rest)
    if out.numel():
        _wait(_all_gather_single(out, buf.contiguous(), group=group.pg, async_op=True), timeout,
              f"allgather over ranks {group.members}")
    out = _unwire(out, t.dtype)
    pieces = [out[group.slot(i) * chunk: group.slot(i) * chunk + n] for i, n in enumerate(sizes)]
    return torch.cat(pieces, 0).movedim(0, dim).contiguous()


def reduce_scatter(t: torch.Tensor, dim: int, group: AxisGroup, bounds: Sequence[tuple[int, int]],
                   op: str = "sum", timeout: float | None = None) -> torch.Tensor:
    """Sum (or max) of every member's `t`, of which this rank keeps [lo, hi) = bounds[me] along `dim`;
    bounds[i] is the piece members[i] keeps (uneven allowed).

    Example::

        def work(rank):
            group = axis_group(DeviceMesh.arange(2), 0, rank)
            return reduce_scatter(torch.ones(3, 2), 0, group, bounds=[(0, 2), (2, 3)])

        ed.launch(work, nprocs=2)  # [tensor([[2., 2.], [2., 2.]]), tensor([[2., 2.]])]
    """
    dim %= max(t.ndim, 1)
    lo, hi = bounds[group.me]
    if group.pg is None:
        return t.narrow(dim, lo, hi - lo).contiguous()
    front = _front(t, dim)
    chunk = max(b - a for a, b in bounds)
    rest = tuple(front.shape[1:])
    buf = front.new_zeros((group.size * chunk,) + rest)
    for i, (a, b) in enumerate(bounds):
        s = group.slot(i) * chunk
        buf[s: s + b - a] = front[a:b]
    out = buf.new_empty((chunk,) + rest)
    if out.numel():
        _wait(_reduce_scatter_single(out, buf, op=_REDUCE_OPS[op], group=group.pg, async_op=True), timeout,
              f"reduce_scatter over ranks {group.members}")
    return out[: hi - lo].movedim(0, dim).contiguous()


def allreduce(t: torch.Tensor, group: AxisGroup, op: str = "sum", timeout: float | None = None) -> torch.Tensor:
    """Sum or max over the members, into a new tensor (t is left as it was).

    Example::

        def work(rank):
            group = axis_group(DeviceMesh.arange(2), 0, rank)
            return allreduce(torch.tensor([float(rank)]), group, op="max")

        ed.launch(work, nprocs=2)  # [tensor([1.]), tensor([1.])]
    """
    out = t.contiguous().clone()
    if group.pg is None or not out.numel():
        return out
    if op not in _REDUCE_OPS:
        raise PlanError(f"allreduce: unknown reduction {op!r} (sum or max)")
    _wait(dist.all_reduce(out, op=_REDUCE_OPS[op], group=group.pg, async_op=True), timeout,
          f"allreduce({op}) over ranks {group.members}")
    return out


def alltoall(t: torch.Tensor, src_dim: int, dst_dim: int, group: AxisGroup, src_sizes: Sequence[int],
             dst_bounds: Sequence[tuple[int, int]], timeout: float | None = None) -> torch.Tensor:
    """narrow(cat(members' t along src_dim), dst_dim, *dst_bounds[me]) without gathering everything:
    member i is sent its [lo, hi) along dst_dim of this rank's piece. src_sizes[i] is member i's
    extent along src_dim.

    Example::

        def work(rank):  # a [4, 2] tensor split by rows becomes split by columns
            group = axis_group(DeviceMesh.arange(2), 0, rank)
            rows = torch.arange(8.).reshape(4, 2)[2 * rank: 2 * rank + 2]
            return alltoall(rows, 0, 1, group, src_sizes=[2, 2], dst_bounds=[(0, 1), (1, 2)])

        ed.launch(work, nprocs=2)[1]  # tensor([[1.], [3.], [5.], [7.]])
    """
    nd = max(t.ndim, 1)
    src_dim, dst_dim = src_dim % nd, dst_dim % nd
    if src_dim == dst_dim:  # not a transpose of the sharding: gather, then cut
        whole = allgather(t, src_dim, group, src_sizes, timeout)
        lo, hi = dst_bounds[group.me]
        return whole.narrow(dst_dim, lo, hi - lo).contiguous()
    if t.shape[src_dim] != src_sizes[group.me]:
        raise ShapeError(f"alltoall: this rank holds {t.shape[src_dim]} along axis {src_dim}, the plan says "
                         f"{src_sizes[group.me]}")
    if group.pg is None:
        lo, hi = dst_bounds[0]
        return t.narrow(dst_dim, lo, hi - lo).contiguous()
    box = list(t.shape)
    box[src_dim] = max(src_sizes)
    box[dst_dim] = max(b - a for a, b in dst_bounds)
    send = t.new_zeros([group.size] + box)
    for i, (a, b) in enumerate(dst_bounds):
        piece = t.narrow(dst_dim, a, b - a)
        send[group.slot(i)][tuple(slice(0, n) for n in piece.shape)] = piece
    send = _wire(send)
    recv = torch.empty_like(send)
    if recv.numel():
        _wait(dist.all_to_all_single(recv, send, group=group.pg, async_op=True), timeout,
              f"alltoall over ranks {group.members}")
    recv = _unwire(recv, t.dtype)
    lo, hi = dst_bounds[group.me]
    pieces = []
    for i, n in enumerate(src_sizes):
        shape = list(t.shape)
        shape[src_dim], shape[dst_dim] = n, hi - lo
        pieces.append(recv[group.slot(i)][tuple(slice(0, k) for k in shape)])
    return torch.cat(pieces, src_dim).contiguous()


def local_slice(t: torch.Tensor, dim: int, lo: int, hi: int) -> torch.Tensor:
    """[lo, hi) of t along dim: R -> S needs no communication.

    >>> local_slice(torch.arange(6).reshape(2, 3), 1, 1, 3)
    tensor([[1, 2],
            [4, 5]])
    """
    return t.narrow(dim, lo, hi - lo).contiguous()


def broadcast(t: torch.Tensor, src: int, group: AxisGroup | None = None, timeout: float | None = None
              ) -> torch.Tensor:
    """Global rank `src`'s t, on every member of `group` (the whole world when None). Every rank
    passes a tensor of the same shape and dtype; a new tensor comes back.

    Example::

        def work(rank):
            return broadcast(torch.tensor([rank + 10]), src=1)

        ed.launch(work, nprocs=2)  # [tensor([11]), tensor([11])]
    """
    out = _wire(t.contiguous().clone())
    pg = None if group is None else group.pg
    if group is not None and pg is None:
        return _unwire(out, t.dtype)
    if out.numel():
        _wait(dist.broadcast(out, src, group=pg, async_op=True), timeout, f"broadcast from rank {src}")
    return _unwire(out, t.dtype)


def send(t: torch.Tensor, dst: int, timeout: float | None = None) -> None:
    """Send t to global rank dst (which calls recv).

    Example::

        def work(rank):
            if rank == 0:
                return send(torch.arange(3.), dst=1)
            return recv((3,), torch.float32, src=0)

        ed.launch(work, nprocs=2)  # [None, tensor([0., 1., 2.])]
    """
    if t.numel():
        _wait(dist.isend(_wire(t.contiguous()), dst), timeout, f"send to rank {dst}")


def recv(shape: Sequence[int], dtype: torch.dtype, src: int, device: torch.device | str = "cpu",
         timeout: float | None = None) -> torch.Tensor:
    """Receive a tensor of `shape` and `dtype` from global rank src (which calls send).

    Example::

        def work(rank):
            if rank == 1:
                return send(torch.tensor([True, False]), dst=0)  # bool travels as uint8
            return recv((2,), torch.bool, src=1)

        ed.launch(work, nprocs=2)  # [tensor([ True, False]), None]
    """
    out = _wire(torch.empty(tuple(shape), dtype=dtype, device=device))
    if out.numel():
        _wait(dist.irecv(out, src), timeout, f"recv from rank {src}")
    return _unwire(out, dtype)


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
    flat = _wire(t.contiguous()).reshape(-1)
    buf = _padded(flat, chunk)
    out = buf.new_empty((world * chunk,))
    if out.numel():
        _wait(_all_gather_single(out, buf.contiguous(), async_op=True), timeout, "gather to every rank")
    out = _unwire(out, t.dtype)
    return [out[r * chunk: r * chunk + sizes[r]].reshape(tuple(shapes[r])).clone() for r in range(world)]


# ---------------------------------------------------------------------------- plan collectives

def local_shape(plan: Plan, value: str, rank: int) -> tuple[int, ...]:
    """The shape of `rank`'s shard of a plan value (its allocation: ceil-cut, uneven splits exact).

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> plan = ed.optimize(row_sum(10, 3), ed.DeviceMesh.arange(4))  # x's 10 rows split over 4 ranks
    >>> [local_shape(plan, "x:S0", r) for r in range(4)]
    [(3, 3), (3, 3), (3, 3), (1, 3)]
    """
    v = plan.values[value]
    return RankContext(plan.mesh, rank).local_shape(Operand(v.shape, v.layout_obj))


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
    mesh, m = plan.mesh, c.mesh_axis
    src_val, dst_val = plan.values[c.src], plan.values[c.dst]
    src, dst = src_val.layout_obj, dst_val.layout_obj
    want = local_shape(plan, c.src, rank)
    if tuple(local.shape) != want:
        raise ShapeError(f"{c.kind}[{c.mesh_axis_name}] {c.tensor}: rank {rank} holds a shard of shape "
                         f"{tuple(local.shape)}, but {c.src}'s layout gives it {want}")
    group = axis_group(mesh, m, rank)

    def bounds(r: int) -> tuple[int, int]:
        """What dst gives member r along its split axis, relative to what src minus axis m holds."""
        return RankContext(mesh, r).cut_range(dst_val.shape, src, dst, m)

    def src_sizes() -> list[int]:
        a = src[m].axis
        out = []
        for r in group.members:
            lo, hi = RankContext(mesh, r).shard_range(src_val.shape[a], src, a)
            out.append(hi - lo)
        return out

    if c.kind == "allreduce":
        return allreduce(local, group, c.reduce, timeout)
    if c.kind == "reduce_scatter":
        return reduce_scatter(local, dst[m].axis, group, [bounds(r) for r in group.members], "sum", timeout)
    if c.kind == "allgather":
        return allgather(local, src[m].axis, group, src_sizes(), timeout)
    if c.kind == "alltoall":
        return alltoall(local, src[m].axis, dst[m].axis, group, src_sizes(),
                        [bounds(r) for r in group.members], timeout)
    if c.kind == "slice":
        return local_slice(local, dst[m].axis, *bounds(rank))
    raise PlanError(f"unknown collective {c.kind!r} (allgather, reduce_scatter, allreduce, alltoall, slice)")


__all__ = ["AxisGroup", "axis_group", "ensure_groups", "check_world", "world_key", "allgather", "reduce_scatter", "allreduce", "alltoall",
           "local_slice", "broadcast", "send", "recv", "gather_to_all", "local_shape", "run_collective"]
