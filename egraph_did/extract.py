"""DAG-aware extraction from the saturated physical graph: a value used by several consumers is paid
once. `greedy_dag` is fast (bottom-up, each class keeps the cheapest set of nodes it needs, as a
bitset); `exact` solves the same problem as an integer program with scipy's HiGHS (small graphs, and
to measure the greedy gap). A per-device memory bound is a constraint in `exact` and a Lagrangian
penalty searched by bisection in `greedy_dag`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .physgraph import Node, PhysGraph
from .errors import PlanError

ROOT = "__root__"


@dataclass
class Selection:
    """The chosen node of every class the plan needs, with their total cost and memory.

    >>> g = PhysGraph({"x": [Node("Load", (), "x")], "y": [Node("Apply", ("x",), "y", 0, cost=4e-6, memory=32.0)]})
    >>> sel = greedy_dag(g, with_roots(g, {"y": ["y"]}))
    >>> sorted(sel.choice), sel.cost, sel.memory, sel.method
    (['__out__:y', '__root__', 'x', 'y'], 4e-06, 32.0, 'greedy-dag')
    """

    choice: dict[str, Node]
    cost: float
    memory: float
    method: str


def _topo_order(graph: PhysGraph, roots: list[str]) -> list[str]:
    """Classes reachable from roots, children before parents (iterative DFS; the graph is acyclic)."""
    order, state = [], {}
    for r in roots:
        stack = [(r, False)]
        while stack:
            c, done = stack.pop()
            if done:
                state[c] = 2
                order.append(c)
                continue
            if state.get(c):
                continue
            state[c] = 1
            stack.append((c, True))
            for n in graph.classes[c]:
                for ch in n.children:
                    if not state.get(ch):
                        stack.append((ch, False))
    return order


def with_roots(graph: PhysGraph, outputs: dict[str, list[str]]) -> list[str]:
    """Add one choice class per output (any of its allowed classes) and a root needing all of them.

    >>> g = PhysGraph({"y:R": [Node("Load", (), "y")], "y:S0": [Node("Load", (), "y")]})
    >>> with_roots(g, {"y": ["y:R", "y:S0"]})
    ['__root__']
    >>> [n.children for n in g.classes["__out__:y"]], g.classes["__root__"][0].children
    ([('y:R',), ('y:S0',)], ('__out__:y',))
    """
    roots = []
    for name, classes in outputs.items():
        cls = f"__out__:{name}"
        graph.classes[cls] = [Node("Choose", (c,)) for c in classes]
        roots.append(cls)
    graph.classes[ROOT] = [Node("Root", tuple(roots))]
    return [ROOT]


def _total(choice: dict[str, Node]) -> tuple[float, float]:
    return sum(n.cost for n in choice.values()), sum(n.memory for n in choice.values())


def _greedy(graph: PhysGraph, order: list[str], penalty: float) -> dict[str, Node] | None:
    nodes = [n for c in order for n in graph.classes[c]]
    index = {id(n): i for i, n in enumerate(nodes)}
    weight = [n.cost + penalty * n.memory for n in nodes]
    best: dict[str, tuple[float, int, Node]] = {}
    for c in order:
        pick = None
        for n in graph.classes[c]:
            if any(ch not in best for ch in n.children):
                continue
            i = index[id(n)]
            # start from the costliest child's set as a whole; walk only what the others add to it,
            # so a residual chain (each set holding the previous one) stays linear
            kids = sorted(set(n.children), key=lambda ch: best[ch][0], reverse=True)
            mask, cost = 1 << i, weight[i]
            if kids:
                mask |= best[kids[0]][1]
                cost += best[kids[0]][0]
            for ch in kids[1:]:
                new = best[ch][1] & ~mask
                mask |= new
                while new:
                    low = new & -new
                    cost += weight[low.bit_length() - 1]
                    new ^= low
            if pick is None or cost < pick[0] - 1e-15:
                pick = (cost, mask, n)
        if pick is not None:
            best[c] = pick
    if ROOT not in best:
        return None
    mask = best[ROOT][1]
    chosen = {}
    # every class's pick in the root's set; a class appears once (the bitset holds one node per class)
    for c in order:
        if c in best and mask >> index[id(best[c][2])] & 1:
            chosen[c] = best[c][2]
    return chosen


def _amortized(graph: PhysGraph, order: list[str], penalty: float) -> dict[str, Node] | None:
    """Tree-cost greedy where a class's cost is split among the logical consumers that may read it: a value
    several consumers share looks cheaper to each (the case plain greedy-DAG misses: b and c each
    alone prefer their own copy, together they prefer one shared a)."""
    tensor_of = {c: graph.ident[c][0] if c in graph.ident else c for c in order}
    readers: dict[str, set] = {c: set() for c in order}
    for c in order:
        for n in graph.classes[c]:
            for ch in n.children:
                readers[ch].add(tensor_of[c])
    best: dict[str, tuple[float, Node]] = {}
    for c in order:
        pick = None
        for n in graph.classes[c]:
            if any(ch not in best for ch in n.children):
                continue
            cost = n.cost + penalty * n.memory + sum(best[ch][0] / max(len(readers[ch]), 1) for ch in n.children)
            if pick is None or cost < pick[0] - 1e-15:
                pick = (cost, n)
        if pick is not None:
            best[c] = pick
    if ROOT not in best:
        return None
    chosen, stack = {}, [ROOT]
    while stack:
        c = stack.pop()
        if c not in chosen:
            chosen[c] = best[c][1]
            stack.extend(chosen[c].children)
    return chosen


def _dag_weight(choice: dict[str, Node], penalty: float) -> float:
    return sum(n.cost + penalty * n.memory for n in choice.values())


def _reachable(choice: dict[str, Node], fallback: dict[str, Node]) -> dict[str, Node] | None:
    out, stack = {}, [ROOT]
    while stack:
        c = stack.pop()
        if c in out:
            continue
        n = choice.get(c) or fallback.get(c)
        if n is None:
            return None
        out[c] = n
        stack.extend(n.children)
    return out


def _improve(graph: PhysGraph, choice: dict[str, Node], fallback: dict[str, Node], penalty: float,
             max_classes: int = 3000) -> dict[str, Node]:
    """Local search: switch one class's node at a time while the whole DAG's cost drops (small graphs)."""
    if len(choice) > max_classes:
        return choice
    current = _dag_weight(choice, penalty)
    for _ in range(4):
        better = False
        for c in list(choice):
            if c not in choice:
                continue
            for n in graph.classes[c]:
                if n is choice[c]:
                    continue
                trial = _reachable({**choice, c: n}, fallback)
                if trial is not None and _dag_weight(trial, penalty) < current - 1e-15:
                    choice, current, better = trial, _dag_weight(trial, penalty), True
        if not better:
            break
    return choice


def _best_of(graph: PhysGraph, order: list[str], penalty: float, improve: bool = True) -> dict[str, Node] | None:
    """The cheaper of greedy-DAG and amortized greedy, then (improve) polished by local search."""
    found = [c for c in (_greedy(graph, order, penalty), _amortized(graph, order, penalty)) if c is not None]
    if not found:
        return None
    found.sort(key=lambda ch: _dag_weight(ch, penalty))
    if not improve:
        return found[0]
    fallback = {c: n for ch in reversed(found) for c, n in ch.items()}
    return _improve(graph, found[0], fallback, penalty)


def greedy_dag(graph: PhysGraph, roots: list[str], memory_limit: float | None = None) -> Selection:
    """Bottom-up greedy: each class keeps the cheapest node counting shared descendants once; an
    amortized variant catches values worth sharing, and a local search polishes small graphs.

    >>> g = PhysGraph({"w": [Node("Load", (), "w")],
    ...                "w:R": [Node("Coll", ("w",), "allgather", 0, cost=20e-6)],
    ...                "y": [Node("Apply", ("w:R",), "y", 0, cost=1e-6), Node("Apply", ("w",), "y", 1, cost=15e-6)],
    ...                "z": [Node("Apply", ("w:R",), "z", 0, cost=1e-6), Node("Apply", ("w",), "z", 1, cost=15e-6)]})
    >>> sel = greedy_dag(g, with_roots(g, {"y": ["y"], "z": ["z"]}))
    >>> round(sel.cost * 1e6), sel.choice["y"].sid  # one allgather serves y and z: 20 + 1 + 1 us
    (22, 0)
    """
    order = _topo_order(graph, roots)
    chosen = _best_of(graph, order, 0.0)
    if chosen is None:
        raise PlanError("no plan computes every output from the pinned inputs: a pin cannot be honoured")
    cost, mem = _total(chosen)
    if memory_limit is not None and mem > memory_limit:
        lo, hi = 0.0, 1e-12
        best_fit = None
        for _ in range(60):  # grow the price of a byte until the plan fits, then bisect (no local search
            trial = _best_of(graph, order, hi, improve=False)  # inside the loop: it is the costly part)
            if _total(trial)[1] <= memory_limit:
                best_fit = trial
                break
            hi *= 4
        if best_fit is None:
            raise PlanError(f"no plan fits the memory bound of {memory_limit / 2**30:.2f} GiB per device "
                            f"(the smallest found needs {_total(trial)[1] / 2**30:.2f} GiB)")
        for _ in range(40):
            mid = (lo + hi) / 2
            trial = _best_of(graph, order, mid, improve=False)
            if _total(trial)[1] <= memory_limit:
                best_fit, hi = trial, mid
            else:
                lo = mid
        polished = _best_of(graph, order, hi)
        chosen = polished if _total(polished)[1] <= memory_limit and \
            _dag_weight(polished, hi) <= _dag_weight(best_fit, hi) else best_fit
        cost, mem = _total(chosen)
    return Selection(chosen, cost, mem, "greedy-dag")


def exact(graph: PhysGraph, roots: list[str], memory_limit: float | None = None,
          time_limit: float = 60.0) -> Selection:
    """Minimum-cost DAG extraction as a 0/1 program (HiGHS): pick nodes so every picked node's child
    classes have a picked node and every root does; each picked node is paid once.

    >>> g = PhysGraph({"x": [Node("Load", (), "x")],
    ...                "y": [Node("Apply", ("x",), "y", 0, cost=1e-6, memory=4096.0),
    ...                      Node("Apply", ("x",), "y", 1, cost=5e-6, memory=1024.0)]})
    >>> roots = with_roots(g, {"y": ["y"]})
    >>> exact(g, roots).choice["y"].sid, exact(g, roots, memory_limit=2048).choice["y"].sid
    (0, 1)
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    order = _topo_order(graph, roots)
    nodes = [(c, n) for c in order for n in graph.classes[c]]
    col = {id(n): i for i, (_, n) in enumerate(nodes)}
    members = {c: [col[id(n)] for n in graph.classes[c]] for c in order}
    rows = [(i, ch) for i, (_, n) in enumerate(nodes) for ch in n.children]
    nrow = len(rows) + len(roots) + (memory_limit is not None)
    a = lil_matrix((nrow, len(nodes)))
    lb, ub = np.full(nrow, -np.inf), np.zeros(nrow)
    for r, (i, ch) in enumerate(rows):  # x_n <= sum of the child class's nodes
        a[r, i] = 1.0
        for j in members[ch]:
            a[r, j] -= 1.0
    for k, root in enumerate(roots):
        r = len(rows) + k
        for j in members[root]:
            a[r, j] = 1.0
        lb[r], ub[r] = 1.0, np.inf
    if memory_limit is not None:
        r = nrow - 1
        for i, (_, n) in enumerate(nodes):
            a[r, i] = n.memory
        ub[r] = memory_limit
    # costs are seconds (~1e-6): solve in nanoseconds so HiGHS's absolute tolerances do not blur plans
    cost = np.array([n.cost for _, n in nodes]) * 1e9
    res = milp(cost, constraints=LinearConstraint(a.tocsr(), lb, ub), integrality=np.ones(len(nodes)),
               bounds=Bounds(0, 1), options={"time_limit": time_limit, "mip_rel_gap": 1e-12})
    if res.x is None:
        raise PlanError("no plan satisfies the pins" + (" and the memory bound" if memory_limit else "")
                        + f" (HiGHS: {res.message})")
    picked = res.x > 0.5
    chosen: dict[str, Node] = {}
    stack = list(roots)
    while stack:  # keep only what the roots need, one node per class (the cheapest picked)
        c = stack.pop()
        if c in chosen:
            continue
        cands = [n for n in graph.classes[c] if picked[col[id(n)]]]
        n = min(cands, key=lambda n: n.cost)
        chosen[c] = n
        stack.extend(n.children)
    total, mem = _total(chosen)
    return Selection(chosen, total, mem, "exact-ilp")
