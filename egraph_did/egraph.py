"""The e-graph: encode a Problem in egglog, saturate, serialize, read back a plain graph.

Two sorts (DESIGN.md): T, the logical program (a term per tensor; a composite and its decomposition
are unioned, so they are one class), and D, the physical program, whose classes are named by the
unextractable Phys(t, layout, level): every way to hold logical tensor t in `layout`. Levels
stratify the graph so it stays acyclic: compute ops write level 0 and read level m (= mesh ndim);
collectives and Keep move one level up, one mesh axis at a time.

Rules are few and generic (one per (operand count, output count) for ops, two per level for
collectives); the per-expr strategies and the moves the collective registry connects are facts.
Rules run forward from the classes that exist (the pinned inputs and every layout of free ones), so
saturation builds exactly the reachable layouts. All version-specific egglog calls live in this module.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from itertools import product

from egglog import EGraph, Expr, String, StringLike, function, i64, i64Like, relation, rule, ruleset, union, var

from .collectives import connecting
from .layout import Layout
from .physgraph import Node, PhysGraph
from .problem import Problem


class T(Expr):
    """A logical tensor."""


@function(egg_fn="Tensor")
def Tensor(name: StringLike) -> T:
    """The logical tensor called `name` (an index such as "t3": user names may hold any character)."""


class D(Expr):
    """A physical value: a logical tensor held in some layout on every rank."""


@function(egg_fn="Phys", unextractable=True)
def Phys(t: T, layout: StringLike, level: i64Like) -> D:
    """The class of every way to hold logical tensor t in `layout` at `level` (0..mesh ndim)."""


@function(egg_fn="Load")
def Load(name: StringLike, layout: StringLike) -> D:
    """Input `name` bound in `layout`: every rank receives its shard."""


@function(egg_fn="Keep")
def Keep(d: D) -> D:
    """d unchanged, one level up (a mesh axis on which no collective runs)."""


@function(egg_fn="Coll")
def Coll(kind: StringLike, axis: i64Like, dst: StringLike, d: D) -> D:
    """d after collective `kind` over mesh axis `axis`, which leaves it in layout `dst`."""


@function(egg_fn="Proj")
def Proj(index: i64Like, d: D) -> D:
    """Output `index` of the multi-output op application d."""


@function(egg_fn="Apply1")
def Apply1(key: StringLike, sid: i64Like, a: D) -> D:
    """The expr `key` run under its strategy `sid` on one operand."""


@function(egg_fn="Apply2")
def Apply2(key: StringLike, sid: i64Like, a: D, b: D) -> D:
    """The expr `key` run under its strategy `sid` on two operands."""


@function(egg_fn="Apply3")
def Apply3(key: StringLike, sid: i64Like, a: D, b: D, c: D) -> D:
    """The expr `key` run under its strategy `sid` on three operands."""


@function(egg_fn="Apply4")
def Apply4(key: StringLike, sid: i64Like, a: D, b: D, c: D, d: D) -> D:
    """The expr `key` run under its strategy `sid` on four operands."""


APPLY = {1: Apply1, 2: Apply2, 3: Apply3, 4: Apply4}
Valid = relation("Valid", T, String, egg_fn="Valid")  # t may be held in layout (its shape fits it)
Trans = relation("Trans", String, String, String, i64, egg_fn="Trans")  # layout -> layout by a collective on a mesh axis
STRAT = {(n, o): relation(f"Strat{n}x{o}", String, i64, *([T, String] * (o + n)), egg_fn=f"Strat{n}x{o}")
         for n in APPLY for o in (1, 2)}


# ---------------------------------------------------------------------- encode + saturate

def _rules(m: int):
    rs = ruleset(name=f"sharding{m}")
    t, l, lf, lt, kind = var("t", T), var("l", String), var("lf", String), var("lt", String), var("kind", String)
    ax = var("ax", i64)
    for k in range(m):
        rs.register(rule(Phys(t, l, k)).then(union(Phys(t, l, k + 1)).with_(Keep(Phys(t, l, k)))))
        rs.register(rule(Phys(t, lf, k), Trans(lf, lt, kind, ax), Valid(t, lt)).then(
            union(Phys(t, lt, k + 1)).with_(Coll(kind, ax, lt, Phys(t, lf, k)))))
    key, sid = var("key", String), var("sid", i64)
    for (n, o), strat in STRAT.items():
        outs = [(var(f"o{i}", T), var(f"lo{i}", String)) for i in range(o)]
        ins = [(var(f"a{i}", T), var(f"la{i}", String)) for i in range(n)]
        fact = strat(key, sid, *[x for pair in outs + ins for x in pair])
        node = APPLY[n](key, sid, *[Phys(a, la, m) for a, la in ins])
        if o == 1:
            acts = [union(Phys(outs[0][0], outs[0][1], 0)).with_(node)]
        else:
            acts = [union(Phys(ot, ol, 0)).with_(Proj(i, node)) for i, (ot, ol) in enumerate(outs)]
        rs.register(rule(fact, *[Phys(a, la, m) for a, la in ins]).then(*acts))
    return rs


def transitions(problem: Problem) -> list[tuple[str, str, str, int]]:
    """Every (src layout, dst layout, collective, mesh axis) that changes one mesh axis's placement, where
    no inner mesh axis splits the same tensor axis (shards nest outer mesh axis first).

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> from egraph_did.problem import build_problem
    >>> moves = transitions(build_problem(row_sum(8, 64), ed.DeviceMesh.arange(4)))
    >>> ("P", "S0", "reduce_scatter", 0) in moves, ("S0", "R", "allgather", 0) in moves, ("R", "P", "slice", 0) in moves
    (True, True, False)
    """
    codes: dict[str, Layout] = {}
    for lays in problem.layouts.values():
        for lay in lays:
            codes[lay.code()] = lay
    out = []
    for src, dst in product(codes.values(), repeat=2):
        diff = [m for m in range(len(src)) if src[m] != dst[m]]
        if len(diff) != 1:
            continue
        m = diff[0]
        inner = src.placements[m + 1:]
        if any(p.is_shard and p in inner for p in (src[m], dst[m])):
            continue
        for k in connecting(src[m], dst[m]):
            out.append((src.code(), dst.code(), k.name, m))
    return out


def _facts(problem: Problem, ident: dict[str, str]) -> list[str]:
    """The problem as egglog facts (text): equal terms, valid layouts, reshards, loads, strategies."""
    def t(name):
        return f'(Tensor "{ident[name]}")'
    out = [f"(union {t(a)} {t(b)})" for a, b in problem.equal]
    for name, lays in problem.layouts.items():
        out += [f'(Valid {t(name)} "{lay.code()}")' for lay in lays]
    out += [f'(Trans "{src}" "{dst}" "{kind}" {ax})' for src, dst, kind, ax in transitions(problem)]
    for tv in problem.fusion.inputs:
        out += [f'(union (Phys {t(tv.name)} "{lay.code()}" 0) (Load "{ident[tv.name]}" "{lay.code()}"))'
                for lay in problem.load_layouts(tv.name)]
    for key, strats in problem.strategies.items():
        e = problem.exprs[key]
        names = [o.name for o in e.outputs] + [v.name for _, v in e.args if hasattr(v, "logical_domain")]
        rel = f"Strat{len(names) - len(e.outputs)}x{len(e.outputs)}"
        for s in strats:
            pairs = " ".join(f'{t(n)} "{lay.code()}"' for n, lay in zip(names, s.outputs + s.inputs))
            out.append(f'({rel} "{ident[key]}" {s.sid} {pairs})')
    return out


def saturate(problem: Problem, chunk: int = 200) -> PhysGraph:
    """Encode, saturate and read back the physical graph (costs are set by the caller).

    Facts go in as egglog text, parsed and run a chunk at a time: building each fact through the
    Python API costs about 0.5 ms, and parsing one long program is quadratic in its length.

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> from egraph_did.problem import build_problem
    >>> graph = saturate(build_problem(row_sum(8, 64), ed.DeviceMesh.arange(4)))
    >>> ways = graph.classes[graph.index[("y", "S0", 1)]]  # y split by rows, after mesh axis 0
    >>> sorted((n.op, n.key) for n in ways)  # computed so, or reached from P or R by a collective
    [('Coll', 'reduce_scatter'), ('Coll', 'slice'), ('Keep', '')]
    """
    m = problem.mesh.ndim
    t0 = time.perf_counter()
    # egglog sees tensors by index: user names may hold any character
    ident = {name: f"t{i}" for i, name in enumerate(problem.fusion.tensors)}
    eg = EGraph()
    first = problem.fusion.inputs[0]
    lay0 = problem.load_layouts(first.name)[0].code()
    eg.register(union(Phys(Tensor(ident[first.name]), lay0, 0)).with_(Load(ident[first.name], lay0)))
    rules = _rules(m)
    eg.run(1, ruleset=rules)  # declares every sort, function and rule before the text facts arrive
    facts = _facts(problem, ident)
    for k in range(0, len(facts), chunk):
        eg._egraph.run_program(*eg._egraph.parse_program("\n".join(facts[k:k + chunk])))
    t1 = time.perf_counter()
    eg.run(rules.saturate())
    t2 = time.perf_counter()
    name_of = {v: k for k, v in ident.items()}
    graph = _read_back(eg, name_of, prefer=lambda name: (name in problem.origin, name))
    t3 = time.perf_counter()
    graph.stats.update(encode_s=t1 - t0, saturate_s=t2 - t1, serialize_s=t3 - t2, facts=len(facts))
    return graph


def _literal(op: str):
    return json.loads(op)


def _read_back(eg: EGraph, name_of: dict[str, str], prefer) -> PhysGraph:
    data = json.loads(eg._serialize(split_primitive_outputs=False).to_json())
    nodes, class_data = data["nodes"], data["class_data"]

    def sort_of(node_id):
        return class_data[nodes[node_id]["eclass"]]["type"].rsplit(".", 1)[-1]

    names_of: dict[str, list[str]] = defaultdict(list)
    for nd in nodes.values():
        if nd["op"] == "Tensor":
            names_of[nd["eclass"]].append(name_of[_literal(nodes[nd["children"][0]]["op"])])
    tensor_names = {cls: min(names, key=prefer) for cls, names in names_of.items()}
    graph = PhysGraph()
    graph.canonical = {n: tensor_names[cls] for cls, names in names_of.items() for n in names}
    for nd in nodes.values():
        if sort_of_class(class_data, nd["eclass"]) != "D":
            continue
        op, ch, cls = nd["op"], nd["children"], nd["eclass"]
        if op == "Phys":
            ident = (tensor_names[nodes[ch[0]]["eclass"]], _literal(nodes[ch[1]]["op"]), _literal(nodes[ch[2]]["op"]))
            assert graph.ident.setdefault(cls, ident) == ident, f"layouts {ident} and {graph.ident[cls]} merged"
            graph.index[ident] = cls
            graph.classes.setdefault(cls, [])
            continue
        d_children = tuple(nodes[c]["eclass"] for c in ch if sort_of(c) == "D")
        if op.startswith("Apply"):
            node = Node("Apply", d_children, name_of[_literal(nodes[ch[0]]["op"])], _literal(nodes[ch[1]]["op"]))
        elif op == "Proj":
            node = Node("Proj", d_children, sid=_literal(nodes[ch[0]]["op"]))
        elif op == "Load":
            node = Node("Load", (), name_of[_literal(nodes[ch[0]]["op"])])
        elif op == "Keep":
            node = Node("Keep", d_children)
        elif op == "Coll":
            node = Node("Coll", d_children, _literal(nodes[ch[0]]["op"]), _literal(nodes[ch[1]]["op"]))
        else:  # pragma: no cover - every D constructor is handled above
            raise AssertionError(f"unexpected physical node {op}")
        graph.classes.setdefault(cls, []).append(node)
    return graph


def sort_of_class(class_data, cls: str) -> str:
    """The sort (short name) of e-class `cls` in egglog's serialized class data.

    >>> sort_of_class({"egraph_did.egraph.D-1": {"type": "egraph_did.egraph.D"}}, "egraph_did.egraph.D-1")
    'D'
    """
    return class_data[cls]["type"].rsplit(".", 1)[-1]
