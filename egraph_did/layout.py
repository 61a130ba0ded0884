"""Layouts: per mesh axis, how a tensor sits on it: R (replicated), P (partial sum), Pmax (partial max,
inside max-reductions only), Pe (a partial sum of expert rows: each rank holds the rows of its own experts,
zeros elsewhere; rewrites/experts.py) or S(a) (logical axis a split over that mesh axis, the outer part
bound).

A layout is the optimizer's compact name for a family of loop domains; `pins.apply_layout` writes
the loop domain and `pins.layout_of` reads one back. `str(layout)` is also its JSON form. Which
elements a rank holds under a layout is `shards`' job.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

from .errors import PlanError
from .mesh import DeviceMesh


@dataclass(frozen=True, order=True)
class Placement:
    """How a tensor sits on one mesh axis: R (replicated), S(axis) (split), P (partial sum), Pmax or Pe.

    Pe is a pending sum whose summands are disjoint rows: rank r holds the rows of tokens sorted by expert
    that belong to its experts (grouped_mm with its weights split on the experts), zeros in every other
    row. As a sum it is a P (every collective that reduces a P reduces it); what it adds is that a row-wise
    op with f(0) = 0 keeps it (rewrites/experts.py), which no P does.

    >>> str(R), str(S(1)), str(P), str(PMAX), str(PE)
    ('R', 'S(1)', 'P', 'Pmax', 'Pe')
    >>> S(1).is_shard, PMAX.is_partial, PMAX.code(), PE.is_partial, PE.reduce, PE.code()
    (True, True, 'M', True, 'sum', 'E')
    """

    kind: str  # "R", "S", "P"
    axis: int = -1  # tensor axis for S
    reduce: str = "sum"  # for P: "sum" or "max"
    rows: bool = False  # for P: a sum of disjoint expert rows (Pe)

    def __post_init__(self):
        assert self.kind in ("R", "S", "P"), self.kind
        assert (self.kind == "S") == (self.axis >= 0), self
        assert self.reduce in ("sum", "max"), self
        assert not self.rows or (self.kind == "P" and self.reduce == "sum"), self

    @property
    def is_shard(self) -> bool:
        """Whether this placement splits a tensor axis (S)."""
        return self.kind == "S"

    @property
    def is_partial(self) -> bool:
        """Whether every rank holds a summand (P) or a candidate maximum (Pmax)."""
        return self.kind == "P"

    def code(self) -> str:
        """Compact text for layout codes: 'R', 'P', 'M' (Pmax), 'E' (Pe) or 'S<axis>'."""
        return {"R": "R", "P": "E" if self.rows else "P" if self.reduce == "sum" else "M"}.get(self.kind) or f"S{self.axis}"

    def __str__(self) -> str:
        if self.kind == "S":
            return f"S({self.axis})"
        if self.kind == "P":
            return "Pe" if self.rows else "P" if self.reduce == "sum" else "Pmax"
        return "R"


R = Placement("R")
P = Placement("P")
PMAX = Placement("P", reduce="max")
PE = Placement("P", rows=True)


def S(axis: int) -> Placement:
    """Sharded on tensor axis `axis` (non-negative).

    >>> str(S(0)), S(0).is_shard, S(0).code()
    ('S(0)', True, 'S0')
    """
    return Placement("S", axis)


@dataclass(frozen=True, order=True)
class Layout:
    """One placement per mesh axis (outermost mesh axis first).

    >>> lay = Layout((S(1), R))  # on a 2-D mesh: axis 1 split over the outer mesh axis
    >>> str(lay), lay.code(), Layout.from_code("S1.R") == lay
    ('[S(1), R]', 'S1.R', True)
    >>> lay.sharding_axes(1), lay.replace(1, P).has_partial
    ([0], True)
    """

    placements: tuple[Placement, ...]

    def __iter__(self):
        return iter(self.placements)

    def __getitem__(self, i: int) -> Placement:
        return self.placements[i]

    def __len__(self):
        return len(self.placements)

    def code(self) -> str:
        """Compact text used as the e-graph's layout name, e.g. 'S1.R'."""
        # kept on the instance: a layout hashes as its code, and pricing a 2-D mesh's graph hashes ~10^5 of them
        code = self.__dict__.get("_code")
        if code is None:
            code = ".".join(p.code() for p in self.placements)
            object.__setattr__(self, "_code", code)
        return code

    @classmethod
    def replicated(cls, ndim: int) -> "Layout":
        """Whole on every one of a mesh's `ndim` axes.

        >>> str(Layout.replicated(2)), Layout.replicated(1) == Layout((R,))
        ('[R, R]', True)
        """
        return cls(tuple(R for _ in range(ndim)))

    @classmethod
    def from_code(cls, code: str) -> "Layout":
        """Inverse of code()."""
        out = []
        for c in code.split("."):
            out.append({"R": R, "P": P, "M": PMAX, "E": PE}.get(c) or S(int(c[1:])))
        return cls(tuple(out))

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """A layout from its text, str(layout) ('[S(1), R]', the JSON form) or its code ('S1.R', the
        suffix of a value name); ValueError naming the text when it is neither.

        >>> Layout.parse("[S(1), Pmax]") == Layout.parse("S1.M") == Layout((S(1), PMAX))
        True
        """
        text = text.strip() if isinstance(text, str) else text
        try:
            if isinstance(text, str) and text.startswith("[") and text.endswith("]"):
                names = {"R": R, "P": P, "Pmax": PMAX, "Pe": PE}
                parts = [t.strip() for t in text[1:-1].split(",")]
                lay = cls(tuple(names.get(t) or S(int(t[2:-1])) if t.startswith("S(") or t in names else
                                _bad(text) for t in parts))
                if str(lay) == text.replace(" ", "").replace(",", ", "):
                    return lay
            elif isinstance(text, str):
                lay = cls.from_code(text)
                if lay.code() == text:
                    return lay
        except (ValueError, KeyError, IndexError, AssertionError):
            pass
        raise ValueError(f"not a layout: {text!r}; write one placement per mesh axis, as '[S(1), R]' (R, "
                         f"S(tensor axis), P for a pending sum, Pmax for a pending max, Pe for expert rows) or as the code 'S1.R'")

    def __eq__(self, other) -> bool:
        """Equal to a layout of the same placements, or to either spelling of its text (a plan's value
        layouts compare with codes: `plan.values[v].layout == "S1"`)."""
        if isinstance(other, str):
            return other in (self.code(), str(self))
        return isinstance(other, Layout) and self.placements == other.placements

    def __hash__(self) -> int:
        return hash(self.code())  # as its code's: a layout and its code are equal, so they hash alike

    @property
    def is_replicated(self) -> bool:
        """Whether every mesh axis holds the whole tensor."""
        return all(p.kind == "R" for p in self.placements)

    @property
    def has_partial(self) -> bool:
        """Whether a reduction over some mesh axis is still pending."""
        return any(p.is_partial for p in self.placements)

    def replace(self, mesh_axis: int, placement: Placement) -> "Layout":
        """A copy with mesh axis `mesh_axis` set to `placement`."""
        ps = list(self.placements)
        ps[mesh_axis] = placement
        return Layout(tuple(ps))

    def sharding_axes(self, tensor_axis: int) -> list[int]:
        """Mesh axes that split tensor axis `tensor_axis`, outermost first."""
        return [m for m, p in enumerate(self.placements) if p.is_shard and p.axis == tensor_axis]

    def __str__(self) -> str:
        return "[" + ", ".join(str(p) for p in self.placements) + "]"


def _bad(text):
    raise ValueError(text)


def valid_layouts(shape: Sequence[int], mesh: DeviceMesh, partial: bool = False,
                  allow_empty: bool = False, rows: bool = False) -> Iterator[Layout]:
    """Every layout of a tensor of `shape`: an axis is sharded only where every rank gets at least one
    element (uneven shards allowed, empty ones only with allow_empty); partials only when asked (Pe with
    rows too: expert rows, in programs of grouped matmuls); only R on a mesh axis of size 1 (see is_valid).

    >>> [str(lay) for lay in valid_layouts((4, 1), DeviceMesh.arange(2))]  # axis 1 is too short to split
    ['[R]', '[S(0)]']
    >>> [str(lay) for lay in valid_layouts((4, 1), DeviceMesh.arange(2), partial=True)]
    ['[R]', '[P]', '[Pmax]', '[S(0)]']
    >>> [str(lay) for lay in valid_layouts((4,), DeviceMesh([[0], [1]]))]  # the second mesh axis has size 1
    ['[R, R]', '[S(0), R]']
    >>> [str(lay) for lay in valid_layouts((4, 1), DeviceMesh.arange(2), allow_empty=True)]  # 1, 0 rows
    ['[R]', '[S(0)]', '[S(1)]']
    """
    full = [R] + ([P, PMAX] if partial else []) + ([PE] if partial and rows else []) + [S(a) for a in range(len(shape))]
    choices = [full if size > 1 else [R] for size in mesh.shape]
    for combo in itertools.product(*choices):
        layout = Layout(tuple(combo))
        if is_valid(layout, shape, mesh, allow_empty):
            yield layout


def nested_chunks(extent: int, ways: Sequence[int]) -> tuple[int, int]:
    """(largest, smallest) piece of `extent` split as a loop domain nests outer splits: by ways[0]
    first (torch.chunk: ceil-sized pieces), then the loop extent of a piece by ways[1], and so on.
    The smallest piece is the last one at every level; 0 means some rank holds nothing.

    >>> nested_chunks(6, [2, 2])  # 3, 3 then 2, 1 each: no rank is empty (a flat split by 4 would be)
    (2, 1)
    >>> nested_chunks(5, [2, 2]), nested_chunks(5, [4])  # 3 -> 2, 1; 2 -> 2, 0   |   2, 2, 1, 0
    ((2, 0), (2, 0))
    """
    loop, last = extent, extent
    for w in ways:
        loop = -(-loop // w)
        last = max(last - (w - 1) * loop, 0)
    return loop, min(last, loop)


def empty_rank(layout: Layout, shape: Sequence[int], mesh: DeviceMesh) -> int | None:
    """The first tensor axis of which some rank would hold nothing under `layout`, or None.

    >>> mesh = DeviceMesh.arange(4)
    >>> empty_rank(Layout((S(0),)), (5, 8), mesh), empty_rank(Layout((S(0),)), (7, 8), mesh)
    (0, None)
    """
    for a in range(len(shape)):
        ways = [mesh.shape[m] for m in layout.sharding_axes(a)]
        if ways and nested_chunks(shape[a], ways)[1] == 0:
            return a
    return None


def is_valid(layout: Layout, shape: Sequence[int], mesh: DeviceMesh, allow_empty: bool = False) -> bool:
    """Whether `layout` fits a tensor of `shape` on `mesh`: one placement per mesh axis, sharded axes
    that exist, no rank left with an empty shard (splits nest as the loop domain nests them: outer mesh
    axis first, each inner split of the ceil-sized loop extent), and only R on a mesh axis of size 1
    (a split or a partial over one device holds the same data as R: R is its canonical form).
    allow_empty admits shards that hold nothing (5 rows over 4 ranks: 2, 2, 1, 0, as DTensor chunks):
    any tensor may be held so, and collectives move such shards, but only ops whose local kernel is right
    on an empty shard (OpDef.empty_shards: elementwise ops and views) compute on them.

    >>> mesh = DeviceMesh.arange(4)
    >>> is_valid(Layout((S(0),)), (7, 8), mesh)  # rows 2, 2, 2, 1
    True
    >>> is_valid(Layout((S(0),)), (5, 8), mesh)  # rows 2, 2, 1, 0: the last shard is empty
    False
    >>> is_valid(Layout((S(0),)), (5, 8), mesh, allow_empty=True)  # fine for a pin
    True
    >>> is_valid(Layout((S(0), S(0))), (6, 8), DeviceMesh([[0, 1], [2, 3]]))  # 3 | 3, then 2, 1 | 2, 1
    True
    >>> tall = DeviceMesh([[0], [1]])  # its second axis has size 1
    >>> is_valid(Layout((S(0), R)), (8,), tall), is_valid(Layout((R, S(0))), (8,), tall)
    (True, False)
    """
    if len(layout) != mesh.ndim:
        return False
    if any(p.kind != "R" and size == 1 for p, size in zip(layout, mesh.shape)):
        return False
    if not all(not p.is_shard or p.axis < len(shape) for p in layout):
        return False
    return allow_empty or empty_rank(layout, shape, mesh) is None


def canonical_layout(layout: Layout, mesh: DeviceMesh) -> Layout:
    """`layout` with every placement on a mesh axis of size 1 made R (the same data: one device holds
    the whole of a split or the whole sum of a partial over one device).

    >>> str(canonical_layout(Layout.from_code("S0.P"), DeviceMesh([[0], [1]])))
    '[S(0), R]'
    """
    return Layout(tuple(p if size > 1 else R for p, size in zip(layout, mesh.shape)))


__all__ = ["Placement", "Layout", "R", "P", "PMAX", "PE", "S", "nested_chunks", "empty_rank",
           "valid_layouts", "is_valid", "canonical_layout"]
