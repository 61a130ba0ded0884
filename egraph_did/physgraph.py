"""The saturated e-graph's physical sort as plain Python data: what extraction and plan building read.
Kept apart from egraph.py so that loading and running plans never imports egglog."""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field


@contextlib.contextmanager
def gc_paused():
    """No cyclic garbage collection inside (restored as it was on exit; reference counting frees as always).
    The optimizer's stages (build_problem, saturate, greedy_dag) allocate many objects that live on, and
    the collector scanned the growing heap again and again while they did (measured on 96 GPT-3 layers:
    0.3 s of build_problem's 0.8 s, 0.6 s of saturate and read back, 0.25 s of greedy extraction).

    >>> import gc
    >>> with gc_paused():
    ...     gc.isenabled()
    False
    >>> gc.isenabled()
    True
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def post_order(roots: Iterable[Hashable], pushes: Callable[[Hashable], Iterable[Hashable]]) -> list:
    """Every vertex reachable from roots, each after the vertices it reaches (depth first, iterative: graphs of
    a hundred thousand classes nest deeper than Python's recursion). A vertex's successors are pushed in the
    order `pushes(v)` gives, so the last of them is visited first; in a cycle, a vertex met again while open
    is left where it is.

    >>> post_order(["y"], {"y": ["a", "b"], "a": ["x"], "b": ["x"], "x": []}.__getitem__)
    ['x', 'b', 'a', 'y']
    """
    order, seen = [], set()
    for r in roots:
        stack = [(r, False)]
        while stack:
            v, done = stack.pop()
            if done:
                order.append(v)
                continue
            if v in seen:
                continue
            seen.add(v)
            stack.append((v, True))
            stack.extend([(w, False) for w in pushes(v) if w not in seen])
    return order


@dataclass
class Node:
    """One node of a physical class: how to make that class's value from its child classes, at what
    predicted cost (seconds) and memory (bytes per device). Costs are set by optimize.price.

    >>> n = Node("Coll", ("c1",), key="allgather", sid=0)  # allgather c1's value over mesh axis 0
    >>> n.op, n.children, n.key, n.cost
    ('Coll', ('c1',), 'allgather', 0.0)
    """

    op: str  # Apply | Proj | Load | Keep | Coll | Choose
    children: tuple[str, ...]  # class ids
    key: str = ""  # Apply: expr key; Load: input name; Coll: kind
    sid: int = -1  # Apply: strategy id; Proj: output index; Coll: mesh axis
    cost: float = 0.0
    memory: float = 0.0


@dataclass
class PhysGraph:
    """Classes of the saturated e-graph's physical sort, with what each names and how to make it.

    >>> g = PhysGraph({"c0": [Node("Load", (), "x")], "c1": [Node("Coll", ("c0",), "allgather", 0)]},
    ...               ident={"c0": ("x", "S0", 0), "c1": ("x", "R", 1)})
    >>> g.n_nodes, g.ident["c1"]
    (2, ('x', 'R', 1))
    """

    classes: dict[str, list[Node]] = field(default_factory=dict)
    ident: dict[str, tuple[str, str, int]] = field(default_factory=dict)  # class -> (tensor, layout, level)
    index: dict[tuple[str, str, int], str] = field(default_factory=dict)  # (tensor, layout, level) -> class
    canonical: dict[str, str] = field(default_factory=dict)  # tensor -> the name its class goes by
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def n_nodes(self) -> int:
        """Nodes over all classes."""
        return sum(len(ns) for ns in self.classes.values())


