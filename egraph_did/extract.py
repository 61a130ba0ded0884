"""DAG-aware extraction from the saturated physical graph: a value used by several consumers is paid
once. `greedy_dag` is fast (bottom-up, each class keeps the cheapest set of nodes it needs, as a
bitset; reruns with a shared value bought up front; local search); `exact` solves the same problem as
an integer program with scipy's HiGHS (small graphs, and to measure the greedy gap). A per-device memory bound is a constraint in `exact` and a Lagrangian
penalty searched by bisection in `greedy_dag`.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from . import extract_dp
from .cost import size_text
from .physgraph import Node, PhysGraph, gc_paused, post_order
from .errors import MemoryBoundError, PlanError

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
    method: str  # "greedy-dag", "exact" (optimality proven) or "exact-unproven"
    proven: bool = False  # exact only: HiGHS proved this plan optimal
    stats: dict = field(default_factory=dict)  # what the extractor measured and decided


def _topo_order(graph: PhysGraph, roots: list[str]) -> list[str]:
    """Classes reachable from roots, children before parents (the graph is acyclic)."""
    classes = graph.classes
    return post_order(roots, lambda c: [ch for n in classes[c] for ch in n.children])


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


class _Skeleton:
    """What the greedy passes read of the graph, whatever the price of a byte: the classes in topological
    order (a class is a bit of a set), their nodes numbered, each node's distinct children (in the order
    set(children) gives them, as the passes always took them), and which tensors and classes read each
    class. Built once per extraction; the passes loop over it instead of the graph's Node objects."""

    def __init__(self, graph: PhysGraph, order: list[str]):
        self.graph, self.order = graph, order
        self.position = {c: k for k, c in enumerate(order)}  # class -> its bit in a set
        # class -> (node, number, distinct children (a one-child node's children tuple), the only one where it has one)
        self.entries: dict[str, list[tuple[Node, int, list[str] | tuple[str], str | None]]] = {}
        # one walk over the nodes makes every per-node table (the graph's ~200k nodes on a 2x2 mesh: each walk
        # of them costs ~0.05 s), the readers too (readers(): the amortized pass and the seeds read them)
        nodes: list[Node] = []
        ident, classes, entries = graph.ident, graph.classes, self.entries
        tensors: dict[str, set] = {}
        parents: dict[str, dict] = {}
        for c in order:
            es = entries[c] = []
            t = ident[c][0] if c in ident else c
            ns = classes[c]
            i = len(nodes)
            nodes.extend(ns)
            for n in ns:
                ch = n.children
                if len(ch) == 1:  # a collective, a Keep, a Proj (87% of a 2-D mesh's nodes): set() of one changes nothing
                    es.append((n, i, ch, ch[0]))  # the children tuple itself: no pass changes a node's kids
                else:
                    kids = list(set(ch))
                    es.append((n, i, kids, kids[0] if len(kids) == 1 else None))
                for k in ch:
                    ts = tensors.get(k)
                    if ts is None:
                        tensors[k], parents[k] = {t}, {c: None}
                    else:
                        ts.add(t)
                        parents[k][c] = None
                i += 1
        self.nodes = nodes
        # id(node) -> its number (its weight's index); zip and map: no Python loop over ~200k nodes
        self.index = dict(zip(map(id, nodes), range(len(nodes))))
        self._readers = (tensors, parents)
        self._shares = None
        n_nodes = len(nodes)
        self._cost_memory = (np.fromiter(map(attrgetter("cost"), nodes), np.float64, n_nodes),
                             np.fromiter(map(attrgetter("memory"), nodes), np.float64, n_nodes))
        self.reads: dict[str, tuple] = {}  # _shared_seeds' view of each class's readers (_reads)
        self._last_weights: tuple[float | None, list[float]] = (None, [])

    def weights(self, penalty: float) -> list[float]:
        """Each node's cost + penalty * memory, by node number: numpy's float64 multiply and add, each rounded
        as Python's are (the same floats as the expression per node, without a Python loop over the nodes)."""
        if self._last_weights[0] != penalty:  # the local search asks again at one price
            cost, memory = self._cost_memory
            self._last_weights = (penalty, (cost + penalty * memory).tolist())
        return self._last_weights[1]

    def shares(self) -> dict[str, int]:
        """For each class some node reads: how many tensors read it (at least 1), the share _amortized splits its
        cost by."""
        if self._shares is None:
            self._shares = {c: max(len(ts), 1) for c, ts in self.readers()[0].items()}
        return self._shares

    def readers(self) -> tuple[dict[str, set], dict[str, dict]]:
        """For each class: the tensors whose nodes read it, and the classes that do (a dict for a stable
        order: the seeds' scores are float sums, and a set's order changes from run to run)."""
        return self._readers


@dataclass
class _Weighted:
    """The classes in topological order (a class is a bit of a set), their nodes numbered and weighted."""
    order: list[str]
    index: dict[int, int]  # id(node) -> its number
    weight: list[float]  # cost + penalty * memory, by node number
    skeleton: _Skeleton | None = None

    @classmethod
    def of(cls, graph: PhysGraph, order: list[str], penalty: float, skeleton: _Skeleton | None = None
           ) -> "_Weighted":
        sk = skeleton if skeleton is not None else _Skeleton(graph, order)
        return cls(order, sk.index, sk.weights(penalty), sk)


Best = dict[str, tuple[float, int, Node]]  # class -> (cost of its set, its set as a bitset of classes, its node)


def _greedy_sets(graph: PhysGraph, w: _Weighted, paid: dict[str, Node] | None = None,
                 base: Best | None = None, affected: set[str] | None = None) -> Best:
    """Each class's cheapest set of nodes, shared descendants counted once. Classes in `paid` are held
    at their given node and cost nothing (their value is bought anyway); with `base`, only `affected`
    classes are recomputed (the others' sets cannot change). A set holds one node per class it reaches (each
    class's pick is fixed before any set that reads it is built), so it is a bitset over classes (bit = the
    class's position in the order), each bit weighing its class's pick: C bits a set where a bitset over
    nodes took N (a 2x4 mesh's Llama window has ~7 nodes a class; its sets over nodes filled 24 GB). A
    one-child node's set (a collective, a Keep: most of a 2-D mesh's graph) is its bit over its child's set,
    made only where a set of several children reads it (_mask): its cost alone decides the class's pick.
    A class whose pick weighs nothing (a Keep, a Proj, a view; at price 0 a free node) has no bit: its
    weight adds 0.0 to a sum, which changes no float, so the sets' sums are the same without it (on a 2x2
    mesh's Qwen2 training step 63% of the picks, and the bits walked per pass 199k -> 55k); its bit is
    the real weight's (`w.weight`), not `paid`'s zero, so _paid_cost still sees a bought class that costs."""
    sk = w.skeleton if w.skeleton is not None else _Skeleton(graph, w.order)
    weight = real = w.weight
    if paid:
        weight = list(weight)
        for n in paid.values():
            weight[w.index[id(n)]] = 0.0
    # the classes kept from base: no affected class is below one of them (affected is closed upwards), so
    # their sets hold kept classes only
    best: Best = {} if base is None else dict(base) if affected is None else \
        {c: b for c, b in base.items() if c not in affected}
    position, index = sk.position, w.index
    picked = [0.0] * len(w.order)  # by class bit: the weight of the class's pick
    for c, (_, _, n) in best.items():
        picked[position[c]] = weight[index[id(n)]]
    entries, get = sk.entries, best.get
    for c in w.order if affected is None else [c for c in w.order if c in affected]:
        pick = None  # (cost, node, its number, its set or None: a one-child node's, made only when kept)
        bound = 0.0  # pick's cost less the tie margin: a later node replaces it only below this
        bit = position[c]
        if paid and c in paid:
            n = paid[c]
            es = [e for e in entries[c] if e[0] is n]
        else:
            es = entries[c]
        for n, i, kids, one in es:
            if one is not None:  # a collective, a Keep: its cost decides; its set is made if kept
                b = get(one)
                if b is None:
                    continue
                cost = weight[i] + b[0]
                if pick is None or cost < bound:
                    pick, bound = (cost, n, i, None), cost - 1e-15
                continue
            for ch in kids:
                if ch not in best:
                    break
            else:
                if not kids:
                    mask, cost = 0, weight[i]  # its own bit added where it is picked
                else:
                    # start from the costliest child's set as a whole; walk only what the others add to it,
                    # so a residual chain (each set holding the previous one) stays linear
                    if len(kids) == 2:  # as sorted(reverse=True) orders two (stable: equal costs keep their order)
                        if best[kids[1]][0] > best[kids[0]][0]:
                            kids = [kids[1], kids[0]]
                    else:
                        kids = sorted(kids, key=lambda ch: best[ch][0], reverse=True)
                    mask = best[kids[0]][1]
                    if not isinstance(mask, int):
                        mask = _mask(best, kids[0])
                    cost = weight[i] + best[kids[0]][0]
                    for ch in kids[1:]:  # (the node's own bit is added to the pick's set only: no child's set has it)
                        new = best[ch][1]
                        if not isinstance(new, int):
                            new = _mask(best, ch)
                        grown = mask | new  # | and ^ of two sets: a few times cheaper than new & ~mask on big ints
                        new = grown ^ mask  # what ch's set adds
                        mask = grown
                        if new:
                            cost = _sum_bits(cost, new, picked)
                if pick is None or cost < bound:
                    pick, bound = (cost, n, i, mask), cost - 1e-15
        if pick is not None:
            cost, n, i, mask = pick
            if mask is None:  # the set made where it is read (bit -1: none of its own)
                mask = (bit if real[i] else -1, n.children[0])
            elif real[i]:
                mask |= 1 << bit
            best[c] = (cost, mask, n)
            picked[bit] = weight[i]
    return best


# _greedy_sets adds the weights of what a child adds to a set (_sum_bits) by clearing its highest bit at a time (each
# step costs the int's length, which shrinks as it goes) while it has at most this many bits; the rest through the
# int's bytes (_wide_bits), one pass over them, then only the bits (a 2x2 mesh's Qwen2 training step: 36,762
# classes, up to ~1,000 new bits a node; most add one or two)
BITS_BY_BYTES = 8
_BYTE_BITS = [tuple(i for i in range(8) if b >> i & 1) for b in range(256)]


def _sum_bits(cost: float, m: int, picked: list[float]) -> float:
    """cost plus picked[b] for each set bit b of m > 0, lowest first (greedy's order of the sums: the same floats).
    Without int.bit_count or m & -m: on sets of ~36k bits each costs several times a | or ^ (bit_count ~7 us).

    >>> _sum_bits(1.0, 0b10110, [0.0, 2.0, 4.0, 8.0, 16.0]), _sum_bits(0.0, (1 << 12) - 1, [float(b) for b in range(12)])
    (23.0, 66.0)
    """
    top = []  # the highest bits, highest first
    while m:
        if len(top) == BITS_BY_BYTES:  # many: the rest (all below top's) through the bytes
            for b in _wide_bits(m):
                cost += picked[b]
            break
        b = m.bit_length() - 1
        top.append(b)
        m ^= 1 << b
    for b in reversed(top):
        cost += picked[b]
    return cost


def _wide_bits(m: int) -> list[int]:
    """The positions of m's set bits, lowest first (the order greedy sums their weights in: the same floats).

    >>> _wide_bits(0b10110), _wide_bits(1 << 70 | 0b1011011111)
    ([1, 2, 4], [0, 1, 2, 3, 4, 6, 7, 9, 70])
    """
    raw = m.to_bytes((m.bit_length() + 7) // 8, "little")
    return [8 * j + b for j in np.frombuffer(raw, np.uint8).nonzero()[0].tolist() for b in _BYTE_BITS[raw[j]]]


def _mask(best: Best, c: str) -> int:
    """Class c's set as a bitset, made (and kept in `best`) through the one-child picks below it."""
    m = best[c][1]
    if isinstance(m, int):
        return m
    chain = []  # the one-child picks down to a made set
    while not isinstance(m, int):
        chain.append(c)
        c = m[1]
        m = best[c][1]
    for c in reversed(chain):
        cost, (bit, _), n = best[c]
        if bit >= 0:
            m = (1 << bit) | m
        best[c] = (cost, m, n)
    return m


def _chosen(best: Best, w: _Weighted, cls: str = ROOT) -> dict[str, Node] | None:
    """The nodes of cls's set, by class in topological order: the picks reached from cls's (a set holds one
    node per class: each class's pick is fixed before any set that contains it is built)."""
    if cls not in best:
        return None
    reached, stack = set(), [cls]
    while stack:
        c = stack.pop()
        if c not in reached:
            reached.add(c)
            stack.extend(best[c][2].children)
    if w.skeleton is not None:  # in the order's order, without a walk over every class
        return {c: best[c][2] for c in sorted(reached, key=w.skeleton.position.__getitem__)}
    return {c: best[c][2] for c in w.order if c in reached}


def _amortized(graph: PhysGraph, order: list[str], penalty: float, skeleton: _Skeleton | None = None,
               weight: list[float] | None = None) -> dict[str, Node] | None:
    """Tree-cost greedy where a class's cost is split among the logical consumers that may read it: a value
    several consumers share looks cheaper to each (the case plain greedy-DAG misses: b and c each
    alone prefer their own copy, together they prefer one shared a). `weight`: the skeleton's nodes'
    cost + penalty * memory, where the caller has them (_Weighted.weight: the same floats)."""
    sk = skeleton if skeleton is not None else _Skeleton(graph, order)
    if weight is None:
        weight = [n.cost + penalty * n.memory for n in sk.nodes]
    share = sk.shares()
    part: dict[str, float] = {}  # class -> its pick's cost over its share (what each reader adds)
    picks: dict[str, Node] = {}
    get = part.get
    for c in order:
        pick, bound = None, 0.0
        for n, i, _, _ in sk.entries[c]:
            ch = n.children
            if len(ch) == 1:  # a collective, a Keep: (its weight) + (0 + the child's part), the same float
                t = get(ch[0])
                if t is None:
                    continue
                cost = weight[i] + t
            else:
                total = 0  # the sum of the children's shares, in the children's order (as sum() added them)
                for x in ch:
                    t = get(x)
                    if t is None:
                        total = None
                        break
                    total += t
                if total is None:
                    continue
                cost = weight[i] + total
            if pick is None or cost < bound:
                pick, bound = n, cost - 1e-15
                kept = cost
        if pick is not None:
            picks[c] = pick
            part[c] = kept / share.get(c, 1)
    if ROOT not in picks:
        return None
    chosen, stack = {}, [ROOT]
    while stack:
        c = stack.pop()
        if c not in chosen:
            chosen[c] = picks[c]
            stack.extend(chosen[c].children)
    return chosen


def _readers(graph: PhysGraph, order: list[str]) -> tuple[dict[str, set], dict[str, dict]]:
    """For each class: the tensors whose nodes read it, and the classes that do (a dict for a stable
    order: the seeds' scores are float sums, and a set's order changes from run to run)."""
    return _Skeleton(graph, order).readers()


def _shared_seeds(graph: PhysGraph, w: _Weighted, best: Best, tensors: dict[str, set],
                  parents: dict[str, dict], layouts: bool = False) -> list[str]:
    """Values worth trying to share, most promising first: what their readers would save if the value were
    free (each reader's cheapest node through it against its own best, children's costs as trees), less the
    value's own cost. A value worth sharing is one no single reader buys on its own.

    Without `layouts`, the values several tensors read. With it, the values of a tensor that the current
    plan holds in several layouts, read by several of its own layouts or levels (each a value of its own)
    or by other tensors: one layout computed once and sliced or gathered into the others, where greedy
    derived each layout its own cheapest way (fuzz seed 22 case 169: gelu computed sharded then gathered,
    and sharded once more for a second reader, where gathering its input once serves both). Those are
    many on a GPT layer, so with `layouts` only values whose score is positive are tried.

    The values are tried in the order of what the current plan would save: a reader's saving is capped at
    what the plan pays for the reader's tensor in the reader's layout (or, where the plan holds the tensor
    in no such layout, in the cheapest it holds; a tensor the plan does not hold, such as a rewrite's
    merged GEMM, is not capped: test_gqa_projections_merge_on_a_2x2_mesh). A reader's own best counts every layout alike, so a
    costly value whose readers are costly layouts no plan takes (an attention backward in a layout split
    three ways) scored above the value the plan needs (fuzz seed 37 case 6459: the forward attention
    computed replicated once, read by its three outputs, was the 204th of 325 values and the tries'
    budget ended at the 15th; ranked by the plan's saving it is the 11th and the plan is the optimum,
    62% cheaper).

    >>> g = PhysGraph({"x": [Node("Load", (), "x")],
    ...                "a": [Node("Apply", ("x",), "a", 0, cost=4e-6)],
    ...                "b": [Node("Apply", ("a",), "b", 0, cost=1e-6)], "c": [Node("Apply", ("a",), "c", 0, cost=1e-6)]},
    ...               ident={"x": ("x", "R", 0), "a": ("a", "R", 0), "b": ("b", "R", 0), "c": ("c", "R", 0)})
    >>> order = _topo_order(g, with_roots(g, {"b": ["b"], "c": ["c"]}))
    >>> w = _Weighted.of(g, order, 0.0)
    >>> best = _greedy_sets(g, w)
    >>> _shared_seeds(g, w, best, *w.skeleton.readers())  # a (read by b and c) saves each of them its 4 us
    ['a']
    """
    ident = graph.ident

    def tensor(c: str) -> str:
        return ident[c][0] if c in ident else c
    held: dict[str, set] = {}
    plan = _chosen(best, w) or {}
    if layouts:
        for c in plan:
            if c in ident:
                held.setdefault(ident[c][0], set()).add(ident[c][1])
        if all(len(lays) < 2 for lays in held.values()):
            return []  # no tensor held in two layouts: no value scores (the loop below skips every one)
    pays: dict = {}  # what the plan pays for each tensor (its cheapest class held) and each (tensor, layout)
    for c in plan:
        for k in (tensor(c), ident[c][:2] if c in ident else None):
            if k is not None:
                pays[k] = min(pays.get(k, float("inf")), best[c][0])
    scored = []
    reads = w.skeleton.reads if w.skeleton is not None else {}
    weight = w.weight
    for d, ts in tensors.items():
        if d not in best:
            continue
        if not layouts and len(ts) < 2:
            continue
        if layouts and len(held.get(tensor(d), ())) < 2:
            continue
        r = reads.get(d)
        if r is None:
            r = reads[d] = _reads(graph, d, parents[d], tensor, w.index)
        apart, readers = r
        if layouts and not apart:
            continue
        saving: dict[str, float] = {}
        planned: dict[str, float] = {}  # the same, each reader's saving capped at what the plan pays
        for p, t_plain, t_own, lay, tp, nodes in readers:
            if p not in best:
                continue
            t = t_own if layouts else t_plain
            bp = best[p][0]
            paid = pays.get(lay) if lay is not None else None
            paid = min(bp, paid if paid is not None else pays.get(tp, bp))
            for i, kids, others in nodes:
                if all(ch in best for ch in kids):
                    alt = weight[i] + sum(best[ch][0] for ch in others)
                    saving[t] = max(saving.get(t, 0.0), bp - alt)
                    planned[t] = max(planned.get(t, 0.0), paid - alt)
        if sum(saving.values()) - best[d][0] > 0 or not layouts:
            scored.append((sum(planned.values()) - best[d][0], d))
    scored.sort(key=lambda sd: -sd[0])  # stable: ties keep topological order, so runs are reproducible
    return [d for _, d in scored]


def _reads(graph: PhysGraph, d: str, parents: dict, tensor, index: dict[int, int]) -> tuple[bool, list]:
    """What _shared_seeds reads of the graph about d, whatever the price (kept in the skeleton): whether d's readers
    name two keys with layouts (a reader of d's own tensor is a value of its own; readers of another tensor are one
    consumer's alternatives), and for each reader p (in `parents` order): p, its key without and with layouts,
    its (tensor, layout) and tensor (what the plan pays for it), and its nodes that read d: (number, distinct
    children, the others in the order set() gives them, as the sum over them always took them)."""
    own = tensor(d)
    ident = graph.ident
    readers, keys = [], set()
    for p in parents:
        tp = tensor(p)
        t_own = p if tp == own else tp
        keys.add(t_own)
        nodes = [(index[id(n)], tuple(set(n.children)), tuple(ch for ch in set(n.children) if ch != d))
                 for n in graph.classes[p] if d in n.children]
        readers.append((p, tp, t_own, ident[p][:2] if p in ident else None, tp, nodes))
    return len(keys) >= 2, readers


def _ancestors(classes, parents: dict[str, dict]) -> set[str]:
    """`classes` and every class that reads one of them, directly or not."""
    seen = set(classes)
    stack = list(seen)
    get = parents.get
    while stack:
        for p in get(stack.pop(), ()):
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def _paid_cost(w: _Weighted, paid: dict[str, Node], mask: int) -> float:
    """What the bought nodes of a set weigh (a bought class holds its bought node in every set)."""
    position = w.skeleton.position
    return sum(w.weight[w.index[id(n)]] for c, n in paid.items() if mask >> position[c] & 1)


def _seeded(graph: PhysGraph, w: _Weighted, best: Best, budget: int) -> dict[str, Node] | None:
    """Greedy again with one shared value bought up front (its greedy set, at no cost), for the most
    promising values in turn: the route that shares a value (an allgather of x read by two consumers) is
    found even where each consumer alone prefers its own. The best try of a round stays bought in the
    next round (measured: keeping every improving try bought at once is worse, it anchors on the first).
    Two searches from greedy's plan, the cheaper kept: values several tensors read, then values of the
    tensors the plan holds in several layouts (_shared_seeds; apart, since what the first buys anchors
    the second). Each try recomputes only the classes above what it buys; `budget` bounds the classes
    recomputed by the first search's tries (deterministic, unlike a clock), and the second gets what the
    first left, or a quarter of it at least. Returns the cheapest plan found if it beats `best`."""
    if ROOT not in best:
        return None
    tensors, parents = (w.skeleton or _Skeleton(graph, w.order)).readers()
    found, start = None, best
    tried: set[str] = set()  # values tried from greedy's plan (a second try from there gives the same)
    left = budget
    for layouts in (False, True):
        if layouts:
            left = max(left, budget // 4)
        paid, best = {}, start
        first = True  # each search tries its most promising value whatever the budget: on a graph of 10,000
        # classes and more a value most classes read takes more than all of it (fuzz seed 38 case 164: x1
        # gathered whole, 9,682 classes recomputed of a budget of 5,637; its plan 30% faster, the exact optimum)
        for round_ in range(3):  # rounds: the best try of a round is the base of the next
            seeds = [d for d in _shared_seeds(graph, w, best, tensors, parents, layouts) if d not in paid]
            if round_ == 0 and layouts:
                seeds = [d for d in seeds if d not in tried]
            current, win = best[ROOT][0] + _paid_cost(w, paid, _mask(best, ROOT)), None
            for d in seeds:
                if left < 0 and not first:  # spent: a try only lowers it (the check below), so no walk to find that
                    break  # (a 2x2 mesh's Llama step walked 30k ancestors of its second seed to break there)
                cone = _chosen(best, w, d)
                priced = [c for c, n in cone.items() if c not in paid and w.weight[w.index[id(n)]] > 0]
                affected = _ancestors(priced, parents)
                left -= len(affected)
                if left < 0 and not first:
                    break
                first = False
                if round_ == 0:
                    tried.add(d)
                trial_paid = {**paid, **cone}
                trial = _greedy_sets(graph, w, trial_paid, best, affected)
                if ROOT not in trial:
                    continue
                cost = trial[ROOT][0] + _paid_cost(w, trial_paid, _mask(trial, ROOT))  # bought nodes it uses
                if cost < current - 1e-15:
                    current, win = cost, (trial_paid, trial)
            if win is None:
                break
            paid, best = win
            if found is None or current < found[0]:
                found = (current, _chosen(best, w))
    return None if found is None else found[1]


def _dag_weight(choice: dict[str, Node], penalty: float) -> float:
    return sum(n.cost + penalty * n.memory for n in choice.values())


def _switch(choice: dict[str, Node], refs: dict[str, int], fallback: dict[str, Node], c: str, n: Node,
            penalty: float) -> tuple[float, dict[str, Node], set[str], dict[str, int]] | None:
    """What switching class c to node n changes: (change of weight, classes added with their fallback
    nodes, classes no longer read, change of each class's reader count); None if n needs a class that
    neither the plan nor the fallback has. Walks only the changed part of the plan."""
    delta = n.cost + penalty * n.memory - choice[c].cost - penalty * choice[c].memory
    added: dict[str, Node] = {}
    dref: dict[str, int] = {}
    stack = list(set(n.children))
    while stack:  # first what n reads (so that nothing it reads is counted as dropped below)
        ch = stack.pop()
        dref[ch] = dref.get(ch, 0) + 1
        if ch in choice or ch in added:
            continue
        m = fallback.get(ch)
        if m is None:
            return None
        added[ch] = m
        delta += m.cost + penalty * m.memory
        stack.extend(set(m.children))
    removed: set[str] = set()
    stack = list(set(choice[c].children))
    while stack:  # then what only the old node read
        ch = stack.pop()
        dref[ch] = dref.get(ch, 0) - 1
        if ch in choice and ch not in removed and refs.get(ch, 0) + dref[ch] == 0:
            removed.add(ch)
            delta -= choice[ch].cost + penalty * choice[ch].memory
            stack.extend(set(choice[ch].children))
    return delta, added, removed, dref


def _completions(sk: _Skeleton, choice: dict[str, Node], penalty: float) -> dict[str, Node]:
    """Each class's cheapest node given the plan `choice`: a class of the plan costs nothing (and keeps its
    node), any other its node's weight plus its children's completions (as trees). What a switch of the
    local search newly needs is completed from these: a route through values the plan already holds (the
    output t2 taken in the layout whose input the plan already transposes, fuzz seed 21 case 225), not
    the route another whole plan took."""
    weight = sk.weights(penalty)  # each node's cost + penalty * memory (the same floats as per node)
    cheapest: dict[str, float] = {}
    node: dict[str, Node] = {}
    get = cheapest.get
    for c in sk.order:
        n = choice.get(c)
        if n is not None:
            cheapest[c], node[c] = 0.0, n
            continue
        pick, bound = None, 0.0
        for n, i, kids, one in sk.entries[c]:
            if one is not None:
                b = get(one)
                if b is None:
                    continue
                cost = weight[i] + b
            else:
                cost = weight[i]
                for ch in kids:
                    b = get(ch)
                    if b is None:
                        cost = None
                        break
                    cost += b
                if cost is None:
                    continue
            if pick is None or cost < bound:
                pick, bound, kept = n, cost - 1e-15, cost
        if pick is not None:
            cheapest[c], node[c] = kept, pick
    return node


def _improve(graph: PhysGraph, choice: dict[str, Node], fallback: dict[str, Node], penalty: float,
             budget: int = 2_000_000, memory_limit: float | None = None, skeleton: _Skeleton | None = None
             ) -> dict[str, Node]:
    """Local search: switch one class's node at a time (completing what it newly needs from `fallback`,
    then, with the skeleton, from the cheapest routes given the plan: _completions) while the whole DAG's
    cost drops (and, with memory_limit, its memory stays within it). Readers are counted, so a try walks only what it
    changes; `budget` bounds the classes walked over all tries."""
    choice = dict(choice)
    given = fallback
    memory = _total(choice)[1]
    refs: dict[str, int] = {ROOT: 1}
    for m in choice.values():
        for ch in set(m.children):
            refs[ch] = refs.get(ch, 0) + 1
    # sweeps completing from `fallback` first, then (skeleton given) from the cheapest routes given the plan
    # as each sweep starts: each search only improves the other's plan (measured: completions alone end in
    # another local optimum, 0.3% slower on the marked GPT layer grad of test_recompute)
    modes = [False] * 4 + ([True] * 4 if skeleton is not None else [])
    while modes:
        completing = modes.pop(0)
        better = False
        if completing:
            fallback = {**given, **_completions(skeleton, choice, penalty)}
        for c in list(choice):
            for n in graph.classes[c]:
                if c not in choice or n is choice[c]:
                    continue
                move = _switch(choice, refs, fallback, c, n, penalty)
                if move is None:
                    continue
                delta, added, removed, dref = move
                budget -= 1 + len(added) + len(removed)
                if budget < 0:
                    return choice
                if memory_limit is not None:
                    grown = n.memory - choice[c].memory + sum(m.memory for m in added.values()) \
                        - sum(choice[r].memory for r in removed)
                    if memory + grown > memory_limit:
                        continue
                if delta < -1e-15:
                    if memory_limit is not None:
                        memory += grown
                    choice[c] = n
                    choice.update(added)
                    for ch, k in dref.items():
                        refs[ch] = refs.get(ch, 0) + k
                    for r in removed:
                        del choice[r]
                        refs.pop(r, None)
                    better = True
        if not better:  # this search is done: on to the next, if any
            modes = [m for m in modes if m != completing]
    return choice


LAYOUT_BIAS = 0.5  # the price of computing in the favoured layout, in _layout_plans (measured on the GPT-3
# training step: 0.5 finds grad_wq/wk/wv in S0 with their AdamW chains; 0, everything in one layout, none)
LAYOUT_PLANS = 8  # the layouts favoured in turn, most used first (a 2-D mesh has many)
# relinking only on graphs up to this many classes: each layout plan is a whole greedy pass over bitsets of
# the graph's nodes (quadratic); on the 8-layer GPT-3 training step (16,301 classes) it found nothing and
# took optimize from 16.8 to 25.2 s; on the 1-layer step (2,333 classes) it adds 0.05-0.1 s a pass
RELINK_MAX_CLASSES = 10_000
# ... unless the graph has few tensors (each in many layouts: attention on a 2x2x2 mesh), whose greedy passes
# stay cheap (fuzz seed 38 case 7070: 10,812 classes of 22 tensors, 0.06 s a pass; the layout plans' regions
# took greedy from 36.8% over exact to its optimum, and that incumbent let the exact DP prove it in 2 s where
# it gave up and the 0/1 program ran out its 60 s)
RELINK_MAX_TENSORS = 64


def _few_tensors(graph: PhysGraph, order: list[str]) -> bool:
    """Whether the graph has at most RELINK_MAX_TENSORS tensors."""
    return len({graph.ident[c][0] for c in order if c in graph.ident}) <= RELINK_MAX_TENSORS


def _relinks(graph: PhysGraph, order: list[str]) -> bool:
    """Whether greedy relinks the layout plans' regions on this graph (see RELINK_MAX_CLASSES)."""
    return len(order) <= RELINK_MAX_CLASSES or _few_tensors(graph, order)


def _layout_plans(graph: PhysGraph, w: _Weighted, surcharge: bool = False) -> list[dict[str, Node]]:
    """Greedy's plans with the computations (level-0 Apply nodes, and the multi-output ops their outputs
    project) of one layout at LAYOUT_BIAS of their price (with surcharge, and those of the other layouts
    dearer by the cheapest collective's), one plan per layout: whole regions computed in one layout, which
    greedy's per-class choices do not reach from a plan that computes them in another (a weight gradient
    and its AdamW chain computed in S0 rather than S1: every tensor of the chain would have to switch at
    once). _relink takes the parts of these plans that pay."""
    sk = w.skeleton
    levels: dict[str, list[str]] = {}
    for c in w.order:
        idn = graph.ident.get(c)
        if idn is not None and idn[2] == 0:
            levels.setdefault(idn[1], []).append(c)
    # a multi-output op (attention and its lse, its backward's three gradients) computes in a class of its
    # own that no layout names; it is a computation of the layout whose outputs project it (fuzz seed 37
    # case 4048: the attention backward, left at its price in the replicated layout's plan, stayed split
    # and its gradients gathered; 23% over exact -> equal)
    for lay, cs in levels.items():
        cs.extend(sorted({ch for c in cs for n in graph.classes[c] if n.op == "Proj" for ch in n.children
                          if ch not in graph.ident}))
    # surcharge: the other layouts' computations dearer by the cheapest collective: a factor on a price of about
    # nothing (an elementwise op) favours nothing, so a chain of them stayed where its input was gathered
    # and each output was sliced back (fuzz seed 37 case 2238: 22% over exact -> equal)
    extra = min((w.weight[i] for c in w.order for n, i, _, _ in sk.entries[c] if n.op == "Coll" and w.weight[i] > 0),
                default=0.0) if surcharge else 0.0
    plans = []
    for lay in sorted(levels, key=lambda k: -len(levels[k]))[:LAYOUT_PLANS]:
        weight = list(w.weight)
        for c in levels[lay]:
            for n, i, _, _ in sk.entries[c]:
                if n.op == "Apply":
                    weight[i] *= LAYOUT_BIAS
        for other, cs in levels.items():
            if extra and other != lay:
                for c in cs:
                    for n, i, _, _ in sk.entries[c]:
                        if n.op == "Apply":
                            weight[i] += extra
        biased = _Weighted(w.order, w.index, weight, sk)
        plan = _chosen(_greedy_sets(graph, biased), biased)
        if plan is not None:
            plans.append(plan)
    return plans


def _differing_regions(graph: PhysGraph, choice: dict[str, Node], other: dict[str, Node]) -> list[set[str]]:
    """The tensors the two plans make differently (a class held by one only, or by another node), grouped
    into connected regions: two such tensors are joined where either plan has one read the other."""
    ident = graph.ident

    def tensor(c: str) -> str:
        return ident[c][0] if c in ident else c
    differ = {tensor(c) for c, n in choice.items() if other.get(c) is not n}
    differ |= {tensor(c) for c in other if c not in choice}
    parent = {t: t for t in differ}

    def find(t: str) -> str:
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t
    for plan in (choice, other):
        for c, n in plan.items():
            a = tensor(c)
            if a not in differ:
                continue
            for ch in n.children:
                b = tensor(ch)
                if b in differ and b != a:
                    parent[find(a)] = find(b)
    regions: dict[str, set[str]] = {}
    for t in sorted(differ):
        regions.setdefault(find(t), set()).add(t)
    return list(regions.values())


class _Prefer:
    """A fallback that takes `first`'s node for the classes of `tensors` and `second`'s for the others
    (either where the preferred plan lacks the class)."""

    def __init__(self, graph: PhysGraph, tensors: set[str], first: dict, second: dict):
        self.ident, self.tensors, self.first, self.second = graph.ident, tensors, first, second

    def get(self, c: str) -> Node | None:
        idn = self.ident.get(c)
        inside = (idn[0] if idn is not None else c) in self.tensors
        a, b = (self.first, self.second) if inside else (self.second, self.first)
        n = a.get(c)
        return n if n is not None else b.get(c)


def _relink(graph: PhysGraph, choice: dict[str, Node], others: list[dict[str, Node]], penalty: float,
            memory_limit: float | None = None) -> dict[str, Node]:
    """Path relinking: for each other plan, each connected region of tensors it makes differently is tried
    as a whole (every class of the region's tensors switched to the other plan's node, what they newly
    read completed from it) and kept where the whole DAG's cost drops. The moves of the local search
    switch one class at a time, so a region whose tensors only pay together (attention kept head-split
    from the projections on, an AdamW chain in the layout its gradient is cheaper in) is out of its reach.
    Each try walks only what it changes (reader counts, as _improve) and is undone if it does not pay, or
    (memory_limit) if it takes the plan's memory over the bound.

    >>> g = PhysGraph({"x": [Node("Load", (), "x")],
    ...                "a": [Node("Apply", ("x",), "a", 0, cost=5e-6), Node("Apply", ("x",), "a", 1, cost=1e-6)],
    ...                "b": [Node("Apply", ("a",), "b", 0, cost=1e-6)]}, ident={"a": ("a", "R", 0)})
    >>> roots = with_roots(g, {"b": ["b"]})
    >>> plan = greedy_dag(g, roots).choice
    >>> worse = {**plan, "a": g.classes["a"][0]}
    >>> _relink(g, worse, [plan], 0.0)["a"].sid  # the region {a} taken from the cheaper plan
    1
    >>> g.classes["a"][1] = Node("Apply", ("x",), "a", 1, cost=1e-6, memory=8.0)
    >>> plan = greedy_dag(g, roots).choice
    >>> _relink(g, worse, [plan], 0.0, memory_limit=4.0)["a"].sid  # faster, but 8 bytes over a bound of 4
    0
    """
    choice = dict(choice)
    refs: dict[str, int] = {ROOT: 1}
    for m in choice.values():
        for ch in set(m.children):
            refs[ch] = refs.get(ch, 0) + 1
    ident = graph.ident
    memory = _total(choice)[1]
    for other in others:
        for region in _differing_regions(graph, choice, other):
            fallback = _Prefer(graph, region, other, choice)
            switches = [c for c, n in other.items() if c in choice and choice[c] is not n
                        and (ident[c][0] if c in ident else c) in region]
            total, undo, grown = 0.0, [], 0.0
            for c in switches:
                if c not in choice or choice[c] is other[c]:
                    continue
                move = _switch(choice, refs, fallback, c, other[c], penalty)
                if move is None:
                    continue
                total += move[0]
                if memory_limit is not None:
                    grown += other[c].memory - choice[c].memory + sum(m.memory for m in move[1].values()) \
                        - sum(choice[r].memory for r in move[2])
                undo.append(_apply(choice, refs, c, other[c], move))
            if total >= -1e-15 or (memory_limit is not None and memory + grown > memory_limit):
                for record in reversed(undo):
                    _undo(choice, refs, record)
            else:
                memory += grown
    return choice


def _apply(choice: dict[str, Node], refs: dict[str, int], c: str, n: Node, move) -> tuple:
    """Make _switch's move (class c to node n) in the plan and its reader counts; returns what _undo needs."""
    _, added, removed, dref = move
    old = choice[c]
    choice[c] = n
    choice.update(added)
    for ch, k in dref.items():
        refs[ch] = refs.get(ch, 0) + k
    dropped = {r: choice.pop(r) for r in removed}
    for r in removed:
        refs.pop(r, None)
    return c, old, list(added), dropped, dref


def _undo(choice: dict[str, Node], refs: dict[str, int], record: tuple) -> None:
    """Take back one _apply."""
    c, old, added, dropped, dref = record
    choice.update(dropped)
    for r in dropped:
        refs[r] = 0
    for ch, k in dref.items():
        refs[ch] = refs.get(ch, 0) - k
    for a in added:
        del choice[a]
    choice[c] = old


def _best_of(graph: PhysGraph, order: list[str], penalty: float, improve: bool = True,
             skeleton: _Skeleton | None = None, buy: bool = True) -> dict[str, Node] | None:
    """The cheapest of greedy-DAG, amortized greedy and (improve) greedy with shared values bought up
    front, then (improve) polished by local search and, without a memory price on graphs up to
    RELINK_MAX_CLASSES (or of few tensors: _relinks), by the regions of the layout plans (_relink). skeleton: the graph's, if built already."""
    w = _Weighted.of(graph, order, penalty, skeleton)
    best = _greedy_sets(graph, w)
    found = [c for c in (_chosen(best, w), _amortized(graph, order, penalty, w.skeleton, w.weight)) if c is not None]
    if not found:
        return None
    if improve:
        # a try recomputes classes whose sets are bitsets over all nodes, so one costs about the graph's
        # size: the budget keeps the extra time about constant (every seed on small graphs; 0.2 s, a
        # few seeds, on a 96-layer GPT)
        seeded = _seeded(graph, w, best, budget=min(20000 + 2 * len(order), 60_000_000 // max(len(order), 1)))
        if seeded is not None:
            found.append(seeded)
    found.sort(key=lambda ch: _dag_weight(ch, penalty))
    if not improve:
        return found[0]
    fallback = {c: n for ch in reversed(found) for c, n in ch.items()}
    improved = _improve(graph, found[0], fallback, penalty, skeleton=w.skeleton)
    # then the regions of the layout plans, and the local search again only where one paid (no cost where
    # none does)
    # Under a memory bound (a price per byte) left out: a region that pays in time may not fit, and the
    # bisection's plans are compared by what fits (measured: fuzz seed 22 case 190, 8% dearer with it)
    if penalty > 0 or not _relinks(graph, order):
        return improved
    # two rounds: the layout plans, then the same with the other layouts' computations surcharged (the
    # first round's plan kept where the second finds nothing: each round ends in a local optimum of its own)
    # on a graph of few tensors each layout plan is first polished by the local search: a region pays only once
    # the plan no longer computes it twice (fuzz seed 38 case 711: the attention backward in the layout its free
    # partial outputs are cheapest from, and again split for the pinned one, whose local search gathers it from
    # the first: 18.6% over exact -> 0.006%), completing also from the cheapest routes given the layout plan
    # (seed 39 case 1395: an output moved to the attention backward the plan holds, which no fallback plan
    # reaches in that layout: 11.6% over exact -> equal; greedy extraction CPU +19-84% on such graphs, seed 39
    # cases 1380-1410: 333 -> 451 ms over 8 of them, 1395 2.1 -> 3.9 s). On the GPT-3 training step (hundreds
    # of tensors) it found a plan 1.7% faster at 44% more extraction CPU: left out there
    polish = _few_tensors(graph, order)
    for surcharge in (False, True):
        plans = _layout_plans(graph, w, surcharge)
        if polish:
            plans = [_improve(graph, p, fallback, penalty, skeleton=w.skeleton) for p in plans]
        relinked = _relink(graph, improved, plans, penalty)
        if _dag_weight(relinked, penalty) < _dag_weight(improved, penalty):
            improved = _improve(graph, relinked, fallback, penalty, skeleton=w.skeleton)
    if buy and polish and len(order) <= BOUGHT_MAX_CLASSES:
        improved = _bought_computations(graph, w, improved, fallback, penalty)
    return _regathered(graph, improved, fallback, penalty, w.skeleton)


# _bought_computations only on graphs up to this many classes (of few tensors): a try per multi-output
# computation the plan does not hold, each a partial greedy pass and a local search (0.4-2.5 s on the fuzz
# cases of 1,700-2,900 classes of seed 39 it was measured on)
BOUGHT_MAX_CLASSES = 4_000


def _bought_computations(graph: PhysGraph, w: _Weighted, choice: dict[str, Node], fallback: dict[str, Node],
                         penalty: float) -> dict[str, Node]:
    """Greedy again with one multi-output computation the plan does not hold (an attention, its backward, or a
    rewrite's blocks of them) bought up front, each at its cheapest route given the plan (_completions: its
    inputs taken from the layouts the plan holds, not derived afresh as greedy's own set for it would), then
    the local search; the cheapest plan kept where one beats `choice`. Its outputs are read by several tensors
    (the attention backward's three gradients), each of which alone prefers to slice or gather its layout from
    the plan's computation: only bought together do they drop it (fuzz seed 39 case 590: the backward computed
    replicated and two gradients sliced to their pinned head split, 54.0 us, where computing it head-split
    costs 50.0, the exact optimum; cases 495 66.0 -> 60.0 and 7644 66.0 -> 62.0, both exact's)."""
    sk = w.skeleton
    _, parents = sk.readers()
    multi = [d for d in w.order if d not in graph.ident and d not in choice and d in parents
             and any(n.op == "Apply" for n in graph.classes[d])
             and any(n.op == "Proj" for p in parents[d] for n in graph.classes[p])]
    if not multi:
        return choice
    near = _completions(sk, choice, penalty)
    base = _greedy_sets(graph, w)
    best, weight = choice, _dag_weight(choice, penalty)
    for d in multi:
        if d not in near:
            continue
        cone, stack = {}, [d]
        while stack:
            c = stack.pop()
            if c not in cone:
                cone[c] = choice.get(c) or near[c]
                stack.extend(cone[c].children)
        priced = [c for c, n in cone.items() if w.weight[w.index[id(n)]] > 0]
        trial = _greedy_sets(graph, w, cone, base, _ancestors(priced, parents))
        plan = _chosen(trial, w)
        if plan is None:
            continue
        plan = _improve(graph, plan, {**fallback, **near, **plan}, penalty, skeleton=sk)
        if _dag_weight(plan, penalty) < weight - 1e-15:
            best, weight = plan, _dag_weight(plan, penalty)
    return best


def _regathered(graph: PhysGraph, choice: dict[str, Node], fallback: dict[str, Node], penalty: float,
                skeleton: _Skeleton) -> dict[str, Node]:
    """Pairs of moves from the local search's optimum: a free output taken at no cost in another layout the
    plan holds (a switch of its Choose that costs nothing, so the local search never takes it), then the local
    search, kept where the pair pays. A free output that reads a computation no other output needs in that
    layout keeps it alive: the attention backward computed twice, once for the free output's layout and
    once for the others' (fuzz seed 38 case 7056, 7% over exact), or every output gathered from the layout
    the free output was cheapest in (case 164, 30%)."""
    base = _dag_weight(choice, penalty)
    outs = [c for c in choice if choice[c].op == "Choose" and len(graph.classes[c]) > 1]
    near = None  # the cheapest routes given the plan (_completions), where a move newly needs a class
    for c in outs:
        if near is None:
            near = {**fallback, **_completions(skeleton, choice, penalty)}
            refs: dict[str, int] = {ROOT: 1}
            for m in choice.values():
                for ch in set(m.children):
                    refs[ch] = refs.get(ch, 0) + 1
        for n in graph.classes[c]:
            if n is choice[c]:
                continue
            move = _switch(choice, refs, near, c, n, penalty)
            if move is None or move[0] > 1e-15 or not move[2]:  # it costs, or frees nothing
                continue
            trial = dict(choice)
            trial[c] = n
            trial.update(move[1])
            for r in move[2]:
                del trial[r]
            trial = _improve(graph, trial, fallback, penalty, skeleton=skeleton)
            weight = _dag_weight(trial, penalty)
            if weight < base - 1e-15:
                choice, base, near = trial, weight, None
                break
    return choice


# the bisection on the price of a byte stops within this fraction of it: the plans of nearby prices differ
# by float ties only (a 2-layer Qwen2 training step: past 1e-3 its 40 steps alternated between two plans
# whose memory differs 2%), and each step is a greedy pass over the whole graph (1 s on a 2x2 mesh's)
PRICE_TOLERANCE = 1e-3


# the memory bound's ladder of prices (_greedy_dag): from this fraction of the unbounded plan's time per byte
# (a price that only breaks ties), each step this many times the last, up to the bisection's price
LADDER_START = 1e-6
LADDER_STEP = 4.0


def greedy_dag(graph: PhysGraph, roots: list[str], memory_limit: float | None = None, buy: bool = True,
               least: bool = True) -> Selection:
    """Bottom-up greedy: each class keeps the cheapest node counting shared descendants once; an
    amortized variant and greedy reruns with one value several tensors read bought up front catch values
    worth sharing that no single consumer buys alone; a local search (switch one class, complete what it
    needs) polishes the cheapest. `buy=False`: without _bought_computations (the exact DP's quick plans on its
    priced graphs, which only limit its search). Under memory_limit, where no pass fits, the plan of least memory
    polished within it (smallest, up to LEAST_MEMORY_S); `least=False`: MemoryBoundError there instead.

    >>> g = PhysGraph({"w": [Node("Load", (), "w")],
    ...                "w:R": [Node("Coll", ("w",), "allgather", 0, cost=20e-6)],
    ...                "y": [Node("Apply", ("w:R",), "y", 0, cost=1e-6), Node("Apply", ("w",), "y", 1, cost=15e-6)],
    ...                "z": [Node("Apply", ("w:R",), "z", 0, cost=1e-6), Node("Apply", ("w",), "z", 1, cost=15e-6)]})
    >>> sel = greedy_dag(g, with_roots(g, {"y": ["y"], "z": ["z"]}))
    >>> round(sel.cost * 1e6), sel.choice["y"].sid  # one allgather serves y and z: 20 + 1 + 1 us
    (22, 0)
    """
    with gc_paused():
        return _greedy_dag(graph, roots, memory_limit, buy, least)


def _greedy_dag(graph: PhysGraph, roots: list[str], memory_limit: float | None, buy: bool = True,
                least: bool = True) -> Selection:
    """greedy_dag's work (the collector paused around it)."""
    order = _topo_order(graph, roots)
    skeleton = _Skeleton(graph, order)
    chosen = _best_of(graph, order, 0.0, skeleton=skeleton, buy=buy)
    if chosen is None:
        raise PlanError("no plan computes every output from the pinned inputs: a pin cannot be honoured")
    cost, mem = _total(chosen)
    if memory_limit is not None and mem > memory_limit:
        lo, hi = 0.0, 1e-12
        best_fit = None
        top = _dominant_price(graph, order)
        for _ in range(60):  # grow the price of a byte until the plan fits, then bisect (no local search
            trial = _best_of(graph, order, hi, False, skeleton)  # inside the loop: it is the costly part)
            if _total(trial)[1] <= memory_limit:
                best_fit = trial
                break
            if top is not None and hi >= top:  # a dearer byte changes no choice (fuzz seed 39 case 4028:
                break  # 40 of its 60 passes, 4 of its 15 s, ran past it, up to 1.3e24 s a byte)
            hi *= 4
        if best_fit is None:
            # the local search at that price may fit where the plain passes do not (fuzz seed 38 case 6262: their
            # smallest plan 1,934 B over a bound of 1,858 B, the polished one 1,758 B; the exact extractor's
            # optimum 110 us within it); the bisection and the ladder below then start from it
            polished = _best_of(graph, order, hi, skeleton=skeleton)
            if _total(polished)[1] > memory_limit:
                # and the layout plans (left out of _best_of under a price): a region computed in one layout,
                # which no switch of one class reaches (fuzz seed 39 case 481: greedy's plans computed the
                # attention twice, in two layouts, one for each output; the replicated layout's plan, polished,
                # computes it once and fits, 4788 B within 4871 B, where every pass's smallest needed 5796 B)
                polished = _fitting_layout_plan(graph, order, hi, skeleton, polished, memory_limit) or polished
            if _total(polished)[1] > memory_limit:  # none fits at any price: the plan of least memory decides
                return _least_fitting(graph, roots, memory_limit, min(_total(trial)[1], _total(polished)[1]), least)
            best_fit = polished
        negligible = None  # _negligible_price, computed where the bisection first nears 0
        while hi - lo > PRICE_TOLERANCE * hi:
            mid = (lo + hi) / 2
            trial = _best_of(graph, order, mid, False, skeleton)
            if _total(trial)[1] <= memory_limit:
                best_fit, hi = trial, mid
                if lo == 0.0:
                    if negligible is None:
                        negligible = _negligible_price(skeleton, len(order))
                    if mid <= negligible and _total(trial)[0] > 0:
                        # every price in [0, mid] gives this plan (_negligible_price), so the halving would
                        # end at price 0 with it: ~1,000 passes down to the least float (a training step's
                        # joint plan whose plain passes fit at any price: 26 s CPU of 54)
                        hi = 0.0
                        break
            else:
                lo = mid
        unbounded = chosen
        polished = _best_of(graph, order, hi, skeleton=skeleton)
        chosen = polished if _total(polished)[1] <= memory_limit and \
            _dag_weight(polished, hi) <= _dag_weight(best_fit, hi) else best_fit
        fallback = {**unbounded, **best_fit, **polished}
        wider = dict(fallback)  # the bisection's plan is polished as before; the others complete from theirs too
        starts, over = [chosen], [unbounded]
        # the bisection's passes are plain greedy (the local search is the costly part), so the price it
        # settles on is where greedy's plan fits, not where the polished one does: polished passes on a
        # ladder of prices from about nothing up, the first that fits kept (fuzz seed 37 case 7845: at a
        # price that only breaks ties the polished plan fits, 57% faster than the bisection's)
        # (a plan that costs nothing, broadcasts of inputs under a bound, started the ladder at 0, where each step
        # stayed: fuzz seed 39 case 8714 never ended; it starts at LADDER_START of the bisection's price. Not
        # that floor for every plan: the prices below it matter, seed 39 case 2411 went 0% -> 50% over exact)
        price = LADDER_START * cost / mem if cost > 0 else LADDER_START * hi
        while price < hi:
            trial = _best_of(graph, order, price, skeleton=skeleton)
            wider.update(trial)
            if _total(trial)[1] <= memory_limit:
                starts.append(trial)
                break
            over = [unbounded, trial]
            price *= LADDER_STEP
        # the price of a byte is one number for the whole plan; spend what the bound leaves on time
        polished = [_improve(graph, s, fallback if i == 0 else wider, 0.0, memory_limit=memory_limit, skeleton=skeleton)
                    for i, s in enumerate(starts)]
        chosen = min(polished, key=lambda ch: _total(ch)[0])  # the first of equals: the bisection's
        # then the regions of the other plans (and of the layout plans at the bisection's price) that pay
        # in time and keep the plan within the bound (_relink with memory_limit), and the local search again
        # where one did (fuzz seed 37 case 8214: 24% over exact -> equal)
        if _relinks(graph, order):
            others = [unbounded, *starts, *over, *_layout_plans(graph, _Weighted.of(graph, order, hi, skeleton), True)]
            relinked = _relink(graph, chosen, others, 0.0, memory_limit)
            if _total(relinked)[0] < _total(chosen)[0]:
                chosen = _improve(graph, relinked, wider, 0.0, memory_limit=memory_limit, skeleton=skeleton)
        cost, mem = _total(chosen)
    return Selection(chosen, cost, mem, "greedy-dag")


def _negligible_price(skeleton: _Skeleton, classes: int) -> float:
    """A price of a byte at or below which a plain pass (_best_of without the local search) picks what it picks at
    price 0, where that pass's plan takes some time: every node's price of its memory, summed over all nodes, stays
    below 2^-60 of the least positive node time over `classes` (the most readers _amortized splits a value among),
    so a sum holding one timed node rounds to that sum at price 0, a sum of untimed nodes stays far below the
    passes' 1e-15 tie margin, and the candidates' order (_dag_weight) is price 0's wherever every candidate takes
    time (an untimed one would sort first). 0.0 where no node takes time.

    >>> g = PhysGraph({"x": [Node("Load", (), "x", memory=8.0)],
    ...                "y": [Node("Apply", ("x",), "y", 0, cost=2e-6, memory=8.0)]})
    >>> 0 < _negligible_price(_Skeleton(g, ["x", "y"]), 2) * 16 <= 2.0 ** -60 * 2e-6 / 2
    True
    """
    times = [n.cost for n in skeleton.nodes if n.cost > 0]
    if not times:
        return 0.0
    memory = sum(max(n.memory, 0.0) for n in skeleton.nodes) or 1.0
    return 2.0 ** -61 * min(times) / max(classes, 1) / memory


def _dominant_price(graph: PhysGraph, order: list[str]) -> float | None:
    """A price of a byte past which greedy's choices no longer change: every node's memory a whole number of
    bytes, so two sets that differ in memory differ by a byte at least, and at a price above the sum of every
    node's time that byte outweighs any difference in time (sets of equal memory are still ordered by time).
    Dearer prices only lose the time's digits to rounding. (The amortized variant splits a value among its
    readers, so its memory differences may be fractions of a byte: it is one candidate of each pass, not the
    pass.) None where some node's memory is not whole."""
    total = 0.0
    for c in order:
        for n in graph.classes[c]:
            if n.memory != int(n.memory):
                return None
            total += n.cost
    return 2 * total + 1e-12


def _fitting_layout_plan(graph: PhysGraph, order: list[str], penalty: float, skeleton: _Skeleton,
                         polished: dict[str, Node], memory_limit: float) -> dict[str, Node] | None:
    """The lightest plan (time plus `penalty` a byte) within memory_limit among the layout plans at that price
    (_layout_plans, both rounds), each polished by the local search from `polished` (the polished pass's plan),
    and `polished` relinked with their regions; None where none fits."""
    w = _Weighted.of(graph, order, penalty, skeleton)
    fits = []
    for surcharge in (False, True):
        plans = [_improve(graph, p, polished, penalty) for p in _layout_plans(graph, w, surcharge)]
        for p in (*plans, _relink(graph, polished, plans, penalty)):
            if _total(p)[1] <= memory_limit:
                fits.append(p)
    return min(fits, key=lambda p: _dag_weight(p, penalty), default=None)


def _feasible_nodes(graph: PhysGraph, order: list[str]) -> dict[str, list[Node]]:
    """Each class's nodes whose children can all be derived (classes with none are dropped)."""
    out: dict[str, list[Node]] = {}
    for c in order:
        ns = [n for n in graph.classes[c] if all(ch in out for ch in n.children)]
        if ns:
            out[c] = ns
    return out


def _fix_free(graph: PhysGraph, classes: dict[str, list[Node]], order: list[str]) -> None:
    """Without a memory bound, a class with a derivation that costs nothing (a pinned or free input and
    Keeps) keeps only that node: switching any plan to it never costs more (costs are >= 0)."""
    for c, n in extract_dp.free_classes(classes, order, memory=False).items():
        classes[c] = [n]


def _level(graph: PhysGraph, c: str) -> int:
    return graph.ident[c][2] if c in graph.ident else -1


def _canonical_colls(graph: PhysGraph, classes: dict[str, list[Node]]) -> set[int]:
    """Collective nodes that need only read a child's collective nodes, never its Keep.

    The physical graph is stratified by level, and its rules are generic: from any class (t, l, k) a Keep
    and every collective lead to level k+1. So Keep-then-collective, (t,l,k) -> (t,l,k+1) -> (t,l',k+2),
    is the same plan as collective-then-Keep through (t,l',k+1): only where the Keeps sit differs. Left
    in, those placements are symmetric copies of every plan and let the 0/1 program's relaxation sum
    fractions of one route several times. A collective is restricted only where its canonical
    counterpart is in the graph (checked here), so no plan is lost."""
    out = set()
    for c, ns in classes.items():
        if c not in graph.ident:
            continue
        t, lay, k = graph.ident[c]
        for n in ns:
            if n.op != "Coll" or len(n.children) != 1:
                continue
            ch = n.children[0]
            if _level(graph, ch) < 1 or ch not in classes:
                continue
            ct, clay, ck = graph.ident[ch]
            below = graph.index.get((ct, clay, ck - 1))  # (t, l, k-2): what the Keep into ch reads
            mid = graph.index.get((t, lay, k - 1))  # (t, l', k-1)
            if below is None or mid is None or below not in classes or mid not in classes:
                continue
            if any(m.op == "Coll" and m.key == n.key and m.sid == n.sid and m.children == (below,)
                   for m in classes[mid]) and any(m.op == "Keep" and m.children == (mid,) for m in ns):
                out.add(id(n))
    return out


def _highs_bindings():
    """scipy's own HiGHS bindings (scipy >= 1.15 ships them as scipy.optimize._highspy._core), or None.

    They let the cut loop add rows to one LP and re-solve from its basis, and hand the MIP greedy's plan
    as its first incumbent; scipy's public `milp` rebuilds the model on every call and takes no start.
    Measured on one GPT-3 layer's training step (4,000 nodes): the cut loop 4.3 s -> 0.6 s, the MIP
    12 s -> 4-5 s. Without them (an older scipy) the same program is solved through `milp`.

    >>> _highs_bindings() is None or hasattr(_highs_bindings(), "_Highs")
    True
    """
    core = sys.modules.get(_HIGHS_CORE) or _load_highs_core()
    return core if hasattr(core, "_Highs") else None


_HIGHS_CORE = "scipy.optimize._highspy._core"


def _load_highs_core():
    """scipy's HiGHS extension module, loaded from its file without running scipy.optimize's __init__ (which
    imports all of scipy.optimize: 0.43 s CPU, where the extension alone takes 0.01 s; it was a fifth of the
    first exact pass of one GPT-3 layer's training step inside optimize). Registered under its own name, so a
    later `import scipy.optimize` finds and shares it. None where scipy has no such extension (< 1.15).

    >>> _load_highs_core() is None or _load_highs_core() is sys.modules[_HIGHS_CORE]
    True
    """
    if _HIGHS_CORE in sys.modules:
        return sys.modules[_HIGHS_CORE]
    import importlib.machinery
    import importlib.util
    import scipy
    where = os.path.join(os.path.dirname(scipy.__file__), "optimize", "_highspy")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(where, "_core" + suffix)
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location(_HIGHS_CORE, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[_HIGHS_CORE] = module
            try:
                spec.loader.exec_module(module)
            except ImportError:  # pragma: no cover - an extension this Python cannot load
                del sys.modules[_HIGHS_CORE]
                return None
            return module
    return None  # pragma: no cover - scipy < 1.15


class _Rows:
    """A sparse matrix by rows (CSR: row i's entries are indices/data[indptr[i]:indptr[i + 1]], columns ascending),
    with what the 0/1 program needs of one. numpy only: scipy.sparse's import (0.16 s CPU, most of it
    scipy._lib's array API layer cloning numpy) was the first exact pass's on one GPT-3 layer's training step,
    and HiGHS takes plain arrays.

    >>> m = _Rows.from_coo([1.0, 2.0, 3.0], [1, 0, 1], [2, 1, 0], (2, 3))
    >>> m.indptr.tolist(), m.indices.tolist(), m.toarray().tolist()
    ([0, 1, 3], [1, 0, 2], [[0.0, 2.0, 0.0], [3.0, 0.0, 1.0]])
    >>> (m @ np.array([1.0, 1.0, 1.0])).tolist(), m.rmatvec(np.array([1.0, 1.0])).tolist()
    ([2.0, 4.0], [3.0, 2.0, 1.0])
    >>> m[np.array([False, True])].toarray().tolist(), m[:1].toarray().tolist()
    ([[3.0, 0.0, 1.0]], [[0.0, 2.0, 0.0]])
    """

    def __init__(self, indptr, indices, data, shape):
        self.indptr = np.asarray(indptr, dtype=np.int64)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.data = np.asarray(data, dtype=float)
        self.shape = (int(shape[0]), int(shape[1]))

    @classmethod
    def from_coo(cls, data, rows, cols, shape) -> "_Rows":
        """From (value, row, column) triples, none repeated."""
        rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
        order = np.lexsort((cols, rows))
        indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=shape[0]))])
        return cls(indptr, cols[order], np.asarray(data, dtype=float)[order], shape)

    @classmethod
    def of(cls, a) -> "_Rows":
        """A _Rows, or any scipy sparse matrix or 2-D array, as a _Rows."""
        if isinstance(a, cls):
            return a
        if hasattr(a, "tocsr"):
            a = a.tocsr()
            a.sort_indices()
            return cls(a.indptr, a.indices, a.data, a.shape)
        a = np.asarray(a, dtype=float)
        rows, cols = np.nonzero(a)
        return cls.from_coo(a[rows, cols], rows, cols, a.shape)

    @property
    def nnz(self) -> int:
        return len(self.data)

    def _row_of_entry(self) -> np.ndarray:
        return np.repeat(np.arange(self.shape[0]), np.diff(self.indptr))

    def __matmul__(self, x: np.ndarray) -> np.ndarray:
        return np.bincount(self._row_of_entry(), self.data * x[self.indices], minlength=self.shape[0])

    def rmatvec(self, y: np.ndarray) -> np.ndarray:
        """The transpose times y."""
        return np.bincount(self.indices, self.data * y[self._row_of_entry()], minlength=self.shape[1])

    def __getitem__(self, keep) -> "_Rows":
        """The rows `keep` picks (a mask, a slice or row indices)."""
        sel = np.arange(self.shape[0])[keep]
        _, at = _spans(self.indptr[sel], self.indptr[sel + 1])
        indptr = np.concatenate([[0], np.cumsum(self.indptr[sel + 1] - self.indptr[sel])])
        return _Rows(indptr, self.indices[at], self.data[at], (len(sel), self.shape[1]))

    def stack(self, other: "_Rows") -> "_Rows":
        """These rows, then other's."""
        return _Rows(np.concatenate([self.indptr, self.indptr[-1] + other.indptr[1:]]),
                     np.concatenate([self.indices, other.indices]), np.concatenate([self.data, other.data]),
                     (self.shape[0] + other.shape[0], self.shape[1]))

    def by_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start, row index, value) column-wise (CSC, rows ascending), as HiGHS takes a model."""
        rows = self._row_of_entry()
        order = np.lexsort((rows, self.indices))
        start = np.concatenate([[0], np.cumsum(np.bincount(self.indices, minlength=self.shape[1]))])
        return start, rows[order], self.data[order]

    def toarray(self) -> np.ndarray:
        out = np.zeros(self.shape)
        out[self._row_of_entry(), self.indices] = self.data
        return out

    def to_scipy(self):
        """As a scipy CSR matrix (scipy's milp, where its HiGHS bindings are missing)."""
        from scipy.sparse import csr_matrix
        return csr_matrix((self.data, self.indices, self.indptr), shape=self.shape)


class _Solver:
    """The 0/1 program's matrix, bounds and costs (every variable in [0, 1]), solved as an LP (the cut
    loop, warm: rows are added to one model) or as a MIP (from a start, with some rows left out).

    >>> from scipy.sparse import csr_matrix
    >>> import numpy as np
    >>> s = _Solver(np.array([1.0, 2.0]), csr_matrix([[1.0, 1.0]]), np.array([1.0]), np.array([np.inf]))
    >>> s.lp()[1], s.mip(np.array([True]), None, 10.0)["fun"]  # x0 + x1 >= 1: x0 = 1
    (1.0, 1.0)
    """

    def __init__(self, cost, a, lo, hi):
        self.cost, self.a, self.lo, self.hi = cost, _Rows.of(a), lo, hi
        self.core = _highs_bindings()
        self.highs = None

    def _model(self, a, lo, hi, integral: bool, upper=None):
        core = self.core
        h = core._Highs()
        h.setOptionValue("output_flag", False)
        # one thread: optimize runs in many processes at once (one per rank under launch, sweeps, fuzz
        # campaigns), and HiGHS's own pool per process oversubscribes the cores
        h.setOptionValue("threads", 1)
        lp = core.HighsLp()
        lp.num_row_, lp.num_col_ = a.shape
        lp.a_matrix_.num_row_, lp.a_matrix_.num_col_ = a.shape
        lp.a_matrix_.format_ = core.MatrixFormat.kColwise
        lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = a.by_columns()
        lp.col_cost_, lp.col_lower_ = self.cost, np.zeros(a.shape[1])
        lp.col_upper_ = np.ones(a.shape[1]) if upper is None else upper
        lp.row_lower_ = np.maximum(lo, -core.kHighsInf)
        lp.row_upper_ = np.minimum(hi, core.kHighsInf)
        if integral:
            lp.integrality_ = [core.HighsVarType.kInteger] * a.shape[1]
        h.passModel(lp)
        return h

    def lp(self, time_limit: float | None = None) -> tuple[np.ndarray | None, float | None]:
        """The relaxation's solution and value (None, None if it has none, or none within `time_limit` s)."""
        if self.core is None:
            from scipy.optimize import Bounds, LinearConstraint, milp
            res = milp(self.cost, constraints=LinearConstraint(self.a.to_scipy(), self.lo, self.hi), bounds=Bounds(0, 1),
                       options={} if time_limit is None else {"time_limit": time_limit})
            return res.x, res.fun
        if self.highs is None:
            self.highs = self._model(self.a, self.lo, self.hi, False)
        # the caller's budget holds HiGHS too: one LP of a memory-priced 2x2x2 attention graph ran 24 s of a 3 s
        # budget (fuzz seed 49 case 7837, greedy's least-memory search)
        self.highs.setOptionValue("time_limit", float("inf") if time_limit is None else max(float(time_limit), 0.01))
        self.highs.run()
        if not self.solved():
            return None, None
        return np.array(self.highs.getSolution().col_value), self.highs.getInfo().objective_function_value

    def solved(self) -> bool:
        """Whether the last relaxation solved here reached its optimum (not infeasible, not stopped by time)."""
        return self.highs is not None and self.highs.getModelStatus() == self.core.HighsModelStatus.kOptimal

    def infeasible(self) -> bool:
        """Whether the last relaxation solved here has no solution: then neither has the 0/1 program (its rows
        and the cuts added to them hold for every 0/1 solution), a proof that no plan exists."""
        return self.highs is not None and self.highs.getModelStatus() == self.core.HighsModelStatus.kInfeasible

    def add_rows(self, rows, lo, hi) -> None:
        """Append rows (a _Rows over the same columns) to the program and to the warm LP."""
        self.a = self.a.stack(rows)
        self.lo, self.hi = np.concatenate([self.lo, lo]), np.concatenate([self.hi, hi])
        if self.highs is not None:
            self.highs.addRows(rows.shape[0], np.maximum(lo, -self.core.kHighsInf), hi, rows.nnz,
                               rows.indptr[:-1].astype(np.int32), rows.indices.astype(np.int32), rows.data)

    def dual_bound(self) -> tuple[float, np.ndarray] | None:
        """The last LP's row duals as a proof: (a lower bound on every solution of the program, each column's
        reduced cost), or None where no LP was solved here. Recomputed from the duals by weak duality (a dual of
        the sign its row's infinite side forbids is dropped), so HiGHS's tolerances can weaken the bound but
        never make it claim more than the program allows."""
        if self.core is None or not self.solved():  # a relaxation stopped by its time limit has no duals to trust
            return None
        y = np.array(self.highs.getSolution().row_dual)
        y = np.where(y > 0, np.where(np.isfinite(self.lo), y, 0.0), np.where(np.isfinite(self.hi), y, 0.0))
        reduced = self.cost - self.a.rmatvec(y)
        rows = np.maximum(y, 0.0) * np.where(np.isfinite(self.lo), self.lo, 0.0) \
            + np.minimum(y, 0.0) * np.where(np.isfinite(self.hi), self.hi, 0.0)
        return float(rows.sum() + np.minimum(reduced, 0.0).sum()), reduced  # every column in [0, 1]

    def feasible(self, x: np.ndarray) -> bool:
        """Whether x satisfies every row (the start HiGHS is given must, or it is dropped)."""
        act = self.a @ x
        return bool(np.all(act >= self.lo - 1e-9) and np.all(act <= self.hi + 1e-9))

    def mip(self, keep, start, time_limit: float, cols=None, search: bool = True) -> dict:
        """Solve the 0/1 program over the rows in `keep` (a mask), from `start` (a feasible 0/1 vector, or
        None), with the columns outside `cols` (a mask; None: all columns) held at 0; returns status
        ("optimal", "time limit", "infeasible" or HiGHS's word), x, fun and the proven lower bound. search=False:
        without HiGHS's primal heuristics (for a start already near the optimum)."""
        a, lo, hi = self.a[keep], self.lo[keep], self.hi[keep]
        upper = None if cols is None else cols.astype(float)
        if self.core is None:
            from scipy.optimize import Bounds, LinearConstraint, milp
            res = milp(self.cost, constraints=LinearConstraint(a.to_scipy(), lo, hi), integrality=np.ones(a.shape[1]),
                       bounds=Bounds(0, 1 if upper is None else upper),
                       options={"time_limit": time_limit, "mip_rel_gap": 1e-9})
            return {"status": {0: "optimal", 1: "time limit", 2: "infeasible"}.get(res.status, res.message),
                    "x": res.x, "fun": res.fun, "bound": getattr(res, "mip_dual_bound", None)}
        h = self._model(a, lo, hi, True, upper)
        h.setOptionValue("time_limit", float(time_limit))
        h.setOptionValue("mip_rel_gap", 1e-9)
        # greedy's plan is within a few percent: HiGHS's primal heuristics (sub-MIPs) were most of its
        # root time and found nothing the start and the bound's own search did not (measured: 5.4 -> 3.9 s)
        h.setOptionValue("mip_heuristic_effort", 0.0)
        if not search:
            # nor did its sub-MIPs (RINS, RENS, reduced-cost), feasibility jump or symmetry detection once a
            # near-optimal start is given: they were a third of the MIP (one GPT-3 layer's training step from
            # its optimum, 1.5 -> 1.0 s); its cuts, restarts and branching still find a better plan if any
            for name in ("mip_heuristic_run_rins", "mip_heuristic_run_rens", "mip_heuristic_run_root_reduced_cost",
                         "mip_heuristic_run_feasibility_jump", "mip_detect_symmetry"):
                h.setOptionValue(name, False)
        if start is not None:
            h.setSolution(len(start), np.arange(len(start), dtype=np.int32), start)
        h.run()
        st, ms = h.getModelStatus(), self.core.HighsModelStatus
        info = h.getInfo()
        has_x = info.primal_solution_status == self.core.kSolutionStatusFeasible
        return {"status": {ms.kOptimal: "optimal", ms.kTimeLimit: "time limit", ms.kInfeasible: "infeasible"}.get(
                    st, h.modelStatusToString(st)),
                "x": np.array(h.getSolution().col_value) if has_x else None,
                "fun": info.objective_function_value if has_x else None, "bound": info.mip_dual_bound}


@dataclass
class _Program:
    """The 0/1 program: a variable per node (chosen) then one per class (needed), over the classes some
    root can still need, in topological order."""
    order: list[str]
    nodes: list[tuple[str, Node]]
    cidx: dict[str, int]
    first: np.ndarray  # class ci's nodes are columns first[ci]:first[ci + 1]
    cost: np.ndarray  # by column, in nanoseconds
    solver: "_Solver"
    cut_keys: list = field(default_factory=list)  # each cut row's (_class_key, (tensor, level))
    n_cover: int = 0  # the first rows after the base ones are _separate's cover rows (the MIP keeps them all)

    @property
    def nn(self) -> int:
        return len(self.nodes)

    def start(self, choice: dict[str, Node], roots: list[str]) -> np.ndarray:
        """A plan (greedy's) as a 0/1 vector of this program. Where _fix_free left a class only its free
        node, that node stands in for the plan's (never costlier, and its children are free too). A plan's
        node is found by identity, else by equality (a plan copied apart from its graph, as
        bench/exact_hard_cases.py captured them: by identity alone every class fell back to its first node,
        the start was infeasible and dropped, and the first pass of one GPT-3 layer's training step took
        3.3 s of MIP from no start, not 1.1)."""
        col = {id(n): j for j, (_, n) in enumerate(self.nodes)}
        x = np.zeros(self.nn + len(self.order))
        stack, seen = list(roots), set()
        while stack:
            c = stack.pop()
            if c in seen:
                continue
            seen.add(c)
            ci = self.cidx[c]
            n = choice.get(c)
            j = col.get(id(n))
            if j is None:
                j = next((k for k in range(self.first[ci], self.first[ci + 1]) if self.nodes[k][1] == n), self.first[ci])
            x[j] = x[self.nn + ci] = 1.0
            stack.extend(self.nodes[j][1].children)
        return x

    def choice(self, x: np.ndarray, roots: list[str]) -> dict[str, Node] | None:
        """The nodes an integral solution picks for what the roots need (None if a needed class has none)."""
        chosen: dict[str, Node] = {}
        stack = list(roots)
        while stack:
            c = stack.pop()
            if c in chosen:
                continue
            ci = self.cidx[c]
            js = [j for j in range(self.first[ci], self.first[ci + 1]) if x[j] > 0.5]
            if not js:  # pragma: no cover - y_c = sum of c's x_n holds in every integral solution
                return None
            chosen[c] = min((self.nodes[j][1] for j in js), key=lambda n: n.cost)
            stack.extend(chosen[c].children)
        return chosen


def _program(graph: PhysGraph, roots: list[str], memory_limit: float | None, usable: "_Usable | None" = None
             ) -> _Program | None:
    """The base rows of the 0/1 program (see _ilp), or None if a root cannot be derived. `usable`: _usable's
    answer where the caller has it."""
    order, classes, canon = usable or _Usable.of(graph, roots, memory_limit)
    if any(r not in classes for r in roots):
        return None
    cidx = {c: i for i, c in enumerate(order)}
    nodes = [(c, n) for c in order for n in classes[c]]
    nn, nc = len(nodes), len(order)
    node_class = np.array([cidx[c] for c, _ in nodes], dtype=np.int64)
    first = np.zeros(nc + 1, dtype=np.int64)
    np.add.at(first, node_class + 1, 1)
    first = np.cumsum(first)
    is_coll = np.array([n.op == "Coll" for _, n in nodes], dtype=bool)
    # y_c = sum of c's nodes: row c
    rows, cols, vals = [node_class, np.arange(nc)], [np.arange(nn), nn + np.arange(nc)], [np.ones(nn), -np.ones(nc)]
    # sum of c's nodes reading d <= y_d (a canonical collective: <= d's collectives): a row per (c, d, canonical),
    # numbered in the order the pairs first appear over c's nodes and their children (so HiGHS's path is
    # reproducible); one loop over the nodes, the rows in numpy (was a row at a time: 0.04 s a pass)
    reads_j, reads_d, reads_canon = [], [], []
    for j, (_, n) in enumerate(nodes):
        for ch in dict.fromkeys(n.children):
            reads_j.append(j)
            reads_d.append(cidx[ch])
            reads_canon.append(id(n) in canon)
    reads_j, reads_d = np.array(reads_j, dtype=np.int64), np.array(reads_d, dtype=np.int64)
    reads_canon = np.array(reads_canon, dtype=bool)
    key = (node_class[reads_j] * nc + reads_d) * 2 + reads_canon
    uniq, first_at, which = np.unique(key, return_index=True, return_inverse=True)
    rank = np.empty(len(uniq), dtype=np.int64)
    rank[np.argsort(first_at, kind="stable")] = np.arange(len(uniq))
    row_of = nc + rank  # each (c, d, canonical) row's number
    rows.append(row_of[which]), cols.append(reads_j), vals.append(np.ones(len(reads_j)))
    d_of, canon_of = (uniq // 2) % nc, (uniq % 2).astype(bool)
    plain = np.nonzero(~canon_of)[0]
    rows.append(row_of[plain]), cols.append(nn + d_of[plain]), vals.append(-np.ones(len(plain)))
    coll_rows = np.nonzero(canon_of)[0]
    owner, ks = _spans(first[d_of[coll_rows]], first[d_of[coll_rows] + 1])
    ks_coll = is_coll[ks]
    rows.append(row_of[coll_rows][owner[ks_coll]]), cols.append(ks[ks_coll]), vals.append(-np.ones(int(ks_coll.sum())))
    n_rows = nc + len(uniq)
    lb = [0.0] * nc + [-np.inf] * len(uniq)
    ub = [0.0] * n_rows
    for r in roots:
        rows.append(np.array([n_rows])), cols.append(np.array([nn + cidx[r]])), vals.append(np.ones(1))
        lb.append(1.0)
        ub.append(1.0)
        n_rows += 1
    # costs are seconds (~1e-6): solved in nanoseconds so HiGHS's absolute tolerances do not blur plans
    cost = np.concatenate([np.array([n.cost for _, n in nodes]) * 1e9, np.zeros(nc)])
    if memory_limit is not None:
        # in units of the bound: rows of bytes (1e3..1e11) or of GiB (1e-8..1e2) leave HiGHS's tolerances too
        # coarse or too fine (measured: a plan 0.1% under the bound declared infeasible)
        scale = 1000.0 / max(memory_limit, 1.0)
        rows.append(np.full(nn, n_rows)), cols.append(np.arange(nn))
        vals.append(np.array([n.memory for _, n in nodes]) * scale)
        lb.append(-np.inf)
        ub.append(memory_limit * scale)
        n_rows += 1
    a = _Rows.from_coo(np.concatenate(vals), np.concatenate(rows), np.concatenate(cols), (n_rows, nn + nc))
    return _Program(order, nodes, cidx, first, cost, _Solver(cost, a, np.array(lb), np.array(ub)))


def _spans(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every integer of the ranges [starts[k], ends[k]), in order, with the k it came from.

    >>> _spans(np.array([0, 5]), np.array([2, 8]))
    (array([0, 0, 1, 1, 1]), array([0, 1, 5, 6, 7]))
    """
    lens = ends - starts
    owner = np.repeat(np.arange(len(lens)), lens)
    return owner, np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens - starts, lens)


def _blocking(p: _Program, cls_group: np.ndarray, ng: int) -> np.ndarray:
    """(node x group) booleans: every derivation of node j passes through group g (a class's is the AND over
    its nodes, plus its own group; a node's the OR over its children). Python ints as bit sets: the same
    recursion over numpy rows took 0.15-0.3 s on one GPT-3 layer's training step, this 0.02 s."""
    nc, first = len(p.order), p.first
    children = [[p.cidx[c] for c in n.children] for _, n in p.nodes]
    blk_c, blk_n = [0] * nc, [0] * p.nn
    for ci in range(nc):
        acc = -1  # all bits: a class's AND starts full
        for j in range(first[ci], first[ci + 1]):
            b = 0
            for d in children[j]:
                b |= blk_c[d]
            blk_n[j] = b
            acc &= b
        blk_c[ci] = acc | (1 << int(cls_group[ci])) if cls_group[ci] >= 0 else acc
    width = (ng + 7) // 8
    raw = np.frombuffer(b"".join(b.to_bytes(width, "little") for b in blk_n), dtype=np.uint8).reshape(p.nn, width)
    return np.unpackbits(raw, axis=1, count=ng, bitorder="little").astype(bool)


def _class_key(graph: PhysGraph, c: str):
    """What names class c in every e-graph of the same fusion: its (tensor, layout, level), or its own name
    for the roots with_roots adds (others, None: their names depend on the order the graph was built in).

    >>> g = PhysGraph({"c0": [Node("Load", (), "z")]}, ident={"c0": ("z", "R", 1)})
    >>> _class_key(g, "c0"), _class_key(g, "__out__:z"), _class_key(g, "c7")
    (('z', 'R', 1), '__out__:z', None)
    """
    return graph.ident.get(c) or (c if c.startswith("__") else None)


def _add_cover_rows(p: _Program, through: np.ndarray, by_group, roots: list[str]) -> None:
    """For each group (one tensor's classes at one level) that every derivation of a root passes through,
    the row sum of the group's y_d >= 1. They are the cuts of the roots' classes, known before any LP: on one
    GPT-3 layer's training step 646 rows where the cut loop had found the same LP bound (6.866 ms) in 14
    rounds and 8,485 cuts (1.1-1.3 s of a 2.5 s pass); from them it takes 2 rounds and 4 cuts."""
    nn, nc = p.nn, len(p.order)
    grp = sorted({int(g) for r in roots if r in p.cidx
                  for g in np.nonzero(through[p.first[p.cidx[r]]:p.first[p.cidx[r] + 1]].all(axis=0))[0]})
    if not grp:
        return
    grp = np.array(grp)
    owner, at = _spans(by_group.indptr[grp], by_group.indptr[grp + 1])  # each group's y columns
    rows = _Rows.from_coo(np.ones(len(at)), owner, nn + by_group.indices[at], (len(grp), nn + nc))
    p.solver.add_rows(rows, np.ones(len(grp)), np.full(len(grp), np.inf))
    p.cut_keys.extend([(None, None)] * len(grp))
    p.n_cover = len(grp)


def _separate(graph: PhysGraph, p: _Program, budget_s: float, hints: set | None = None, roots: list[str] = ()
              ) -> tuple[int, int, float | None, np.ndarray | None]:
    """Cutting planes, added to p's solver while the LP violates them: for a class c and a group D of
    classes every derivation of some of c's nodes passes through (all layouts of one tensor at one level),
    the sum of those nodes is <= the sum over D of y_d. Before the first LP, the cover rows: for each group
    every derivation of a root passes through, the sum of its y_d >= 1 (p.n_cover of them; a root is
    needed, so some class of the group is). `hints`: (_class_key, (tensor, level)) pairs whose
    cuts are added before the first LP where this program has them (cuts another pass of the same fusion
    needed; each is derived here, so valid whatever the hint). Returns (cuts, rounds, LP bound, last LP
    solution); p.cut_keys names each cut row (a cover row: (None, None))."""
    t0 = time.perf_counter()
    order, nodes, first, nn, nc = p.order, p.nodes, p.first, p.nn, len(p.order)
    node_class = np.repeat(np.arange(nc), np.diff(first))
    gid: dict[tuple, int] = {}
    cls_group = np.full(nc, -1, dtype=np.int64)
    for ci, c in enumerate(order):
        if c in graph.ident:
            t, _, k = graph.ident[c]
            cls_group[ci] = gid.setdefault((t, k), len(gid))
    ng = len(gid)
    if not ng:
        return 0, 0, None, None
    blk_n = _blocking(p, cls_group, ng)
    own = np.zeros((nn, ng), dtype=bool)
    has = cls_group[node_class] >= 0
    own[np.nonzero(has)[0], cls_group[node_class[has]]] = True
    through = blk_n & ~own  # node j reads group g (not its own) on every derivation
    grouped = np.nonzero(cls_group >= 0)[0]
    by_group = _Rows.from_coo(np.ones(len(grouped)), cls_group[grouped], grouped, (ng, nc))  # group -> its classes
    seen: set[int] = set()  # (class, group) as class * ng + group
    groups = list(gid)

    def add_cuts(cls: np.ndarray, grp: np.ndarray) -> None:
        seen.update((cls * ng + grp).tolist())
        cand = np.arange(len(cls))
        owner, js = _spans(first[cls], first[cls + 1])  # c's nodes, those through the group
        on = through[js, grp[owner]]
        m_owner, m_at = _spans(by_group.indptr[grp], by_group.indptr[grp + 1])  # the group's y columns
        rows = np.concatenate([owner[on], cand[m_owner]])
        cols = np.concatenate([js[on], nn + by_group.indices[m_at]])
        vals = np.concatenate([np.ones(int(on.sum())), -np.ones(len(m_at))])
        p.solver.add_rows(_Rows.from_coo(vals, rows, cols, (len(cls), nn + nc)),
                          np.full(len(cls), -np.inf), np.zeros(len(cls)))
        p.cut_keys.extend((_class_key(graph, order[c]), groups[g]) for c, g in zip(cls.tolist(), grp.tolist()))

    n_cuts, rounds, lp_bound, x = 0, 0, None, None
    _add_cover_rows(p, through, by_group, roots)
    if hints:
        cidx_of = {k: ci for ci, c in enumerate(order) if (k := _class_key(graph, c)) is not None}
        pairs = sorted({(cidx_of[a], gid[b]) for a, b in hints if a in cidx_of and b in gid})
        pairs = [(c, g) for c, g in pairs if through[first[c]:first[c + 1], g].any()]
        if pairs:
            add_cuts(np.array([c for c, _ in pairs]), np.array([g for _, g in pairs]))
            n_cuts += len(pairs)
    while rounds < 60 and time.perf_counter() - t0 < budget_s:
        lp_x, fun = p.solver.lp(budget_s - (time.perf_counter() - t0))
        if lp_x is None:  # infeasible (p.solver.infeasible() says), or out of time: the last solved LP stands
            break
        x = lp_x
        rounds += 1
        lp_bound = fun
        ysum = np.bincount(cls_group[grouped], x[nn:][grouped], minlength=ng)  # group -> sum of its y
        row, col, val = _through_sums(through, node_class, x[:nn])  # (class, group): its nodes through it
        violated = np.unique(row[(val > 1e-9) & (val - ysum[col] > 1e-6)])
        lhs = np.zeros((len(violated), ng))  # dense rows for these classes only (all rows' sort: 0.18 s a pass)
        on = np.isin(row, violated)
        lhs[np.searchsorted(violated, row[on]), col[on]] = val[on]
        viol = np.where(lhs > 1e-9, lhs - ysum[None, :], 0.0)
        # the three most violated groups of each class (one a round: twice the rounds, measured)
        top = np.argsort(-viol, axis=1)[:, :3]
        ok = np.take_along_axis(viol, top, axis=1) > 1e-6
        cls, grp = np.repeat(violated[:, None], top.shape[1], axis=1)[ok], top[ok]
        fresh = np.array([k not in seen for k in (cls * ng + grp).tolist()], dtype=bool)
        cls, grp = cls[fresh], grp[fresh]
        if not len(cls):
            break
        add_cuts(cls, grp)
        n_cuts += len(cls)
    return n_cuts, rounds, lp_bound, x


def _through_sums(through: np.ndarray, node_class: np.ndarray, x: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(class, group, the sum of x over the class's nodes through the group), where some node the LP uses is.

    >>> through = np.array([[True, False], [True, True], [False, True]])
    >>> [a.tolist() for a in _through_sums(through, np.array([0, 0, 1]), np.array([0.25, 0.5, 1.0]))]
    [[0, 0, 1], [0, 1, 1], [0.75, 0.5, 1.0]]
    """
    used = np.nonzero(x > 0)[0]
    at, grp = np.nonzero(through[used])
    ng = through.shape[1]
    key, inverse = np.unique(node_class[used[at]] * ng + grp, return_inverse=True)
    return key // ng, key % ng, np.bincount(inverse, x[used[at]], minlength=len(key))


def _lp_guided(graph: PhysGraph, roots: list[str], memory_limit: float | None, p: _Program,
               x: np.ndarray) -> dict[str, Node] | None:
    """Greedy extraction over the nodes the LP relaxation uses (a class the LP leaves at zero keeps all its
    nodes): the relaxation sees which values are worth sharing where greedy's local view does not.
    Measured on fuzz graphs greedy missed by 18-88% (bench/fuzz.py --seed 7): it found the optimum
    (cases 2, 4392; their MIPs 2-3x faster from it) or came within 0.001% of it (815); on the training
    step it is 0.1% better to 4% worse than greedy, and the cheaper of the two is the start."""
    classes = dict(graph.classes)
    for ci, c in enumerate(p.order):
        used = [p.nodes[j][1] for j in range(p.first[ci], p.first[ci + 1]) if x[j] > 1e-6]
        if used:
            classes[c] = used
    try:
        # least=False: the least-memory search's seconds would come out of the 0/1 program's time limit
        return greedy_dag(PhysGraph(classes, graph.ident, graph.index), roots, memory_limit, least=False).choice
    except PlanError:
        return None


def _best_start(graph: PhysGraph, roots: list[str], memory_limit: float | None, p: _Program,
                x: np.ndarray | None, start: dict[str, Node] | None, guided: bool = True) -> np.ndarray | None:
    """The cheaper feasible 0/1 vector of `start` (greedy's plan) and the LP-guided greedy plan (if
    `guided`): the better the MIP's first incumbent, the more columns HiGHS fixes by reduced cost at its root."""
    plans = [start] + ([_lp_guided(graph, roots, memory_limit, p, x)] if x is not None and guided else [])
    vectors = [p.start(c, roots) for c in plans if c is not None]
    vectors = [v for v in vectors if p.solver.feasible(v)]
    return min(vectors, key=lambda v: float(p.cost @ v)) if vectors else None


# the restricted MIP's share of time_limit (it takes 0.1-0.2 s on a GPT-3 layer's training step)
RESTRICTED_SHARE = 0.05


def _restricted_start(p: _Program, keep: np.ndarray, x: np.ndarray | None, x0: np.ndarray | None,
                      time_limit: float) -> np.ndarray | None:
    """A better first incumbent than x0: the 0/1 program over only the columns the last LP uses or x0 holds
    (RENS-like). Small (2,000-2,900 of ~7,000 columns on a GPT-3 layer's training step), so solved in
    0.1-0.2 s CPU; its plan was 0.9-1.3% cheaper than greedy's there, and the whole MIP from it proved
    the first pass in 2.7 s CPU where from greedy's plan it took 5.7 s (HiGHS's own sub-MIPs found the
    optimum late, after most of its cut rounds). Returns x0 where it finds nothing cheaper."""
    if x is None or x0 is None:
        return x0
    res = p.solver.mip(keep, x0, time_limit, cols=(x > 1e-9) | (x0 > 0.5))
    got = res["x"]
    if got is None:
        return x0
    got = np.round(got)
    if not p.solver.feasible(got) or float(p.cost @ got) >= float(p.cost @ x0) * (1 - 1e-12):
        return x0
    return got


def _reduced_cost_columns(p: _Program, start: np.ndarray | None) -> tuple[np.ndarray | None, float | None]:
    """(the columns a plan cheaper than `start` may still use, the last LP's dual bound), or (None, bound)
    where there is no start. Reduced-cost fixing: with dual bound L and reduced cost r_j, every solution with
    x_j = 1 costs at least L + r_j, so where that exceeds start's cost no better plan uses column j (start's
    own columns stay, so it remains the MIP's incumbent). On one GPT-3 layer's training step it fixed 700 of
    6,900 columns, and HiGHS's presolve took 3,600 out where it took 1,700 (the MIP 1.9 -> 1.4 s)."""
    dual = p.solver.dual_bound()
    if dual is None or start is None:
        return None, None if dual is None else dual[0]
    bound, reduced = dual
    upper = float(p.cost @ start)
    return (bound + reduced <= upper + 1e-9 * abs(upper)) | (start > 0.5), bound


def _ilp(graph: PhysGraph, roots: list[str], memory_limit: float | None, time_limit: float,
         start: dict[str, Node] | None = None, guided: bool = True, hints: set | None = None,
         usable: "_Usable | None" = None, upper: float | None = None, prove: bool = True) -> dict:
    """Solve the extraction 0/1 program from a known plan (`start`, greedy's; with `guided`, also from the
    LP-guided greedy plan where cheaper); returns the choice (or None) and what HiGHS proved.

    Variables: x_n (node n chosen), y_c (class c needed). Rows: y_c = sum of c's x_n (one node per needed
    class); for each class c and child class d, the sum of c's nodes that read d is <= y_d (aggregated:
    c's nodes exclude each other); every root needed. The graph is stratified (acyclic), so no ordering
    variables. Then cutting planes tighten the relaxation (_separate). Without them the relaxation pays
    a small fraction of a value and sums it up again through the many layouts and routes that derive
    from it (measured: the bound was 15-40% of the optimum; with them 70-100%). The MIP keeps only the
    cuts the last LP holds tight (the rest slowed HiGHS's root: 16,000 rows -> 12,700 on one GPT-3
    layer's training step, 15 s -> 6.5 s)."""
    t0 = time.perf_counter()
    p = _program(graph, roots, memory_limit, usable)
    if p is None:
        return {"choice": None, "proven": True, "status": "infeasible", "bound": None, "lp_bound": None,
                "cuts": 0, "rounds": 0, "classes": 0, "cut_s": 0.0, "solve_s": 0.0}
    n_base = p.solver.a.shape[0]
    n_cuts, rounds, lp_bound, x = _separate(graph, p, 0.3 * time_limit, hints, roots)
    if p.solver.infeasible():
        # no plan fits, proven by the relaxation: the MIP would prove it again, but HiGHS's presolve of such a
        # program ran past its time limit, growing to 18 GB (fuzz seed 44 case 8976: 77k rows, a bound of 162 B)
        return {"choice": None, "proven": True, "status": "infeasible", "proof": "lp", "bound": None,
                "lp_bound": None, "cuts": n_cuts, "rounds": rounds, "classes": len(p.order),
                "cut_s": time.perf_counter() - t0, "solve_s": 0.0}
    keep = np.ones(p.solver.a.shape[0], dtype=bool)
    if x is not None:
        act = p.solver.a @ x
        # cuts tight at the last LP with a nonzero dual: the LP's optimum needs no others, and HiGHS's root
        # runs on fewer rows (one GPT-3 layer's training step: 69 of 4,280 tight cuts, the MIP 1.0 -> 0.5 s)
        row_dual = np.array(p.solver.highs.getSolution().row_dual) if p.solver.solved() else None
        keep[n_base:] = ((p.solver.hi - act) < 1e-7)[n_base:] & (
            True if row_dual is None else np.abs(row_dual[n_base:]) > 1e-9)
    # every cover row: with only the tight ones of nonzero dual HiGHS's root bound fell to 81% of the LP's
    # and the first pass of one GPT-3 layer's training step ran out of time (60 s)
    keep[n_base:n_base + p.n_cover] = True
    binding = [p.cut_keys[i] for i in np.nonzero(keep[n_base:])[0] if p.cut_keys[i][0] is not None]
    found = {"lp_bound": lp_bound, "cuts": n_cuts, "rounds": rounds, "classes": len(p.order), "binding_cuts": binding,
             "choice": None, "solve_s": 0.0}
    dual = p.solver.dual_bound()
    if upper is not None and dual is not None and dual[0] > upper * 1e9 * (1 + 1e-9):
        # no plan of this graph is cheaper than `upper` (exact's caller has one): the MIP would prove a plan
        # nobody takes (one GPT-3 layer's training step, the replicated loop: 2.7 s for 22.8 ms against 7.16), and
        # the starts (the restricted MIP's, 0.05-0.13 s there) would find one
        return {**found, "start_feasible": None, "cut_s": time.perf_counter() - t0, "dual_bound": dual[0], "fixed": 0,
                "proven": False, "status": "above upper", "proof": "bound above upper", "bound": dual[0] / 1e9}
    x0 = _best_start(graph, roots, memory_limit, p, x, start, guided)
    x0 = _restricted_start(p, keep, x, x0, RESTRICTED_SHARE * time_limit)
    cols, dual = _reduced_cost_columns(p, x0)
    t1 = time.perf_counter()
    base = {**found, "start_feasible": None if x0 is None else p.solver.feasible(x0), "cut_s": t1 - t0,
            "dual_bound": dual, "fixed": 0 if cols is None else int((~cols).sum())}
    if x0 is not None and dual is not None and dual >= float(p.cost @ x0) * (1 - 1e-9) and base["start_feasible"]:
        # the cuts' LP already reaches the start's cost: it is optimal, and no MIP runs
        return {**base, "proven": True, "status": "optimal", "proof": "lp", "bound": dual / 1e9, "solve_s": 0.0,
                "choice": p.choice(x0, roots)}
    if not prove and x0 is not None and base["start_feasible"]:
        # the caller reads only which layouts the plan holds (optimize's first pass of a training step whose plan is
        # no loop): the restricted MIP's plan, with the LP's bound, and no proof
        return {**base, "proven": False, "status": "not proven (prove=False)", "proof": "none",
                "bound": None if dual is None else dual / 1e9, "solve_s": 0.0, "choice": p.choice(x0, roots)}
    res = p.solver.mip(keep, x0, max(time_limit - (t1 - t0), 1.0), cols=cols, search=x0 is None)
    info = {**base, "proven": res["status"] in ("optimal", "infeasible"), "status": res["status"], "proof": "mip",
            "bound": None if res["bound"] is None else res["bound"] / 1e9, "solve_s": time.perf_counter() - t1}
    if res["x"] is None:
        return info
    info["choice"] = p.choice(res["x"], roots)
    if info["choice"] is None:  # pragma: no cover
        info["status"] = "no node picked for a needed class"
    return info


def _components(graph: PhysGraph, roots: list[str]) -> list[tuple[str, ...]]:
    """The root's outputs grouped so that no two groups reach a common class (through any alternative): with
    no memory bound to share, each group's cheapest plan is independent of the others'.

    >>> g = PhysGraph({"x": [Node("Load", (), "x")], "a": [Node("Apply", ("x",), "a")],
    ...                "b": [Node("Apply", ("x",), "b")], "z": [Node("Load", (), "z")]})
    >>> _components(g, with_roots(g, {"a": ["a"], "b": ["b"], "z": ["z"]}))
    [('__out__:a', '__out__:b'), ('__out__:z',)]
    """
    if roots != [ROOT] or len(graph.classes[ROOT]) != 1:
        return []
    outs = graph.classes[ROOT][0].children
    owner: dict[str, int] = {}
    parent = list(range(len(outs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    # one walk over the graph: a class another output's walk reached joins the two groups, and its
    # descendants were reached by that walk, so need no second visit (a walk per output took 0.12 s
    # of each exact pass on one GPT-3 layer's training step, 34 outputs)
    for i, out in enumerate(outs):
        stack = [out]
        while stack:
            c = stack.pop()
            j = owner.get(c)
            if j is not None:
                if find(j) != find(i):
                    parent[find(j)] = find(i)
                continue
            owner[c] = i
            stack.extend(ch for n in graph.classes[c] for ch in n.children)
    groups: dict[int, list[str]] = {}
    for i, out in enumerate(outs):
        groups.setdefault(find(i), []).append(out)
    return [tuple(g) for g in groups.values()]


def _exact_by_parts(graph: PhysGraph, roots: list[str], parts: list[tuple[str, ...]], time_limit: float
                    ) -> Selection:
    """exact() on each independent group of outputs under its own root, joined: a 0/1 program over
    disjoint parts proves no faster than its hardest part alone, and HiGHS was measured far slower on the
    joint one (fuzz seed 21 case 639: rms_norm and a transposed exp on a 2x2x2 mesh, 1.2 s and 1.3 s apart,
    29 s together). Proven only if every part is; never worse than greedy on the whole."""
    deadline = time.perf_counter() + time_limit
    whole = graph.classes[ROOT]
    choice: dict[str, Node] = {}
    proven, stats, methods = True, {"exact_components": len(parts)}, []
    try:
        for part in parts:
            graph.classes[ROOT] = [Node("Root", part)]
            sel = exact(graph, roots, None, max(deadline - time.perf_counter(), 1.0))
            choice.update(sel.choice)
            proven &= sel.proven
            methods.append(sel.stats.get("exact_method", "ilp"))
            for k, v in sel.stats.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    stats[k] = stats.get(k, 0) + v
    finally:
        graph.classes[ROOT] = whole
    choice[ROOT] = whole[0]
    total, mem = _total(choice)
    # every part proven: the parts reach no common class, so their optima add up to the whole's and greedy
    # cannot beat it (its pass over the whole graph was 3.2 s of 12.8 s CPU of fuzz seed 41 case 5832's exact optimize)
    greedy = None if proven else greedy_dag(graph, roots)
    if greedy is not None and greedy.cost < total * (1 - 1e-12):
        stats.update(exact_from="greedy", exact_proven=False,
                     exact_note="greedy's plan beat the parts' unproven incumbents")
        return Selection(greedy.choice, greedy.cost, greedy.memory, "exact-unproven", False, stats)
    # which method proved each part, in the parts' order ("dp", "ilp")
    stats.update(exact_from="+".join(sorted(set(methods))), exact_method=",".join(methods), exact_proven=proven)
    return Selection(choice, total, mem, "exact" if proven else "exact-unproven", proven, stats)


def _usable(graph: PhysGraph, roots: list[str], memory_limit: float | None) -> tuple[list[str], dict[str, list[Node]]]:
    """The classes some root can still need, children first, with the nodes that can be derived (without a
    memory bound, a class with a free derivation keeps only it: _fix_free). A root missing from the
    classes cannot be derived."""
    order = _topo_order(graph, roots)
    classes = _feasible_nodes(graph, order)
    if any(r not in classes for r in roots):
        return order, classes
    if memory_limit is None:
        _fix_free(graph, classes, order)
    keep, stack = set(), list(roots)
    while stack:
        c = stack.pop()
        if c in keep:
            continue
        keep.add(c)
        stack.extend(ch for n in classes[c] for ch in n.children)
    return [c for c in order if c in keep], classes


class _Usable(NamedTuple):
    """What the DP and the 0/1 program both start from (computed once a pass: 0.025 s of each exact pass on
    one GPT-3 layer's training step, twice): _usable's classes and order, and the canonical collectives."""
    order: list[str]
    classes: dict[str, list[Node]]
    canon: set[int]

    @classmethod
    def of(cls, graph: PhysGraph, roots: list[str], memory_limit: float | None) -> "_Usable":
        """_usable's answer with _canonical_colls' (empty where a root cannot be derived).

        >>> g = PhysGraph({"x": [Node("Load", (), "x")], "y": [Node("Apply", ("x",), "y")]})
        >>> _Usable.of(g, with_roots(g, {"y": ["y"]}), None).order
        ['x', 'y', '__out__:y', '__root__']
        """
        order, classes = _usable(graph, roots, memory_limit)
        if any(r not in classes for r in roots):
            return cls(order, classes, set())
        return cls(order, classes, _canonical_colls(graph, classes))


# the DP's share of exact's time, (fraction of time_limit, at most seconds), by whether a memory bound holds.
# Without one: the hard fuzz cases it proves take 0.1-5 s alone on 2 cores, 4x that under load (case 2446 gave
# up at 8 s beside a test run); on what it cannot prove, e.g. a GPT training step whose many independent
# branches multiply its states, the 0/1 program gets the rest. Under one the share is larger: there the 0/1
# program's LP stays far below the optimum and its share went unproven on every hard case measured (45/9356: 53%
# LP bound at 76 s, 41/4050: 56%, final bound 57%, both returning the DP's plan; 33/6050 24% below), while the
# DP proves 45/9356 and 41/4050 in 24-28 s CPU alone (33/6050 42 s under load 4)
DP_SHARE = {False: (0.5, 30.0), True: (0.75, 45.0)}


def _exact_dp(graph: PhysGraph, roots: list[str], memory_limit: float | None, greedy: Selection | None,
              time_limit: float, usable: "_Usable | None" = None) -> "Selection | dict":
    """The exact DP over tensors (extract_dp) within its share of time_limit: a proven Selection, or the
    stats of its try (the caller then solves the 0/1 program). `usable`: _usable's answer where the caller has it."""
    t0 = time.perf_counter()
    order, classes, canon = usable or _Usable.of(graph, roots, memory_limit)
    if any(r not in classes for r in roots):
        return {"exact_dp": "no derivation of a root"}
    found: dict = {}
    share, most = DP_SHARE[memory_limit is not None]
    res = extract_dp.solve(graph, roots, classes, order, canon,
                           upper=None if greedy is None else greedy.cost, memory_limit=memory_limit,
                           upper_memory=None if greedy is None else greedy.memory,
                           time_limit=min(share * time_limit, most), found=found,
                           quick=lambda g, r: greedy_dag(g, r, buy=False).choice)  # its limits as before _bought_computations
    stats = {"exact_dp_s": time.perf_counter() - t0, **({} if res is None else res.stats)}
    if res is None:
        if greedy is None and found.get("choice") is not None:
            # a plan the DP saw where greedy found none (a tight memory bound): the 0/1 program's start
            _, mem = _total(found["choice"])
            if memory_limit is None or mem <= memory_limit:
                stats["_dp_plan"] = found["choice"]
        return {**stats, "exact_dp": "gave up (states or time): the 0/1 program solves it"}
    if res.choice is None and "dp_memory_floor" in res.stats:
        raise _no_plan_fits(memory_limit, f"every plan needs at least {size_text(res.stats['dp_memory_floor'])}")
    if res.choice is None and greedy is not None and res.stats.get("dp_upper_proven"):
        # the Lagrangian dual of the memory bound reached greedy's cost: its plan is optimal
        stats.update(exact_from="greedy", exact_method="dp", exact_proven=True, exact_status="optimal",
                     exact_note="the memory bound's Lagrangian dual proved no plan beats greedy's", greedy_cost=greedy.cost)
        return Selection(greedy.choice, greedy.cost, greedy.memory, "exact", True, stats)
    if res.choice is None:
        if greedy is None:  # nothing within no limit: no plan exists
            return {**stats, "exact_dp": "found no plan: the 0/1 program checks"}
        # greedy's plan is within the DP's limit, so the DP must reach it (or better)
        return {**stats, "exact_dp": "missed greedy's plan: the 0/1 program solves it"}  # pragma: no cover
    total, mem = _total(res.choice)
    if abs(total - res.cost) > 1e-9 * max(abs(total), 1e-12) or (memory_limit is not None and mem > memory_limit):
        return {**stats, "exact_dp": "its plan disagrees with its cost: the 0/1 program solves it"}  # pragma: no cover
    stats.update(exact_from="dp", exact_method="dp", exact_proven=True, exact_status="optimal",
                 greedy_cost=None if greedy is None else greedy.cost)
    return Selection(res.choice, total, mem, "exact", True, stats)


def exact(graph: PhysGraph, roots: list[str], memory_limit: float | None = None,
          time_limit: float = 60.0, start: Selection | None = None, cuts: set | None = None,
          upper: float | None = None, prove: bool = True) -> Selection:
    """Minimum-cost DAG extraction, proven: a dynamic program over the fusion's tensors (extract_dp), and
    where that outgrows its share of time_limit, a 0/1 program (HiGHS), honest about what it proved.

    Greedy runs first: its cost bounds the DP's search and its plan is the 0/1 program's first incumbent,
    returned if the solver finds nothing better in time. `start`: another plan known to be valid (optimize
    passes greedy's plan of a training step that keeps every saved value), used in place of greedy's where
    within memory_limit (`stats["exact_incumbent"]` says which was). With the 0/1 program,
    `stats["exact_proof"]` says how the proof came: "lp" (the cuts' relaxation reached the incumbent's cost)
    or "mip" (HiGHS, after reduced-cost fixing took `stats["exact_fixed"]` columns out). `cuts`: a set the passes
    of one optimize call share: the first 0/1 program to run puts in the cuts its LP needed (by class and
    tensor), and later ones start their cut loops from them (`stats["exact_hinted_cuts"]`). `upper` (seconds): the
    caller holds a plan of this cost already (optimize's cheapest loop so far); where the 0/1 program's LP bound
    is above it, no MIP runs and the start (or greedy's plan) is returned unproven, `stats["exact_status"]`
    "above upper" and `stats["exact_proof"]` "bound above upper" (no plan of this graph is as cheap). `prove=False`:
    for a caller that reads only which layouts the plan holds (optimize's first pass of a training step): where
    the cut loop's LP does not prove the plan in hand, no MIP runs, and the restricted MIP's plan comes back
    unproven (`stats["exact_proof"]` "none", `stats["exact_bound"]` the LP's bound). `stats["exact_method"]` says which method
    ran ("dp" or "ilp"; per independent part, comma-separated). `method` is "exact" only when optimality is proven; otherwise "exact-unproven" (and
    `proven` is False). `stats` says which plan was returned and why. Pins or a memory bound are
    reported infeasible only when the solver proves it.

    >>> g = PhysGraph({"x": [Node("Load", (), "x")],
    ...                "y": [Node("Apply", ("x",), "y", 0, cost=1e-6, memory=4096.0),
    ...                      Node("Apply", ("x",), "y", 1, cost=5e-6, memory=1024.0)]})
    >>> roots = with_roots(g, {"y": ["y"]})
    >>> exact(g, roots).choice["y"].sid, exact(g, roots, memory_limit=2048).choice["y"].sid
    (0, 1)
    >>> sel = exact(g, roots)
    >>> sel.method, sel.proven, sel.stats["exact_method"]
    ('exact', True, 'dp')
    """
    # the collector paused (as greedy_dag does): inside optimize a pass's exact met one or two full
    # collections of optimize's heap, 0.2-0.24 s of a 1.2-4 s pass on one GPT-3 layer's training step
    with gc_paused():
        return _exact(graph, roots, memory_limit, time_limit, start, cuts, upper, prove)


def smallest(graph: PhysGraph, roots: list[str], time_limit: float = 10.0, upper: float | None = None) -> Selection:
    """The plan of least memory per device (of those, the least time), by the exact extractor on the graph whose
    nodes cost their bytes; `proven` where that least memory is proven, and stats["smallest_lower"] a proven lower
    bound of it (the 0/1 program's bound, where it ran). `upper`: bytes past which no plan is wanted (exact's upper:
    no MIP runs where its LP bound is above). Greedy's passes trade bytes against time
    at one price and can miss it: fuzz seed 48 case 7127 (2x2x2, attention's backward), their smallest plan
    13,032 B over a bound of 12,912 B; this one 11,880 B, proven in 4.4 s CPU.

    >>> g = PhysGraph({"x": [Node("Load", (), "x")],
    ...                "y": [Node("Apply", ("x",), "y", 0, cost=1e-6, memory=4096.0),
    ...                      Node("Apply", ("x",), "y", 1, cost=5e-6, memory=1024.0),
    ...                      Node("Apply", ("x",), "y", 2, cost=9e-6, memory=1024.0)]})
    >>> sel = smallest(g, with_roots(g, {"y": ["y"]}))
    >>> sel.choice["y"].sid, sel.memory, sel.cost, sel.proven
    (1, 1024.0, 5e-06, True)
    """
    # time weighs less than half a byte in any plan (a plan takes each node at most once): it only breaks ties
    per_second = 0.5 / (1.0 + sum(n.cost for nodes in graph.classes.values() for n in nodes))
    original: dict[int, Node] = {}
    classes = {}
    for c, nodes in graph.classes.items():
        classes[c] = [replace(n, cost=n.memory + per_second * n.cost) for n in nodes]
        original.update((id(m), n) for m, n in zip(classes[c], nodes))
    sel = exact(replace(graph, classes=classes), roots, None, time_limit, upper=upper)
    choice = {c: original[id(n)] for c, n in sel.choice.items()}
    bounds = [sel.stats.get(k) for k in ("exact_lp_bound", "exact_dual_bound")] + [sel.cost if sel.proven else None]
    lower = max((b for b in bounds if b is not None and math.isfinite(b)), default=0.0) - 0.5  # less time's share
    return Selection(choice, *_total(choice), sel.method, sel.proven,
                     {"smallest_lower": lower, **{"smallest_" + k: v for k, v in sel.stats.items()}})


# the exact extractor's limit for the plan of least memory (smallest), where greedy's passes find none within a bound
LEAST_MEMORY_S = 10.0


def _least_fitting(graph: PhysGraph, roots: list[str], memory_limit: float, found: float,
                   search: bool = True) -> Selection:
    """Greedy's plan where none of its passes fits memory_limit (the smallest of them needs `found` bytes): the plan
    of least memory (smallest, within LEAST_MEMORY_S; not searched unless `search`) polished within the bound.
    MemoryBoundError where that plan does not fit, naming the least memory where it is proven (else `found`)."""
    try:
        least = smallest(graph, roots, LEAST_MEMORY_S, upper=memory_limit) if search else None
    except PlanError:  # no plan in time: greedy's passes say what they found
        least = None
    if least is None or least.memory > memory_limit:
        lower = 0.0 if least is None else least.stats["smallest_lower"]
        if search and not (least is not None and least.proven):
            # the DP's memory floor, where smallest proved no least within its limit (fuzz 49/7837: 2,634 B over a
            # bound of 1,781.5 B in 2.3 s CPU, where smallest's 0/1 program ran out of time without a bound)
            lower = max(lower, _memory_floor(graph, roots, memory_limit))
        raise _no_plan_fits(memory_limit,
                            f"the smallest plan needs {size_text(least.memory)}" if least is not None and least.proven else
                            f"every plan needs at least {size_text(lower)}" if lower > memory_limit else
                            f"the smallest found needs {size_text(found if least is None else min(found, least.memory))}")
    return polished(graph, roots, least, memory_limit)


def _memory_floor(graph: PhysGraph, roots: list[str], memory_limit: float) -> float:
    """A proven lower bound of the memory of every plan within memory_limit (extract_dp.memory_floor over the nodes
    such a plan can use); 0.0 where the DP cannot set up."""
    order, classes = _usable(graph, roots, memory_limit)  # not _Usable.of: the floor needs no canonical collectives
    if any(r not in classes for r in roots):
        return 0.0  # no derivation of a root (within the bound): smallest says what it finds
    got = extract_dp.memory_floor(graph, roots, classes, order)
    return 0.0 if got is None else got[0]


def _no_plan_fits(memory_limit: float, need: str) -> MemoryBoundError:
    """The refusal of a memory bound no plan fits, saying what a plan needs (`need`)."""
    return MemoryBoundError(f"no plan fits the memory bound of {size_text(memory_limit)} per device ({need}); "
                            f"raise the cost model's memory_limit")


def polished(graph: PhysGraph, roots: list[str], start: Selection, memory_limit: float | None = None) -> Selection:
    """Greedy's local search (switch one class's node, complete what it needs) from `start`'s plan while the time
    drops and the memory stays within memory_limit. From smallest's plan of fuzz seed 48 case 7127 (144.0 us,
    11,880 B) within 12,912 B: 124.0 us, the exact extractor's optimum, in 0.07 s.

    >>> g = PhysGraph({"x": [Node("Load", (), "x")],
    ...                "y": [Node("Apply", ("x",), "y", 0, cost=1e-6, memory=4096.0),
    ...                      Node("Apply", ("x",), "y", 1, cost=5e-6, memory=1024.0),
    ...                      Node("Apply", ("x",), "y", 2, cost=3e-6, memory=2048.0)]})
    >>> roots = with_roots(g, {"y": ["y"]})
    >>> sel = polished(g, roots, smallest(g, roots), memory_limit=3000.0)
    >>> sel.choice["y"].sid, sel.cost, sel.memory, sel.method
    (2, 3e-06, 2048.0, 'greedy-dag')
    """
    skeleton = _Skeleton(graph, _topo_order(graph, roots))
    choice = _improve(graph, start.choice, start.choice, 0.0, memory_limit=memory_limit, skeleton=skeleton)
    return Selection(choice, *_total(choice), "greedy-dag")


def _exact(graph: PhysGraph, roots: list[str], memory_limit: float | None, time_limit: float,
           start: Selection | None, cuts: set | None, upper: float | None = None, prove: bool = True) -> Selection:
    """exact's work (the collector paused around it)."""
    parts = _components(graph, roots) if memory_limit is None else []
    if len(parts) > 1:
        return _exact_by_parts(graph, roots, parts, time_limit)
    def greedy_or_none() -> Selection | None:
        try:  # least=False: the least-memory search's seconds (fuzz 49/7837: 24 s CPU, unproven) are the program's
            return greedy_dag(graph, roots, memory_limit, least=False)
        except PlanError:
            return None
    t0 = time.perf_counter()
    if start is not None and (memory_limit is None or start.memory <= memory_limit):
        # in place of greedy's plan, which is not run: on one GPT-3 layer's training step the start was each loop
        # pass's optimum and greedy's plan 2% over (and 0.35 s of a 1.5 s pass)
        greedy, incumbent = start, "start"
    elif memory_limit is not None:
        # under a memory bound greedy runs only where the DP gives up (the 0/1 program's start): its ladder of
        # prices per byte is long (fuzz seed 41 case 4397, 19,700 classes: 20 s CPU of exact's 54, for 118.0 us),
        # and the DP's Lagrangian dual finds plans within the bound of its own to prune by (there the optimum,
        # 82.0 us, proven in the same DP time without greedy's cost as with it)
        greedy, incumbent = None, "deferred"
    else:
        greedy, incumbent = greedy_or_none(), "greedy"
    t1 = time.perf_counter()
    greedy_s = t1 - t0
    usable = _Usable.of(graph, roots, memory_limit)
    by_dp = _exact_dp(graph, roots, memory_limit, greedy, time_limit, usable)
    if isinstance(by_dp, Selection):
        by_dp.stats.update(greedy_s=greedy_s, exact_incumbent="none" if incumbent == "deferred" else incumbent)
        return by_dp
    if incumbent == "deferred":
        t2 = time.perf_counter()
        greedy, incumbent = greedy_or_none(), "greedy"
        greedy_s = time.perf_counter() - t2
    greedy_cost = None if greedy is None else greedy.cost
    # the 0/1 program starts from greedy's plan (or the caller's start) where there is one
    ilp_start, guided = (None, False) if greedy is None else (greedy.choice, incumbent == "greedy")
    seen = by_dp.pop("_dp_plan", None)
    if seen is not None and (greedy is None or _total(seen)[0] < greedy.cost):
        # a plan the DP saw within the bound: where greedy found none (case 33/6050: greedy none within 0.3 of the
        # free memory) also the program's start; where cheaper than greedy's (case 41/4050: the dual's 94.0 us,
        # greedy's 134.0) the plan returned unless the program finds a cheaper one. Not the program's start there:
        # on 41/4050 its vector was not feasible in the program (the start was dropped and HiGHS searched from none)
        if greedy is None:
            ilp_start = seen
        greedy, incumbent = Selection(seen, *_total(seen), "dp-incumbent"), "dp"
    time_limit = max(time_limit - (time.perf_counter() - t1), 1.0)
    # a start (a training step's, from optimize) was each loop pass's optimum where measured, and the LP-guided
    # greedy plan (0.1-0.2 s) no better than the restricted MIP's: it is then left out
    hinted = len(cuts) if cuts else 0
    info = _ilp(graph, roots, memory_limit, time_limit, ilp_start,
                guided=guided, hints=cuts, usable=usable, upper=upper, prove=prove)
    if cuts is not None and not cuts:
        # only the first pass's (a training step's free pass: each loop pass differs from it by its own pins
        # alone, and from the other loop by both): pass 3 of one GPT-3 layer's step from pass 1's cuts took
        # 0.9-1.0 s CPU, from passes 1 and 2's 1.4-1.7 s (its MIP from another LP dual)
        cuts.update(info.get("binding_cuts", ()))
    stats = {**by_dp, "exact_method": "ilp", "exact_proven": bool(info["proven"] and info["choice"] is not None), "exact_status": info["status"],
             "exact_lp_bound": None if info["lp_bound"] is None else info["lp_bound"] / 1e9,
             "exact_bound": info["bound"], "exact_cuts": info["cuts"], "exact_cut_rounds": info["rounds"],
             "exact_cut_s": info["cut_s"], "exact_solve_s": info["solve_s"], "greedy_s": greedy_s,
             "greedy_cost": greedy_cost, "exact_incumbent": incumbent, "exact_start_feasible": info.get("start_feasible"),
             "exact_proof": info.get("proof"), "exact_fixed": info.get("fixed", 0), "exact_hinted_cuts": hinted,
             "exact_dual_bound": None if info.get("dual_bound") is None else info["dual_bound"] / 1e9}
    if info["choice"] is None:
        if greedy is None:
            if info["proven"]:
                raise (MemoryBoundError if memory_limit else PlanError)(
                    "no plan satisfies the pins" + (" and the memory bound" if memory_limit else "")
                                + f" (proven by the 0/1 program: {info['status']})")
            raise PlanError(f"the 0/1 program found no plan within {time_limit:.0f} s and greedy extraction "
                            "found none either" + (" under the memory bound" if memory_limit else "")
                            + "; infeasibility is not proven: raise time_limit")
        # the solver ran out of time with no plan of its own (or, with the bound from greedy's plan, found
        # none better): greedy's plan stands; it is optimal only if the solver proved nothing beats it
        proven, whose = info["proven"], ("the DP's" if incumbent == "dp" else "greedy's")
        stats.update(exact_from="dp" if incumbent == "dp" else "greedy",
                     exact_note=f"the 0/1 program proved no plan beats {whose}" if proven
                     else f"the 0/1 program's bound {info['bound'] * 1e6:.3f} us is above upper ({upper * 1e6:.3f} us): "
                     f"{whose} plan is returned, unproven" if info["status"] == "above upper"
                     else f"the 0/1 program timed out without a plan: {whose} plan is returned")
        stats["exact_proven"] = proven
        return Selection(greedy.choice, greedy.cost, greedy.memory, "exact" if proven else "exact-unproven",
                         proven, stats)
    total, mem = _total(info["choice"])
    if greedy is not None and greedy.cost < total * (1 - 1e-12):
        whose = "dp" if incumbent == "dp" else "greedy"
        stats.update(exact_from=whose, exact_note=f"{whose}'s plan beat the 0/1 program's unproven incumbent")
        return Selection(greedy.choice, greedy.cost, greedy.memory, "exact-unproven", False, stats)
    proven = stats["exact_proven"]
    stats.update(exact_from="ilp")
    return Selection(info["choice"], total, mem, "exact" if proven else "exact-unproven", proven, stats)
