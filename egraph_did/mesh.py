"""DeviceMesh: an N-D grid of ranks with named axes (1-, 2- and 3-D).

As in nvFuser, DID parallel types bind mesh axes from the inside out: DIDx is the innermost (last)
mesh axis, DIDy the next, DIDz the outermost of a 3-D mesh.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from .errors import MeshError

DEFAULT_AXIS_NAMES = {1: ("x",), 2: ("y", "x"), 3: ("z", "y", "x")}


def _rank(r) -> int:
    """An int rank; a float, bool or string is an error, never silently truncated."""
    if isinstance(r, bool) or not isinstance(r, int):
        if hasattr(r, "__index__") and not isinstance(r, bool):  # numpy integers
            return int(r.__index__())
        raise MeshError(f"DeviceMesh: ranks are ints, got {r!r} ({type(r).__name__}); pass a grid of ints such "
                        f"as [[0, 1], [2, 3]] or torch.arange(4).reshape(2, 2)")
    return r


def _flatten(devices) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(flat ranks, shape) of a torch tensor, numpy array or nested sequence of ints."""
    if hasattr(devices, "tolist") and hasattr(devices, "shape"):
        shape = tuple(int(s) for s in devices.shape)
        flat = devices.reshape(-1).tolist() if len(shape) else [devices.tolist()]
        return tuple(_rank(r) for r in flat), shape
    if isinstance(devices, int):
        raise MeshError(f"DeviceMesh needs a sequence or tensor of ranks, got the int {devices}; "
                        f"use DeviceMesh.arange({devices}) for ranks 0..{devices - 1}")
    if not isinstance(devices, (list, tuple)):
        raise MeshError(f"DeviceMesh needs a (nested) list or tensor of int ranks, got the "
                        f"{type(devices).__name__} {devices!r:.40}; e.g. DeviceMesh([0, 1, 2, 3]) or DeviceMesh.arange(4)")
    shape: list[int] = []
    level: Sequence = devices
    while isinstance(level, (list, tuple)):
        shape.append(len(level))
        if not level:
            break
        level = level[0]
    flat: list[int] = []

    def walk(node, depth):
        if depth == len(shape):
            if isinstance(node, (list, tuple)):
                raise MeshError(f"DeviceMesh: ragged nesting, expected a grid of shape {tuple(shape)}")
            flat.append(_rank(node))
            return
        if not isinstance(node, (list, tuple)) or len(node) != shape[depth]:
            raise MeshError(f"DeviceMesh: ragged nesting, expected a grid of shape {tuple(shape)}")
        for child in node:
            walk(child, depth + 1)

    walk(devices, 0)
    return tuple(flat), tuple(shape)


@dataclass(frozen=True)
class DeviceMesh:
    """A grid of ranks. Immutable; equal meshes compare equal.

    >>> import torch
    >>> mesh = DeviceMesh(torch.arange(8).reshape(2, 4), axis_names=("dp", "tp"))
    >>> mesh.shape, mesh.size, mesh.ranks_along("tp", rank=5)
    ((2, 4), 8, (4, 5, 6, 7))
    """

    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]

    def __init__(self, devices, axis_names: Sequence[str] | None = None):
        ranks, shape = _flatten(devices)
        if len(shape) == 0:
            raise MeshError("DeviceMesh: a 0-D mesh has no axes; pass a 1-D list such as [0]")
        if len(shape) > 3:
            raise MeshError(f"DeviceMesh: {len(shape)}-D meshes are not supported (DIDx/DIDy/DIDz bind at most 3 axes)")
        if math.prod(shape) == 0:
            raise MeshError(f"DeviceMesh: empty mesh of shape {shape}; a mesh needs at least one rank")
        if any(r < 0 for r in ranks):
            raise MeshError(f"DeviceMesh: negative rank {min(ranks)} in {list(ranks)}")
        if len(set(ranks)) != len(ranks):
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            raise MeshError(f"DeviceMesh: rank(s) {dup} appear more than once; every rank holds one place")
        if isinstance(axis_names, str):
            raise MeshError(f"DeviceMesh: axis_names must be a sequence of names, one per mesh axis, got the "
                            f"string {axis_names!r}; write axis_names=({axis_names!r},)")
        names = tuple(axis_names) if axis_names is not None else DEFAULT_AXIS_NAMES[len(shape)]
        bad = [n for n in names if not isinstance(n, str) or not n]
        if bad:
            raise MeshError(f"DeviceMesh: axis names must be non-empty strings, got {bad} in {names}")
        if len(names) != len(shape):
            raise MeshError(f"DeviceMesh: {len(names)} axis names {names} for a {len(shape)}-D mesh of shape {shape}")
        if len(set(names)) != len(names):
            raise MeshError(f"DeviceMesh: duplicate axis names {names}")
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)

    @classmethod
    def arange(cls, n: int, axis_name: str = "x") -> "DeviceMesh":
        """A 1-D mesh of ranks 0..n-1.

        >>> DeviceMesh.arange(4).ranks
        (0, 1, 2, 3)
        """
        if not isinstance(n, int) or n <= 0:
            raise MeshError(f"DeviceMesh.arange: need a positive number of ranks, got {n!r}")
        return cls(list(range(n)), axis_names=(axis_name,))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of ranks in the mesh."""
        return len(self.ranks)

    def axis_index(self, axis: int | str) -> int:
        """Index of a mesh axis given by position (negative allowed) or name."""
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise MeshError(f"mesh axis {axis!r} does not exist; axes are {self.axis_names}")
            return self.axis_names.index(axis)
        if not -self.ndim <= axis < self.ndim:
            raise MeshError(f"mesh axis {axis} out of range for a {self.ndim}-D mesh of shape {self.shape}")
        return axis % self.ndim

    def axis_size(self, axis: int | str) -> int:
        return self.shape[self.axis_index(axis)]

    def __contains__(self, rank: int) -> bool:
        return rank in self.ranks

    def coords(self, rank: int) -> tuple[int, ...]:
        """The rank's position in the grid.

        >>> DeviceMesh([[0, 1], [2, 3]]).coords(2)
        (1, 0)
        """
        if rank not in self.ranks:
            raise MeshError(f"rank {rank} is not in the mesh {list(self.ranks)}")
        flat = self.ranks.index(rank)
        out = []
        for extent in reversed(self.shape):
            out.append(flat % extent)
            flat //= extent
        return tuple(reversed(out))

    def rank_at(self, coords: Iterable[int]) -> int:
        """Inverse of coords()."""
        coords = tuple(coords)
        if len(coords) != self.ndim or any(not 0 <= c < e for c, e in zip(coords, self.shape)):
            raise MeshError(f"coordinates {coords} are outside the mesh of shape {self.shape}")
        flat = 0
        for c, extent in zip(coords, self.shape):
            flat = flat * extent + c
        return self.ranks[flat]

    def ranks_along(self, axis: int | str, rank: int) -> tuple[int, ...]:
        """The ranks on one mesh axis through `rank`: the group a collective on that axis spans.

        >>> DeviceMesh([[0, 1], [2, 3]], axis_names=("dp", "tp")).ranks_along("dp", 3)
        (1, 3)
        """
        ax = self.axis_index(axis)
        base = list(self.coords(rank))
        group = []
        for i in range(self.shape[ax]):
            base[ax] = i
            group.append(self.rank_at(base))
        return tuple(group)

    def groups(self, axis: int | str) -> tuple[tuple[int, ...], ...]:
        """Every group of ranks along a mesh axis (one process group per slice)."""
        seen, out = set(), []
        for r in self.ranks:
            g = self.ranks_along(axis, r)
            if g not in seen:
                seen.add(g)
                out.append(g)
        return tuple(out)

    def to_dict(self) -> dict:
        return {"ranks": list(self.ranks), "shape": list(self.shape), "axis_names": list(self.axis_names)}

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceMesh":
        """Inverse of to_dict().

        >>> DeviceMesh.from_dict({"ranks": [0, 1]})
        Traceback (most recent call last):
        ...
        egraph_did.errors.MeshError: mesh dict lacks the field 'shape'; write it with DeviceMesh.to_dict()
        """
        if not isinstance(d, dict):
            raise MeshError(f"a mesh dict is a dict (DeviceMesh.to_dict()), got {type(d).__name__}")
        for key in ("ranks", "shape", "axis_names"):
            if key not in d:
                raise MeshError(f"mesh dict lacks the field {key!r}; write it with DeviceMesh.to_dict()")
            if not isinstance(d[key], list):
                raise MeshError(f"mesh dict: field {key!r} must be a list, got {type(d[key]).__name__}")
        ranks, shape = d["ranks"], d["shape"]
        if not shape or any(isinstance(e, bool) or not isinstance(e, int) or e <= 0 for e in shape):
            raise MeshError(f"mesh dict: shape {shape} must list positive ints, one per mesh axis")
        if math.prod(shape) != len(ranks):
            raise MeshError(f"mesh dict: shape {shape} does not hold {len(ranks)} ranks")
        grid: list = list(ranks)
        for extent in reversed(shape[1:]):
            grid = [grid[i:i + extent] for i in range(0, len(grid), extent)]
        return cls(grid, axis_names=d["axis_names"])

    def same_shape(self, other: "DeviceMesh") -> bool:
        """Whether `other` has this mesh's shape and axis names (rank ids may differ)."""
        return self.shape == other.shape and self.axis_names == other.axis_names

    def __str__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        return f"DeviceMesh({axes})"

    __repr__ = __str__


def check_mesh(mesh, where: str = "optimize") -> "DeviceMesh":
    """MeshError unless `mesh` is a DeviceMesh; returns it.

    >>> check_mesh(4)
    Traceback (most recent call last):
    ...
    egraph_did.errors.MeshError: optimize: mesh must be an ed.DeviceMesh, got the int 4; use ed.DeviceMesh.arange(4) for 4 ranks
    """
    if isinstance(mesh, DeviceMesh):
        return mesh
    hint = (f"use ed.DeviceMesh.arange({mesh}) for {mesh} ranks" if isinstance(mesh, int) and not isinstance(mesh, bool)
            else "build one with ed.DeviceMesh.arange(n) or ed.DeviceMesh(grid, axis_names=...)")
    raise MeshError(f"{where}: mesh must be an ed.DeviceMesh, got the {type(mesh).__name__} {mesh!r:.40}; {hint}")
