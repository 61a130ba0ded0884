"""Which elements each rank holds, computed from the loop domain; shard and unshard exactly.

A rank holds, along each logical axis, the indices whose coordinate on every DID loop axis derived
from that axis equals the rank's coordinate on the bound mesh axis. Splits that do not divide give
torch.chunk semantics (ceil-sized shards, the last smaller or empty). A partial axis makes every rank
hold a summand of the whole tensor: shard_tensor gives the value to the ranks at coordinate 0 of the
partial mesh axes and zeros to the others, so unshard_tensor (a sum) returns it exactly.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from .errors import ShapeError, ShardingError
from .ir import ParallelType, TensorView
from .mesh import DeviceMesh


def _mesh_of(tv: TensorView) -> DeviceMesh:
    return tv.device_mesh()


def local_indices(tv: TensorView, rank: int) -> list[np.ndarray]:
    """Per logical axis, the sorted global indices `rank` holds (the local order is the global order).

    >>> from egraph_did import FusionDefinition, DeviceMesh, ParallelType
    >>> with FusionDefinition() as fd:
    ...     x = fd.define_tensor((5,))
    >>> _ = x.set_device_mesh(DeviceMesh.arange(2)).outer_split(0, 2).axis(0).parallelize(ParallelType.DIDx)
    >>> [a.tolist() for a in local_indices(x, 1)]
    [[3, 4]]
    """
    return tv.local_indices(rank)


def local_shape(tv: TensorView, rank: int) -> tuple[int, ...]:
    """The shape of the shard `rank` holds.

    >>> from egraph_did import FusionDefinition, DeviceMesh, ParallelType
    >>> with FusionDefinition() as fd:
    ...     x = fd.define_tensor((10, 3))
    >>> _ = x.set_device_mesh(DeviceMesh.arange(4)).outer_split(0, 4).axis(0).parallelize(ParallelType.DIDx)
    >>> [local_shape(x, r) for r in range(4)]
    [(3, 3), (3, 3), (3, 3), (1, 3)]
    """
    return tuple(len(i) for i in local_indices(tv, rank))


def _pending(tv: TensorView, reduce: str) -> list[int]:
    mesh = _mesh_of(tv)
    return [d.parallel_type.mesh_axis(mesh) for d in tv.loop_domain
            if d.is_device and d.is_reduction and d.index.reduce == reduce]


def partial_mesh_axes(tv: TensorView) -> list[int]:
    """Mesh axes over which `tv` is a pending sum.

    >>> from egraph_did import FusionDefinition, DeviceMesh, ParallelType
    >>> with FusionDefinition() as fd:
    ...     y = fd.define_tensor((4, 8))
    >>> partial_mesh_axes(y.set_device_mesh(DeviceMesh([[0, 1], [2, 3]])).add_partial(ParallelType.DIDy))
    [0]
    """
    mesh = _mesh_of(tv)
    return [d.parallel_type.mesh_axis(mesh) for d in tv.loop_domain if d.is_device and d.is_reduction]


def replicated_mesh_axes(tv: TensorView) -> list[int]:
    """Mesh axes that neither shard `tv` nor hold a partial of it.

    >>> from egraph_did import FusionDefinition, DeviceMesh, ParallelType
    >>> with FusionDefinition() as fd:
    ...     x = fd.define_tensor((4, 8))
    >>> _ = x.set_device_mesh(DeviceMesh([[0, 1], [2, 3]])).outer_split(1, 2).axis(1).parallelize(ParallelType.DIDx)
    >>> replicated_mesh_axes(x)  # DIDx binds mesh axis 1; axis 0 holds copies
    [0]
    """
    mesh = _mesh_of(tv)
    bound = {d.parallel_type.mesh_axis(mesh) for d in tv.loop_domain if d.is_device}
    return [a for a in range(mesh.ndim) if a not in bound]


def _index_tuple(indices: list[np.ndarray]) -> tuple[torch.Tensor, ...]:
    """Broadcastable index tensors selecting the cartesian product of per-axis indices."""
    n = len(indices)
    return tuple(torch.from_numpy(ix).reshape([-1 if k == a else 1 for k in range(n)])
                 for a, ix in enumerate(indices))


def _check_global(tensor: torch.Tensor, tv: TensorView, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ShapeError(f"{what}: expected a torch.Tensor for {tv.name}, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tv.shape:
        raise ShapeError(f"{what}: {tv.name} has logical shape {tv.shape} but the tensor given is "
                         f"{tuple(tensor.shape)}")


def shard_tensor(tensor: torch.Tensor, tv: TensorView, rank: int) -> torch.Tensor:
    """The local shard `rank` holds of the global `tensor` laid out as `tv`'s loop domain says.

    >>> import torch
    >>> from egraph_did import FusionDefinition, DeviceMesh, ParallelType
    >>> with FusionDefinition() as fd:
    ...     x = fd.define_tensor((2, 4))
    >>> _ = x.set_device_mesh(DeviceMesh.arange(2)).outer_split(1, 2).axis(1).parallelize(ParallelType.DIDx)
    >>> shard_tensor(torch.arange(8.).reshape(2, 4), x, 1)
    tensor([[2., 3.],
            [6., 7.]])
    """
    _check_global(tensor, tv, "shard_tensor")
    mesh = _mesh_of(tv)
    coords = mesh.coords(rank)
    indices = local_indices(tv, rank)
    local = tensor[_index_tuple(indices)] if tv.ndim else tensor.clone()
    if any(coords[a] != 0 for a in _pending(tv, "sum")):
        local = torch.zeros_like(local)  # a pending max needs no zeros: every copy is the value
    return local.contiguous()


def unshard_tensor(shards: Sequence[torch.Tensor] | Mapping[int, torch.Tensor], tv: TensorView) -> torch.Tensor:
    """Assemble the global tensor from every rank's shard (a list in ascending rank order, or a dict
    {rank: shard}). Partial axes are summed; replicated copies must agree.

    >>> import torch
    >>> from egraph_did import FusionDefinition, DeviceMesh, ParallelType
    >>> with FusionDefinition() as fd:
    ...     x = fd.define_tensor((5,))
    >>> _ = x.set_device_mesh(DeviceMesh.arange(2)).outer_split(0, 2).axis(0).parallelize(ParallelType.DIDx)
    >>> unshard_tensor([torch.tensor([0., 1., 2.]), torch.tensor([3., 4.])], x)
    tensor([0., 1., 2., 3., 4.])
    """
    mesh = _mesh_of(tv)
    ranks = sorted(mesh.ranks)
    if isinstance(shards, Mapping):
        missing = [r for r in ranks if r not in shards]
        if missing:
            raise ShardingError(f"unshard_tensor({tv.name}): no shard for rank(s) {missing} of {mesh}")
        by_rank = dict(shards)
    else:
        shards = list(shards)
        if len(shards) != len(ranks):
            raise ShardingError(f"unshard_tensor({tv.name}): got {len(shards)} shards for the {len(ranks)} "
                                f"ranks of {mesh} (pass one per rank, in ascending rank order)")
        by_rank = dict(zip(ranks, shards))
    for r in ranks:
        want = local_shape(tv, r)
        if tuple(by_rank[r].shape) != want:
            raise ShapeError(f"unshard_tensor({tv.name}): rank {r}'s shard has shape {tuple(by_rank[r].shape)}, "
                             f"but its loop domain {tv.loop_str()} gives it {want}")
    replicated = replicated_mesh_axes(tv)
    first = by_rank[ranks[0]]
    pending_max = bool(_pending(tv, "max"))
    if pending_max and _pending(tv, "sum"):
        raise ShardingError(f"unshard_tensor({tv.name}): a pending sum and a pending max on one tensor "
                            f"do not commute; resolve one first")
    out = (torch.full(tv.shape, -torch.inf, dtype=first.dtype, device=first.device) if pending_max
           else torch.zeros(tv.shape, dtype=first.dtype, device=first.device))
    for r in ranks:
        coords = mesh.coords(r)
        if any(coords[a] != 0 for a in replicated):
            # a replica: it must equal the copy held at coordinate 0 of the replicated axes
            twin = mesh.rank_at([0 if a in replicated else c for a, c in enumerate(coords)])
            if not torch.equal(by_rank[r], by_rank[twin]):
                axes = [mesh.axis_names[a] for a in replicated]
                raise ShardingError(f"unshard_tensor({tv.name}): ranks {twin} and {r} hold different data "
                                    f"although {tv.name} is replicated on mesh axes {axes}")
            continue
        if pending_max:
            idx = _index_tuple(local_indices(tv, r)) if tv.ndim else ()
            out[idx] = torch.maximum(out[idx], by_rank[r])
        elif tv.ndim == 0:
            out += by_rank[r]
        else:
            out.index_put_(_index_tuple(local_indices(tv, r)), by_rank[r], accumulate=True)
    return out


def placements(tv: TensorView) -> tuple[str, ...]:
    """Per mesh axis, 'R', 'P' or 'S(a)' for a tensor whose DID splits are simple outer splits.

    Informational (explain tables, DTensor interop); the loop domain stays the source of truth.

    >>> from egraph_did import FusionDefinition, DeviceMesh, ParallelType
    >>> with FusionDefinition() as fd:
    ...     x = fd.define_tensor((4, 8))
    >>> _ = x.set_device_mesh(DeviceMesh([[0, 1], [2, 3]])).outer_split(1, 2).axis(1).parallelize(ParallelType.DIDx)
    >>> placements(x.add_partial(ParallelType.DIDy))
    ('P', 'S(1)')
    """
    mesh = _mesh_of(tv)
    out = ["R"] * mesh.ndim
    for d in tv.loop_domain:
        if d.is_device:
            ax = d.parallel_type.mesh_axis(mesh)
            pend = "Pmax" if d.is_reduction and d.index.reduce == "max" else "P"
            out[ax] = pend if d.is_reduction else f"S({next(iter(d.logical_axes))})"
    return tuple(out)


__all__ = ["local_indices", "local_shape", "shard_tensor", "unshard_tensor", "placements",
           "partial_mesh_axes", "replicated_mesh_axes", "ParallelType"]
