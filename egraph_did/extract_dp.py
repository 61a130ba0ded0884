"""Exact DAG extraction by dynamic programming over the fusion's tensors (issue 12): what proves the cases
whose 0/1 program's relaxation stays weak.

Why a DP: the physical graph's classes are (tensor, layout, level); a tensor's classes are made from one
another (collectives, Keeps) and its level-0 classes by a computation reading its inputs' classes. So
tensors interact only through which of an input's classes their computations read. Walk the tensors
consumers first: when a tensor's turn comes, every class its readers need is known (its demand), and how
to make that demand (its own collectives and computations) is a small problem inside the tensor that
leaves a demand on its inputs. A state is the set of classes demanded of the tensors not yet walked (the
frontier); a value several readers read is one class in that set, so it is paid once. States reached
twice keep the cheaper, and a state whose cost plus a lower bound of what it still needs exceeds the best
known plan is dropped. The DP is exact; it gives up (returns None) when its states exceed a budget, and
the caller falls back to the 0/1 program.

Inside a tensor: where every node reads at most one class of its own tensor (collectives and Keeps) and
computations read only inputs, the classes made are trees, each grown from one computation, and the
options come from a Steiner-tree DP over the demand's subsets (_Tensor._forest_options; under a memory
bound with (cost, memory) Pareto fronts in place of costs, _Tensor._forest_fronts); otherwise a search
over the sets of classes still to make (_Tensor._search_options).

Bounds: a state's lower bound is the larger of a per-tensor one and a cone one (_Lower: a class's least
cost with everything below it, readings with disjoint cones adding up). The walk's limit comes from a beam,
then from probes between the start's bound and that limit (a walk that finds a plan under a probe has
found the optimum).

Memory bounds: first the bound's Lagrangian dual (_lagrange: the DP without the bound on cost + price x
memory, a few prices), which often proves the optimum (a plan within the bound that meets the dual's lower
bound) at the unbounded DP's speed; else a state keeps its (cost, memory) Pareto front, so the bound is
honoured exactly, and its entries are pruned by the dual's priced bound and by a lower bound of the memory
the state still needs (_by_memory).
"""
from __future__ import annotations

import dataclasses
import time
from bisect import bisect_right
from dataclasses import dataclass, field

from .errors import EgraphDidError
from .physgraph import Node, PhysGraph

_EPS = 1e-15
# the largest demand a forest tensor's options take by the Steiner-tree DP (its partitions: Bell(k), 52 for 5)
FOREST_MAX_DEMAND = 4
BEAM_ROUNDS = 4  # beams, each under the last one's cost, before the exact walk
# probes below the best plan known while the lower bound is further than this below it (0.1 left case 43/8836's
# walk under 104.0 us after a probe at 95.0: 19 s CPU, where a probe at 101.3 finds the optimum, 100.0 us, in 8 s)
PROBE_GAP = 0.05
PROBE_AT = 0.7  # where a probe sits between the bound and the best plan (0.5: 5441 1.0 s CPU, 0.7: 0.75 s; 6658 same)

# pairs a bag's join makes before reducing them with its front (_join_front)
JOIN_CHUNK = 65_536

@dataclass
class DPResult:
    """What the DP proved: the optimal choice (None: no plan, proven), its cost, and what it measured.

    >>> DPResult(None, None, {"dp_states": 0}).choice is None
    True
    """
    choice: dict[str, Node] | None
    cost: float | None
    stats: dict = field(default_factory=dict)


class _Budget(Exception):
    """The DP's states outgrew its budget (or time ran out): the caller falls back."""


class _Clock:
    """The DP's budget: states expanded and a deadline, checked as work is done."""

    def __init__(self, max_states: int, time_limit: float, max_width: int = 40_000):
        self.left, self.deadline = max_states, time.perf_counter() + time_limit
        self.max_states = max_states
        self.max_width = max_width  # states after one step (the hard fuzz cases peak at 17,000)
        self.used = 0

    def spend(self, states: int) -> None:
        self.left -= states
        self.used += states
        if self.left < 0 or time.perf_counter() > self.deadline:
            raise _Budget()


def _group_of(graph: PhysGraph, classes: dict[str, list[Node]], order: list[str]) -> dict[str, str]:
    """Each class's tensor: its ident's; for an output's choice among one tensor's classes, that tensor's
    (so the choice is made inside it, not multiplied over every output's choices before any is made); for
    a class with no ident whose nodes all compute one op (a multi-output op's tuple, read through Proj)
    that op's; else the class alone."""
    out = {}
    for c in order:
        if c in graph.ident:
            out[c] = graph.ident[c][0]
            continue
        keys = {(n.op, n.key) for n in classes[c]}
        op, key = next(iter(keys))
        read = {out[ch] for n in classes[c] for ch in n.children}
        if op == "Choose" and len(read) == 1 and all(ch in graph.ident for n in classes[c] for ch in n.children):
            out[c] = next(iter(read))
        else:
            out[c] = f"#{key}" if len(keys) == 1 and op == "Apply" else c
    return out


def _groups(group: dict[str, str], classes: dict[str, list[Node]], order: list[str]
            ) -> tuple[list[str], dict[str, list[str]], dict[str, set[str]]] | None:
    """The tensors in an order consumers-first that keeps the frontier narrow, each tensor's classes (children
    first), and each tensor's input tensors; None if tensors read each other in a cycle."""
    members: dict[str, list[str]] = {}
    inputs: dict[str, set[str]] = {}
    for c in order:
        g = group[c]
        members.setdefault(g, []).append(c)
        ins = inputs.setdefault(g, set())
        for n in classes[c]:
            ins.update(group[ch] for ch in n.children)
        ins.discard(g)
    readers: dict[str, set[str]] = {g: set() for g in members}
    for g, ins in inputs.items():
        for u in ins:
            readers[u].add(g)
    # a tensor's width: how many of its classes others read (what its demand may be drawn from)
    read = {ch for c in order for n in classes[c] for ch in n.children if group[ch] != group[c]}
    width = {g: max(sum(c in read for c in cs), 1) for g, cs in members.items()}
    left = {g: len(rs) for g, rs in readers.items()}
    ready = [g for g, k in left.items() if k == 0]
    walked, frontier, out = set(), set(), []
    while ready:
        # the ready tensor that leaves the narrowest frontier (ties: the one opened last)
        g = min(ready, key=lambda g: (sum(width[u] for u in inputs[g] - frontier) - width[g], -out.index(g)
                                      if g in out else 0))
        ready.remove(g)
        out.append(g)
        walked.add(g)
        frontier.discard(g)
        frontier.update(inputs[g])
        for u in inputs[g]:
            left[u] -= 1
            if left[u] == 0:
                ready.append(u)
    if len(out) != len(members):
        return None
    return out, members, inputs


class _Cached:
    """A walk step's options by demand, cached: `_options` computes them, `options` keeps the list made under
    the highest caps asked so far and filters it for lower ones (a _Tensor's, or a _Bag's joined)."""

    def options(self, demand: int, cap: float, reach: float, merge, clock: _Clock) -> list:
        """[(external demand, cost, memory, chosen nodes, cost plus the demand's reach)] Pareto-minimal,
        cheapest first, costing at most `cap` and, with what their external demand costs at least below
        (`self.below`, the cone bound), at most `reach` (cached: a later call with caps no higher filters
        the cached list)."""
        got = self.cache.get(demand)
        if got is None or got[0] < cap or got[1] < reach:
            got = self.cache[demand] = (cap, reach, self._options(demand, cap, reach, merge, clock))
        opts = got[2]
        if got[0] > cap or got[1] > reach:
            opts = [o for o in opts if o[1] <= cap and o[4] <= reach]
        return opts


class _Tensor(_Cached):
    """One tensor's classes and its options: for a demand (a bitmask of its classes), every Pareto-minimal
    way to make it, as (what it demands of other tensors as a bitmask, cost, memory, the nodes it chose).
    Bit i is the class at position i of the extraction's topological order, so a demand's highest bit is
    the class all of whose readers are decided."""

    def __init__(self, classes: dict[str, list[Node]], members: list[str], bit: dict[str, int],
                 memory: bool, free: dict[str, Node], canon: set[int], ident: dict, like: "_Tensor | None" = None):
        self.members = members
        self.cache: dict[int, list] = {}
        # each node as (node, own classes it reads, others' classes it reads, cost, memory); a free class
        # (made at no cost from free classes: a loaded input) is never demanded
        self.nodes: dict[int, list] = {}
        if like is not None:  # the same classes and free ones at other costs: its masks (see _setup's like)
            self.mask, self.cls, self.own_bits = like.mask, like.cls, like.own_bits
            for c in members:
                i = bit[c]
                self.nodes[i] = [(n, e[1], e[2], n.cost, n.memory if memory else 0.0, e[1] if id(n) in canon else 0, e[6])
                                 for n, e in zip(classes[c], like.nodes[i])]
        else:
            self.mask = 0
            for c in members:
                self.mask |= 1 << bit[c]
            self.cls = {bit[c]: c for c in members}
            for c in members:
                es = self.nodes[bit[c]] = []
                for n in classes[c]:
                    kids = 0
                    for ch in n.children:
                        if ch not in free:
                            kids |= 1 << bit[ch]
                    own = kids & self.mask
                    es.append((n, own, kids & ~self.mask, n.cost, n.memory if memory else 0.0,
                               own if id(n) in canon else 0, n.op == "Keep"))
            # each node's own classes read, as positions (the masks are as long as the graph's classes: a
            # setup of 19,700 classes spent most of its time in their arithmetic)
            self.own_bits: dict[int, list[tuple]] = {i: [tuple(_bits(e[1])) for e in es] for i, es in self.nodes.items()}
        # a lower bound of each class's cost inside this tensor (its cheapest chain of own nodes), and of
        # each layout's: a class is made by a node other than a Keep in its layout at its level or below,
        # so distinct layouts demanded pay distinct nodes
        self.lb: dict[int, float] = {}
        self.layout: dict[int, int] = {}
        first: dict[object, float] = {}
        for c in members:
            i = bit[c]
            self.lb[i] = min((e[3] + max((self.lb[j] for j in own), default=0.0)
                              for e, own in zip(self.nodes[i], self.own_bits[i])), default=0.0)
            lay = ident[c][1] if c in ident else c
            self.layout[i] = lay
            made = min((e[3] for e in self.nodes[i] if not e[6]), default=float("inf"))
            first[lay] = min(first.get(lay, float("inf")), made)
        self.first = {i: first[lay] for i, lay in self.layout.items()}
        self.floor = min(self.lb.values(), default=0.0)  # the least any plan using this tensor pays in it
        self.forced = 0  # set by _forced_closure
        self.below = lambda ext: 0.0  # a lower bound of what an external demand costs: set by _Lower
        self.bounds: dict[int, float] = {}
        self.columns: dict[int, tuple] = {}  # the Steiner-tree DP's columns by terminal set (_column)
        self.anc: dict[int, set] = {} if like is None else like.anc  # class -> the classes it can be made from (_ancestors)
        # a tensor whose every node reads at most one own class, and none both its own and others' (Keeps and
        # collectives convert; computations read inputs only), makes its classes as trees each grown from one
        # computation: its options come from a Steiner-tree DP (_forest_options; under a memory bound its
        # bi-objective form, _forest_fronts)
        self.up: dict[int, list] = {i: [] for i in self.nodes}  # class -> [(cost, class reading it, node)]
        self.sources: dict[int, list] = {}  # class -> its nodes that read no own class
        self.memory = memory
        self.mem_cap = float("inf")  # the memory bound, set by solve: larger entries of _mcolumn are dropped
        self.mcolumns: dict[int, dict] = {}  # _mcolumn's fronts by terminal set
        self.forest = True
        for i, es in self.nodes.items():
            for e, own in zip(es, self.own_bits[i]):
                if len(own) > 1 or (own and e[2]):
                    self.forest = False
                elif own:
                    self.up[own[0]].append((e[3], i, e))
                else:
                    self.sources.setdefault(i, []).append(e)

    def bound(self, demand: int) -> float:
        """A lower bound of what making `demand` costs inside this tensor: its costliest member's chain, or
        the cheapest first node of each layout it holds."""
        got = self.bounds.get(demand)
        if got is None:
            got = self.bounds[demand] = self._bound(demand)
        return got

    def _bound(self, demand: int) -> float:
        chain, layouts = 0.0, {}
        for i in _bits(demand):
            chain = max(chain, self.lb[i])
            layouts[self.layout[i]] = self.first[i]
        return max(chain, sum(layouts.values())) if len(layouts) > 1 else chain

    def _options(self, demand: int, cap: float, reach: float, merge, clock: _Clock) -> list:
        if self.forest and demand.bit_count() <= FOREST_MAX_DEMAND:
            if self.memory:
                opts = self._forest_fronts(demand, cap, reach, clock)
            else:
                opts = self._forest_options(demand, cap, reach, clock)
        else:
            opts = self._search_options(demand, cap, merge, clock)
        below = self.below
        return [o + (o[1] + below(o[0]),) for o in opts if o[1] + below(o[0]) <= reach]

    def _forest_options(self, demand: int, cap: float, reach: float, clock: _Clock) -> list:
        """The options of `demand` in a forest tensor (see __init__): each option is a partition of the
        demand into groups, each group made by one tree from one source, and the cheapest tree from each
        class to each group is a Steiner-tree DP over the demand's subsets (_steiner) on the tensor's
        classes, where a search over the sets of classes still to make (_search_options) keeps ~100k states
        for 3 classes of a tensor in 52 layouts."""
        terms = list(_bits(demand))
        cols, masks = self._steiner(terms)
        full = (1 << len(terms)) - 1
        # per group of the demand, its trees: the cheapest per external demand, cheapest first
        trees: dict[int, list] = {}
        for a in range(1, full + 1):
            best: dict[int, tuple] = {}
            col = cols[a]
            for v, es in self.sources.items():
                hv = col.get(v)
                if hv is None or hv > cap:  # no tree from v, or none within cap
                    continue
                for e in es:
                    k = e[3] + hv
                    if k <= cap and (e[2] not in best or k < best[e[2]][0]):
                        best[e[2]] = (k, v, e)
            trees[a] = sorted(((k, e[2], v, e, a) for k, v, e in best.values() if k + self.below(e[2]) <= reach),
                              key=lambda t: t[0])
        shapes: dict[tuple, tuple] = {}

        def shape(tree: tuple) -> tuple:
            """(classes held, (class, node entry) pairs) of a tree (cost, external demand, source class,
            source node entry, group), rebuilt only for the trees a choice of several groups or a kept
            option uses."""
            _, _, v, e, a = tree
            key = (v, id(e), a)
            got = shapes.get(key)
            if got is None:
                pairs = self._tree(v, masks[a]) + [(v, e)]
                held = 0
                for u, _ in pairs:
                    held |= 1 << u
                if held.bit_count() < len(pairs):  # two routes to one class: it is made once
                    _, _, held, pairs, _ = self._settle(pairs, terms, a)
                got = shapes[key] = (held, pairs)
            return got
        found: dict[int, tuple] = {}
        work = 0
        for groups in _partitions(full):
            lists = [trees[g] for g in groups]
            if not all(lists):
                continue
            rest = [0.0] * (len(groups) + 1)  # the least the groups from i on cost
            for i in reversed(range(len(groups))):
                rest[i] = rest[i + 1] + lists[i][0][0]
            work += self._combine(lists, rest, cap, reach, terms, found, shape)
            if work > 20000:
                clock.spend(work)
                work = 0
        clock.spend(work + len(cols[full]))
        kept = _pareto_ext([(ext, k, 0.0, p) for ext, (k, p) in found.items()])
        return [(ext, k, m, _Trees(self.cls, [p if isinstance(p, list) else shape(p)[1] for p in picked]))
                for ext, k, m, picked in kept]

    def _combine(self, lists: list, rest: list, cap: float, reach: float, terms: list[int], found: dict,
                 shape) -> int:
        """Every choice of one tree per group within `cap` and `reach` (see options) into found (external
        demand -> the cheapest (cost, trees)), cheapest trees first; a choice is dropped as soon as an
        option found already demands a subset of what its trees demand for no more than its trees cost at
        least. Trees that share a class are settled into one plan (_settle). Returns the choices tried."""
        below = self.below
        last, made = len(lists) - 1, 0
        inf = (float("inf"),)

        def extend(i: int, cost: float, ext: int, picked: tuple, subs: tuple) -> None:
            nonlocal made
            least = rest[i + 1]
            for t in lists[i]:
                k = cost + t[0]
                if k + least > cap:
                    break
                made += 1
                e = t[1]
                if k + least + below(ext | e) > reach:  # a superset of a demand costs no less below
                    continue
                more = subs + tuple(u | e for u in subs) + (e,)
                if any(found.get(u, inf)[0] <= k + least for u in more):
                    continue
                if i < last:
                    extend(i + 1, k, ext | e, picked + (t,), more)
                    continue
                picked2, held, overlap = picked + (t,), 0, False
                if last:
                    for x in picked2:
                        h = shape(x)[0]
                        overlap |= bool(held & h)
                        held |= h
                if overlap:
                    k, e2, _, pairs, _ = self._settle([p for x in picked2 for p in shape(x)[1]], terms,
                                                   (1 << len(terms)) - 1)
                    if k < found.get(e2, inf)[0]:
                        found[e2] = (k, (pairs,))
                else:
                    found[ext | e] = (k, picked2)
        extend(0, 0.0, 0, (), ())
        return made

    def _steiner(self, terms: list[int]) -> tuple[list, list[int]]:
        """Per subset `a` of `terms` (a bitmask of positions in it), {v: the least cost of the nodes that make
        the terminals in `a` from class v (v made), through this tensor's conversions}, finite costs only;
        and each subset's classes as a bitmask (what _tree takes). Each subset's costs are a column of
        Dreyfus-Wagner (_column), kept across demands: demands of one tensor share most of their subsets
        (case 30/4937: 3,412 subsets in 546 demands, 914 distinct)."""
        full = (1 << len(terms)) - 1
        masks = [0] * (full + 1)
        for a in range(1, full + 1):
            low = a & -a
            masks[a] = masks[a ^ low] | 1 << terms[low.bit_length() - 1]
        return [None] + [self._column(masks[a])[0] for a in range(1, full + 1)], masks

    def _ancestors(self, t: int) -> set[int]:
        """The classes `t` can be made from through this tensor's conversions, `t` included (cached)."""
        got = self.anc.get(t)
        if got is None:
            got, stack = {t}, [t]
            while stack:
                for e in self.nodes[stack.pop()]:
                    if e[1] and e[1].bit_length() - 1 not in got:
                        got.add(e[1].bit_length() - 1)
                        stack.append(e[1].bit_length() - 1)
            self.anc[t] = got
        return got

    def _column(self, terms: int) -> tuple[dict, dict]:
        """({v: the least cost of the nodes that make the classes in `terms` (a bitmask) from class v}, {v:
        how}) over the classes v all the terms can be made from; how: (0, the rest) v is a term, then the rest;
        (1, u, node entry) the node of a class u reading v, then from u; (2, s) a split of the terms into s
        and the rest, each from v. Dreyfus-Wagner on the tensor's DAG, parents first (a class's readers
        have higher bits), the terms' subsets first (cached)."""
        got = self.columns.get(terms)
        if got is not None:
            return got
        low = terms & -terms
        others = terms ^ low
        splits = []  # (s, its column, the rest's column): s holds the lowest term, the rest is not empty
        sub = (others - 1) & others
        while others:
            s = low | sub
            splits.append((s, self._column(s)[0], self._column(terms ^ s)[0]))
            if not sub:
                break
            sub = (sub - 1) & others
        near = set().union(*(self._ancestors(t) for t in _bits(terms)))
        inf = float("inf")
        cost: dict[int, float] = {}
        how: dict[int, tuple] = {}
        for v in sorted(near, reverse=True):
            if terms >> v & 1:
                rest = terms ^ 1 << v
                k = self._column(rest)[0].get(v, inf) if rest else 0.0
                if k < inf:
                    cost[v], how[v] = k, (0, rest)
                continue
            best, way = inf, None
            for c, u, e in self.up[v]:
                k = c + cost.get(u, inf)
                if k < best:
                    best, way = k, (1, u, e)
            for s, hs, hr in splits:
                k = hs.get(v, inf) + hr.get(v, inf)
                if k < best:
                    best, way = k, (2, s)
            if way is not None:
                cost[v], how[v] = best, way
        got = self.columns[terms] = (cost, how)
        return got

    def _tree(self, v: int, terms: int) -> list:
        """The (class, node entry) pairs of the tree _column chose to make `terms` (a bitmask) from v (the
        source of v not included)."""
        out, stack = [], [(v, terms)]
        while stack:
            v, terms = stack.pop()
            if not terms:
                continue
            how = self.columns[terms][1][v]
            if how[0] == 0:
                stack.append((v, how[1]))
            elif how[0] == 1:
                out.append((how[1], how[2]))
                stack.append((how[1], terms))
            else:
                stack.append((v, how[1]))
                stack.append((v, terms ^ how[1]))
        return out

    def _settle(self, pairs: list, terms: list[int], group: int) -> tuple:
        """(cost, external demand, classes held, pairs, memory) of the plan that makes the terminals of `group`
        by `pairs`, each class by its first pair: trees that reach one class by two routes pay it once."""
        node: dict[int, tuple] = {}
        for v, e in pairs:
            node.setdefault(v, e)
        cost, mem, ext, held, out = 0.0, 0.0, 0, 0, []
        stack = [t for j, t in enumerate(terms) if group >> j & 1]
        while stack:
            v = stack.pop()
            if held >> v & 1:
                continue
            held |= 1 << v
            e = node[v]
            cost += e[3]
            mem += e[4]
            ext |= e[2]
            out.append((v, e))
            if e[1]:
                stack.append(e[1].bit_length() - 1)
        return cost, ext, held, out, mem

    def _mcolumn(self, terms: int) -> dict:
        """_column under a memory bound: {v: the Pareto front of (cost, memory, how) of the nodes that make
        the classes in `terms` from class v}, entries over the memory bound dropped; how: (0, entry) v is a
        term, then the rest by entry; (1, u, node entry, entry) the node of a class u reading v, then from u
        by entry; (2, entry, entry) a split of the terms, each part from v (cached)."""
        got = self.mcolumns.get(terms)
        if got is not None:
            return got
        low = terms & -terms
        others = terms ^ low
        splits = []
        sub = (others - 1) & others
        while others:
            s = low | sub
            splits.append((self._mcolumn(s), self._mcolumn(terms ^ s)))
            if not sub:
                break
            sub = (sub - 1) & others
        near = set().union(*(self._ancestors(t) for t in _bits(terms)))
        cap = self.mem_cap
        front: dict[int, list] = {}
        for v in sorted(near, reverse=True):
            if terms >> v & 1:
                rest = terms ^ 1 << v
                if not rest:
                    front[v] = [(0.0, 0.0, None)]
                else:
                    got_v = self._mcolumn(rest).get(v)
                    if got_v:
                        front[v] = [(k, m, (0, x)) for x in got_v for k, m in (x[:2],)]
                continue
            cand = []
            for c, u, e in self.up[v]:
                fu = front.get(u)
                if fu:
                    m0 = e[4]
                    cand.extend((c + x[0], m0 + x[1], (1, u, e, x)) for x in fu if m0 + x[1] <= cap)
            for fs, fr in splits:
                a, b = fs.get(v), fr.get(v)
                if a and b:
                    cand.extend((x[0] + y[0], x[1] + y[1], (2, x, y)) for x in a for y in b if x[1] + y[1] <= cap)
            if cand:
                front[v] = _pareto(cand)
        self.mcolumns[terms] = front
        return front

    @staticmethod
    def _mtree(entry) -> list:
        """The (class, node entry) pairs of a _mcolumn entry's tree (its source class's node not included)."""
        out, stack = [], [entry]
        while stack:
            how = stack.pop()[2]
            if how is None:
                continue
            if how[0] == 0:
                stack.append(how[1])
            elif how[0] == 1:
                out.append((how[1], how[2]))
                stack.append(how[3])
            else:
                stack.append(how[1])
                stack.append(how[2])
        return out

    def _forest_fronts(self, demand: int, cap: float, reach: float, clock: _Clock) -> list:
        """_forest_options under a memory bound: each group's trees are the Pareto fronts of (cost, memory)
        of a bi-objective Steiner-tree DP (_mcolumn) per source, and the options the Pareto-minimal
        choices of one tree per group (a forest tensor in 726 classes: _search_options spent a minute on
        one step, fuzz seed 43 case 5663)."""
        terms = list(_bits(demand))
        full = (1 << len(terms)) - 1
        masks = [0] * (full + 1)
        for a in range(1, full + 1):
            low = a & -a
            masks[a] = masks[a ^ low] | 1 << terms[low.bit_length() - 1]
        mcap = self.mem_cap
        below = self.below
        trees: dict[int, list] = {}
        work = 0
        for a in range(1, full + 1):
            col = self._mcolumn(masks[a])
            by_ext: dict[int, list] = {}
            for v, es in self.sources.items():
                fv = col.get(v)
                if not fv:
                    continue
                for e in es:
                    for x in fv:
                        k, m = e[3] + x[0], e[4] + x[1]
                        if k <= cap and m <= mcap:
                            by_ext.setdefault(e[2], []).append((k, m, (v, e, x)))
            lst = []
            for ext, f in by_ext.items():
                for k, m, how in _pareto(f):
                    if k + below(ext) <= reach:
                        lst.append((k, m, ext, how, a))
            lst.sort(key=lambda t: (t[0], t[1]))
            trees[a] = lst
            work += len(lst)
        shapes: dict[tuple, tuple] = {}

        def shape(tree: tuple) -> tuple:
            v, e, x = tree[3]
            key = (v, id(e), id(x))
            got = shapes.get(key)
            if got is None:
                pairs = self._mtree(x) + [(v, e)]
                held = 0
                for u, _ in pairs:
                    held |= 1 << u
                got = shapes[key] = (held, pairs)
            return got
        found: dict[int, list] = {}  # external demand -> [(cost, memory, trees)]
        inf = float("inf")
        for groups in _partitions(full):
            lists = [trees[g] for g in groups]
            if not all(lists):
                continue
            n = len(groups)
            rest_k, rest_m = [0.0] * (n + 1), [0.0] * (n + 1)
            for i in reversed(range(n)):
                rest_k[i] = rest_k[i + 1] + lists[i][0][0]
                rest_m[i] = rest_m[i + 1] + min(t[1] for t in lists[i])
            last = n - 1

            def extend(i: int, k0: float, m0: float, ext: int, picked: tuple) -> None:
                nonlocal work
                lk, lm = rest_k[i + 1], rest_m[i + 1]
                for t in lists[i]:
                    k = k0 + t[0]
                    if k + lk > cap:
                        break
                    m = m0 + t[1]
                    if m + lm > mcap:
                        continue
                    work += 1
                    e = ext | t[2]
                    if k + lk + below(e) > reach:
                        continue
                    if i < last:
                        extend(i + 1, k, m, e, picked + (t,))
                        continue
                    picked2 = picked + (t,)
                    held, overlap = 0, False
                    if last:
                        for y in picked2:
                            h = shape(y)[0]
                            overlap |= bool(held & h)
                            held |= h
                    if overlap:
                        k, e, _, pairs, m = self._settle([p for y in picked2 for p in shape(y)[1]], terms, full)
                        entry = (k, m, (pairs,))
                    else:
                        entry = (k, m, picked2)
                    f = found.get(e)
                    if f is None:
                        found[e] = [entry]
                    elif not any(g[0] <= entry[0] + _EPS and g[1] <= entry[1] for g in f):
                        found[e] = _pareto(f + [entry])
            extend(0, 0.0, 0.0, 0, ())
            if work > 20000:
                clock.spend(work)
                work = 0
        clock.spend(work)
        kept = _pareto_ext([(ext, k, m, p) for ext, f in found.items() for k, m, p in f])
        return [(ext, k, m, _Trees(self.cls, [p if isinstance(p, list) else shape(p)[1] for p in picked]))
                for ext, k, m, picked in kept]

    def _search_options(self, demand: int, cap: float, merge, clock: _Clock) -> list:
        # states (own classes still to make, others' classes demanded) -> front of (cost, memory, chosen),
        # bucketed by the highest class still to make: its readers are all decided, so its demand is final
        buckets: dict[int, dict] = {demand.bit_length() - 1: {(demand, 0, 0): [(0.0, 0.0, ())]}}
        done: dict[int, list] = {}
        work = 0
        while buckets:
            top = max(buckets)
            states = buckets.pop(top)
            work += len(states)
            if work > 20000:
                clock.spend(work)
                work = 0
            c, clear = self.cls[top], ~(1 << top)
            for (pend, strict, ext), front in states.items():
                rest, no_keep = pend & clear, strict >> top & 1
                strict &= clear
                for n, own, other, cost, mem, canon, keep in self.nodes[top]:
                    if keep and no_keep:  # a canonical collective reads it: the Keep goes after instead
                        continue
                    p2, e2 = rest | own, ext | other
                    need = cap - cost - (self.bound(p2) if p2 else 0.0)
                    entries = [(k + cost, m + mem, (ch, (c, n))) for k, m, ch in front if k <= need]
                    if not entries:
                        continue
                    if p2:
                        merge(buckets.setdefault(p2.bit_length() - 1, {}), (p2, strict | canon, e2), entries)
                    else:
                        merge(done, e2, entries)
        clock.spend(work)
        return _pareto_ext([(ext, k, m, ch) for ext, front in done.items() for k, m, ch in front])


class _Bag(_Cached):
    """Tensors walked as one step whose options join: readers of the same inputs, none reading another, that
    the walk's order puts one after the other. Walked one at a time, the first's options multiply every
    state before the second's collapse them (case 44/8330: t5 and t4, both read by the root alone and both
    reading only the sdpa_backward tuple: 5,044 states times t5's ~97 options made 489,268 states, then 5,044
    again after t4, 29 s of a probe); joined, the product of their options is taken once per demand and
    reduced (_pareto_ext) before any state meets it. The walk passes the members after the first with no
    demand left (the bag took it), so positions, and the bounds by position, stay as they were."""

    def __init__(self, parts: list["_Tensor"]):
        self.parts = parts
        self.mask = 0
        for t in parts:
            self.mask |= t.mask
        self.cache: dict[int, tuple] = {}

    def _options(self, demand: int, cap: float, reach: float, merge, clock: _Clock) -> list:
        joint = [(0, 0.0, 0.0, ())]
        below = self.parts[0].below
        parts = [sorted(t.options(demand & t.mask, cap, reach, merge, clock), key=lambda o: o[1])
                 for t in self.parts if demand & t.mask]
        parts = _join_order(parts, cap, reach)
        small = _Compact()  # one renumbering of the demands for every join of this bag (see _join)
        for opts in parts:
            joint = _join_front(joint, opts, cap, reach, below, clock, small=small)
        return [o + (kb,) for o in joint for kb in (o[1] + below(o[0]),) if kb <= reach]


def _join_order(parts: list, cap: float, reach: float) -> list:
    """A bag's parts' options (each cheapest first) in the order to join them: first the two whose pairs the
    join looks at fewest of (see _join: the pairs within either's bound), then the rest, fewest options first.
    The same joined options in any order, but not the same work: on case 47/7743 a bag of 309, 150 and 57
    options joined in that order paired 7,921 kept options with the 57 (451,497 pairs), where the 309 and the
    57 first keep 273 (17,613 pairs, 310 within the bounds) for the 150; the walk's order of a bag's parts
    depends on the run (string hashing), and one such order ran out of the DP's budget in its joins.

    >>> a = [(1, 1.0, 0.0, "a", 2.0)] * 3; b = [(2, 1.0, 0.0, "b", 2.0)] * 2; c = [(4, 1.0, 0.0, "c", 9.5)] * 4
    >>> [len(p) for p in _join_order([a, b, c], 10.0, 10.0)]  # c pairs with none (1 + 9.5 > 10): a and c first
    [3, 4, 2]
    """
    if len(parts) < 3:
        return sorted(parts, key=len)
    def looked(first: list, opts: list) -> int:
        costs, reaches = [o[1] for o in opts], sorted(o[4] for o in opts)
        return sum(min(bisect_right(costs, min(cap - k, reach - kb)), bisect_right(reaches, reach - k))
                   for _, k, _, _, kb in first)
    pairs = [(looked(parts[i], parts[j]), i, j) for i in range(len(parts)) for j in range(len(parts)) if i != j]
    _, i, j = min(pairs)
    rest = sorted((p for n, p in enumerate(parts) if n not in (i, j)), key=len)
    return [parts[i], parts[j]] + rest


def _join(joint: list, opts: list, cap: float, reach: float, below, clock: _Clock, small: "_Compact | None" = None
          ) -> list:
    """The pairs of a bag's options so far (external demand, cost, memory, chosen) and a part's `opts` (cheapest
    first, each with its cost plus its demand's cone bound last) that cost at most `cap` and, with what either
    demand costs at least below, at most `reach` (a joint demand costs no less than either part's: every plan
    making it makes both). For each option so far only the prefix of `opts` within what its own demand's bound
    leaves is looked at, and the budget pays for the pairs looked at (case 47/7743: of 451,497 pairs of a step
    8,552 were kept, and 1.8 million pairs spent the DP's 2 million states before its beam's walk ended). The
    joint demand's own cone bound dropped almost none of the pairs these keep (there: 9,743 of 9,743), for a
    bound of each new union (a fifth of the DP's time), and the bag's caller drops by it once the pairs are reduced.
    Each pair carries its demand renumbered by `small` last (a _Compact; a new one where None), the union of its
    parts' (each renumbered once): what _pareto_ext(keyed=True) walks subsets of. Renumbering each pair's union
    anew (a wide integer's bits, then the memo's hash of it) was a third of the DP's time on fuzz case 49/2683.

    >>> lower = lambda e: 2.0 * e.bit_count()
    >>> opts = [(0b01, 1.0, 0.0, "a", 3.0), (0b10, 2.0, 0.0, "b", 4.0), (0, 5.0, 0.0, "c", 5.0)]
    >>> [(e, k) for e, k, _, _, _ in _join([(0b01, 1.0, 0.0, ())], opts, 10.0, 6.0, lower, _Clock(100, 10.0))]
    [(1, 2.0), (3, 3.0)]
    """
    small = _Compact() if small is None else small
    opts = [o + (small(o[0]),) for o in opts]
    by_reach = sorted(opts, key=lambda o: o[4])
    costs, reaches = [o[1] for o in opts], [o[4] for o in by_reach]
    out, looked = [], 0
    for e0, k0, m0, c0 in joint:
        room, left = min(cap - k0, reach - k0 - below(e0)), reach - k0
        n, m = bisect_right(costs, room), bisect_right(reaches, left)
        s0 = small(e0)
        # the shorter of the two prefixes, each option in it checked against the other's limit
        for e, k, m1, c, kb, s in (opts[:n] if n <= m else by_reach[:m]):
            if k <= room and kb <= left:
                out.append((e0 | e, k0 + k, m0 + m1, (c0, c), s0 | s))
        looked += min(n, m)
    clock.spend(max(looked, 1))
    return out


def _join_front(joint: list, opts: list, cap: float, reach: float, below, clock: _Clock,
                chunk: int = JOIN_CHUNK, small: "_Compact | None" = None) -> list:
    """_pareto_ext of _join's pairs, reduced as they are made: the rows of `joint` a chunk at a time (about
    `chunk` pairs each), each chunk's pairs reduced with the front so far, so a join holds its front and one
    chunk, not the product (case 47/5520: the dual's priced DP at Kelley's price joined 1,926 x 2,876 options
    into 3.1 million pairs within its limits, 190,458 on the front). Exact: an option the front drops is
    dominated by one it keeps (the same relation, _pareto_ext's), so the front of the front so far and the
    next chunk is the front of every pair so far. The budget pays for the pairs looked at, as _join's: paying
    for the options kept instead let that case's beam walk run 117 s CPU to the time limit (it gave up on its
    budget at 30 s), nothing proven either way, so the pairs are the work and the budget keeps bounding it.
    Where the deadline passes, it is seen at the next step's charge, as with _join.

    >>> lower = lambda e: 0.0
    >>> a = [(0b01, 1.0, 0.0, "a"), (0b10, 0.5, 0.0, "b")]
    >>> opts = [(0b01, 1.0, 0.0, "c", 1.0), (0b10, 1.0, 0.0, "d", 1.0)]
    >>> [(e, k) for e, k, _, _ in _join_front(a, opts, 10.0, 10.0, lower, _Clock(100, 10.0), chunk=1)]
    [(2, 1.5), (1, 2.0)]
    """
    # the budget pays for every pair _join would look at before any is made, as for the whole product: paid
    # chunk by chunk, 5520's DP reduced most of a 3.1 million pair join before its budget ran out (48.7 -> 86.5 s
    # CPU to give up), where paid first it gives up before the work
    costs, reaches = [o[1] for o in opts], sorted(o[4] for o in opts)
    clock.spend(max(sum(min(bisect_right(costs, min(cap - k0, reach - k0 - below(e0))),
                            bisect_right(reaches, reach - k0)) for e0, k0, _, _ in joint), 1))
    paid = _Clock(1 << 62, float("inf"))
    small = _Compact() if small is None else small
    front: list = []
    i = 0
    while i < len(joint):
        # a chunk at least twice the front: each reduction sorts the front again (fixed chunks of 65,536 pairs
        # sort it ~48 times on 5520's widest join, a front of up to 190,458; with the budget paid per chunk the
        # DP gave up at 99.8 s CPU with fixed chunks, 86.5 s with these; paid first, 34.1 s)
        rows = max(1, max(chunk, 2 * len(front)) // max(len(opts), 1))
        pairs = _join(joint[i:i + rows], opts, cap, reach, below, paid, small)
        i += rows
        if pairs:
            front = _pareto_ext(front + pairs, keyed=True) if front else _pareto_ext(pairs, keyed=True)
    return [o[:4] for o in front]


def _bagged(tensors: list["_Tensor"], lower: "_Lower") -> list:
    """The walk's steps: `tensors`, where a run of consecutive ones read the same inputs (each after the first
    only inputs the first reads) and none reads another, the first replaced by a _Bag of the run."""
    _, seq, _, inputs, _, _ = lower.structure
    steps = list(tensors)
    i = 0
    while i < len(seq):
        j = i + 1
        while (j < len(seq) and inputs[seq[j]] and inputs[seq[j]] <= inputs[seq[i]]
               and not any(seq[k] in inputs[seq[j]] or seq[j] in inputs[seq[k]] for k in range(i, j))):
            j += 1
        if j > i + 1:
            steps[i] = _Bag(tensors[i:j])
        i = j
    return steps


def _partitions(full: int):
    """The partitions of the bits of `full` into groups (bitmasks), the fewest groups first.

    >>> sorted(sorted(p) for p in _partitions(0b111))[:2]
    [[1, 2, 4], [1, 6]]
    >>> len(list(_partitions(0b111))), len(list(_partitions(0b1111)))
    (5, 15)
    """
    def split(rest: int):
        if not rest:
            yield []
            return
        low = rest & -rest
        others = rest ^ low
        sub = others
        while True:  # the group holding the lowest bit: it plus every subset of the others
            for more in split(others ^ sub):
                yield [low | sub] + more
            if not sub:
                break
            sub = (sub - 1) & others
    return sorted(split(full), key=len)


class _Trees:
    """A forest option's choices: its trees, each [(class bit, node entry)], read only by _unwind for the
    plan the DP returns."""
    __slots__ = ("cls", "trees")

    def __init__(self, cls: dict[int, str], trees: tuple):
        self.cls, self.trees = cls, trees

    def pairs(self):
        for t in self.trees:
            for v, e in t:
                yield self.cls[v], e[0]


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _merge_min(table: dict, key, front: list) -> None:
    """table[key] keeps the cheapest entry (no memory bound: memory is not tracked)."""
    old = table.get(key)
    if old is None or front[0][0] < old[0][0]:
        table[key] = front[:1] if len(front) == 1 else [min(front, key=lambda e: e[0])]


def _merge(table: dict, key, front: list) -> None:
    """Add (cost, memory, chosen) entries to table[key], keeping its Pareto front."""
    old = table.get(key)
    table[key] = _pareto(front if old is None else old + front)


def _pareto(front: list) -> list:
    """The (cost, memory) Pareto-minimal entries, cheapest first."""
    if len(front) == 1:
        return front
    front = sorted(front, key=lambda e: (e[0], e[1]))
    out = [front[0]]
    for e in front[1:]:
        if e[1] < out[-1][1]:
            out.append(e)
    return out


def _pareto_ext(opts: list, keyed: bool = False) -> list:
    """Drop an option whose external demand contains another's that costs and holds no more (more demand
    never makes the rest cheaper). `keyed`: each option carries its demand renumbered last (by one _Compact for
    all: the same subsets), which the subset walks use (_join's pairs); else they renumber here."""
    small = (lambda o: o[4]) if keyed else (lambda o, c=_Compact(): c(o[0]))
    opts.sort(key=lambda o: (o[1], o[2], o[0].bit_count()))
    kept: list = []
    if any(o[2] for o in opts):
        # every option kept before o costs no more (the sort): it dominates o where its demand is a subset of
        # o's at no more memory. By the least memory kept per demand, over o's demand's subsets where they are
        # fewer than the options kept (a bag's joined options on case 41/4050: 3 million pairs compared)
        least: dict[int, float] = {}
        for o in opts:
            ext, m = small(o), o[2]
            if 1 << ext.bit_count() < len(least):
                sub, dominated = ext, False
                while True:
                    got = least.get(sub)
                    if got is not None and got <= m:
                        dominated = True
                        break
                    if not sub:
                        break
                    sub = (sub - 1) & ext
            else:
                dominated = any(e & ~ext == 0 and v <= m for e, v in least.items())
            if not dominated:
                kept.append(o)
                if least.get(ext, float("inf")) > m:
                    least[ext] = m
        return kept
    # no memory: an option is dominated by any kept before it (no dearer) whose demand is a subset of its
    # own, found by walking its demand's subsets where they are few; costs within _EPS are one cost (sums
    # of the same nodes in another order), the smaller demand first
    opts.sort(key=lambda o: (round(o[1] / _EPS), o[0].bit_count()))
    seen: set[int] = set()
    for o in opts:
        ext = small(o)
        if ext.bit_count() <= 10:
            sub = ext
            while sub not in seen and sub:
                sub = (sub - 1) & ext
            dominated = sub in seen
        else:
            dominated = any(small(k) & ~ext == 0 for k in kept)
        if not dominated:
            kept.append(o)
            seen.add(ext)
    return kept


class _Compact:
    """Demands renumbered by the bits seen so far: a bag's joined options' demands are a few of ~140 classes
    at positions near 9,500 (case 47/7743), and _pareto_ext's subset walks hashed and masked those wide integers
    (13.9 of the DP's 46.8 s CPU, profiled); the same subsets in a renumbering are narrow. One per call: a
    demand's renumbered bits are a subset of another's exactly where its own bits are.

    >>> small = _Compact()
    >>> small(1 << 9000 | 1 << 9500), small(1 << 9500), small(1 << 9000 | 1 << 9500)
    (3, 2, 3)
    """

    def __init__(self):
        self.index: dict[int, int] = {}  # a class's bit -> its bit here
        self.memo: dict[int, int] = {}

    def __call__(self, ext: int) -> int:
        got = self.memo.get(ext)
        if got is None:
            got, index = 0, self.index
            for b in _bits(ext):
                got |= 1 << index.setdefault(b, len(index))
            self.memo[ext] = got
        return got


def _unwind(chosen) -> dict[str, Node]:
    """The nodes of a chain of choices: (earlier, item), item a (class, node) pair or another chain."""
    out: dict[str, Node] = {}
    stack = [chosen]
    while stack:
        ch = stack.pop()
        while ch:
            ch, item = ch
            if isinstance(item, _Trees):
                out.update(item.pairs())
            elif len(item) == 2 and isinstance(item[1], Node):
                out[item[0]] = item[1]
            else:
                stack.append(item)
    return out


def solve(graph: PhysGraph, roots: list[str], classes: dict[str, list[Node]], order: list[str],
          canon: set[int] = frozenset(), upper: float | None = None, memory_limit: float | None = None, max_states: int = 2_000_000,
          time_limit: float = 30.0, beam: int = 64, max_tensors: int = 120, upper_memory: float | None = None,
          found: dict | None = None, quick=None, like: "_Lower | None" = None, setups: list | None = None
          ) -> DPResult | None:
    """The cheapest plan (within memory_limit) over `classes` (each class's usable nodes, `order` children
    first), proven; None when the DP outgrew `max_states` or `time_limit`, or the graph has more than
    `max_tensors` tensors (a GPT training step's ~370: measured 8 s without a plan; the fuzz cases it proves
    have 6-20) (nothing proven). `upper`: the
    cost of a known plan (greedy's), which prunes; the result is then None-choice only if nothing is
    strictly cheaper AND the DP found nothing at all, so callers pass a plan they already hold;
    `upper_memory` is that plan's memory. Under a memory bound, the result may have choice None with
    stats["dp_upper_proven"]: the bound's Lagrangian dual proved the caller's plan optimal. `found`: where
    the DP gives up, it gets found["choice"], the cheapest plan (within the bound) it saw, if any, for the
    0/1 program to start from. `quick(graph, roots)`: a fast extractor's choice (extract passes greedy's),
    whose plan on each priced graph of the memory bound's dual limits that DP. `like`: see _setup.
    `setups`: gets (its lower bounds, its start state) (the dual keeps its priced solves').

    >>> from egraph_did.extract import with_roots, _topo_order
    >>> g = PhysGraph({"w": [Node("Load", (), "w")],
    ...                "w:R": [Node("Coll", ("w",), "allgather", 0, cost=20e-6)],
    ...                "y": [Node("Apply", ("w:R",), "y", 0, cost=1e-6), Node("Apply", ("w",), "y", 1, cost=15e-6)],
    ...                "z": [Node("Apply", ("w:R",), "z", 0, cost=1e-6), Node("Apply", ("w",), "z", 1, cost=15e-6)]})
    >>> roots = with_roots(g, {"y": ["y"], "z": ["z"]})
    >>> order = _topo_order(g, roots)
    >>> r = solve(g, roots, {c: g.classes[c] for c in order}, order)
    >>> round(r.cost * 1e6), r.choice["y"].sid, r.choice["z"].sid  # one allgather serves both
    (22, 0, 0)
    """
    t0 = time.perf_counter()
    setup = _setup(graph, roots, classes, order, canon, memory_limit is not None, max_tensors, like)
    if setup is None:
        return None
    tensors, lower, start, free = setup
    if setups is not None:
        setups.append((lower, start))
    if memory_limit is not None:
        for t in tensors:
            t.mem_cap = memory_limit
    steps = _bagged(tensors, lower)
    clock = _Clock(max_states, time_limit)
    stats = {"dp_tensors": len(tensors)}
    lagrangian = None  # (price, the priced graph's lower bounds, the memory bound)
    held = None  # lower bounds of the memory a state still needs
    incumbent = None  # the dual's cheapest plan within the bound
    if memory_limit is not None:
        floor = memory_floor(graph, roots, classes, order, max_tensors, lower)
        if floor is not None and floor[0] > memory_limit * (1 + 1e-9):
            stats.update(dp_memory_floor=floor[0], dp_states=0, dp_s=time.perf_counter() - t0)
            return DPResult(None, None, stats)  # proven: no plan within the bound
        dual = _lagrange(graph, roots, classes, order, canon, upper, upper_memory, memory_limit, clock, beam,
                         max_tensors, quick, lower)
        stats.update(dual.stats)
        if dual.proven:
            stats.update(dp_states=clock.used, dp_s=time.perf_counter() - t0)
            return DPResult(dual.choice, dual.cost, stats)
        if dual.cost is not None:
            upper = dual.cost if upper is None else min(upper, dual.cost)
            incumbent = dual.choice
        if dual.price > 0.0:
            # the bounded walk's states pruned by the dual too: what a state still costs is at least its
            # priced bound less the price of the memory it has left (case 33/6050: the dual 7% below the
            # optimum, the cone bound 34%)
            # (the dual's own setup at that price where it walked every class: bounds need no canonical
            # collectives, so one is the other)
            priced = dual.setup
            if priced is None:
                got = _setup(graph, roots, _priced(classes, dual.price), order, set(), False, max_tensors, lower)
                priced = None if got is None else got[1:3]
            if priced is not None and priced[1] == start:
                lagrangian = (dual.price, priced[0], memory_limit)
        # and by what memory a state still needs (memory_floor's bounds). An entry whose memory plus that exceeds
        # the bound has no completion within it (case 41/4050: a state sampled at the widest step of the walk under
        # 88.6 us had none at all)
        if floor is not None and floor[2] == start:
            held = floor[1]
    # first a beam (the best states of each step only) for a plan near the optimum: its cost is the exact
    # walk's limit, which prunes every state that cannot beat it. Again while it gets cheaper: a lower limit
    # drops states before the beam ranks them (case 5441: 98 us from no limit, then the optimum, 84)
    try:
        lim, got = upper, []
        low = max(lower(start, 0), stats.get("dp_dual_bound", 0.0))
        # no beam where the plan in hand is within PROBE_GAP of the bound: a beam's plan could lower the walk's
        # limit only that little, which drops few of its states (case 45/9356: the dual's 110.0025 us over its bound
        # 108.41, the beam 3.3 s for the same plan, the walk under it 1.8 s); the walk under `upper` is exact alone
        rounds = BEAM_ROUNDS if beam and (lim is None or lim - low > PROBE_GAP * lim) else 0
        for _ in range(rounds):
            walked = _walk(steps, lower, start, lim, memory_limit, clock, beam=beam, lagrangian=lagrangian, held=held)
            if not walked or (got and min(e[0] for e in walked) >= lim):
                break
            got, lim = walked, min(e[0] for e in walked)
        stats["dp_beam_cost"] = lim
        # then walks under probes between a lower bound and that limit: one that finds a plan has found the
        # optimum, one that finds none raises the bound, and both cost far less than the walk under a loose
        # limit (case 5441 before the cone bound's sums, CPU: 0.7 s under 76 us, 2.1 s under 87, 7.1 s under 98)
        probes, proven = 0, False
        while lim is not None and lim - low > PROBE_GAP * lim:
            # the first at the bound itself: where the bound is the optimum (case 44/8330: 24.0006 us, the
            # beam's plan 28.0006), only states on its tight paths are walked; elsewhere the fewest of any probe
            probe = low if not probes else low + (lim - low) * PROBE_AT
            if lim - probe <= PROBE_GAP * lim:
                # a probe this near the limit saves little even where it finds the optimum (the walk under it
                # keeps nearly the states of the walk under the limit) and costs a whole walk where it finds
                # none (case 41/4050: 8.3 s under 92.38 us, then 7.4 s under the beam's 94.0027, the optimum);
                # the walk under the limit below proves the optimum either way
                break
            probes += 1
            walked = _walk(steps, lower, start, probe, memory_limit, clock, lagrangian=lagrangian, held=held)
            if walked:
                got, proven = walked, True
                break
            low = probe
        stats["dp_probes"] = probes
        if not proven:
            got = _walk(steps, lower, start, lim, memory_limit, clock, lagrangian=lagrangian, held=held) or got
    except _Budget:
        if found is not None:  # what it saw stays useful: the 0/1 program's first incumbent
            if got:
                found["choice"] = _complete(_unwind(min(got, key=lambda e: (e[0], e[1]))[2]), roots, free)
            elif incumbent is not None:
                found["choice"] = incumbent
        return None
    stats.update(dp_states=clock.used, dp_s=time.perf_counter() - t0)
    if not got:
        return DPResult(None, None, stats)
    k, m, ch = min(got, key=lambda e: (e[0], e[1]))
    return DPResult(_complete(_unwind(ch), roots, free), k, stats)


def _priced(classes: dict[str, list[Node]], price: float, twin_of: dict | None = None) -> dict[str, list[Node]]:
    """`classes` with each node costing cost + price x memory and holding no memory (the Lagrangian dual's
    graph); `twin_of` (cleared) gets each new node's id -> the node it prices.

    >>> _priced({"y": [Node("Apply", (), "y", 0, cost=1e-6, memory=1024.0)]}, 1e-9)["y"][0].cost
    2.024e-06
    """
    if twin_of is not None:
        twin_of.clear()
    out = {}
    for c, ns in classes.items():
        out[c] = [dataclasses.replace(n, cost=n.cost + price * n.memory, memory=0.0) for n in ns]
        if twin_of is not None:
            twin_of.update((id(m), n) for m, n in zip(out[c], ns))
    return out


def _by_memory(classes: dict[str, list[Node]]) -> dict[str, list[Node]]:
    """`classes` with each node weighing its memory as its cost (so _Lower's bounds on them bound the memory
    a state still needs: they hold for any node weights); a node of no memory that costs time weighs 1e-300,
    so the free classes (no cost, no memory) stay those of the bounded setup, whose masks it reuses.

    >>> _by_memory({"y": [Node("Apply", (), "y", 0, cost=1e-6, memory=1024.0)]})["y"][0].cost
    1024.0
    """
    return {c: [dataclasses.replace(n, cost=n.memory if n.memory > 0.0 else 0.0 if n.cost == 0.0 else 1e-300)
                for n in ns] for c, ns in classes.items()}


def memory_floor(graph: PhysGraph, roots: list[str], classes: dict[str, list[Node]], order: list[str],
                 max_tensors: int = 120, like: "_Lower | None" = None) -> tuple | None:
    """(a lower bound of every plan's memory over `classes`: the cone bound of the graph whose nodes weigh their
    memory, _by_memory, at the walk's start; those lower bounds; the start state), or None where the DP cannot set
    up (see _setup). The bounded walk prunes by the same bounds, so a floor over the memory bound proves that no
    plan fits: fuzz seed 49 case 7837 (2x2x2 attention, a bound of 1,781.5 B), a floor of 2,634 B in 2.3 s CPU,
    where the Lagrangian dual and the bounded walk spent the DP's share (32 s CPU) and proved nothing.

    >>> from egraph_did.extract import with_roots, _topo_order
    >>> g = PhysGraph({"x": [Node("Load", (), "x")],  # y in 4 KiB or 1 KiB, then z reading y in 512 B
    ...                "y": [Node("Apply", ("x",), "y", i, cost=c, memory=m) for i, (c, m) in enumerate([(1e-6, 4096.0), (3e-6, 1024.0)])],
    ...                "z": [Node("Apply", ("y",), "z", 0, cost=1e-6, memory=512.0)]})
    >>> roots = with_roots(g, {"z": ["z"]})
    >>> floor = memory_floor(g, roots, {c: g.classes[c] for c in _topo_order(g, roots)}, _topo_order(g, roots))
    >>> floor[0]  # no plan within 1,500 B
    1536.0
    """
    got = _setup(graph, roots, _by_memory(classes), order, set(), False, max_tensors, like)
    if got is None:
        return None
    _, held, start, _ = got
    return held(start, 0), held, start


# the Lagrangian dual's most solves (each a DP without the memory bound, on cost + price x memory); the dual's
# breakpoints are plans, so few solves reach its optimum
DUAL_SOLVES = 8
GREEDY_LADDER = 3  # greedy's plans at these many prices (x8 each) for one within the bound, before the priced DPs


@dataclass
class _Dual:
    """What the Lagrangian dual of a memory-bound extraction proved: `proven` with `choice` the optimum
    (None: the plan costing `cost`, the caller's, is), or else the cheapest plan within the bound it saw
    (choice and cost, or both None) for the memory-bound DP to beat, and the price whose bound was the
    highest, with its priced solve's (lower bounds, start state) where that solve walked every class; where no
    priced solve raised the bound above the unbounded optimum's (they gave up), Kelley's price over the known
    plans (the bounded walk prunes by the priced bounds at any price; 0.0: no plan within the bound known)."""
    proven: bool
    choice: dict[str, Node] | None
    cost: float | None
    stats: dict
    price: float = 0.0
    setup: tuple | None = None


def _lagrange(graph: PhysGraph, roots: list[str], classes: dict[str, list[Node]], order: list[str], canon: set[int],
              upper: float | None, upper_memory: float | None, memory_limit: float, clock: _Clock, beam: int,
              max_tensors: int, quick=None, like: "_Lower | None" = None) -> _Dual:
    """Bound a memory-bound extraction from below by its Lagrangian dual: for a price p >= 0 per byte, the
    cheapest plan by cost + p x memory (a DP without the bound, so its states keep one cost each and forest
    tensors take the Steiner-tree DP) is a plan x_p, and cost(x_p) + p x (memory(x_p) - bound) is at most
    the bounded optimum. At p = 0 that is the unbounded optimum: where it fits, it is the answer (case
    31/6391: greedy's plan fits at the unbounded optimum's cost, and the bounded DP's fronts ran 600 s
    without a proof). Else, once a plan within the bound is known (greedy's at prices x8 apart, or a
    priced DP's), the price where the least of the known plans' lines peaks (Kelley's cutting planes on
    the dual: where a plan over the bound and one within it cost the same) raises the bound, until the DP
    there finds no plan below the peak; a plan within the bound that meets it is optimal, and `upper`
    (the caller's plan) is too if the bound reaches it.
    `like`: the bounded walk's lower bounds, whose setup the priced solves reuse (see _setup).

    >>> from egraph_did.extract import with_roots, _topo_order
    >>> g = PhysGraph({"w": [Node("Load", (), "w")],
    ...                "y": [Node("Apply", ("w",), "y", 0, cost=1e-6, memory=4096.0),
    ...                      Node("Apply", ("w",), "y", 1, cost=3e-6, memory=1024.0)]})
    >>> roots = with_roots(g, {"y": ["y"]})
    >>> order = _topo_order(g, roots)
    >>> d = _lagrange(g, roots, {c: g.classes[c] for c in order}, order, set(), None, None, 1024.0, _Clock(10**6, 10.0), 64, 120)
    >>> d.proven, d.choice["y"].sid, round(d.cost * 1e6, 6)
    (True, 1, 3.0)
    """
    known: list[tuple] = [] if upper is None else [(None, upper, memory_limit if upper_memory is None else upper_memory)]

    def graph_at(price: float) -> tuple:
        """(the priced graph, its classes, their order, its canonical collectives' ids, its nodes' ids -> the
        real ones) at `price`; the last one is kept (greedy and the DP may both run at one price)."""
        got = graphs.get(price)
        if got is not None:
            return got
        # at price 0 memory is free: a class with a derivation costing nothing keeps only it, as without a
        # bound (extract._fix_free), and the classes only other derivations read drop out (case 33/6050)
        fixed = free_classes(classes, order, memory=False) if price == 0.0 else {}
        twin_of: dict[int, Node] = {}
        cls = _priced({c: [fixed[c]] if c in fixed else classes[c] for c in order}, price, twin_of)
        read, stack = set(), list(roots)
        while stack:
            c = stack.pop()
            if c not in read:
                read.add(c)
                stack.extend(ch for n in cls[c] for ch in n.children)
        sub = [c for c in order if c in read]
        cls = {c: cls[c] for c in sub}
        canon2 = {i for i, n in twin_of.items() if id(n) in canon}
        graphs.clear()
        got = graphs[price] = (PhysGraph(cls, graph.ident, graph.index), cls, sub, canon2, twin_of)
        return got

    def greedy_at(price: float) -> None:
        """`quick`'s plan on the graph priced at `price` (greedy's) joins the known plans."""
        priced_graph, _, _, _, twin_of = graph_at(price)
        try:
            known.append(back(quick(priced_graph, roots), twin_of))
        except EgraphDidError:  # no plan by it: the DP says whether there is one
            pass

    def priced(price: float, greedy: bool) -> tuple | None:
        """(the cheapest plan by cost + price x memory as (its nodes, cost, memory), a lower bound of that
        least value), or None where there is no plan. The plans known already limit the DP (with `greedy`,
        `quick`'s plan on the priced graph first); where it finds none cheaper, the cheapest of them is
        returned with its value as the bound. No `quick` plan at a price the known plans chose (Kelley's,
        below), whose value there limits the DP already (a limit only prunes, so the DP's answer is the same
        without it: the cheapest plan under the limit, or the known plan that set it; case 45/9356: 1.5-2 s a
        greedy plan, one above the crossing's value, one 4% under it)."""
        priced_graph, cls, sub, canon2, twin_of = graph_at(price)
        if quick is not None and greedy:
            greedy_at(price)
        limit = min((k + price * m for _, k, m in known), default=None)
        made: list = []
        # each priced DP has a state budget of its own (the bounded walk keeps the caller's): a DP at a Kelley
        # price can walk 1.7 million states (case 40/127), which left the bounded walk none of the 2 million;
        # the clock's deadline holds for all
        res = solve(priced_graph, roots, cls, sub, canon2, limit, None, clock.max_states,
                    max(clock.deadline - time.perf_counter(), 0.0), beam, max_tensors, like=like, setups=made)
        if made and len(sub) == len(order):
            setups[price] = made[0]
        if res is None:
            raise _Budget()
        clock.used += res.stats.get("dp_states", 0)
        clock.spend(0)  # the deadline
        if res.choice is None:
            return None if limit is None else (min(known, key=lambda e: e[1] + price * e[2]), limit)
        plan = back(res.choice, twin_of)
        known.append(plan)
        return plan, plan[1] + price * plan[2]

    def back(choice: dict[str, Node], twin_of: dict[int, Node]) -> tuple:
        """A plan on a priced graph as (its nodes on the real one, cost, memory)."""
        real = {c: twin_of[id(n)] for c, n in choice.items()}
        return real, sum(n.cost for n in real.values()), sum(n.memory for n in real.values())

    def within() -> list:
        return [e for e in known if e[2] <= memory_limit]

    def cheapest() -> tuple | None:
        """The cheapest known plan within the bound that is not the caller's."""
        return min((e for e in within() if e[0] is not None), key=lambda e: e[1], default=None)

    def done() -> bool:
        return any(e[1] <= tol(low) for e in within())

    def kelley() -> tuple | None:
        """(the price that maximizes the least of the known plans' values less price x bound, that value):
        an upper bound of the dual (Kelley's cutting planes), at p = 0 or where the line of a plan over the
        bound crosses one within it; None where no known plan is within the bound (the least grows without
        end)."""
        fits = within()
        if not fits:
            return None
        model = lambda p: min(k + p * (m - memory_limit) for _, k, m in known)  # noqa: E731
        top = (0.0, model(0.0))
        for _, k0, m0 in known:
            for _, k1, m1 in fits:
                if m0 > memory_limit and k1 > k0:
                    p = (k1 - k0) / (m0 - m1)
                    v = model(p)
                    if v > top[1]:
                        top = (p, v)
        return top

    tol = lambda k: k * (1 + 1e-9) + 1e-18  # noqa: E731
    graphs: dict[float, tuple] = {}
    setups: dict[float, tuple] = {}  # price -> its priced solve's (lower bounds, start) (see _Dual)
    stats: dict = {"dp_dual_solves": 1, "dp_dual_greedy": 0}
    try:
        got = priced(0.0, True)
    except _Budget:  # the unbounded DP outgrew its budget: the bounded one may not (it has greedy's cost)
        return _Dual(False, None, None, {**stats, "dp_dual": "gave up"})
    if got is None:  # nothing at all, let alone within the bound
        return _Dual(True, None, None, stats)
    low = got[1]  # the unbounded optimum bounds the bounded one
    best_price = 0.0
    price = max(low, 1e-12) / max(memory_limit, 1.0)  # where a byte weighs about what the plan costs
    # a plan within the bound first: greedy's, on graphs weighing bytes more and more (1-2 s a plan, where a
    # priced DP may return the plan over the bound again after 15 s: case 43/115 at the first price); the
    # DPs then run where the known plans' lines say the dual may peak
    ladder = [] if quick is None else [price * 8.0 ** i for i in range(GREEDY_LADDER)]
    while ladder and not within():
        stats["dp_dual_greedy"] += 1
        greedy_at(ladder.pop(0))
    while not done() and stats["dp_dual_solves"] < DUAL_SOLVES:
        top = kelley()
        if top is not None:
            price, value = top
            if value <= tol(low):
                break  # the dual's optimum is reached: no plan below the known plans' lines at their peak
        stats["dp_dual_solves"] += 1
        try:
            got = priced(price, greedy=top is None and not stats["dp_dual_greedy"])
        except _Budget:
            stats["dp_dual"] = "gave up"
            break
        if got is None:
            break
        got, value = got
        if value - price * memory_limit > low:
            low, best_price = value - price * memory_limit, price
        if top is None and got[2] > memory_limit:
            price *= 8.0  # no plan within the bound yet: weigh bytes more
    best = cheapest()
    stats["dp_dual_bound"] = low
    if best is not None and best[1] <= tol(low):
        return _Dual(True, best[0], best[1], stats)
    if upper is not None and upper <= tol(low):
        stats["dp_upper_proven"] = True
        return _Dual(True, None, upper, stats)
    if best_price == 0.0:
        # no priced solve raised the bound (case 46/9941: the DP at Kelley's price passed max_width): the bounded
        # walk's priced pruning holds at any price, and without it the walk under 88.4 us passed max_width too,
        # with it under 88.0 us it finds the optimum, 82.0019 us, in 82 s CPU
        top = kelley()
        if top is not None and top[0] > 0.0:
            best_price = top[0]
            stats["dp_dual_kelley"] = best_price
    return _Dual(False, None if best is None else best[0], None if best is None else best[1], stats, best_price,
                 setups.get(best_price))


def _setup(graph: PhysGraph, roots: list[str], classes: dict[str, list[Node]], order: list[str], canon: set[int],
           memory: bool, max_tensors: int, like: "_Lower | None" = None) -> tuple | None:
    """(the tensors in walk order, their lower bounds, the start state, the free classes); None where
    tensors read each other in a cycle or there are more than max_tensors. `like`: the lower bounds of a setup of
    the same `order` whose classes' nodes are these at other costs (the memory bound's priced graphs, _priced):
    its tensors, walk order and masks are reused where the free classes are the same (a setup of 19,700 classes,
    fuzz seed 41 case 4397, took 2.5 s of big-integer masks, built five times by the dual and the bounded walk)."""
    free = free_classes(classes, order, memory)
    if like is not None and like.structure[-1].keys() == free.keys() and like.structure[4] == order:
        group, seq, members, inputs, _, old_free = like.structure
        bit = {c: i for i, c in enumerate(order)}
        tensors = [_Tensor(classes, members[g], bit, memory, free, canon, graph.ident, t)
                   for g, t in zip(seq, like.tensors)]
        for t, old in zip(tensors, like.tensors):
            t.forced = old.forced
        lower = _Lower(tensors, seq, inputs, classes, order, free, bit, like)
        lower.structure = like.structure
        return tensors, lower, _start(roots, free, bit), free
    group = _group_of(graph, classes, order)
    # many tensors, many independent branches: the frontier's states multiply. Counted before the walk's
    # order is chosen (each tensor is walked once), which took 0.02 s of each exact pass on one GPT-3
    # layer's training step (2,300 classes, 370 tensors) only to be refused
    if len(set(group.values())) > max_tensors:
        return None
    walk = _groups(group, classes, order)
    if walk is None:
        return None
    seq, members, inputs = walk
    bit = {c: i for i, c in enumerate(order)}
    tensors = [_Tensor(classes, members[g], bit, memory, free, canon, graph.ident) for g in seq]
    _forced_closure(tensors, seq, members, classes, group)
    lower = _Lower(tensors, seq, inputs, classes, order, free, bit)
    lower.structure = (group, seq, members, inputs, order, free)
    return tensors, lower, _start(roots, free, bit), free


def _start(roots: list[str], free: dict[str, Node], bit: dict[str, int]) -> int:
    """The walk's first state: the roots that are not free."""
    start = 0
    for r in roots:
        if r not in free:
            start |= 1 << bit[r]
    return start


def _walk(tensors: list["_Tensor"], lower: _Lower, start: int, upper: float | None, memory_limit: float | None,
          clock: _Clock, beam: int = 0, lagrangian: tuple | None = None, held: "_Lower | None" = None) -> list:
    """The DP over the tensors in order, keeping states within `upper` (None: no limit); the final front.
    `lagrangian` (price, lower bounds on cost + price x memory, the memory bound) prunes too: an entry
    (cost k, memory m) of a state needs at least its priced bound less the price of the memory left,
    k + price x m + bound - price x memory bound. `held` (lower bounds of the memory a state still needs)
    drops an entry whose memory plus its state's bound exceeds the memory bound."""
    memory = memory_limit is not None
    merge = _merge if memory else _merge_min
    limit = float("inf") if upper is None else upper * (1 + 1e-9) + 1e-18
    mem_cap = float("inf") if memory_limit is None else memory_limit
    mem_tol = mem_cap * (1 + 1e-9) + 1e-9  # the bound on memory summed in another order
    states: dict[int, list] = {start: [(0.0, 0.0, ())]}
    for step, tensor in enumerate(tensors):
        nxt: dict[int, list] = {}
        moved = False  # whether any state took this step's options (else its states are the last step's)
        for pend, front in states.items():
            demand = pend & tensor.mask
            if not demand:
                merge(nxt, pend, front)
                continue
            moved = True
            rest = pend & ~demand
            # what the rest still needs bounds what this tensor may spend
            reach = limit - front[0][0]
            cap = reach - lower(rest, step + 1)
            # each option's state bounded before it is made, its cost bound summed from the rest's (most are
            # dropped there: see _Lower.adding); the full bounds below drop what this misses (the memory and priced
            # bounds summed so too dropped ~1% more on cases 46/9941 and 41/4050, for no time)
            need = lower.adding(rest) if upper is not None else _none
            for ext, k, m, ch, _ in _for_state(tensor.options(demand, cap, reach, merge, clock), rest):
                k1 = k + need(ext)
                new = [(k0 + k, m0 + m, (c0, ch)) for k0, m0, c0 in front if k0 + k1 <= limit and m0 + m <= mem_cap]
                if new:
                    merge(nxt, rest | ext, new)
        if upper is not None or beam or held is not None:  # drop states whose cost (or memory) and a bound of
            pruned = {}                                       # what they still need exceed
            for s, f in nxt.items():
                need = lower(s, step + 1)
                f = [e for e in f if e[0] + need <= limit]
                if f and held is not None:
                    need = held(s, step + 1)
                    f = [e for e in f if e[1] + need <= mem_tol]
                if f and lagrangian is not None:
                    price, priced, bound = lagrangian
                    need = priced(s, step + 1) - price * bound
                    f = [e for e in f if e[0] + price * e[1] + need <= limit]
                if f:
                    pruned[s] = f
            nxt = pruned
        nxt = _undominated(nxt, tensors[step + 1].mask if step + 1 < len(tensors) else 0, small=moved)
        if beam and len(nxt) > beam:
            if lagrangian is not None:
                # ranked by the priced value (cost + price x memory and its bound): by cost alone the beam keeps
                # the cheap states that hold too much to finish within the memory bound
                price, priced, _ = lagrangian
                score = {s: min(e[0] + price * e[1] for e in f) + priced(s, step + 1) for s, f in nxt.items()}
            else:
                score = {s: f[0][0] + lower(s, step + 1) for s, f in nxt.items()}
            nxt = {s: nxt[s] for s in sorted(score, key=score.get)[:beam]}
        states = nxt
        if len(states) > clock.max_width:  # the frontier's states multiply: this graph is too wide for the DP
            raise _Budget()
        clock.spend(len(states))
    return states.get(0, [])


def _none(ext: int) -> float:
    """No bound (a walk with no limit)."""
    return 0.0


def _for_state(opts: list, rest: int):
    """The options (cheapest first) worth taking in a state that demands `rest` besides: one is skipped where an
    earlier one (no dearer) adds to the state a subset of what it adds, at no more memory, since the state
    it leads to then demands a subset for no more (_undominated would drop it after the step). Two readers
    of one tensor, each with a fixed demand (case 44/8330: t5 and t4, both read by the root alone, each
    with ~97 options on the sdpa_backward tuple): the second's options in each of the first's 5,044 states made
    489,268 states, 5,044 of them undominated; most of its options read a tuple class the state holds already.

    >>> opts = [(0b01, 1.0, 0.0), (0b10, 2.0, 0.0), (0b11, 3.0, 0.0)]  # demands on another tensor, cheapest first
    >>> [o[0] for o in _for_state(opts, 0b10)]  # 0b11 adds what 0b01 adds, for more
    [1, 2]
    >>> [o[0] for o in _for_state(opts, 0b01)]  # the first adds nothing: the rest cost more
    [1]
    """
    if not any(o[0] & rest for o in opts):  # then what each adds is its demand: _pareto_ext dropped those
        return opts
    return list(_undominated_here(opts, rest))


def _undominated_here(opts: list, rest: int):
    """_for_state's filter."""
    seen: dict[int, float] = {}  # what an option taken adds -> the least memory it took
    for o in opts:
        add, m = o[0] & ~rest, o[2]
        if add.bit_count() <= SUBSET_BITS:
            sub = add
            while True:
                got = seen.get(sub)
                if got is not None and got <= m:
                    break
                if not sub:
                    sub = -1
                    break
                sub = (sub - 1) & add
            if sub >= 0:
                continue
        elif any(e & ~add == 0 and v <= m for e, v in seen.items()):
            continue
        if seen.get(add, float("inf")) > m:
            seen[add] = m
        yield o


# the most classes a state's subsets are enumerated over when looking for one that dominates it (2^10 lookups)
SUBSET_BITS = 10


def _undominated(states: dict[int, list], near: int, small: bool = True) -> dict[int, list]:
    """`states` without the entries that a state demanding a proper subset of their classes matches at no
    more cost and memory: every way to finish a state finishes its subsets too, so what a state still costs
    only grows with what it demands. The subsets walked: all of a state's, or where it holds more than
    SUBSET_BITS classes, those of its classes in `near` (the next tensor's) with the rest kept. `small=False`:
    the states are some of those an earlier call returned, so one of at most SUBSET_BITS classes (whose
    subsets do not depend on `near`) is kept unchecked (a walk's step that no state's demand touches, a bag's
    later members among them: 4.0 of _undominated's 6.8 s on case 41/4050, dropping nothing).
    Two readers demanding of one tensor multiply its states (case 30/4937: a dropout's and an add's choices of
    abs's layouts, 33,447 states after the dropout, 868 undominated; each a distinct demand whose options
    the next step computes).

    >>> sorted(_undominated({0b011: [(2.0, 0.0, ())], 0b001: [(1.0, 0.0, ())], 0b110: [(1.0, 0.0, ())]}, 0))
    [1, 6]
    """
    if not any(small or s.bit_count() > SUBSET_BITS for s in states):
        return states  # every state kept unchecked
    # the subset walks look up the states renumbered by the bits they hold (_Compact: the same subsets), not the
    # states themselves: hashing a wide state (a bit per class of the graph) for each of up to 1,023 subsets was
    # 6.8 s of 48/50's DP (62,397 states of 3-14 classes, 7.1 million look-ups)
    narrow = _Compact()
    fronts = {narrow(s): front for s, front in states.items()}
    near_here = 0  # `near`'s bits among the states', renumbered
    for b, i in narrow.index.items():
        if near >> b & 1:
            near_here |= 1 << i
    out = {}
    for s, front in states.items():
        if not small and s.bit_count() <= SUBSET_BITS:
            out[s] = front
            continue
        ns = narrow(s)
        free = ns if ns.bit_count() <= SUBSET_BITS else ns & near_here
        if free.bit_count() > SUBSET_BITS:
            free = 0
        keep = ns & ~free
        sub = (free - 1) & free
        while front and free:
            other = fronts.get(keep | sub)
            if other is not None:
                front = [e for e in front if not any(o[0] <= e[0] and o[1] <= e[1] for o in other)]
            if not sub:
                break
            sub = (sub - 1) & free
        if front:
            out[s] = front
    return out


def _forced_closure(tensors: list["_Tensor"], seq: list[str], members: dict[str, list[str]],
                    classes: dict[str, list[Node]], group: dict[str, str]) -> None:
    """Each tensor's `forced`: the tensors (as a bitmask of positions in seq) any plan that uses it must
    compute too: every node that makes one of its classes from nothing of its own reads those tensors
    (and, transitively, what they force). A loaded input forces nothing."""
    pos = {g: i for i, g in enumerate(seq)}
    for i in reversed(range(len(seq))):  # inputs come later in seq: their closures are done
        g, need = seq[i], None
        for c in members[g]:
            for n in classes[c]:
                if any(group[ch] == g for ch in n.children):
                    continue
                reads = {group[ch] for ch in n.children}
                need = reads if need is None else need & reads
        mask = 0
        for u in need or ():
            mask |= 1 << pos[u] | tensors[pos[u]].forced
        tensors[i].forced = mask


class _Lower:
    """Lower bounds of what a state (classes demanded of the tensors not yet walked) still costs, the
    larger of two:
    - by tensor: each demanded tensor's own bound, plus the cheapest class of each tensor they force that
      is not demanded itself;
    - by cone: a class's `reach` is the least cost of making it and everything it reads (below), where
      readings whose cones (the tensors they may draw from, loaded inputs left out: those cost nothing) are
      disjoint add up, as no class can serve two of them, and others count their largest. A state's
      classes, the largest reach first, each add what they cost at least outside the cones of those before
      them (_outside): no class there can serve them. The first bound misses the collectives a tensor's
      readers force below it (case 6658: 16 us at the start, the optimum 86); the cone bound sees them
      (66 us) and, for outputs that share only part of their cones, adds up their own parts (5441: 54 us
      by the largest reach alone, 72 us so, the optimum 84).
    """

    def __init__(self, tensors: list["_Tensor"], seq: list[str], inputs: dict[str, set[str]],
                 classes: dict[str, list[Node]], order: list[str], free: dict[str, Node], bit: dict[str, int],
                 like: "_Lower | None" = None):
        self.tensors = tensors
        self.structure: tuple = ()  # what _setup's like reuses: set by _setup
        if like is not None:  # the same tensors at other costs (see _setup's like)
            self.cone, self.tensor = like.cone, like.tensor
            self.ways: dict[int, list] = {i: [(n.cost, kids) for n, (_, kids) in zip(classes[c], like.ways[i])]
                                          for c in order if c not in free for i in (bit[c],)}
        else:
            cone: dict[str, int] = {}
            for i in reversed(range(len(seq))):  # inputs come later in seq
                g = seq[i]
                mask = 0 if all(c in free for c in tensors[i].members) else 1 << i
                for u in inputs[g]:
                    mask |= cone[u]
                cone[g] = mask
            self.cone: dict[int, int] = {}  # class bit -> its tensor's cone
            self.tensor: dict[int, int] = {}  # class bit -> its tensor's position
            for i, g in enumerate(seq):
                for c in tensors[i].members:
                    self.cone[bit[c]] = cone[g]
                    self.tensor[bit[c]] = i
            # each class's ways: (cost, the classes read that are not free)
            self.ways: dict[int, list] = {bit[c]: [(n.cost, [bit[ch] for ch in n.children if ch not in free])
                                                   for n in classes[c]] for c in order if c not in free}
        self.outside: dict[int, dict[int, float]] = {}  # tensors (a union of cones) -> class -> least cost outside
        self.reach: dict[int, float] = {}
        for c in order:
            if c not in free:
                i = bit[c]
                self.reach[i] = min((k + self._chain(kids) for k, kids in self.ways[i]), default=float("inf"))
        self.cache: dict[int, float] = {}
        self.cone_cache: dict[int, float] = {}
        for t in tensors:
            t.below = self.cone_bound

    def adding(self, state: int):
        """A function of a demand `more` -> a lower bound of what `state` and `more` cost together: the cone
        bound's classes in one more order, `state`'s first (its cached bound), then each of `more`'s adding what
        it costs outside the cones before it (any order is a bound, see _chain). One per state, called for each
        of its options' demands: it prunes them before their states are made (case 46/9941: of 515,372 states
        one step made, the cone bound dropped 494,000, each bound ~40 us to compute; this one drops 490,000 of
        them at a memo look-up or two each, the cones of `state` shared)."""
        held = 0
        for i in _bits(state):
            held |= self.cone[i]
        base = self.cone_bound(state)
        memo: dict[int, float] = {}

        def add(more: int) -> float:
            got = memo.get(more)
            if got is None:
                total, h = base, held
                for i in _bits(more):
                    cone = self.cone[i]
                    if cone & ~h:
                        total += self.reach[i] if not cone & h else self._outside(i, h)
                        h |= cone
                got = memo[more] = total
            return got
        return add

    def cone_bound(self, state: int) -> float:
        """The cone bound of `state` (cached)."""
        got = self.cone_cache.get(state)
        if got is None:
            got = self.cone_cache[state] = self._chain(_bits(state))
        return got

    def _chain(self, bits) -> float:
        """What classes cost at least together: each, in some order, adds what it costs outside the cones
        of those before it (any order is a bound: what a class adds lies outside every earlier cone, so no
        node counts twice). The larger of two orders: the largest reach first, and the deepest tensor first
        (the walk's inputs come later, so by position last first), where cones nest: a class then adds its
        own layers on top of what it reads. Case 43/8836 (an attention backward's tanh_8, the tuple of
        sdpa_backward and sdpa_lse_1 demanded at once, each the cone of the one before): the largest reach
        first counts tanh_8's cheapest cone and adds nothing for the tuple classes it holds, 42-56 us where
        the deepest first counts each tensor's part, 62-76 us (the states' costs to go: over 50-74)."""
        bits = [(self.reach[i], i) for i in bits]
        if len(bits) < 2:
            return self._ordered(i for _, i in bits)
        by_reach = [i for _, i in sorted(bits, reverse=True)]
        tensor = self.tensor
        deep = [i for _, i in sorted(bits, key=lambda e: (-tensor[e[1]], -e[0]))]
        return self._ordered(by_reach) if deep == by_reach else max(self._ordered(by_reach), self._ordered(deep))

    def _ordered(self, bits) -> float:
        """What classes cost at least together, in this order: each adds what it costs outside the cones of
        those before it."""
        total, held = 0.0, 0
        for i in bits:
            cone = self.cone[i]
            if cone & ~held:  # else its tensor and all it reads are inside the cones before it
                total += self.reach[i] if not cone & held else self._outside(i, held)
                held |= cone
        return total

    def _outside(self, i: int, held: int) -> float:
        """The least cost of making class i and what it reads, counting only the nodes of tensors outside
        `held` (a union of cones, so what such a tensor reads is inside too)."""
        memo = self.outside.setdefault(held, {})
        stack = [i]
        while stack:
            j = stack[-1]
            if j in memo:
                stack.pop()
                continue
            todo = [c for _, kids in self.ways[j] for c in kids if c not in memo and not held >> self.tensor[c] & 1]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            memo[j] = min((k + self._spread((self.cone[c], 0.0 if held >> self.tensor[c] & 1 else memo[c])
                                            for c in kids) for k, kids in self.ways[j]), default=float("inf"))
        return memo[i]

    @staticmethod
    def _spread(items) -> float:
        """What classes, each (its cone, the least it costs), cost at least together: the sum over groups of
        overlapping cones of the largest in each."""
        groups: list[list] = []  # [cone, largest]
        for cone, most in items:
            keep = []
            for g in groups:
                if g[0] & cone:
                    cone |= g[0]
                    most = max(most, g[1])
                else:
                    keep.append(g)
            keep.append([cone, most])
            groups = keep
        return sum(g[1] for g in groups)

    def __call__(self, state: int, first: int) -> float:
        got = self.cache.get(state)
        if got is None:
            got = self.cache[state] = max(self._by_tensor(state, first), self.cone_bound(state))
        return got

    def _by_tensor(self, state: int, first: int) -> float:
        tensors = self.tensors
        total, demanded, forced = 0.0, 0, 0
        for i in range(first, len(tensors)):
            t = tensors[i]
            d = state & t.mask
            if d:
                total += t.bound(d)
                demanded |= 1 << i
                forced |= t.forced
        forced &= ~demanded
        while forced:
            low = forced & -forced
            total += tensors[low.bit_length() - 1].floor
            forced ^= low
        return total


def free_classes(classes: dict[str, list[Node]], order: list[str], memory: bool) -> dict[str, Node]:
    """Classes made at no cost (and, under a memory bound, no memory) from free classes: a loaded input
    and its Keeps. The DP never demands them; the plan takes them at that node. Without a memory bound,
    extract._fix_free keeps only these nodes in their classes.

    >>> classes = {"x": [Node("Load", (), "x")], "x:R": [Node("Coll", ("x",), "allgather", 0, cost=2e-5)],
    ...            "y": [Node("Apply", ("x",), "y", 0, cost=0.0, memory=64.0)]}
    >>> order = ["x", "x:R", "y"]
    >>> sorted(free_classes(classes, order, memory=False)), list(free_classes(classes, order, memory=True))
    (['x', 'y'], ['x'])
    """
    free: dict[str, Node] = {}
    for c in order:
        for n in classes.get(c, ()):
            if n.cost == 0.0 and (not memory or n.memory == 0.0) and all(ch in free for ch in n.children):
                free[c] = n
                break
    return free


def _complete(choice: dict[str, Node], roots: list[str], free: dict[str, Node]) -> dict[str, Node]:
    """The chosen nodes plus the free classes they (or the roots) read, at their free node."""
    stack = list(roots) + [ch for n in choice.values() for ch in n.children]
    while stack:
        c = stack.pop()
        if c not in choice:
            choice[c] = free[c]
            stack.extend(choice[c].children)
    return choice
