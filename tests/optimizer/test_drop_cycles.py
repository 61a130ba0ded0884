"""drop_cycles keeps a bucketed graph acyclic by adding the rewrite's nodes back one at a time where no class
they read is computed from their own class. It keeps a topological order as it goes (optimize._TopoOrder)
instead of searching the graph below each candidate: on random graphs it keeps exactly the nodes the
whole-graph search keeps, and the result has no cycle."""
from __future__ import annotations

import random

from egraph_did.optimize import drop_cycles
from egraph_did.physgraph import Node, PhysGraph


def _reference(graph: PhysGraph, keys: list[str]) -> None:
    """drop_cycles as first written: one search of everything below each candidate's children."""
    order = {k: i for i, k in enumerate(keys)}
    held = {c: [n for n in ns if n.op == "Apply" and n.key in order] for c, ns in graph.classes.items()}
    for c, ns in held.items():
        graph.classes[c] = [n for n in graph.classes[c] if n not in ns]

    def reaches(start, goal):
        seen, stack = set(), [start]
        while stack:
            c = stack.pop()
            if c == goal:
                return True
            if c not in seen:
                seen.add(c)
                stack.extend(ch for n in graph.classes.get(c, ()) for ch in n.children)
        return False

    for c, n in sorted(((c, n) for c, ns in held.items() for n in ns), key=lambda cn: order[cn[1].key]):
        if not any(reaches(ch, c) for ch in n.children):
            graph.classes[c].append(n)
    while True:
        empty = {c for c, ns in graph.classes.items() if not ns}
        if not empty:
            return
        for c in empty:
            del graph.classes[c]
        for c, ns in graph.classes.items():
            graph.classes[c] = [n for n in ns if not empty.intersection(n.children)]


def _random_graph(rng: random.Random, n: int, extra: int) -> PhysGraph:
    """An acyclic graph of n classes (class i reads classes below i), then `extra` rewrite nodes ("pack",
    "unpack") reading any classes, which may close cycles."""
    classes = {"c0": [Node("Load", (), "x")]}
    for i in range(1, n):
        kids = tuple(f"c{j}" for j in rng.sample(range(i), min(i, rng.randint(1, 3))))
        classes[f"c{i}"] = [Node("Apply", kids, "op", i)]
    for j in range(extra):
        c = f"c{rng.randrange(1, n)}"
        kids = tuple(f"c{k}" for k in rng.sample(range(n), rng.randint(1, 2)))
        classes[c].append(Node("Apply", kids, rng.choice(["pack", "unpack"]), 1000 + j))
    return PhysGraph(classes)


def _acyclic(graph: PhysGraph) -> bool:
    state: dict[str, int] = {}

    def visit(c):
        if state.get(c) == 1:
            return False
        if state.get(c) == 2:
            return True
        state[c] = 1
        ok = all(visit(ch) for nd in graph.classes.get(c, ()) for ch in nd.children)
        state[c] = 2
        return ok

    return all(visit(c) for c in graph.classes)


def _rewrite_nodes(graph: PhysGraph) -> int:
    return sum(n.key in ("pack", "unpack") for ns in graph.classes.values() for n in ns)


def test_drop_cycles_keeps_what_the_whole_graph_search_keeps():
    kept = dropped = 0
    for seed in range(60):
        rng = random.Random(seed)
        n, extra = rng.randint(5, 60), rng.randint(1, 40)
        got, want = _random_graph(random.Random(seed), n, extra), _random_graph(random.Random(seed), n, extra)
        offered = _rewrite_nodes(got)
        drop_cycles(got, ["pack", "unpack"])
        _reference(want, ["pack", "unpack"])
        assert got.classes == want.classes, seed
        assert _acyclic(got), seed
        kept += _rewrite_nodes(got)
        dropped += offered - _rewrite_nodes(got)
    assert kept > 100 and dropped > 100  # both ways taken, often
