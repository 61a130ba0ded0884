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
from .shards import assemble, by_rank_of


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
    mesh = tv.device_mesh()
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
    mesh = tv.device_mesh()
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
    mesh = tv.device_mesh()
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
    mesh = tv.device_mesh()
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
    mesh = tv.device_mesh()
    where = f"unshard_tensor({tv.name})"
    by_rank = by_rank_of(shards, mesh, where, "shard")
    index = {r: _index_tuple(local_indices(tv, r)) if tv.ndim else () for r in mesh.ranks}
    for r in mesh.ranks:
        want = local_shape(tv, r)
        if tuple(by_rank[r].shape) != want:
            raise ShapeError(f"{where}: rank {r}'s shard has shape {tuple(by_rank[r].shape)}, but its loop domain "
                             f"{tv.loop_str()} gives it {want}")
    reduce = {d.index.reduce for d in tv.loop_domain if d.is_device and d.is_reduction}
    return assemble(by_rank, tv.shape, mesh, index, replicated_mesh_axes(tv), reduce, where, tv.name)


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
    mesh = tv.device_mesh()
    out = ["R"] * mesh.ndim
    for d in tv.loop_domain:
        if d.is_device:
            ax = d.parallel_type.mesh_axis(mesh)
            pend = "Pmax" if d.is_reduction and d.index.reduce == "max" else "P"
            out[ax] = pend if d.is_reduction else f"S({next(iter(d.logical_axes))})"
    return tuple(out)


__all__ = ["local_indices", "local_shape", "shard_tensor", "unshard_tensor", "placements",
           "partial_mesh_axes", "replicated_mesh_axes", "ParallelType"]
