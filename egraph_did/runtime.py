"""run_plan(): one rank's part of a plan, inside an initialized torch.distributed process group.

Binds this rank's inputs (global tensors it shards, local shards it checks, or DTensors), runs the
plan's lowered segments in order (fused kernels, torch compute steps, collectives through the
collective registry's torch.distributed calls) as the rank's prepared program (lowering/program.py:
built once per input signature, then a flat loop; on a GPU replayed as a CUDA graph, lowering/graphs.py),
and hands back its outputs as global tensors, local shards or DTensors. Every rank of the plan's mesh runs the same steps, so every rank makes the same collective
calls in the same order; what each rank is doing is kept in a progress record (`last_progress`,
`add_progress_hook`), which launch() reads to say where a stalled run stopped.

Semantics are simulate()'s: the same local kernels, the same cuts; collectives are real.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from .errors import EgraphDidError, PlanError, ShapeError, ShardingError
from .layout import Layout
from . import collectives
from .lowering.communication import (axis_group, check_world, world_key, ensure_groups, gather_to_all,
                                     run_collective, check_shard)
from .lowering.graphs import run_graphed
from .lowering.program import SegmentFailed, program_for, program_inputs
from .lowering.segment import eager_segments
from .ir import ParallelType
from .mesh import DeviceMesh
from .plan import Plan, register_runner
from .shards import Operand, RankContext, dtensor_chunks_agree, shard, unshard

INPUT_KINDS = ("global", "local", "dtensor")
OUTPUT_KINDS = ("global", "local", "dtensor")


class StepError(PlanError):
    """A step of a plan failed on one rank; names the rank, the step and what it was doing."""

    def __init__(self, message: str, rank: int, index: int, what: str):
        super().__init__(message)
        self.rank, self.index, self.what = rank, index, what


# ---------------------------------------------------------------------------- progress

class Progress(NamedTuple):
    """Where one rank is: step `index` of `total` (-1 while binding inputs, `total` while delivering
    outputs), what that step does, and since when (time.time()). A NamedTuple: one is made before every
    collective of an uncaptured run (0.9 us on the CI-like machine; a frozen dataclass took 1.9).

    >>> str(Progress(0, 2, 3, 20, "comm allreduce[x] y:P -> y:R", "running", 0.0))
    'in step 3/20 (run 2): comm allreduce[x] y:P -> y:R'
    """

    rank: int
    run: int  # how many run_plan calls this process has started
    index: int
    total: int
    what: str
    state: str  # "running" | "finished" | "failed"
    since: float

    def __str__(self) -> str:
        if self.state == "finished":
            return f"finished run {self.run} ({self.total} steps)"
        where = (f"{self.what} (run {self.run})" if not 0 <= self.index < self.total
                 else f"step {self.index}/{self.total} (run {self.run}): {self.what}")
        return f"{'failed in' if self.state == 'failed' else 'in'} {where}"


_last: Progress | None = None
_hooks: list[Callable[[Progress], None]] = []
_runs = 0


def last_progress() -> Progress | None:
    """The latest progress record of this process (None before any run_plan)."""
    return _last


def add_progress_hook(fn: Callable[[Progress], None]) -> Callable[[], None]:
    """Call fn(progress) at every record (each step's start, the end of a run, a failure); returns a
    function that removes the hook. launch() uses it to let the parent see every rank's place."""
    _hooks.append(fn)
    return lambda: _hooks.remove(fn) if fn in _hooks else None


def _record(rank: int, index: int, total: int, what: str, state: str = "running") -> None:
    global _last
    _last = Progress(rank, _runs, index, total, what, state, time.time())
    for fn in list(_hooks):
        fn(_last)


# ---------------------------------------------------------------------------- DTensor interop

def _torch_placements(layout: Layout) -> tuple:
    from torch.distributed.tensor import Partial, Replicate, Shard
    return tuple(Shard(p.axis) if p.is_shard else Partial(p.reduce) if p.is_partial else Replicate()
                 for p in layout)


def _grid(mesh: DeviceMesh) -> list:
    return torch.tensor(mesh.ranks).reshape(mesh.shape).tolist()


_TORCH_MESHES: dict[tuple, Any] = {}


def torch_device_mesh(mesh: DeviceMesh, device_type: str):
    """The torch.distributed DeviceMesh of `mesh` (created once per process group; collective)."""
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    key = (mesh, device_type, world_key())
    if key not in _TORCH_MESHES:
        grid = torch.tensor(mesh.ranks).reshape(mesh.shape)
        _TORCH_MESHES[key] = TorchMesh(device_type, grid, mesh_dim_names=mesh.axis_names)
    return _TORCH_MESHES[key]


def _is_dtensor(x) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, DTensor)


def _local_of_dtensor(plan: Plan, name: str, value: str, dt, rank: int) -> torch.Tensor:
    """This rank's shard of a DTensor input: its local tensor where its mesh, placements and shard order
    give every rank the elements the plan's value holds, in the same order (Shard, _StridedShard and
    non-default shard orders read as DTensor chunks them; a viewed input's shard reshaped to its view);
    otherwise the whole tensor (full_tensor, collective on every rank) sharded as planned."""
    val = plan.values[value]
    if tuple(dt.shape) != plan.input_shape(name):
        raise ShapeError(f"run_plan: input {name!r} is a DTensor of global shape {tuple(dt.shape)}, the plan "
                         f"expects {plan.input_shape(name)}")
    if dt.device_mesh.ndim == plan.mesh.ndim and dt.device_mesh.mesh.tolist() == _grid(plan.mesh) and \
            _dtensor_agrees(plan, name, value, dtensor_placements(dt)):
        placements = dtensor_placements(dt)
        scale = avg_scale(placements, plan.mesh)  # Partial('avg'): the summand is the local tensor over n
        local = dt.to_local() if scale == 1.0 else dt.to_local() * scale
        want = plan.input_shape(name, rank, value)  # the shard of this value's layout (an input may load in several)
        if tuple(local.shape) != want:  # pragma: no cover - DTensor broke its own chunking
            raise ShapeError(f"run_plan: input {name!r}: rank {rank}'s DTensor shard is {tuple(local.shape)}, "
                             f"its placements give {want}")
        return plan.bind_view(name, local, rank, value).contiguous()
    return shard(plan.bind_view(name, dt.full_tensor()), val.layout, plan.mesh, rank, val.tensor)


def dtensor_placements(dt) -> tuple:
    """A DTensor's placements with its shard order written into them: a tensor axis split over several mesh
    axes in a non-default order (DTensorSpec.shard_order) as the _StridedShard placements DTensor itself
    converts it to, so the placements alone say which elements each rank holds."""
    placements, spec = tuple(dt.placements), getattr(dt, "_spec", None)
    order = getattr(spec, "shard_order", None)
    if not order or any(_is_strided(p) for p in placements):
        return placements
    cls = type(spec)
    if cls.is_default_device_order(order):
        return placements
    return tuple(cls._convert_shard_order_to_StridedShard(order, placements, dt.device_mesh))


def _is_strided(p) -> bool:
    return type(p).__name__ == "_StridedShard"


def _dtensor_indices(shape, placements, mesh: DeviceMesh, rank: int) -> list[list[int]]:
    """Per tensor axis, the global indices DTensor gives `rank` under `placements`, in its local order:
    DTensor's own chunking (Shard and _StridedShard._split_tensor), left to right over the mesh axes."""
    coords = mesh.coords(rank)
    idx = [torch.arange(e) for e in shape]
    for m, p in enumerate(placements):
        if not (p.is_replicate() or p.is_partial()):  # Shard or _StridedShard (whose is_shard() is False)
            d = p.dim % len(shape)
            along0 = type(p)(0, split_factor=p.split_factor) if _is_strided(p) else type(p)(0)  # idx[d] is 1-D
            chunks = along0._split_tensor(idx[d], mesh.shape[m], with_padding=False)[0]
            idx[d] = chunks[coords[m]] if coords[m] < len(chunks) else idx[d][:0]
    return [i.tolist() for i in idx]


def _plan_indices(plan: Plan, name: str, value: str, rank: int) -> list[list[int]]:
    """Per axis of the tensor the user binds or receives as `name`, the global indices `rank` holds of
    `value`, in local order (a viewed one's view axes combined back into the tensor's own)."""
    val = plan.values[value]
    ctx = RankContext(plan.mesh, rank)
    ranges = [np.arange(*ctx.shard_range(e, val.layout, a)) for a, e in enumerate(val.shape)]
    if name not in plan.views:
        return [r.tolist() for r in ranges]
    view, out, k = plan.views[name], [], 0
    for g in view.groups:
        flat = np.zeros(1, dtype=np.int64)
        for j in range(k, k + g):
            flat = (flat[:, None] * view.view_shape[j] + ranges[j][None, :]).ravel()
        out.append(flat.tolist())
        k += g
    return out


def _dtensor_agrees(plan: Plan, name: str, value: str, placements) -> bool:
    """Whether DTensor `placements` hold what the plan's `value` holds on every rank: the same pending
    reductions on the same mesh axes, the same elements in the same order (decided alike on every rank:
    the fallback is collective). Cached on the plan: binding compares every rank's indices, and a
    parallelized module binds its DTensors on every call."""
    cache = plan.__dict__.setdefault("_dtensor_agrees", {})
    key = (name, value, tuple(placements))
    if key not in cache:
        cache[key] = _agrees(plan, name, value, placements)
    return cache[key]


def partial_reduce(p) -> str | None:
    """The pending reduction a DTensor placement stands for ('sum' or 'max'; None: not a partial).
    Partial('avg') is a pending sum with a scale: the value is sum_r (x_r / n), n the mesh axis's size, so
    each rank's summand is its local tensor over n (avg_scale).

    >>> from torch.distributed.tensor import Partial, Replicate
    >>> partial_reduce(Partial("avg")), partial_reduce(Partial()), partial_reduce(Replicate())
    ('sum', 'sum', None)
    """
    if not p.is_partial():
        return None
    op = getattr(p, "reduce_op", "sum")
    return "sum" if op == "avg" else op


def avg_scale(placements, mesh: DeviceMesh) -> float:
    """What a rank's local tensor is multiplied by to be its summand of the pending sum: 1 / n for each
    mesh axis of size n a Partial('avg') pends over, 1 where none does.

    >>> from torch.distributed.tensor import Partial, Replicate
    >>> avg_scale((Partial("avg"), Replicate()), DeviceMesh([[0, 1, 2], [3, 4, 5]]))
    0.5
    """
    out = 1.0
    for m, p in enumerate(placements):
        if p.is_partial() and getattr(p, "reduce_op", "sum") == "avg":
            out /= mesh.shape[m]
    return out


def _agrees(plan: Plan, name: str, value: str, placements) -> bool:
    layout = plan.values[value].layout
    if len(placements) != len(layout):
        return False
    for p, q in zip(placements, layout):
        if q.is_partial != p.is_partial() or (q.is_partial and partial_reduce(p) != q.reduce):
            return False  # elements alike, values not: a summand is not a shard
    shape = plan.views[name].shape if name in plan.views else plan.values[value].shape
    return all(_dtensor_indices(shape, placements, plan.mesh, r) == _plan_indices(plan, name, value, r)
               for r in plan.mesh.ranks)


def pin_placements(tv, placements, mesh: DeviceMesh):
    """Pin `tv` to the loop domain DTensor `placements` express on `mesh` (Shard, _StridedShard, Partial,
    Replicate; a DTensor's own through dtensor_placements, its shard order included): per tensor axis, the
    digits DTensor's left-to-right chunking cuts, outer first, each mesh axis's bound to it. Plain Shards in
    the default order are the canonical layout, uneven allowed; where they nest unevenly and DTensor's chunks
    are no loop domain's (9 rows on 2x2: DTensor chunks 5 | 4 into 3, 2 | 2, 2, a loop domain cuts the ceil
    extent 5 of each half: 3, 2 | 3, 1), tv is pinned to that loop domain held in DTensor's chunks
    (tv.chunks = "dtensor": local_shape and shard_tensor give DTensor's), which the plan rechunks at its
    boundary (plan.dtensor_chunks). A _StridedShard nesting must divide the extents (ShardingError naming the
    tensor otherwise). Returns tv.

    >>> import torch, egraph_did as ed
    >>> from torch.distributed.tensor import Shard
    >>> from torch.distributed.tensor.placement_types import _StridedShard
    >>> mesh = ed.DeviceMesh([[0, 1], [2, 3]])
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((8, 6), name="x")
    >>> pin_placements(x, (_StridedShard(0, split_factor=2), Shard(0)), mesh).loop_str()  # inner-first
    '[DIDx{2}, DIDy{2}, 8/2/2, 6]'
    >>> pin_placements(x, (_StridedShard(0, split_factor=2),), ed.DeviceMesh.arange(4)).loop_str()  # gate/up
    '[2, DIDx{4}, 8/2/4, 6]'
    >>> with ed.FusionDefinition() as fd:
    ...     z = fd.define_tensor((9, 6), name="z")
    >>> z = pin_placements(z, (Shard(0), Shard(0)), mesh)  # DTensor's chunk of a chunk
    >>> z.loop_str(), z.chunks, [z.local_shape(r)[0] for r in mesh.ranks]
    ('[DIDy{2}, DIDx{2}, 9/2/2, 6]', 'dtensor', [3, 2, 2, 2])
    """
    if len(placements) != mesh.ndim:
        raise ShardingError(f"{tv.name}: {len(placements)} placements for the {mesh.ndim}-D {mesh}; give one per "
                            f"mesh axis")
    digits = {a: [[e, None]] for a, e in enumerate(tv.shape)}  # per axis: [extent, mesh axis or None], outer first
    for m, p in enumerate(placements):
        if p.is_replicate() or p.is_partial():
            continue
        a, n, sf = p.dim % tv.ndim, mesh.shape[m], int(getattr(p, "split_factor", 1))
        row, i, acc = digits[a], 0, 1
        while acc < sf:  # the free digits DTensor keeps whole before this mesh axis's chunk (sf of them)
            while i < len(row) and row[i][1] is not None:
                i += 1
            if i == len(row):
                break
            e = row[i][0]
            if acc * e > sf:
                if sf % acc or e % (sf // acc):
                    break
                row[i:i + 1] = [[sf // acc, None], [e // (sf // acc), None]]
                e = sf // acc
            acc, i = acc * e, i + 1
        while i < len(row) and row[i][1] is not None:
            i += 1
        if acc != sf or i == len(row) or (sf > 1 and row[i][0] % n):
            raise ShardingError(f"{tv.name}: placement {p} on mesh axis {m} (size {n}) does not divide axis {a} "
                                f"(extent {tv.shape[a]}) as its nesting needs; give an extent the nested splits "
                                f"divide, or plain Shard placements")
        e = row[i][0]
        row[i:i + 1] = [[n, m]] + ([[-(-e // n), None]] if -(-e // n) > 1 or i + 1 == len(row) else [])
    tv.reset_loop_domain().set_device_mesh(mesh)
    for a in reversed(range(tv.ndim)):
        pos = a
        row = digits[a]
        for k, (e, m) in enumerate(row):
            if k == len(row) - 1 and m is None:
                break
            tv.outer_split(pos, e)
            if m is not None:
                tv.parallelize(pos, ParallelType.for_mesh_axis(mesh, m))
            pos += 1
    for m, p in enumerate(placements):
        if p.is_partial():
            tv.add_partial(ParallelType.for_mesh_axis(mesh, m), partial_reduce(p))  # avg: a sum (avg_scale)
    def differs():
        return next((r for r in mesh.ranks if [i.tolist() for i in tv.local_indices(r)] !=
                     _dtensor_indices(tv.shape, placements, mesh, r)), None)
    if differs() is not None and not any(_is_strided(p) for p in placements):
        # plain Shards nested unevenly (9 rows on 2x2: DTensor's 3, 2, 2, 2, the loop domain's 3, 2, 3, 1): no
        # loop domain cuts DTensor's chunks, so the pin is the loop domain of the same placements held in
        # DTensor's chunks; the plan holds the loop domain's and rechunks at its boundary (plan.dtensor_chunks)
        tv.chunks = "dtensor"
    r = differs()
    if r is not None:  # exactly DTensor's chunks, or no pin
        tv.reset_loop_domain()
        raise ShardingError(f"{tv.name}: DTensor's chunks of {tuple(tv.shape)} under {tuple(placements)} differ "
                            f"from every loop domain's on rank {r} (an uneven split nested in a _StridedShard "
                            f"nesting); give extents the splits divide, or pin the loop domain itself")
    return tv


def _view_placements(plan: Plan, name: str, value: str) -> tuple:
    """The DTensor placements of an output delivered through a view (plan.views): per mesh axis that splits
    a view axis k of the tensor's axis a, Shard(a) where no digit of a that is still whole when DTensor
    reaches that mesh axis (left to right) precedes k, else _StridedShard(a, split_factor = their extent)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    view, layout = plan.views[name], plan.values[value].layout
    axis_of = [a for a, g in enumerate(view.groups) for _ in range(g)]
    out = []
    for m, p in enumerate(layout):
        if not p.is_shard:
            out.append(Partial(p.reduce) if p.is_partial else Replicate())
            continue
        k, a = p.axis, axis_of[p.axis]
        taken = {q.axis for q in layout.placements[:m] if q.is_shard}
        sf = math.prod(view.view_shape[j] for j in range(k) if axis_of[j] == a and j not in taken)
        out.append(Shard(a) if sf == 1 else _StridedShard(a, split_factor=sf))
    return tuple(out)


def _to_dtensor(plan: Plan, name: str, value: str, local: torch.Tensor, rank: int, timeout: float | None):
    from torch.distributed.tensor import DTensor
    val = plan.values[value]
    layout = val.layout
    tmesh = torch_device_mesh(plan.mesh, local.device.type)
    viewed = name in plan.views
    placements = _view_placements(plan, name, value) if viewed else _torch_placements(layout)
    shape = plan.views[name].shape if viewed else val.shape
    if viewed and not _dtensor_agrees(plan, name, value, placements):
        if layout.has_partial:
            raise ShardingError(f"run_plan: output {name!r} is a pending sum held through the view "
                                f"{plan.views[name]}, whose uneven chunks DTensor's placements {placements} do not "
                                f"express: take outputs='global' or 'local'")
        whole = plan.deliver_view(name, _global_of(plan, value, local, timeout))
        local = whole[np.ix_(*_dtensor_indices(shape, placements, plan.mesh, rank))].contiguous()
    elif viewed:
        local = plan.deliver_view(name, local, rank)
    elif not dtensor_chunks_agree(val.shape, layout, plan.mesh):
        # DTensor cannot express these nested uneven chunks: deliver its own chunks of the same placements
        whole = _global_of(plan, value, local, timeout)
        local = shard(whole, layout, plan.mesh, rank, val.tensor, chunks="dtensor")
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, tmesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def _rechunk(plan: Plan, value: str, local: torch.Tensor, rank: int, timeout: float | None, to: str) -> torch.Tensor:
    """This rank's shard of `value` cut in the other chunking of its layout: to="loop" from DTensor's chunks
    (a local input pinned so, plan.dtensor_chunks), to="dtensor" from the loop domain's (such an output
    delivered local). Every rank's piece is gathered and the whole cut again: a step at the plan's boundary,
    outside its predicted cost (collective: every rank takes it for the same tensor)."""
    val = plan.values[value]
    held = "dtensor" if to == "loop" else "loop"
    shapes = [RankContext(plan.mesh, r).local_shape(Operand(val.shape, val.layout), held)
              for r in sorted(plan.mesh.ranks)]
    whole = unshard(gather_to_all(local, shapes, timeout), val.layout, plan.mesh, val.shape, val.tensor, held)
    return shard(whole, val.layout, plan.mesh, rank, val.tensor, chunks=to)


def _global_of(plan: Plan, value: str, local: torch.Tensor, timeout: float | None) -> torch.Tensor:
    """The whole tensor of a value on every rank: every rank's shard gathered, partials summed."""
    if plan.values[value].layout.is_replicated:
        return local
    pieces = gather_to_all(local, [plan.local_shape(value, r) for r in sorted(plan.mesh.ranks)], timeout)
    val = plan.values[value]
    return unshard(pieces, val.layout, plan.mesh, val.shape, val.tensor)


# ---------------------------------------------------------------------------- run

def _device() -> torch.device | None:
    """Where tensors must live for the backend: NCCL needs this rank's GPU; gloo takes them as given."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _bind_inputs(plan: Plan, inputs: Mapping[str, Any], kind: str, rank: int, device, timeout) -> dict:
    env: dict[str, torch.Tensor] = {}
    for name, vals in plan.inputs.items():
        given = inputs[name]
        if _is_dtensor(given):
            for v in vals:
                env[v] = _local_of_dtensor(plan, name, v, given, rank)
            continue
        if kind == "dtensor":
            raise ShapeError(f"run_plan: inputs_kind='dtensor' but input {name!r} is a "
                             f"{type(given).__name__}; pass a torch DTensor (or inputs_kind='global'/'local')")
        if not isinstance(given, torch.Tensor):
            raise ShapeError(f"run_plan: input {name!r}: expected a torch.Tensor, got {type(given).__name__}")
        plan.check_input_dtype(name, given, f"run_plan on rank {rank}")
        if kind == "global":
            for v in vals:
                val = plan.values[v]
                if tuple(given.shape) != plan.input_shape(name):
                    raise ShapeError(f"run_plan: input {name!r} has shape {tuple(given.shape)}, the plan expects "
                                     f"the global shape {plan.input_shape(name)} (pass inputs_kind='local' for shards)")
                piece = shard(plan.bind_view(name, given), val.layout, plan.mesh, rank, name)  # only the piece moves
                env[v] = piece if device is None else piece.to(device)
            continue
        if device is not None:
            given = given.to(device)
        # local: the shard of the input's first layout; any other layout it is loaded in is cut from the
        # whole tensor (gathered: every rank takes this branch, so the gather matches)
        first = vals[0]
        want = plan.input_shape(name, rank)
        if tuple(given.shape) != want:
            loop = plan.views[name].loop if name in plan.views else plan.value_view(first).loop_str()
            raise ShapeError(f"run_plan: input {name!r} on rank {rank}: the local shard has shape "
                             f"{tuple(given.shape)}, but its loop domain {loop} "
                             f"gives rank {rank} the shape {want} (of global {plan.input_shape(name)}); pass "
                             f"that shard (ed.shard_tensor) or the global tensor with inputs_kind='global'")
        if name in plan.dtensor_chunks:  # DTensor's chunk, as pinned: the loop domain's is the plan's
            given = _rechunk(plan, first, given, rank, timeout, to="loop")
        env[first] = plan.bind_view(name, given, rank).contiguous()  # a viewed input: its view's shard
        if len(vals) > 1:
            whole = _global_of(plan, first, env[first], timeout)
            for v in vals[1:]:
                env[v] = shard(whole, plan.values[v].layout, plan.mesh, rank, name)
    return env


def _bind_collective(plan: Plan, rank: int, timeout: float | None, overlap: bool = True):
    """c -> (lean call, checked call, start, checked start) of one tensor: the registry entry, the move and
    the process group found once (run_collective finds them, and checks the shard's shape, on every call).
    start(t) issues the collective and returns its finish (the program runs independent compute between:
    lowering/program.py's _overlap); with overlap=False, or a step timeout (whose stall report names the
    collective it waits at), there is no start."""
    def bind(c):
        entry = collectives.get(c.kind, f"run: {c.kind}[{c.mesh_axis_name}] {c.tensor}")
        move = plan.move(c)
        group, run, start = axis_group(plan.mesh, c.mesh_axis, rank), entry.run, entry.start
        lean, checked = (lambda t: run(move, t, group, timeout)), (lambda t: run_collective(plan, c, t, rank, timeout=timeout))
        if not overlap or timeout is not None:
            return lean, checked, None, None

        def checked_start(t):
            check_shard(plan, c, t, rank)
            return start(move, t, group, timeout)
        return lean, checked, (lambda t: start(move, t, group, timeout)), checked_start
    return bind


def run_plan(plan: Plan, inputs: Mapping[str, Any], *, inputs_kind: str = "global", outputs_kind: str = "global",
             rank: int | None = None, step_timeout: float | None = None, lowered: bool = True,
             cuda_graph: bool = True, check_indices: bool = True) -> dict[str, Any]:
    """Run this rank's part of `plan`; every rank of plan.mesh calls it, with the default process group
    initialized over exactly the mesh's ranks (launch() sets that up).

    inputs: {name: tensor}. inputs_kind "global": whole tensors, sharded here as the plan lays each
    input out; "local": this rank's shard (ed.shard_tensor of the global tensor), shape-checked. A torch
    DTensor is taken as given either way (its local tensor when its placements are the plan's, else
    resharded from full_tensor()).
    outputs_kind "global": whole tensors on every rank (shards gathered, partial sums added); "local":
    this rank's shards; "dtensor": torch DTensors (Shard/Replicate, Partial for a pending sum or max).
    rank: this process's rank in the default process group (the default; mesh ranks are those ranks).
    step_timeout: seconds any one collective may wait for its group (None: the process group's timeout).
    lowered: run the lowered program (fused segments as Triton kernels; under TRITON_INTERPRET on a CPU);
    False runs every compute step through torch eager.
    cuda_graph: on a GPU, capture the rank's program once per input signature and replay it (one host
    call a run; lowering/graphs.py says which inputs are copied in); where it cannot be captured (a
    step_timeout, host-side index checks, a capture error) it runs without, and a warning says why once.
    check_indices: check embedding/gather ids against their table on every run (a device-to-host read
    per indexing step); False skips the checks, for ids known to be in range.
    Returns {output name: tensor}. A failing step raises StepError naming the rank and the step; a
    progress record is kept before each collective (compute steps run without records).

    Example (one process per rank; `work` must be importable by the spawned processes)::

        def work(rank, plan_json, X):
            plan = ed.Plan.from_json(plan_json)
            return run_plan(plan, {"x": X}, outputs_kind="global")["y"]

        ys = launch(work, nprocs=4, args=(plan.to_json(), X))  # every rank holds the whole y
    """
    global _runs
    if inputs_kind not in INPUT_KINDS:
        raise PlanError(f"run_plan: inputs_kind must be one of {INPUT_KINDS}, got {inputs_kind!r}")
    if outputs_kind not in OUTPUT_KINDS:
        raise PlanError(f"run_plan: outputs_kind must be one of {OUTPUT_KINDS}, got {outputs_kind!r}")
    if not isinstance(lowered, bool):
        raise PlanError(f"run_plan: lowered must be True (Triton kernels) or False (torch eager), got {lowered!r}")
    if not isinstance(cuda_graph, bool) or not isinstance(check_indices, bool):
        raise PlanError(f"run_plan: cuda_graph and check_indices must be True or False, got {cuda_graph!r} and "
                        f"{check_indices!r}")
    if step_timeout is not None and (isinstance(step_timeout, bool) or not isinstance(step_timeout, (int, float))
                                     or not step_timeout > 0):
        raise PlanError(f"run_plan: step_timeout must be a positive number of seconds, or None for the process "
                        f"group's timeout; got {step_timeout!r}")
    check_world(plan.mesh)
    me = dist.get_rank()
    if rank is None:
        rank = me
    elif rank != me:
        raise PlanError(f"run_plan: rank={rank} was passed, but this process is rank {me} of the process group "
                        f"(mesh ranks are process-group ranks; leave rank=None)")
    plan.check_inputs(inputs, f"run_plan on rank {rank}", dtensors=True)  # before any collective
    _runs += 1
    total = len(plan.steps)
    device = _device()

    def phase(index: int, what: str, fn):
        _record(rank, index, total, what)
        try:
            return fn()
        except Exception as e:
            _record(rank, index, total, what, "failed")
            if index < 0 and isinstance(e, EgraphDidError):
                raise  # a bad input: its message already names the input and the rank
            where = ("binding inputs" if index < 0 else "delivering outputs" if index >= total
                     else f"segment {index} of {total}")
            raise StepError(f"rank {rank}, {where} ({what}): {type(e).__name__}: {e}", rank, index, what) from e

    phase(-1, "creating process groups", lambda: ensure_groups(plan.mesh, rank))
    env = phase(-1, f"binding inputs ({inputs_kind})",
                lambda: _bind_inputs(plan, inputs, inputs_kind, rank, device, step_timeout))
    ins = [env[v] for v in program_inputs(plan)]
    prog = phase(-1, "preparing the program", lambda: program_for(
        plan, rank, ins, None, key=("process group", world_key(), step_timeout), check_indices=check_indices,
        segments=None if lowered else eager_segments(plan), bind_collective=_bind_collective(plan, rank, step_timeout)))
    del env  # the program drops each value after its last reader: hold no other reference
    total = len(prog.segments)

    def before_comm(i: int) -> None:  # a stalled collective is where a run hangs: name it
        _record(rank, i, total, prog.described[i])

    try:
        if cuda_graph:
            if device is not None:  # a replay runs every segment at once: no record per collective
                _record(rank, -1, total, f"running {total} segments (CUDA graph where captured)")
            why = None if step_timeout is None else "a step_timeout bounds each collective's wait on the host"
            outs = run_graphed(prog, ins, not_capturable=why, before_comm=before_comm)
        else:
            outs = prog.run(ins, before_comm)
    except SegmentFailed as f:
        e = f.error
        _record(rank, f.index, total, f.what, "failed")
        raise StepError(f"rank {rank}, segment {f.index} of {total} ({f.what}): {type(e).__name__}: {e}",
                        rank, f.index, f.what) from e
    del ins
    env = dict(zip(prog.outputs, outs))

    def deliver():
        out = {}
        for name, v in plan.outputs.items():
            if outputs_kind == "local" and name in plan.dtensor_chunks:  # pinned in DTensor's chunks
                out[name] = _rechunk(plan, v, env[v], rank, step_timeout, to="dtensor")
            elif outputs_kind == "local":
                out[name] = plan.deliver_view(name, env[v], rank)
            elif outputs_kind == "global":
                out[name] = plan.deliver_view(name, _global_of(plan, v, env[v], step_timeout))
            else:
                out[name] = _to_dtensor(plan, name, v, env[v], rank, step_timeout)
        return out

    out = phase(total, f"delivering outputs ({outputs_kind})", deliver)
    _record(rank, total, total, "done", "finished")
    return out


register_runner(run_plan)  # plan.run() runs through this; `import egraph_did` imports this module

__all__ = ["run_plan", "Progress", "StepError", "last_progress",
           "add_progress_hook", "torch_device_mesh", "dtensor_placements", "pin_placements"]
