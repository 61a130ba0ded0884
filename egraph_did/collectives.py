"""Collectives: one registry entry per kind, the one place that says what a collective is.

An entry states, for a tensor moving between placements on one mesh axis: the identity it implements
(its docstring's first line), which placements it connects (the resharding rule the e-graph offers),
which bytes it moves and in how many latency-bound phases (the cost model and calibration price
these), what every rank ends up with (`simulate`, on every rank's tensor in one process) and the
torch.distributed call that does it (`run`, on this rank's tensor).

>>> for k in KINDS.values():
...     print(f"{k.name}: {k.identity}")
allgather: S(a) -> R: every rank gets the concatenation of all shards along a
reduce_scatter: P -> S(a): rank r gets (sum_q x_q)[shard r]
allreduce: P -> R: every rank gets sum_r x_r (max_r x_r for a pending max)
alltoall: S(a) -> S(b): rank r sends piece q of its a-shard, cut along b, to rank q
slice: R -> S(a): each rank keeps its own shard; no communication
to_partial: R -> P: one rank of the axis keeps the value, the others zeros (a pending max: every rank); no communication

Adding a kind is one class here, registered with @register; the e-graph offers it wherever `connects`
holds, and the cost model, simulate, the runtime and calibration read it from KINDS.

Cuts follow the destination layout's loop domain (RankContext.cut_range), so uneven and nested splits
are exact; `run` gives a rank exactly what `simulate` gives it. On the wire every member's piece is
padded to the largest one (the backend moves equal pieces), a sharded axis that is not outermost moves
to the front, and bool travels as uint8 (gloo has no bool). torch 2.13 renames all_gather_into_tensor
/ reduce_scatter_tensor to all_gather_single / reduce_scatter_single (the old names warn); torch 2.11
has only the old names: the newest present is used.
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import torch
import torch.distributed as dist

from .errors import PlanError
from .layout import PE, P, Layout, Placement, R, S
from .mesh import DeviceMesh
from .shards import RankContext, local_extents

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


# ---------------------------------------------------------------------------- what an entry acts on

@dataclass(frozen=True)
class Move:
    """A tensor of global `shape` going from layout src to dst by a collective on mesh axis m; reduce
    says how a pending partial combines ('sum' or 'max').

    >>> move = Move(DeviceMesh.arange(4), (10,), Layout((R,)), Layout((S(0),)), 0)
    >>> [move.cut(r) for r in range(4)]  # what each rank keeps of the 10 it holds (ceil-sized pieces)
    [(0, 3), (3, 6), (6, 9), (9, 10)]
    >>> Move(DeviceMesh.arange(4), (10,), Layout((S(0),)), Layout((R,)), 0).held(3)
    1
    """

    mesh: DeviceMesh
    shape: tuple[int, ...]
    src: Layout
    dst: Layout
    m: int
    reduce: str = "sum"

    def cut(self, rank: int) -> tuple[int, int]:
        """[lo, hi) along dst's split axis that dst leaves `rank`, relative to src with axis m replicated."""
        return RankContext(self.mesh, rank).cut_range(self.shape, self.src, self.dst, self.m)

    def held(self, rank: int) -> int:
        """How many elements of the axis that src splits on mesh axis m `rank` holds."""
        a = self.src[self.m].axis
        lo, hi = RankContext(self.mesh, rank).shard_range(self.shape[a], self.src, a)
        return hi - lo

    def nbytes(self, layout: Layout, itemsize: int) -> int:
        """Bytes of the largest shard of the tensor under `layout` (what one rank holds)."""
        return math.prod(local_extents(self.shape, layout, self.mesh)) * itemsize


@dataclass(frozen=True)
class AxisGroup:
    """The ranks on one mesh axis through a rank, and the process group that connects them.

    members is in mesh order (coordinate 0 first): the order simulate concatenates in. The backend
    orders a group by ascending global rank, so `slot(i)` is where member i's piece sits in a backend
    buffer. pg is None for a group of one (nothing to communicate).

    >>> group = AxisGroup((3, 1), me=0, pg=None)  # a shuffled mesh axis: rank 3 comes first
    >>> group.size, group.rank, group.slot(0)
    (2, 3, 1)
    """

    members: tuple[int, ...]
    me: int  # this rank's index in members
    pg: object | None

    @property
    def size(self) -> int:
        """How many ranks the group holds."""
        return len(self.members)

    @property
    def rank(self) -> int:
        """This rank's global rank."""
        return self.members[self.me]

    def slot(self, member_index: int) -> int:
        """The backend position of members[member_index]."""
        return sorted(self.members).index(self.members[member_index])


# ---------------------------------------------------------------------------- the wire

def wait(work, timeout: float | None, what: str) -> None:
    """Wait for an async backend call; TimeoutError naming it after `timeout` seconds (None: the
    process group's own timeout).

    >>> wait(None, 1.0, "nothing")  # a call that moved no data returns no work
    """
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


def to_wire(t: torch.Tensor) -> torch.Tensor:
    """What the backend moves: bool travels as uint8 (gloo has no bool).

    >>> to_wire(torch.tensor([True, False])), from_wire(torch.tensor([1, 0], dtype=torch.uint8), torch.bool)
    (tensor([1, 0], dtype=torch.uint8), tensor([ True, False]))
    """
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def from_wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of to_wire for a tensor that was `dtype`."""
    return t.view(torch.bool) if dtype == torch.bool else t


def padded(t: torch.Tensor, size: int) -> torch.Tensor:
    """t zero-padded along axis 0 to `size` (the backend moves equal pieces).

    >>> padded(torch.ones(1, 2), 2)
    tensor([[1., 1.],
            [0., 0.]])
    """
    if t.shape[0] == size:
        return t
    out = t.new_zeros((size,) + tuple(t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def _front(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t with `dim` moved to the front, contiguous (the backend cuts along the first axis)."""
    return t.movedim(dim, 0).contiguous() if dim else t.contiguous()


def _cut(t: torch.Tensor, move: Move, rank: int) -> torch.Tensor:
    """What dst gives `rank` of t, laid out as src with axis m replicated."""
    lo, hi = move.cut(rank)
    return t.narrow(move.dst[move.m].axis, lo, hi - lo)


def _sum(parts: Sequence[torch.Tensor], reduce: str) -> torch.Tensor:
    """Left-to-right sum (or maximum) of the parts, in a new tensor."""
    out = parts[0].clone()
    for x in parts[1:]:
        out = torch.maximum(out, x) if reduce == "max" else out + x
    return out


def _done(out: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A finish for a collective that completed when it started (a group of one rank, nothing to move)."""
    return lambda: out


# ---------------------------------------------------------------------------- the registry

@dataclass(frozen=True)
class Kind:
    """A collective kind. Subclasses state one identity (their docstring's first line) and override
    what differs; `phases` latency-bound steps each send factor(p) of `nbytes` (the alpha-beta model:
    t = phases * alpha + phases * factor(p) * nbytes / bandwidth, cost.Link.time).

    >>> KINDS["allreduce"].phases, KINDS["allreduce"].factor(4), KINDS["slice"].phases
    (2, 0.75, 0)
    """

    name: ClassVar[str]
    phases: ClassVar[int] = 1  # a ring collective is one pass; allreduce two
    example: ClassVar[tuple[Placement, Placement]]  # a (src, dst) it connects: tests and calibration
    offered: ClassVar[bool] = True  # the e-graph offers it between any two layouts it connects

    @property
    def identity(self) -> str:
        """The identity this collective implements, in one line."""
        return type(self).__doc__.strip().splitlines()[0]

    @property
    def communicates(self) -> bool:
        """Whether ranks exchange data (a local slice does not)."""
        return self.phases > 0

    def factor(self, p: int) -> float:
        """The share of nbytes each of p ranks sends per phase: all but its own 1/p."""
        return (p - 1) / p

    def connects(self, src: Placement, dst: Placement) -> bool:  # pragma: no cover - every kind overrides
        """Whether this collective takes a tensor from src to dst on one mesh axis."""
        raise NotImplementedError

    def nbytes(self, src_bytes: float, dst_bytes: float) -> float:
        """The bytes the cost model charges, from what one rank holds before and after: the input."""
        return src_bytes

    def moved(self, move: Move, itemsize: int) -> float:
        """nbytes for `move`, of elements of `itemsize` bytes (shards as the largest rank holds them).

        >>> KINDS["allgather"].moved(Move(DeviceMesh.arange(4), (8, 8), Layout((S(0),)), Layout((R,)), 0), 4)
        256
        """
        return self.nbytes(move.nbytes(move.src, itemsize), move.nbytes(move.dst, itemsize))

    def simulate(self, move: Move, parts: Sequence[torch.Tensor], rank: int) -> torch.Tensor:  # pragma: no cover
        """`rank`'s result, given every member's tensor of its group on axis m, in mesh order."""
        raise NotImplementedError

    def run(self, move: Move, t: torch.Tensor, group: AxisGroup, timeout: float | None = None) -> torch.Tensor:
        """This rank's result over torch.distributed, given its own tensor: simulate's, for this rank (a kind
        overrides start, or run where nothing waits)."""
        return self.start(move, t, group, timeout)()

    def start(self, move: Move, t: torch.Tensor, group: AxisGroup, timeout: float | None = None
              ) -> Callable[[], torch.Tensor]:
        """Issue this rank's part of the collective and return `finish`, which waits for it and gives run's
        result: what the program does between the two (compute that does not read the result) overlaps
        the transfer (lowering/program.py places finish before the first reader). A kind that moves
        nothing runs whole here.

        >>> move = Move(DeviceMesh.arange(2), (4,), Layout((R,)), Layout((S(0),)), 0)
        >>> finish = KINDS["slice"].start(move, torch.arange(4.), AxisGroup((0, 1), 1, None))
        >>> finish()
        tensor([2., 3.])
        """
        out = self.run(move, t, group, timeout)
        return lambda: out


KINDS: dict[str, Kind] = {}


def register(cls: type[Kind]) -> type[Kind]:
    """Register a collective kind under its name, as a frozen dataclass (a value: no state)."""
    KINDS[cls.name] = dataclass(frozen=True)(cls)()
    return cls


@register
class Allgather(Kind):
    """S(a) -> R: every rank gets the concatenation of all shards along a

    >>> move = Move(DeviceMesh.arange(2), (3,), Layout((S(0),)), Layout((R,)), 0)
    >>> KINDS["allgather"].simulate(move, [torch.tensor([0., 1.]), torch.tensor([2.])], rank=1)
    tensor([0., 1., 2.])
    """

    name = "allgather"
    example = (S(0), R)

    def connects(self, src, dst):
        return src.is_shard and dst == R

    def nbytes(self, src_bytes, dst_bytes):
        return dst_bytes  # a rank ends with the whole, of which it received (p-1)/p

    def simulate(self, move, parts, rank):
        return torch.cat(list(parts), dim=move.src[move.m].axis)

    def start(self, move, t, group, timeout=None):
        if group.pg is None:
            return _done(self.simulate(move, [t], group.rank).contiguous())
        dim = move.src[move.m].axis
        sizes = [move.held(r) for r in group.members]
        front = _front(t, dim)
        chunk = max(sizes)
        buf = to_wire(padded(front, chunk)).contiguous()
        out = buf.new_empty((group.size * chunk,) + tuple(front.shape[1:]))
        work = _all_gather_single(out, buf, group=group.pg, async_op=True) if out.numel() else None

        def finish(sent=buf):  # the send buffer lives until the transfer is done
            wait(work, timeout, f"allgather over ranks {group.members}")
            got = from_wire(out, t.dtype)
            pieces = [got[group.slot(i) * chunk: group.slot(i) * chunk + n] for i, n in enumerate(sizes)]
            return torch.cat(pieces, 0).movedim(0, dim).contiguous()
        return finish


@register
class ReduceScatter(Kind):
    """P -> S(a): rank r gets (sum_q x_q)[shard r]

    >>> move = Move(DeviceMesh.arange(2), (3,), Layout((P,)), Layout((S(0),)), 0)
    >>> KINDS["reduce_scatter"].simulate(move, [torch.ones(3), torch.ones(3)], rank=1)
    tensor([2.])
    """

    name = "reduce_scatter"
    example = (P, S(0))

    def connects(self, src, dst):
        return src in (P, PE) and dst.is_shard  # expert rows (Pe) are a sum too

    def simulate(self, move, parts, rank):
        return _cut(_sum(parts, move.reduce), move, rank)

    def start(self, move, t, group, timeout=None):
        if group.pg is None:
            return _done(self.simulate(move, [t], group.rank).contiguous())
        dim = move.dst[move.m].axis
        bounds = [move.cut(r) for r in group.members]
        front = _front(t, dim)
        chunk = max(b - a for a, b in bounds)
        rest = tuple(front.shape[1:])
        buf = front.new_zeros((group.size * chunk,) + rest)
        for i, (a, b) in enumerate(bounds):
            s = group.slot(i) * chunk
            buf[s: s + b - a] = front[a:b]
        out = buf.new_empty((chunk,) + rest)
        work = (_reduce_scatter_single(out, buf, op=_REDUCE_OPS[move.reduce], group=group.pg, async_op=True)
                if out.numel() else None)

        def finish(sent=buf):  # the send buffer lives until the transfer is done
            wait(work, timeout, f"reduce_scatter over ranks {group.members}")
            lo, hi = bounds[group.me]
            return out[: hi - lo].movedim(0, dim).contiguous()
        return finish


@register
class Allreduce(Kind):
    """P -> R: every rank gets sum_r x_r (max_r x_r for a pending max)

    >>> move = Move(DeviceMesh.arange(2), (2,), Layout((P,)), Layout((R,)), 0, reduce="max")
    >>> KINDS["allreduce"].simulate(move, [torch.tensor([1., 5.]), torch.tensor([3., 2.])], rank=0)
    tensor([3., 5.])
    """

    name = "allreduce"
    phases = 2  # NCCL's ring allreduce is a reduce-scatter phase then an allgather phase
    example = (P, R)

    def connects(self, src, dst):
        return src.is_partial and dst == R

    def simulate(self, move, parts, rank):
        return _sum(parts, move.reduce)

    def start(self, move, t, group, timeout=None):
        out = t.contiguous().clone()
        if group.pg is None or not out.numel():
            return _done(out)
        if move.reduce not in _REDUCE_OPS:
            raise PlanError(f"allreduce: unknown reduction {move.reduce!r} (sum or max)")
        work = dist.all_reduce(out, op=_REDUCE_OPS[move.reduce], group=group.pg, async_op=True)

        def finish():
            wait(work, timeout, f"allreduce({move.reduce}) over ranks {group.members}")
            return out
        return finish


@register
class Alltoall(Kind):
    """S(a) -> S(b): rank r sends piece q of its a-shard, cut along b, to rank q

    >>> move = Move(DeviceMesh.arange(2), (2, 2), Layout((S(0),)), Layout((S(1),)), 0)
    >>> KINDS["alltoall"].simulate(move, [torch.tensor([[0., 1.]]), torch.tensor([[2., 3.]])], rank=1)
    tensor([[1.],
            [3.]])
    """

    name = "alltoall"
    example = (S(0), S(1))

    def connects(self, src, dst):
        return src.is_shard and dst.is_shard and src.axis != dst.axis

    def simulate(self, move, parts, rank):
        return _cut(torch.cat(list(parts), dim=move.src[move.m].axis), move, rank)

    def start(self, move, t, group, timeout=None):
        if group.pg is None:
            return _done(self.simulate(move, [t], group.rank).contiguous())
        src_dim, dst_dim = move.src[move.m].axis, move.dst[move.m].axis
        sizes = [move.held(r) for r in group.members]
        bounds = [move.cut(r) for r in group.members]
        box = list(t.shape)
        box[src_dim], box[dst_dim] = max(sizes), max(b - a for a, b in bounds)
        send = t.new_zeros([group.size] + box)
        for i, (a, b) in enumerate(bounds):
            piece = t.narrow(dst_dim, a, b - a)
            send[group.slot(i)][tuple(slice(0, n) for n in piece.shape)] = piece
        send = to_wire(send)
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=group.pg, async_op=True) if recv.numel() else None

        def finish(sent=send):  # the send buffer lives until the transfer is done
            wait(work, timeout, f"alltoall over ranks {group.members}")
            got = from_wire(recv, t.dtype)
            lo, hi = bounds[group.me]
            pieces = []
            for i, n in enumerate(sizes):
                shape = list(t.shape)
                shape[src_dim], shape[dst_dim] = n, hi - lo
                pieces.append(got[group.slot(i)][tuple(slice(0, k) for k in shape)])
            return torch.cat(pieces, src_dim).contiguous()
        return finish


@register
class Slice(Kind):
    """R -> S(a): each rank keeps its own shard; no communication

    >>> move = Move(DeviceMesh.arange(2), (3,), Layout((R,)), Layout((S(0),)), 0)
    >>> KINDS["slice"].simulate(move, [torch.arange(3.), torch.arange(3.)], rank=1)
    tensor([2.])
    """

    name = "slice"
    phases = 0  # local: the optimizer prices it as a copy kernel
    example = (R, S(0))

    def connects(self, src, dst):
        return src == R and dst.is_shard

    def nbytes(self, src_bytes, dst_bytes):
        return 0.0

    def simulate(self, move, parts, rank):
        return _cut(parts[move.mesh.coords(rank)[move.m]], move, rank)

    def run(self, move, t, group, timeout=None):
        return _cut(t, move, group.rank).contiguous()


@register
class ToPartial(Kind):
    """R -> P: one rank of the axis keeps the value, the others zeros (a pending max: every rank); no communication

    A pin that asks a partial of a value computed whole (a replicated bias added to a partial sum, kept
    pending) is honoured this way, as DTensor's Replicate -> Partial redistribute.

    >>> move = Move(DeviceMesh.arange(2), (3,), Layout((R,)), Layout((P,)), 0)
    >>> [KINDS["to_partial"].simulate(move, [torch.ones(3), torch.ones(3)], rank=r).tolist() for r in (0, 1)]
    [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    """

    name = "to_partial"
    phases = 0  # local: the optimizer prices it as a copy kernel
    example = (R, P)
    offered = False  # only where a pin asks a partial that no rule makes (optimize.partial_from_whole)

    def connects(self, src, dst):
        return src == R and dst.is_partial and not dst.rows  # rank 0's whole value is no rank's expert rows

    def nbytes(self, src_bytes, dst_bytes):
        return 0.0

    def simulate(self, move, parts, rank):
        return _keep_or_zero(parts[move.mesh.coords(rank)[move.m]], move, move.mesh.coords(rank)[move.m])

    def run(self, move, t, group, timeout=None):
        return _keep_or_zero(t, move, group.me)


def _keep_or_zero(t: torch.Tensor, move: Move, coord: int) -> torch.Tensor:
    """A summand of t for the rank at `coord` on the move's axis: t at coordinate 0, zeros elsewhere
    (the value itself for a pending max, which copies do not change)."""
    if move.dst[move.m].reduce == "max" or coord == 0:
        return t.clone()
    return torch.zeros_like(t)


# ---------------------------------------------------------------------------- collective matmuls (rings)

@dataclass(frozen=True)
class Ring:
    """A collective fused with the GEMM beside it, run as a ring of n = group-size steps on one mesh axis
    (rewrites/collective_matmul.py offers it, cost.CostModel.ring_time prices it): each step computes one
    row block while the next block (or accumulator) travels to the neighbour, so transfer hides behind
    compute. `flag` is the local kernel name a plan's compute step carries; `collective` the one it
    replaces; `simulate` gives every rank's result in one process, `run` this rank's over torch.distributed
    point-to-point sends (no process group but the default one: global ranks). The step's op is matmul
    or linear without bias (`gemm(x, w)` on local tensors); `a` is the row axis of x and y the ring cuts.

    >>> [(r.name, r.flag, r.collective) for r in RINGS.values()]  # doctest: +NORMALIZE_WHITESPACE
    [('allgather_matmul', 'ag_ring', 'allgather'), ('matmul_reduce_scatter', 'rs_ring', 'reduce_scatter'),
     ('ring_attention', 'kv_ring', 'allgather'), ('ring_attention_backward', 'dkv_ring', 'reduce_scatter')]
    >>> RINGS["allgather_matmul"].identity
    'allgather_m(x) @ w = cat_i(x_i @ w): rank r multiplies the row block it holds while passing it on'
    """

    name: str
    flag: str
    collective: str
    identity: str


RINGS = {r.name: r for r in (
    Ring("allgather_matmul", "ag_ring", "allgather",
         "allgather_m(x) @ w = cat_i(x_i @ w): rank r multiplies the row block it holds while passing it on"),
    Ring("matmul_reduce_scatter", "rs_ring", "reduce_scatter",
         "reduce_scatter_m(x @ w) = block r of sum_q (x_q @ w_q): an accumulator of each row block passes round the ring"),
    Ring("ring_attention", "kv_ring", "allgather",
         "sdpa(q_r, allgather_m(k), allgather_m(v)) = merge_j sdpa_lse(q_r, k_j, v_j): rank r attends to the key "
         "block it holds while passing it on (k and v in one buffer), merging by the online softmax"),
    Ring("ring_attention_backward", "dkv_ring", "reduce_scatter",
         "sdpa_backward(g_r, q_r, allgather_m(k), allgather_m(v), ..) = (sum_j dq_rj, reduce_scatter_m(dk), "
         "reduce_scatter_m(dv)): each key block travels with its dk, dv accumulator, every rank adding its part"),
)}
RING_FLAGS = {r.flag: r for r in RINGS.values()}


def gemm(op: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The local GEMM of a ring step: matmul(x, w) (w [in, out]) or linear(x, w) without bias (w [out, in]).

    >>> gemm("linear", torch.ones(2, 3), torch.ones(4, 3)).shape
    torch.Size([2, 4])
    """
    return torch.matmul(x, w) if op == "matmul" else torch.nn.functional.linear(x, w)


def _blocks(t: torch.Tensor, a: int, n: int) -> list[torch.Tensor]:
    """t cut into n equal row blocks along axis a (the ring is offered only where the extent divides)."""
    return list(t.chunk(n, dim=a)) if t.shape[a] else [t] * n


def ring_simulate(ring: str, op: str, xs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor], a: int
                  ) -> list[torch.Tensor]:
    """Every member's result of a ring step, given every member's x and w shards (mesh order on the ring's
    axis), in the order the ring adds: what `ring_run` gives each rank, bit for bit.

    >>> xs, ws = [torch.ones(1, 2), 2 * torch.ones(1, 2)], [torch.eye(2), torch.eye(2)]
    >>> ring_simulate("allgather_matmul", "matmul", xs, ws, 0)[1]  # rows of both ranks, times w
    tensor([[1., 1.],
            [2., 2.]])
    >>> ring_simulate("matmul_reduce_scatter", "matmul", [torch.ones(2, 2)] * 2, ws, 0)[0]  # row 0 of the sum
    tensor([[2., 2.]])
    """
    n = len(xs)
    if ring == "allgather_matmul":
        return [torch.cat([gemm(op, x, w) for x in xs], dim=a) for w in ws]
    parts = [_blocks(gemm(op, x, w), a, n) for x, w in zip(xs, ws)]  # q's partial, cut in n row blocks
    out = []
    for r in range(n):  # block r starts at member r + 1 and ends at r, as the ring carries it
        acc = parts[(r + 1) % n][r].clone()
        for s in range(2, n + 1):
            acc = acc + parts[(r + s) % n][r]
        out.append(acc.contiguous())
    return out


def _exchange(send: torch.Tensor, recv: torch.Tensor, to: int, frm: int) -> list:
    """Start sending `send` to global rank `to` and receiving into `recv` from `frm`: the requests."""
    ops = [dist.P2POp(dist.isend, send, to), dist.P2POp(dist.irecv, recv, frm)]
    return dist.batch_isend_irecv(ops)


def ring_run(ring: str, op: str, x: torch.Tensor, w: torch.Tensor, a: int, members: Sequence[int], me: int,
             timeout: float | None = None) -> torch.Tensor:
    """This rank's result of a ring step over the global ranks `members` (mesh order; this rank is
    members[me]): ring_simulate's, computed while the blocks travel. Each step sends to the next member
    and receives from the previous one, then computes its block while both are in flight (on a GPU,
    NCCL runs the transfers on its own stream, beside the GEMM on the current one).

    Example::

        def work(rank):  # 2 ranks, each holding one row of x: both get x @ w
            x = torch.full((1, 2), float(rank + 1))
            return ring_run("allgather_matmul", "matmul", x, torch.eye(2), 0, (0, 1), rank)

        ed.launch(work, nprocs=2)  # [tensor([[1., 1.], [2., 2.]])] * 2
    """
    n = len(members)
    to, frm = members[(me + 1) % n], members[(me - 1) % n]
    if ring == "allgather_matmul":
        out: list = [None] * n
        held = x.contiguous()
        for s in range(n):
            src = (me - s) % n  # whose block this rank holds at step s
            nxt = torch.empty_like(held) if s < n - 1 else None
            reqs = _exchange(held, nxt, to, frm) if nxt is not None else []
            out[src] = gemm(op, held, w)
            for q in reqs:
                wait(q, timeout, f"{ring} step {s} over ranks {tuple(members)}")
            held = nxt
        return torch.cat(out, dim=a).contiguous()
    xb, reqs, got, sent = _blocks(x, a, n), [], None, None
    for s in range(n):
        b = (me - s - 1) % n  # the row block whose sum this rank adds to at step s
        part = gemm(op, xb[b].contiguous(), w)  # while the previous step's sum travels
        for q in reqs:
            wait(q, timeout, f"{ring} step {s - 1} over ranks {tuple(members)}")
        acc = part if got is None else got + part  # the members' sum before this one, then ours
        if s == n - 1:
            return acc.contiguous()
        sent, got = acc.contiguous(), torch.empty_like(part)  # sent lives until its transfer is done
        reqs = _exchange(sent, got, to, frm)
    raise AssertionError("unreachable: a ring has at least one step")


def _ring_group(ring: str, ctx, m: int) -> tuple[list[int], int]:
    """(the global ranks of this rank's group on mesh axis m, this rank's place in it) for a ring step's local
    kernel, which communicates: a PlanError outside torch.distributed."""
    if not dist.is_initialized():
        raise PlanError(f"{ring}: a ring step communicates; run the plan under torch.distributed "
                        f"(plan.run under ed.launch) or with ed.simulate, which runs every rank at once")
    members = ctx.mesh.ranks_along(m, ctx.rank)
    return members, members.index(ctx.rank)


def ring_kernel(op: str, ring: str) -> Callable:
    """The local kernel a ring step of `op` (matmul or linear) names (ops.py lists it beside the op): on
    the mesh axis it applies on, run the ring over this rank's group (run_local's signature). simulate
    runs every rank of a ring step at once (lowering/collective_matmul.py), so this runs under
    torch.distributed only.

    >>> print(ring_kernel("matmul", "allgather_matmul").__doc__.splitlines()[0])
    allgather_m(x) @ w = cat_i(x_i @ w): rank r multiplies the row block it holds while passing it on
    """
    def kernel(args, operands, outputs, ctx, axes):
        (m,) = axes
        x, w = (args["a"], args["b"]) if op == "matmul" else (args["x"], args["weight"])
        lay = next(iter(operands.values())).layout if ring == "allgather_matmul" else outputs[0].layout
        return ring_run(ring, op, x, w, lay[m].axis, *_ring_group(ring, ctx, m))
    kernel.__doc__ = RINGS[ring].identity
    kernel.__name__ = f"{op}_{RING_FLAGS_OF[ring]}"
    return kernel


RING_FLAGS_OF = {r.name: r.flag for r in RINGS.values()}


# ring attention: `block(q, k, v, diagonal, scale) -> (out, lse)` is one block's attention (ops.py's, torch's
# fused kernels on a GPU; diagonal: the causal mask of the block whose keys are the queries' own positions)

def attention_merge(acc: tuple[torch.Tensor, torch.Tensor], part: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention over two disjoint sets of keys from each set's: the online-softmax merge,
    exact. lse = log(e^l1 + e^l2); out = o1 e^(l1 - lse) + o2 e^(l2 - lse), in the logsumexp's dtype.

    >>> o, l = attention_merge((torch.ones(1, 2), torch.zeros(1)), (3 * torch.ones(1, 2), torch.zeros(1)))
    >>> o.tolist(), round(l.item(), 4)  # two keys sets of equal weight: the mean, log 2
    ([[2.0, 2.0]], 0.6931)
    """
    (o1, l1), (o2, l2) = acc, part
    lse = torch.logaddexp(l1, l2)
    return (o1.to(lse.dtype) * torch.exp(l1 - lse).unsqueeze(-1)
            + o2.to(lse.dtype) * torch.exp(l2 - lse).unsqueeze(-1)), lse


def _attention_step(block: Callable, q, held, dk: int, src: int, me: int, causal: bool, scale, acc):
    """One ring step of rank `me` holding key block `src` (k and v side by side in `held`): attend to it
    and merge; a block entirely above the causal diagonal (src > me: every key after every query) adds
    nothing and is skipped."""
    if causal and src > me:
        return acc
    part = block(q, held[..., :dk], held[..., dk:], causal and src == me, scale)
    return part if acc is None else attention_merge(acc, part)


def _attention_done(acc, dtype: torch.dtype, with_lse: bool):
    out = acc[0].to(dtype).contiguous()
    return (out, acc[1].contiguous()) if with_lse else out


def ring_attention_simulate(block: Callable, qs: Sequence[torch.Tensor], ks: Sequence[torch.Tensor],
                            vs: Sequence[torch.Tensor], causal: bool, scale, with_lse: bool) -> list:
    """Every member's result of a ring_attention step, given every member's q, k and v blocks on the
    sequence (mesh order on the ring's axis), in the order the ring merges: what ring_attention_run gives
    each rank, bit for bit. Member r holds key block (r - s) mod n at step s.

    >>> def block(q, k, v, diagonal, scale):  # attention without scaling or mask, for the example
    ...     s = q @ k.transpose(-2, -1)
    ...     return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)
    >>> qs = ks = [torch.zeros(1, 1, 1, 1)] * 2
    >>> vs = [torch.ones(1, 1, 1, 1), 3 * torch.ones(1, 1, 1, 1)]
    >>> [o.item() for o in ring_attention_simulate(block, qs, ks, vs, False, None, False)]  # equal scores: the mean
    [2.0, 2.0]
    """
    n, dk = len(qs), ks[0].shape[-1]
    helds = [torch.cat([k, v], -1).contiguous() for k, v in zip(ks, vs)]
    out = []
    for me in range(n):
        acc = None
        for s in range(n):
            src = (me - s) % n
            acc = _attention_step(block, qs[me], helds[src], dk, src, me, causal, scale, acc)
        out.append(_attention_done(acc, qs[me].dtype, with_lse))
    return out


def ring_attention_run(block: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale,
                       with_lse: bool, members: Sequence[int], me: int, timeout: float | None = None):
    """This rank's result of a ring_attention step over the global ranks `members` (mesh order; this rank
    is members[me], holding query block me and key block me): k and v travel as one buffer to the next
    member while this rank attends to the block it holds (on a GPU, NCCL runs the transfer on its own
    stream beside the attention kernel); ring_attention_simulate's result.

    Example::

        def work(rank):  # 2 ranks, each holding one query and one key of the sequence
            q = k = torch.zeros(1, 1, 1, 4); v = torch.full((1, 1, 1, 4), float(rank))
            return ring_attention_run(ops.ring_attention_block, q, k, v, False, None, False, (0, 1), rank)

        ed.launch(work, nprocs=2)  # both ranks: 0.5 everywhere (equal weights on values 0 and 1)
    """
    n, dk = len(members), k.shape[-1]
    to, frm = members[(me + 1) % n], members[(me - 1) % n]
    held, acc = torch.cat([k, v], -1).contiguous(), None
    for s in range(n):
        nxt = torch.empty_like(held) if s < n - 1 else None
        reqs = _exchange(held, nxt, to, frm) if nxt is not None else []
        acc = _attention_step(block, q, held, dk, (me - s) % n, me, causal, scale, acc)
        for r in reqs:
            wait(r, timeout, f"ring_attention step {s} over ranks {tuple(members)}")
        held = nxt
    return _attention_done(acc, q.dtype, with_lse)


# ring attention's backward: `grad(g, q, k, v, out, lse, diagonal, scale) -> (dq, dk, dv)` is one block's
# (ops.py's; exact per key block from the rows' whole output and logsumexp)

def _backward_part(grad: Callable, ops_: tuple, held, dk: int, src: int, me: int, causal: bool, scale):
    """Rank `me`'s part of the gradients of key block `src` (k and v side by side in `held`), in the
    logsumexp's dtype: (dq part, dk|dv part side by side), or None for a block above the causal diagonal."""
    if causal and src > me:
        return None
    g, q, out, lse = ops_
    dq, dkp, dvp = grad(g, q, held[..., :dk], held[..., dk:], out, lse, causal and src == me, scale)
    return dq.to(lse.dtype), torch.cat([dkp, dvp], -1).to(lse.dtype)


def ring_attention_backward_simulate(grad: Callable, gs, qs, ks, vs, outs, lses, causal: bool, scale) -> list:
    """Every member's (dq, dk, dv) of a ring_attention_backward step, given every member's blocks on the
    sequence (mesh order), summed in the ring's order: what ring_attention_backward_run gives each rank,
    bit for bit. Key block j starts at member j with its accumulator and visits j + 1, .., j + n - 1, each
    adding its part; one more hop brings the sums home to member j."""
    n, dk = len(qs), ks[0].shape[-1]
    helds = [torch.cat([k, v], -1).contiguous() for k, v in zip(ks, vs)]
    parts = {(me, s): _backward_part(grad, (gs[me], qs[me], outs[me], lses[me]), helds[(me - s) % n], dk,
                                     (me - s) % n, me, causal, scale) for me in range(n) for s in range(n)}
    res = []
    for me in range(n):
        dq = None
        for s in range(n):
            p = parts[(me, s)]
            if p is not None:
                dq = p[0] if dq is None else dq + p[0]
        acc = None  # key block me: member me + s adds its part at its step s
        for s in range(n):
            p = parts[((me + s) % n, s)]
            if p is not None:
                acc = p[1] if acc is None else acc + p[1]
        res.append((dq.to(qs[me].dtype).contiguous(), acc[..., :dk].to(ks[me].dtype).contiguous(),
                    acc[..., dk:].to(vs[me].dtype).contiguous()))
    return res


def ring_attention_backward_run(grad: Callable, g, q, k, v, out, lse, causal: bool, scale, members: Sequence[int],
                                me: int, timeout: float | None = None):
    """This rank's (dq, dk, dv) of a ring_attention_backward step over the global ranks `members`: at step
    s it holds key block (me - s) mod n, sent on to the next member before its part is computed (the transfer
    behind the compute), and that block's dk|dv accumulator, received from the previous member while the
    part is computed, added to, and sent on; after n steps the accumulator of its own block arrives
    complete. ring_attention_backward_simulate's result."""
    n, dk = len(members), k.shape[-1]
    to, frm = members[(me + 1) % n], members[(me - 1) % n]
    held, dq, acc, acc_reqs, got = torch.cat([k, v], -1).contiguous(), None, None, [], None
    what = f"ring_attention_backward over ranks {tuple(members)}"
    for s in range(n):
        nxt = torch.empty_like(held) if s < n - 1 else None
        reqs = _exchange(held, nxt, to, frm) if nxt is not None else []
        p = _backward_part(grad, (g, q, out, lse), held, dk, (me - s) % n, me, causal, scale)
        for r in acc_reqs:
            wait(r, timeout, f"{what}: accumulator of step {s - 1}")
        acc = got  # the members' sum before this one (None at step 0: the block starts here)
        if p is not None:
            dq = p[0] if dq is None else dq + p[0]
            acc = p[1] if acc is None else acc + p[1]
        if acc is None:  # no member added yet (a causal block above every diagonal so far): zeros travel
            acc = torch.zeros(held.shape, dtype=lse.dtype, device=held.device)
        sent, got = acc.contiguous(), torch.empty(held.shape, dtype=lse.dtype, device=held.device)
        acc_reqs = _exchange(sent, got, to, frm)
        for r in reqs:
            wait(r, timeout, f"{what}: key block of step {s}")
        held = nxt
    for r in acc_reqs:
        wait(r, timeout, f"{what}: the last accumulator")
    return dq.to(q.dtype).contiguous(), got[..., :dk].to(k.dtype).contiguous(), got[..., dk:].to(v.dtype).contiguous()


def ring_attention_backward_kernel(grad: Callable) -> Callable:
    """The local kernel (flag dkv_ring) of a ring_attention_backward step of sdpa_backward: on the mesh axis
    it applies on, run the ring over this rank's group (run_local's signature), under torch.distributed."""
    def kernel(args, operands, outputs, ctx, axes):
        (m,) = axes
        a = args
        return ring_attention_backward_run(grad, a["g"], a["q"], a["k"], a["v"], a["output"], a["lse"],
                                           bool(a.get("is_causal")), a.get("scale"),
                                           *_ring_group("ring_attention_backward", ctx, m))
    kernel.__doc__ = RINGS["ring_attention_backward"].identity
    kernel.__name__ = "sdpa_backward_dkv_ring"
    return kernel


def ring_attention_kernel(block: Callable, with_lse: bool) -> Callable:
    """The local kernel (flag kv_ring) of a ring_attention step of sdpa (with_lse=False) or sdpa_lse: on the
    mesh axis it applies on, run the ring over this rank's group (run_local's signature). Runs under
    torch.distributed only: simulate runs every rank of a ring step at once (lowering/collective_matmul.py).
    """
    def kernel(args, operands, outputs, ctx, axes):
        (m,) = axes
        return ring_attention_run(block, args["q"], args["k"], args["v"], bool(args.get("is_causal")),
                                  args.get("scale"), with_lse, *_ring_group("ring_attention", ctx, m))
    kernel.__doc__ = RINGS["ring_attention"].identity
    kernel.__name__ = f"{'sdpa_lse' if with_lse else 'sdpa'}_kv_ring"
    return kernel


# ---------------------------------------------------------------------------- expert exchanges (uneven all-to-alls)

@dataclass(frozen=True)
class Exchange:
    """Token dispatch or combine of expert parallelism, fused with the grouped matmul beside it (as a ring is
    with its GEMM; rewrites/experts.py offers it, cost.CostModel.exchange_time prices it): rows sorted by
    expert move on one mesh axis between ceil-sized row blocks (S(0)) and the rows of each rank's experts
    (offsets[e_lo - 1]:offsets[e_hi - 1], its expert span) by one all-to-all whose split sizes come from the
    offsets at run time: uneven, any of them 0. The counts live inside the step only, so every tensor of the
    plan keeps a static shape (the dispatch's output is expert rows, Pe: the rank's span in a whole-size
    buffer, zeros elsewhere; the combine's a row block). `flag` is the local kernel name a grouped_mm step
    carries (ops.py); `src`/`dst` say which partition the rows leave and reach.

    >>> [(x.name, x.flag) for x in EXCHANGES.values()]
    [('expert_dispatch', 'ep_dispatch'), ('expert_combine', 'ep_combine'), ('expert_dispatch_wgrad', 'ep_wgrad')]
    """

    name: str
    flag: str
    src: str  # "blocks" (S(0)) or "spans" (the experts' rows)
    dst: str
    identity: str


EXCHANGES = {x.name: x for x in (
    Exchange("expert_dispatch", "ep_dispatch", "blocks", "spans",
             "grouped_mm(x, w_e, offsets) from x split on its rows: rank r sends each expert rank q the rows of its "
             "block that q's experts own, q runs them (counts from the offsets, uneven)"),
    Exchange("expert_combine", "ep_combine", "spans", "blocks",
             "grouped_mm(x, w_e, offsets) split on its rows: rank q runs its experts' rows and sends each row to the "
             "rank whose block holds it (counts from the offsets, uneven)"),
    Exchange("expert_dispatch_wgrad", "ep_wgrad", "blocks", "spans",
             "grouped_mm_wgrad(x, g, offsets)[experts of rank q] from one operand split on its rows and the other as "
             "expert rows: rank r sends q the rows of its block that q's experts own, q multiplies them with its own "
             "rows of the other (counts from the offsets, uneven)"),
)}
EXCHANGE_FLAGS = {x.flag: x for x in EXCHANGES.values()}


def overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    """How many rows the ranges [a0, a1) and [b0, b1) share.

    >>> overlap((0, 3), (2, 9)), overlap((0, 3), (5, 9))
    (1, 0)
    """
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def exchange_simulate(held: Sequence[torch.Tensor], src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]]
                      ) -> list[torch.Tensor]:
    """What each member receives: member i holds the global rows src[i] (in order), member j gets the rows of
    dst[j] that some member holds, in row order (both partitions are consecutive ranges in member order, so
    the pieces concatenate in sender order).

    >>> held = [torch.tensor([0., 1., 2.]), torch.tensor([3., 4.])]  # row blocks of 5 rows
    >>> exchange_simulate(held, [(0, 3), (3, 5)], [(0, 1), (1, 4)])  # expert spans: 1 row, then 3 (row 4 past the end)
    [tensor([0.]), tensor([1., 2., 3.])]
    """
    return [torch.cat([h[max(a, lo) - a: max(a, min(b, hi)) - a] for h, (a, b) in zip(held, src)])
            for lo, hi in dst]


def exchange_run(t: torch.Tensor, src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]],
                 members: Sequence[int], me: int, timeout: float | None = None) -> torch.Tensor:
    """This rank's exchange_simulate result over torch.distributed: one all_to_all_single of the default
    process group with input and output split sizes from the ranges (0 to and from every rank outside
    `members`, which runs its own group's exchange in the same call: every rank runs the step). gloo and NCCL
    both take uneven splits; the sizes are host integers (on a GPU the offsets are read to the host first,
    as torchtitan's and Megatron's token dispatchers read their counts)."""
    world = dist.get_world_size()
    ins, outs = [0] * world, [0] * world
    for j, q in enumerate(members):
        ins[q] = overlap(src[me], dst[j])
        outs[q] = overlap(src[j], dst[me])
    a = src[me][0]
    order = sorted(range(len(members)), key=lambda j: members[j])  # the backend orders pieces by global rank
    send = torch.cat([t[max(a, dst[j][0]) - a: max(a, dst[j][0]) - a + ins[members[j]]] for j in order]).contiguous()
    recv = t.new_empty((sum(outs),) + tuple(t.shape[1:]))
    work = dist.all_to_all_single(recv, send, output_split_sizes=outs, input_split_sizes=ins, async_op=True)
    wait(work, timeout, f"expert exchange over ranks {tuple(members)}")
    pieces, at = {}, 0
    for q in sorted(members):
        pieces[q], at = recv[at: at + outs[q]], at + outs[q]
    return torch.cat([pieces[q] for q in members]).contiguous()


def exchange_bytes(rows: int, width: int, itemsize: int, n: int) -> float:
    """The bytes a rank holds to exchange under balanced routing (as grouped_mm's flops assume it): its block
    of ceil(rows / n) rows, of which (n - 1) / n leave (the all-to-all's factor).

    >>> exchange_bytes(8192, 4096, 2, 4) / 2 ** 20
    16.0
    """
    return -(-rows // n) * width * itemsize


# ---------------------------------------------------------------------------- queries

def get(name: str, where: str = "") -> Kind:
    """The registry entry of collective `name`; PlanError naming the kinds for an unknown one.

    >>> get("all_reduce", "simulate")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    egraph_did.errors.PlanError: simulate: unknown collective kind 'all_reduce'; kinds are allgather, ...
    """
    if name not in KINDS:
        raise PlanError(f"{where + ': ' if where else ''}unknown collective kind {name!r}; kinds are "
                        f"{', '.join(KINDS)}")
    return KINDS[name]


def communicating() -> tuple[str, ...]:
    """The kinds that move data between ranks (what Plan.collectives lists and calibration measures).

    >>> communicating()
    ('allgather', 'reduce_scatter', 'allreduce', 'alltoall')
    """
    return tuple(name for name, k in KINDS.items() if k.communicates)


def is_local(name: str) -> bool:
    """Whether a collective of kind `name` moves nothing between ranks (a slice); an unknown kind is
    taken to communicate, so that nothing is hidden from counts and pictures.

    >>> is_local("slice"), is_local("allgather")
    (True, False)
    """
    return name in KINDS and not KINDS[name].communicates


def connecting(src: Placement, dst: Placement) -> list[Kind]:
    """The kinds the e-graph offers to take a tensor from src to dst on one mesh axis (to_partial is not
    offered: it only honours a pin, see optimize.partial_from_whole).

    >>> [k.name for k in connecting(P, R)], [k.name for k in connecting(R, P)]
    (['allreduce'], [])
    """
    return [k for k in KINDS.values() if k.offered and k.connects(src, dst)]


@dataclass(frozen=True)
class Cancellation:
    """`first` then `second` on one mesh axis is `becomes` (None: the identity, when the pair ends in the
    layout it started from). The extractor never picks such a pair (the direct class is cheaper); plans
    loaded from JSON or written by hand are cleaned with them (Plan.simplified).

    >>> CANCELLATIONS[-1].becomes, CANCELLATIONS[-1].identity.split(":")[0]
    ('allreduce', 'allgather(reduce_scatter(x, a), a) = allreduce(x)')
    """

    first: str
    second: str
    becomes: str | None
    identity: str


CANCELLATIONS: tuple[Cancellation, ...] = (
    Cancellation("allgather", "slice", None, "slice(allgather(x, a), a) = x: S(a) -> R -> S(a)"),
    Cancellation("slice", "allgather", None, "allgather(slice(x, a), a) = x: R -> S(a) -> R"),
    Cancellation("alltoall", "alltoall", None, "alltoall(alltoall(x, a->b), b->a) = x: S(a) -> S(b) -> S(a)"),
    Cancellation("reduce_scatter", "allgather", "allreduce",
                 "allgather(reduce_scatter(x, a), a) = allreduce(x): P -> S(a) -> R"),
)


def cancellation(first: str, second: str) -> Cancellation | None:
    """What `first` then `second` on one mesh axis compose to, if they cancel.

    >>> cancellation("slice", "allgather").becomes is None, cancellation("allgather", "allreduce")
    (True, None)
    """
    return next((c for c in CANCELLATIONS if (c.first, c.second) == (first, second)), None)


__all__ = ["EXCHANGES", "EXCHANGE_FLAGS", "Exchange", "overlap", "exchange_simulate", "exchange_run",
           "exchange_bytes", "RINGS", "RING_FLAGS", "Ring", "gemm", "ring_simulate", "ring_run", "ring_kernel", "attention_merge",
           "ring_attention_simulate", "ring_attention_run", "ring_attention_kernel", "ring_attention_backward_simulate",
           "ring_attention_backward_run", "ring_attention_backward_kernel", "KINDS", "Kind", "Move", "AxisGroup", "register", "get", "communicating", "is_local", "connecting",
           "Cancellation", "CANCELLATIONS", "cancellation", "wait", "to_wire", "from_wire", "padded"]
