"""The e-graph (docs/egraph.md): encode a Problem's program over the typed sorts of rewrites/sorts.py,
saturate the rewrites/ rulesets, read back the physical classes as a plain PhysGraph.

Encoding: one named term per tensor, equal to its op's constructor (Def), shape facts once per distinct
shape, each op application (Site) and its signature (Sig: op, shapes, attributes; AxisMap, Reduced,
AttrS, AttrI, ReshapeBlock and Param computed here by op kind: `_axis_facts`), the inputs (Input, or
LoadIn for a pin). No strategy is a fact: the family rulesets derive the per-mesh-axis relation Ax per
signature; the rules generated here join it over the mesh axes (Strat, then Plan per application),
compute level 0 from operands held at level m = mesh ndim (Run) and move one mesh axis a level up by Keep
or by a collective the registry connects (Move; the graph stays acyclic). The schedule runs the
families and the program rules once, then the physical rules to saturation.

Every registered rule has an egglog form (rules.egglog_form): a rule without one is an error naming it
(check_egglog_forms), never a silent fallback to rows its Python rule computes. tests/optimizer/test_egraph.py
holds the graph equal to a plain Python worklist over the problem's priced strategies; tests/rewrites/
test_egglog_rules.py holds every egglog form equal to its Python rule.
"""
from __future__ import annotations

import contextlib
import functools
import json
import time
from collections import defaultdict

import numpy as np

from egglog import EGraph, String, eq, i64, relation, ruleset, union, var
from egglog import rule as erule

from egraph_did.rewrites import (ALL_RULES, aten, collective_matmul, experts, frontend_ops, grad_ops, pointwise, ring_attention,
                                  reduction, scans, views)
from egraph_did.rewrites.experts import expert_rows_attrs
from egraph_did.rewrites.rules import EGGLOG
from egraph_did.rewrites.sorts import (AX, KERNS, LAYOUTS, OPS_SORT, PLAN, RUN, SIG, SITE, STRAT, Apart, AttrI, AttrS, AxisMap,
                                       Bcast, Connect, D, Def, Extent, Fits, FitsAny, FitsEmpty, FloatSize, Held, Input, Lit, Load,
                                       LoadIn, KernOK, MeshSize, NestOK, NoPartial, OpKind, Out, Param, Placement, Rank,
                                       Reduced, ReshapeBlock, Shape, ShapeOf, Shp, T, Tensor, Valid, attr_text,
                                       shape_code)
from egraph_did.rewrites.sorts import Kern as KernSort, Layout as LayoutSort
from egraph_did.rewrites.sorts import P as P_, Pe as Pe_, Pmax as Pmax_, R as R_, S as S_

from .collectives import RING_FLAGS, connecting
from .egglog_io import frozen_rows, run_text, string_term, value_id
from .layout import PE, PMAX, Layout, P, R, S, is_valid
from .ops import OPS
from .physgraph import Node, PhysGraph, gc_paused
from .problem import Problem, op_view

Lay = relation("Lay", LayoutSort, egg_fn="Lay")  # a layout some tensor may be held in
Move = relation("Move", LayoutSort, LayoutSort, String, i64, egg_fn="Move")  # src, dst, collective, mesh axis
Whole = relation("Whole", LayoutSort, egg_fn="Whole")  # a layout with no pending reduction
# Open(1): every application takes every strategy its signature's Strat rows give. Absent where the problem
# was restricted to another plan's strategies (build_problem(like=): a pin on every expr), which then come
# as Plan rows
Open = relation("Open", i64, egg_fn="Open")
# The physical nodes as edges into the class they make (its Held term), not as terms unioned with it: the
# physical rules never union, so no iteration pays egglog's rebuild (canonicalizing every table that holds
# a D) for them (96 GPT-3 layers: saturation 2.8 s -> 1.4 s, the same classes and nodes). A multi-output
# op's run stays a term (the class of its tuple), which ProjOf edges read. Keeps and collectives have no
# relation of their own: the Held term one level up is what their rules make, and read_back joins their
# edges from Held, Move and Valid (a 2x2 mesh's ~170k collective rows were the most of what it read).
ProjOf = relation("ProjOf", D, i64, D, egg_fn="ProjOf")  # dst, output index, the run's tuple
# dst, key, kernels, output layout, operands..: a single-output op run rank-locally into dst
RUN_OF = {(n, o): relation(f"RunOf{n}x{o}", D, String, KernSort, LayoutSort, *([D] * n), egg_fn=f"RunOf{n}x{o}")
          for (n, o) in RUN if o == 1}

# The family rulesets (rules.family_ruleset, one per module of rewrites/), composed into one by the schedule
RING_FLAG_SET = frozenset(RING_FLAGS)

FAMILIES = (pointwise.pointwise | views.views | reduction.reduction | aten.aten | grad_ops.grad_ops
            | frontend_ops.frontend_ops | scans.scans | experts.experts)


def check_egglog_forms(rules=None, forms=None) -> None:
    """Raise, naming them, if registered sharding rules have no egglog form (rules.egglog_form): the e-graph
    derives every strategy by its rulesets, and a rule without one would silently offer nothing there.
    Defaults: every registered rule (rewrites.ALL_RULES) against the declared forms (rules.EGGLOG).

    >>> check_egglog_forms()  # every rule of rewrites/ has one
    >>> check_egglog_forms([r for r in ALL_RULES if r.name == "cat_of_partials"], {})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: sharding rules without an egglog form: cat_of_partials (frontend_ops); write ...
    """
    rules, forms = ALL_RULES if rules is None else rules, EGGLOG if forms is None else forms
    missing = [f"{r.name} ({r.family})" for r in rules if r.name not in forms]
    if missing:
        raise RuntimeError(f"sharding rules without an egglog form: {', '.join(missing)}; write an "
                           f"@egglog_form(rule) beside each in its family module (docs/egraph.md, Adding a rule)")


check_egglog_forms()  # at import, with every family of rewrites/ registered (FAMILIES holds their rulesets)


# ---------------------------------------------------------------------- terms as text (the adapter's input)

def _q(s: str) -> str:
    return string_term(s)  # egglog strings: JSON's quotes become single quotes, a backslash is escaped


PLACEMENTS = (("R", R), ("P", P), ("Pmax", PMAX), ("Pe", PE))  # the egglog constructor of each placement but S


def pl_text(p) -> str:
    """A placement as an egglog term.

    >>> pl_text(S(1)), pl_text(PMAX), pl_text(PE)
    ('(S 1)', '(Pmax)', '(Pe)')
    """
    if p.is_shard:
        return f"(S {p.axis})"
    return "(R)" if p.kind == "R" else "(Pe)" if p.rows else "(P)" if p.reduce == "sum" else "(Pmax)"


def lay_text(lay: Layout) -> str:
    """A layout as an egglog term: (L2 (S 0) (R))."""
    return f"(L{len(lay)} " + " ".join(pl_text(p) for p in lay) + ")"


# ---------------------------------------------------------------------- op facts by kind

def _norm(a: int, n: int) -> int:
    return a % n if n else a


def _dims(x_ndim: int, dims) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(x_ndim))
    return tuple(sorted(_norm(d, x_ndim) for d in ((dims,) if isinstance(dims, int) else dims)))


def _axis_facts(e) -> list[tuple]:
    """The op's axis correspondence (AxisMap: output axis b is operand axis a, unchanged), its reduced or
    gathered axes (Reduced), a reshape's groups (ReshapeBlock) and attributes the rules read (AttrS, AttrI:
    an rfactor's blocks, scatter_add's dim), by op kind.

    >>> from egraph_did.models import row_sum
    >>> _axis_facts(row_sum(8, 64).fusion.exprs[0])  # sum over axis 1 keeps axis 0
    [('AxisMap', 0, 0, 0), ('Reduced', 1)]
    """
    args, op = dict(e.args), e.op
    tensors = [v for _, v in e.args if hasattr(v, "logical_domain")]
    if not tensors:  # a constant (full): no operand axis maps to its output's
        return []
    x = tensors[0]
    out: list[tuple] = []
    if op.kind == "reduction" and "dims" in op.signature.parameters:  # sum, amin, any, var_mean, ...
        dims = _dims(x.ndim, args.get("dims"))
        kept = [a for a in range(x.ndim) if a not in dims]
        out += [("AxisMap", 0, a, a if args.get("keepdim") else a - sum(d < a for d in dims)) for a in kept]
        out += [("Reduced", a) for a in dims]
    elif op.kind == "scan":  # cumsum: every axis but the scanned one, unchanged
        dim = _norm(args["dim"], x.ndim)
        out += [("AxisMap", 0, a, a) for a in range(x.ndim) if a != dim]
    elif op.permutes:
        out += [("AxisMap", 0, a, b) for b, a in enumerate(op.permutation(args, x.ndim))]
    elif op.name == "reshape":
        out += [("ReshapeBlock", *blk) for blk in views.reshape_blocks(x.shape, e.outputs[0].shape)]
    elif op.name == "welford_blocks":
        dim = _norm(args["dim"], x.ndim)
        out += [("AxisMap", 0, a, a) for a in range(x.ndim) if a != dim] + [("Reduced", dim)]
    elif op.name == "unsqueeze":
        d = _norm(args["dim"], e.outputs[0].ndim)
        out += [("AxisMap", 0, a, a if a < d else a + 1) for a in range(x.ndim)]
    elif op.name == "expand":
        out += [("AxisMap", 0, a, a + e.outputs[0].ndim - x.ndim) for a in range(x.ndim)]
    elif op.name == "broadcast_in_dim":
        out += [("AxisMap", 0, a, b) for a, b in enumerate(args["broadcast_dims"])]
    elif op.name in ("softmax", "take_along_axis"):
        dim = _norm(args["dim"], x.ndim)
        out += [("AxisMap", 0, a, a) for a in range(x.ndim) if a != dim] + [("Reduced", dim)]
    elif op.name in ("layer_norm", "rms_norm"):
        ns = args.get("normalized_shape")
        k = (len(args["weight"].shape) if args.get("weight") is not None
             else 1 if isinstance(ns, int) else len(ns or (1,)))
        out += [("AxisMap", 0, a, a) for a in range(x.ndim - k)]
    elif op.name in ("slice", "cat", "scatter_add"):  # every axis but dim unchanged (cat: in both operands)
        dim = _norm(args["dim"], x.ndim)
        out += [("AxisMap", j, a, a) for j in range(2 if op.name == "cat" else 1) for a in range(x.ndim) if a != dim]
        if op.name == "scatter_add":
            out.append(("AttrI", "dim", dim))
    elif op.name == "welford_merge":
        rank = x.ndim - 1
        dim, keep = _norm(args["dim"], rank), args.get("keepdim")
        out += [("AxisMap", 0, a, a if keep or a < dim else a - 1) for a in range(rank) if a != dim]
    for name in ("reduction", "is_causal", "ignore_index"):
        if name in args:
            out.append(("AttrS", name, attr_text(args[name])))
    if "blocks" in args:  # an rfactor's first half (welford_blocks, attention_blocks): one block per rank
        out.append(("AttrI", "blocks", args["blocks"]))
    out += [("AttrI", name, int(v)) for name, v in expert_rows_attrs(e)]  # rows sorted by the same offsets
    return out


# ---------------------------------------------------------------------- encode

def encode(problem: Problem) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """The problem's program, shapes, structure and loads as egglog facts (text), the tensor index and each
    expr's signature (op applications alike, as in the layers of a model, share one: the sharding rules
    run once per signature).

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> from egraph_did.problem import build_problem
    >>> facts, ident, sig_of = encode(build_problem(row_sum(8, 64), ed.DeviceMesh.arange(4)))
    >>> [f for f in facts if f.startswith(("(Def", "(Site", "(Sig"))]  # doctest: +NORMALIZE_WHITESPACE
    ['(Def (T "t1") (op_sum (T "t0") (Lit "1") (Lit "false")))', '(Sig1x1 "g0" "sum" (Shp "float32:8") (Shp "float32:8,64"))',
     '(Site1x1 "t1" "g0" (T "t1") (T "t0"))']
    """
    fusion, mesh = problem.fusion, problem.mesh
    ident = {name: f"t{i}" for i, name in enumerate(fusion.tensors)}

    def t(name):
        return f'(T "{ident[name]}")'

    out: list[str] = []
    shapes: dict[str, object] = {}
    for name, tv in fusion.tensors.items():
        code = shape_code(tv)
        shapes.setdefault(code, tv)
        out.append(f"(ShapeOf {t(name)} (Shp {_q(code)}))")
    for code, tv in shapes.items():
        s = f"(Shp {_q(code)})"
        out.append(f"(Rank {s} {tv.ndim})")
        out += [f"(Extent {s} {a} {n})" for a, n in enumerate(tv.shape)]
        if tv.dtype.is_floating_point:
            out.append(f"(FloatSize {s} {tv.dtype.itemsize})")
        out += [f"({'Fits' if is_valid(lay, tv.shape, mesh) else 'FitsEmpty'} {s} {lay_text(lay)})"
                for lay in problem.layouts[tv.name]]
    for name, lay in problem.pins.items():
        out.append(f"(Valid {t(name)} {lay_text(lay)})")
    for d in sorted(set(mesh.shape)):
        out.append(f"(MeshSize {d})")
    if collective_matmul.NAME in problem.rewrites and max(mesh.shape) >= 2:  # (no ring rule, no RingsOn, on one device)
        out.append("(RingsOn 1)")
    if problem.restricted:  # restricted to a plan's strategies (Problem._restrict_to)
        out += _allowed_plans(problem, ident)
    else:
        out.append("(Open 1)")
    kinds, sig_of, sigs = set(), {}, {}
    for key, e in problem.exprs.items():
        params = list(e.op.signature.parameters)
        args = dict(e.args)
        slots = [t(args[p].name) if hasattr(args.get(p), "logical_domain")
                 else f"(Lit {_q(json.dumps(args.get(p, None), default=str))})" for p in params]
        app = f"(op_{e.op.name} {' '.join(slots)})"
        if len(e.outputs) == 1:
            out.append(f"(Def {t(e.outputs[0].name)} {app})")
        else:
            out += [f"(Def {t(o.name)} (Out {i} {app}))" for i, o in enumerate(e.outputs)]
        tens = [v for _, v in e.args if hasattr(v, "logical_domain")]
        view = op_view(e, 0)
        code = repr((view.op, view.operands, view.attrs, view.outputs))  # all a sharding rule sees of e
        if code not in sigs:  # the first application of this signature: what the rules read of it
            g = sigs[code] = _q(f"g{len(sigs)}")
            shp = [f"(Shp {_q(shape_code(v))})" for v in list(e.outputs) + tens]
            out.append(f"(Sig{len(tens)}x{len(e.outputs)} {g} {_q(e.op.name)} {' '.join(shp)})")
            out += [f"(Param {g} {i} {_q(o.param)})" for i, o in enumerate(view.operands)]
            for f in _axis_facts(e):
                out.append(f"({f[0]} {g} " + " ".join(_q(v) if isinstance(v, str) else str(v) for v in f[1:]) + ")")
        sig_of[key] = sigs[code][1:-1]
        out.append(f"(Site{len(tens)}x{len(e.outputs)} {_q(ident[key])} {sigs[code]} "
                   + " ".join(t(v.name) for v in list(e.outputs) + tens) + ")")
        kinds.add(e.op.name)
    for name in sorted(kinds):
        op = OPS[name]
        tags = [op.kind] + (["broadcasts"] if op.kind == "pointwise" or name == "matmul" else [])
        tags.append("empty_shards" if op.empty_shards else "full_shards")  # which Fits its strategies read
        out += [f"(OpKind {_q(name)} {_q(tag)})" for tag in tags]
    for a, b in problem.equal:
        out.append(f"(Def {t(a)} {t(b)})")
    for tv in fusion.inputs:  # a free input: every whole layout it fits (Problem.load_layouts), by rule
        if tv.name in problem.pins or tv.name in problem.input_layouts:
            out += [f'(LoadIn {t(tv.name)} "{ident[tv.name]}" {lay_text(lay)})' for lay in problem.load_layouts(tv.name)]
        else:
            out.append(f'(Input {t(tv.name)} "{ident[tv.name]}")')
    return out, ident, sig_of


def _allowed_plans(problem: Problem, ident: dict[str, str]) -> list[str]:
    """The Plan rows of a problem restricted to another plan's strategies: each allowed strategy of each
    application, as the rules would have derived it."""
    out, m = [], problem.mesh.ndim
    for key, ss in problem.strategies.items():
        e = problem.exprs[key]
        names = [o.name for o in e.outputs] + [v.name for _, v in e.args if hasattr(v, "logical_domain")]
        for s in ss:
            kern = " ".join(_q(next(iter(f)) if f else "") for f in s.flags)
            lays = " ".join(lay_text(lay) for lay in s.outputs + s.inputs)
            out.append(f"(Plan{len(names) - len(e.outputs)}x{len(e.outputs)} {_q(ident[key])} (K{m} {kern}) "
                       + " ".join(f'(T "{ident[n]}")' for n in names) + f" {lays})")
    return out


# ---------------------------------------------------------------------- generated rules: mesh joins

def _universe(problem: Problem) -> list:
    rank = max((tv.ndim for tv in problem.fusion.tensors.values()), default=0)
    rows = any(PE in lay for ls in problem.layouts.values() for lay in ls)  # programs of grouped matmuls
    return [R, P, PMAX] + [PE] * rows + [S(a) for a in range(rank)]


def _mesh_facts(problem: Problem) -> list[str]:
    """Which collective connects two placements (the registry's), and which placements nest apart."""
    return _placement_facts(_universe(problem))


def _placement_facts(u: list) -> list[str]:
    out = [f"(Connect {pl_text(a)} {pl_text(b)} {_q(k.name)})" for a in u for b in u for k in connecting(a, b)]
    apart = [(a, b) for a in u for b in u if not (a.is_shard and a == b)]
    out += [f"(Apart {pl_text(a)} {pl_text(b)})" for a, b in apart]
    out += [f"(NestOK 0 {pl_text(a)} {pl_text(b)})" for a, b in apart]
    out += [f"(NestOK 1 {pl_text(a)} {pl_text(b)})" for a in u for b in u]
    out += [f"(NoPartial {pl_text(a)})" for a in u if not a.is_partial]
    names = [""] + sorted({k.name for op in OPS.values() for k in op.local_kernels})
    out += [f"(KernOK {_q(a)} {_q(b)})" for a in names for b in names if a == b or not a or not b]
    return out


def program_rules(shape: tuple[int, ...]):
    """The rules over the program alone (they saturate once, before the physical rules): each tensor is its
    op's term (Def), the inputs' loads, which layouts each tensor may take (Valid), which collective moves a
    layout to another over one mesh axis (Move, the registry's Connect where shards still nest outer mesh axis first), and each arity's join
    of the per-axis relation Ax over the mesh axes: a signature's whole-mesh strategies (Strat), where every
    layout fits its shape and a non-nestable row (nestable 0) shares no split tensor axis with another mesh
    axis."""
    m = len(shape)
    L, K = LAYOUTS[m], KERNS[m]
    t, t2, s, lay = var("t", Tensor), var("t2", Tensor), var("s", Shape), var("lay", LayoutSort)
    yield erule(Def(t, t2)).then(union(t).with_(t2))
    yield erule(ShapeOf(t, s), Fits(s, lay)).then(Valid(t, lay), Lay(lay))
    yield erule(ShapeOf(t, s), FitsEmpty(s, lay)).then(Valid(t, lay), Lay(lay))  # held and moved, if not computed on
    yield erule(Fits(s, lay)).then(FitsAny(s, lay))
    yield erule(FitsEmpty(s, lay)).then(FitsAny(s, lay))
    yield erule(Valid(t, lay)).then(Lay(lay))
    ps = [var(f"p{k}", Placement) for k in range(m)]
    q, kind, name = var("q", Placement), var("kind", String), var("name", String)
    yield erule(Lay(L(*ps)), *[NoPartial(p) for p in ps]).then(Whole(L(*ps)))
    yield erule(Input(t, name), Valid(t, lay), Whole(lay)).then(union(Held(t, lay, 0)).with_(Load(name, lay)))
    yield erule(LoadIn(t, name, lay)).then(union(Held(t, lay, 0)).with_(Load(name, lay)))
    for j in range(m):  # Move: layout lf becomes lt by collective `kind` over mesh axis j (layouts only: small)
        dst = L(*[q if i == j else ps[i] for i in range(m)])
        nest = [c for i in range(j + 1, m) for c in (Apart(ps[j], ps[i]), Apart(q, ps[i]))]
        yield erule(Lay(L(*ps)), Connect(ps[j], q, kind), *nest).then(Move(L(*ps), dst, kind, j))
    sig, op = var("sig", String), var("op", String)
    for (n, o) in SIG:
        sy, sx = [var(f"sy{j}", Shape) for j in range(o)], [var(f"sx{i}", Shape) for i in range(n)]
        pin = [[var(f"a{k}_{i}", Placement) for i in range(n)] for k in range(m)]
        pout = [[var(f"b{k}_{j}", Placement) for j in range(o)] for k in range(m)]
        kern, nst = [var(f"k{k}", String) for k in range(m)], [var(f"n{k}", i64) for k in range(m)]
        lin = [L(*[pin[k][i] for k in range(m)]) for i in range(n)]
        lout = [L(*[pout[k][j] for k in range(m)]) for j in range(o)]
        query = [SIG[(n, o)](sig, op, *sy, *sx)]
        query += [AX[(n, o)](sig, shape[k], *pin[k], *pout[k], kern[k], nst[k]) for k in range(m)]
        query += [NestOK(nst[k], pin[k][i], pin[j][i]) for k in range(m) for i in range(n) for j in range(m) if j != k]
        query += [KernOK(kern[k], kern[j]) for k in range(m) for j in range(k + 1, m)]
        for tag, fits in (("full_shards", Fits), ("empty_shards", FitsAny)):  # OpDef.empty_shards
            shards = [OpKind(op, tag)] + [fits(x, li) for x, li in zip(sx, lin)] + [fits(y, lo) for y, lo in zip(sy, lout)]
            yield erule(*query, *shards).then(STRAT[(n, o)](sig, K(*kern), *lout, *lin))
    key, kern = var("key", String), var("kern", KernSort)
    for (n, o) in SITE:  # each application's strategies: the physical rules join Plan with Held alone
        ys, xs = [var(f"y{j}", Tensor) for j in range(o)], [var(f"x{i}", Tensor) for i in range(n)]
        lin, lout = [var(f"li{i}", LayoutSort) for i in range(n)], [var(f"lo{j}", LayoutSort) for j in range(o)]
        yield erule(Open(1), SITE[(n, o)](key, sig, *ys, *xs), STRAT[(n, o)](sig, kern, *lout, *lin)).then(
            PLAN[(n, o)](key, kern, *ys, *xs, *lout, *lin))


def mesh_rules(shape: tuple[int, ...]):
    """The physical rules for one mesh: Keep and collectives move one mesh axis a level up; a strategy
    (Plan) runs its expr from operands held at level m = mesh ndim into level 0. A run's node is an edge
    (RunOf, ProjOf) into its class's Held term; a Keep or a collective is a match of its rule, held as the
    Held term it makes one level up (read_back joins those edges again: _level_edges)."""
    m = len(shape)
    t, lay, kind = var("t", Tensor), var("lay", LayoutSort), var("kind", String)
    lf, lt, ax = var("lf", LayoutSort), var("lt", LayoutSort), var("ax", i64)
    for k in range(m):
        # the Keep and collective edges are these matches themselves; read_back joins them again from Held,
        # Move and Valid as arrays (_level_edges) rather than reading ~170k edge rows on a 2x2 mesh
        yield erule(Held(t, lay, k)).then(Held(t, lay, k + 1))
        yield erule(Held(t, lf, k), Move(lf, lt, kind, ax), Valid(t, lt)).then(*[Held(t, lt, j) for j in range(k + 1, m + 1)])
    key, kern = var("key", String), var("kern", KernSort)
    for (n, o) in SITE:
        ys, xs = [var(f"y{j}", Tensor) for j in range(o)], [var(f"x{i}", Tensor) for i in range(n)]
        lin, lout = [var(f"li{i}", LayoutSort) for i in range(n)], [var(f"lo{j}", LayoutSort) for j in range(o)]
        query = [PLAN[(n, o)](key, kern, *ys, *xs, *lout, *lin)] + [Held(x, li, m) for x, li in zip(xs, lin)]
        operands = [Held(x, li, m) for x, li in zip(xs, lin)]
        # the outputs kept as they are up to level m in the same step: a consumer that needs no collective
        # fires in the next iteration
        keep = [Held(y, lo, k + 1) for y, lo in zip(ys, lout) for k in range(m)]
        # every strategy's outputs held at level 0 up front, so the operands' levels (Keep, Coll) grow in m
        # iterations for the whole program at once rather than one step of its longest chain per iteration;
        # outputs no plan can reach are pruned in read_back (_Edges.closure)
        yield erule(PLAN[(n, o)](key, kern, *ys, *xs, *lout, *lin)).then(*[Held(y, lo, 0) for y, lo in zip(ys, lout)])
        if o == 1:
            yield erule(*query).then(RUN_OF[(n, o)](Held(ys[0], lout[0], 0), key, kern, lout[0], *operands), *keep)
        else:
            app = RUN[(n, o)](key, kern, *lout, *operands)
            yield erule(*query).then(*[ProjOf(Held(ys[j], lout[j], 0), j, app) for j in range(o)], *keep)


# ---------------------------------------------------------------------- saturate

@functools.lru_cache(maxsize=4)
def _template(shape: tuple[int, ...]):
    """An EGraph with every sort, function and ruleset for meshes of this shape declared and compiled, and
    the program and physical rulesets: declaring costs about 0.15 s, a problem loaded into a pushed copy
    of it (loaded) pays only for its facts."""
    # the collective matmuls' rings are strategies too: their rules join the program rules (RingsOn switches them)
    program = ruleset(*program_rules(shape), *collective_matmul.egglog_rules(shape), *ring_attention.egglog_rules(shape),
                      name=f"program{shape}")
    rules = ruleset(*mesh_rules(shape), name=f"mesh{shape}")
    eg = EGraph()
    _declare(eg)
    eg.run(1, ruleset=FAMILIES | program | rules)  # declares the rules' functions before any text arrives
    return eg, program, rules


@contextlib.contextmanager
def loaded(problem: Problem):
    """The mesh's template EGraph holding the problem's facts (popped on exit), its program and physical
    rulesets, the facts, the tensor index and each expr's signature (encode)."""
    facts, ident, sig_of = encode(problem)
    facts = _mesh_facts(problem) + facts
    eg, program, rules = _template(problem.mesh.shape)
    with eg:
        run_text(eg, facts)
        yield eg, program, rules, facts, ident, sig_of


def saturate(problem: Problem) -> PhysGraph:
    """Encode, saturate the rulesets and read back the physical graph (costs are set by the caller).

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> from egraph_did.problem import build_problem
    >>> graph = saturate(build_problem(row_sum(8, 64), ed.DeviceMesh.arange(4)))
    >>> ways = graph.classes[graph.index[("y", "S0", 1)]]  # y split by rows, after mesh axis 0
    >>> sorted((n.op, n.key) for n in ways)  # computed so, or reached from P or R by a collective
    [('Coll', 'reduce_scatter'), ('Coll', 'slice'), ('Keep', '')]
    """
    t0 = time.perf_counter()
    _template(problem.mesh.shape)  # built once per mesh shape and process: its time is reported apart
    tt = time.perf_counter()
    with gc_paused(), loaded(problem) as (eg, program, rules, facts, ident, _):
        t1 = time.perf_counter()
        # the families and the program rules read only the program's facts: each saturates once, then the
        # physical rules (Keep, Coll, Run) from the loads
        report = eg.run(FAMILIES.saturate() + program.saturate() + rules.saturate())
        t2 = time.perf_counter()
        graph = read_back(eg, problem, {v: k for k, v in ident.items()})
        t3 = time.perf_counter()
    graph.stats.update(template_s=tt - t0, encode_s=t1 - tt, saturate_s=t2 - t1, serialize_s=t3 - t2, facts=len(facts),
                       iterations=len(report.iterations), classes=len(graph.classes), nodes=graph.n_nodes,
                       ring_nodes=_ring_nodes(graph, problem))
    return graph


def _ring_nodes(graph: PhysGraph, problem: Problem) -> int:
    """How many nodes run a collective matmul's ring (rewrites/collective_matmul.py)."""
    rings = {(k, s.sid) for k, ss in problem.strategies.items() for s in ss if any(f & RING_FLAG_SET for f in s.flags)}
    return sum(1 for ns in graph.classes.values() for n in ns if n.op == "Apply" and (n.key, n.sid) in rings) if rings else 0


def transitions(problem) -> list[tuple[str, str, str, int]]:
    """Every (src layout, dst layout, collective, mesh axis) the e-graph offers between layouts of the
    problem's tensors (the Move rows its program rules derive): a collective the registry connects changes
    one mesh axis, where no inner mesh axis splits the same tensor axis before or after.

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> from egraph_did.problem import build_problem
    >>> moves = transitions(build_problem(row_sum(8, 64), ed.DeviceMesh.arange(4)))
    >>> ("P", "S0", "reduce_scatter", 0) in moves, ("S0", "R", "allgather", 0) in moves, ("R", "P", "slice", 0) in moves
    (True, True, False)
    """
    lays = {lay.code(): lay for ls in problem.layouts.values() for lay in ls}
    m = len(next(iter(lays.values())))
    u = [R, P, PMAX] + [PE] * any(PE in lay for lay in lays.values()) + sorted(
        {p for lay in lays.values() for p in lay if p.is_shard}, key=lambda p: p.axis)
    eg, program, _ = _template((1,) * m)  # Move reads the number of mesh axes alone
    with eg:
        run_text(eg, _placement_facts(u) + [f"(Lay {lay_text(lay)})" for lay in lays.values()])
        eg.run(program.saturate())
        rows, raw = frozen_rows(eg, ["Move", "R", "P", "Pmax", "Pe", "S"] + [f"L{k}" for k in LAYOUTS])
    place = {out: pl for name, pl in PLACEMENTS for _, out in rows.get(name, [])}
    place.update({out: S(raw.value_to_i64(ins[0])) for ins, out in rows.get("S", [])})
    code = {out: Layout(tuple(place[v] for v in ins)).code() for k in LAYOUTS for ins, out in rows.get(f"L{k}", [])}
    moves = [(code[ins[0]], code[ins[1]], raw.value_to_string(ins[2]), raw.value_to_i64(ins[3])) for ins, _ in rows["Move"]]
    return sorted(mv for mv in moves if mv[1] in lays)


def axis_rows(problem: Problem) -> dict[tuple[str, int], set[tuple]]:
    """What the family rulesets derive, per (expr key, mesh axis size): the Ax rows as (operand placements,
    output placements, kernel name, nestable) — to hold equal to the Python rules (rules.axis_strategies).

    >>> import egraph_did as ed
    >>> from egraph_did.models import row_sum
    >>> from egraph_did.problem import build_problem
    >>> sorted(axis_rows(build_problem(row_sum(8, 64), ed.DeviceMesh.arange(4)))[("y", 4)])[:2]
    [(('P',), ('P',), '', 1), (('R',), ('R',), '', 1)]
    """
    with loaded(problem) as (eg, _, _, _, _, sig_of):
        eg.run(FAMILIES.saturate())
        frozen = eg.freeze().decl
    rows: dict[tuple[str, int], set[tuple]] = defaultdict(set)  # by (signature, d)
    for act in frozen.expr_actions:
        call = act.expr
        name = call.callable.ident.name
        if not (name.startswith("Ax") and name[2].isdigit()):
            continue
        n, o = map(int, name[2:].split("x"))
        args = [x.expr for x in call.args]
        pls = tuple(_placement_decl(frozen.e_classes[x.value][1][0]).code() for x in args[2:2 + n + o])
        rows[(args[0].value, args[1].value)].add((pls[:n], pls[n:], args[-2].value, args[-1].value))
    return {(key, d): rows[(g, d)] for key, g in sig_of.items() for d in set(problem.mesh.shape) if rows[(g, d)]}


def _placement_decl(call):
    """A placement term of a frozen e-graph (a CallDecl) as a layout Placement."""
    head = call.callable.ident.name
    return dict(PLACEMENTS).get(head) or S(call.args[0].expr.value)


def _declare(eg: EGraph) -> None:
    """egglog-python knows a function once an action through its public API used it: register, through the
    public API, an action that uses every constructor text may (each op constructor on literal arguments,
    in a class no tensor names, which read_back ignores)."""
    acts = [OPS_SORT[name](*[Lit("declare")] * _arity(name)) for name in sorted(OPS_SORT)]
    acts.append(Out(0, Lit("declare")))
    acts.append(ShapeOf(Lit("declare"), Shp("declare")))
    eg.register(*acts)
    # everything else the text names: a rule that mentions each, run once while they are empty
    key, v, s, pl = var("key", String), var("v", i64), var("s", Shape), var("pl", Placement)
    lay, t, dv = var("lay", LayoutSort), var("t", Tensor), var("dv", D)
    kern = var("kern", KernSort)
    mention = [Open(v), Def(t, t), Input(t, key), LoadIn(t, key, lay), NoPartial(pl), AxisMap(key, v, v, v), Reduced(key, v), AttrS(key, key, key), AttrI(key, key, v), Param(key, v, key),
               ReshapeBlock(key, v, v, v, v), Bcast(key, v, v, pl), Rank(s, v),
               Extent(s, v, v), FloatSize(s, v), MeshSize(v), OpKind(key, key), Fits(s, lay), FitsEmpty(s, lay), FitsAny(s, lay), Valid(t, lay),
               Connect(pl, pl, key), Apart(pl, pl), NestOK(v, pl, pl), KernOK(key, key), eq(pl).to(R_()), eq(pl).to(P_()),
               eq(pl).to(Pmax_()), eq(pl).to(Pe_()), eq(pl).to(S_(v)), eq(t).to(T(key)), eq(dv).to(Load(key, lay)),
               eq(dv).to(Held(t, lay, v))]
    mention += [eq(lay).to(L(*[pl] * m)) for m, L in LAYOUTS.items()]
    mention += [SITE[k](key, key, *[t] * sum(k)) for k in SITE] + [SIG[k](key, key, *[s] * sum(k)) for k in SIG]
    mention += [AX[k](key, v, *[pl] * sum(k), key, v) for k in AX]
    mention += [PLAN[k](key, kern, *[t] * sum(k), *[lay] * sum(k)) for k in PLAN]
    mention += [eq(kern).to(K(*[key] * m)) for m, K in KERNS.items()]
    mention = ruleset(erule(*mention).then(), name="declare")
    eg.run(1, ruleset=mention)


def _arity(op: str) -> int:
    return len(OPS[op].signature.parameters)


# ---------------------------------------------------------------------- read back

def read_back(eg: EGraph, problem: Problem, name_of: dict[str, str]) -> PhysGraph:
    """The physical classes of the saturated e-graph as a PhysGraph: each class named by its Held term
    (tensor, layout code, level), its nodes Load, Keep, Coll, Proj and Apply (a Run, mapped onto the
    problem's priced strategy of the same placements and kernels), read from the edges into it; without
    what no plan makes (the least set of classes some node makes from the loads: _Edges.closure).

    The rows are read as class numbers (ints, from the values' ids) and the classes no plan makes are
    found on them before any Node is made: a 2-D mesh's graph holds ~170k edges, and a Node a row, a
    Value-keyed lookup a column and a sweep over the named graph cost more than all else here."""
    run_rows = [f"RunOf{n}x{o}" if o == 1 else f"Run{n}x{o}" for n, o in RUN]
    rows, raw = frozen_rows(eg, ["R", "P", "Pmax", "Pe", "S", "T", "Held", "Load", "Move", "Valid", "ProjOf"]
                            + [f"L{m}" for m in LAYOUTS] + [f"K{m}" for m in KERNS] + run_rows,
                            inputs_only={"Move", "Valid", "ProjOf"} | {r for (_, o), r in zip(RUN, run_rows) if o == 1})
    vid = value_id(raw)
    strs: dict = {}

    def string(v):  # a String value's text, by its id
        i = vid(v)
        got = strs.get(i)
        if got is None:
            got = strs[i] = raw.value_to_string(v)
        return got

    place = {vid(out): pl for name, pl in PLACEMENTS for _, out in rows.get(name, [])}
    place.update({vid(out): S(raw.value_to_i64(ins[0])) for ins, out in rows.get("S", [])})
    lays = {vid(out): Layout(tuple(place[vid(v)] for v in ins)).code() for m in LAYOUTS for ins, out in rows.get(f"L{m}", [])}
    kerns = {vid(out): tuple(string(v) for v in ins) for m in KERNS for ins, out in rows.get(f"K{m}", [])}
    graph = PhysGraph()
    tensor = _tensor_names(rows["T"], vid, string, name_of, problem, graph)
    num, held = _held_classes(rows["Held"], vid, tensor, lays, problem, graph)
    edges = _Edges(len(num))
    loads = [(num[vid(out)], name_of[string(ins[0])]) for ins, out in rows.get("Load", [])]
    edges.made.update(dst for dst, _ in loads)
    keeps, colls = _level_edges(held, rows.get("Move", []), rows.get("Valid", []), vid, string, len(problem.mesh.shape),
                                edges)
    for (n, o), name in zip(RUN, run_rows):  # a multi-output run's class (a tuple) named by what it runs
        if o > 1:
            apps = [(string(ins[0]), kerns[vid(ins[1])], tuple(lays[vid(v)] for v in ins[2:2 + o]),
                     tuple(num[vid(v)] for v in ins[2 + o:]), vid(out)) for ins, out in rows.get(name, [])]
            for *_, out in sorted(apps):
                if out not in num:
                    num[out] = edges.new()
    projs = sorted((num[vid(ins[0])], raw.value_to_i64(ins[1]), num[vid(ins[2])]) for ins, _ in rows.get("ProjOf", []))
    edges.ones([app for *_, app in projs], [dst for dst, *_ in projs])
    applies = _applies(rows, run_rows, vid, string, num, kerns, lays, name_of, problem, graph, edges)
    made = edges.closure()
    return _physgraph(graph, made, edges.count, loads, keeps, colls, projs, applies)


def _level_edges(held: np.ndarray, move_rows, valid_rows, vid, string, m: int, edges: "_Edges") -> tuple:
    """The Keep and collective edges, joined from the rows the physical rules matched (a 2-D mesh's graph
    holds ~30k Keeps and ~170k collectives: as arrays of ids, sorted as one int each, never a row each):
    Held(t, lay, k) is kept as Held(t, lay, k + 1) for k < m, and moved to Held(t, lt, k + 1) by each
    Move(lay, lt, kind, axis) with Valid(t, lt). `held`: the Held rows as (tensor id, layout id, level, class)
    (_held_classes). Returns (class, source class) of the Keeps sorted by both, (class, source class, move) of
    the collectives sorted by class, source, collective, mesh axis, and the moves, (collective, axis) by
    number; their edges added."""
    moves = np.array([[vid(v) for v in ins] for ins, _ in move_rows], np.int64).reshape(-1, 4)
    valid = np.array([[vid(v) for v in ins] for ins, _ in valid_rows], np.int64).reshape(-1, 2)
    tensors = np.unique(np.concatenate([held[:, 0], valid[:, 0]]))
    layouts = np.unique(np.concatenate([held[:, 1], moves[:, 0], moves[:, 1], valid[:, 1]]))
    t, lay, level, cls = np.searchsorted(tensors, held[:, 0]), np.searchsorted(layouts, held[:, 1]), held[:, 2], held[:, 3]
    nl = len(layouts)
    key = (t * nl + lay) * (m + 1) + level  # a Held term by (tensor, layout, level): one int
    order = np.argsort(key)
    sorted_key, sorted_cls = key[order], cls[order]

    def class_of(k: np.ndarray) -> np.ndarray:  # the class of each Held key (each must be held: the rules made it)
        at = np.minimum(np.searchsorted(sorted_key, k), max(len(key) - 1, 0))
        assert len(k) == 0 or (sorted_key[at] == k).all(), "a Keep or a collective leads to no Held term"
        return sorted_cls[at]

    below = level < m
    src = cls[below]
    dst = class_of(key[below] + 1)
    edges.ones(src, dst)
    n = edges.count
    packed = np.sort(dst * n + src)
    keeps = (packed // n, packed % n)
    if not len(moves):
        return keeps, (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), [])
    mf, mt = np.searchsorted(layouts, moves[:, 0]), np.searchsorted(layouts, moves[:, 1])
    by_src = np.argsort(mf, kind="stable")
    first = np.searchsorted(mf[by_src], np.arange(nl + 1))
    h = np.flatnonzero(below)  # each held row below m, repeated once per move from its layout
    count = first[lay[h] + 1] - first[lay[h]]
    rows = np.repeat(h, count)
    step = np.arange(len(rows)) - np.repeat(np.cumsum(count) - count, count)
    mv = by_src[np.repeat(first[lay[h]], count) + step]
    allowed = np.unique(np.searchsorted(tensors, valid[:, 0]) * nl + np.searchsorted(layouts, valid[:, 1]))
    wanted = t[rows] * nl + mt[mv]
    ok = allowed[np.minimum(np.searchsorted(allowed, wanted), len(allowed) - 1)] == wanted if len(allowed) else \
        np.zeros(len(wanted), bool)
    rows, mv = rows[ok], mv[ok]
    src = cls[rows]
    dst = class_of(wanted[ok] * (m + 1) + level[rows] + 1)
    edges.ones(src, dst)
    # each move row's (collective, axis) numbered in their sorted order: the moves are a few hundred rows
    _, first_of, move_of = np.unique(moves[:, 2] * (int(moves[:, 3].max()) + 1) + moves[:, 3], return_index=True,
                                     return_inverse=True)
    named = sorted((string(move_rows[i][0][2]), int(moves[i, 3]), j) for j, i in enumerate(first_of.tolist()))
    rank = np.empty(len(named), np.int64)
    rank[[j for *_, j in named]] = np.arange(len(named))
    n, k = edges.count, len(named)
    packed = np.sort((dst * n + src) * k + rank[move_of.reshape(-1)[mv]])
    used = np.unique(packed % k)  # the moves some edge takes, renumbered in the same order
    renumber = np.full(k, -1, np.int64)
    renumber[used] = np.arange(len(used))
    names = [(c, ax) for c, ax, _ in named]
    return keeps, (packed // (n * k), packed // k % n, renumber[packed % k], [names[u] for u in used.tolist()])


def _tensor_names(t_rows, vid, string, name_of, problem: Problem, graph: PhysGraph) -> dict:
    """The tensor each T class names (by its value's id): of the names unioned into it, a name of the program
    before its decompositions (problem.origin) first, then the least; graph.canonical of every name."""
    names: dict = defaultdict(list)
    for ins, out in t_rows:
        names[vid(out)].append(name_of[string(ins[0])])
    prefer = lambda name: (name in problem.origin, name)  # noqa: E731
    tensor = {v: min(ns, key=prefer) for v, ns in names.items()}
    graph.canonical = {n: tensor[v] for v, ns in names.items() for n in ns}
    return tensor


def _held_classes(held_rows, vid, tensor: dict, lays: dict, problem: Problem, graph: PhysGraph) -> dict:
    """Number the Held terms c0, c1, .. by what they hold (the program's order of tensors, level, layout),
    never by egglog's row order: that follows the e-graph's history (which problems the mesh's template
    held before), and the extractors break cost ties by order. Fills graph.ident and graph.index (every
    Held class; read_back drops those no plan makes); returns value id -> class number, and the rows as
    (tensor id, layout id, level, class) (an array: _level_edges joins them)."""
    rank = {name: i for i, name in enumerate(problem.fusion.tensors)}
    # (an i64's id is its value: value_id)
    ids = [(vid(ins[0]), vid(ins[1]), vid(ins[2]), vid(out)) for ins, out in held_rows]
    held = [((tensor[t], lays[lay], k), out) for t, lay, k, out in ids]
    num: dict = {}
    ident, index = graph.ident, graph.index
    for key, out in sorted(held, key=lambda h: (rank.get(h[0][0], len(rank)), h[0][0], h[0][2], h[0][1])):
        c = num.setdefault(out, len(num))
        assert ident.setdefault(c, key) == key, f"layouts {key} and {ident[c]} merged"
        index[key] = c
    rows = np.array(ids, np.int64).reshape(-1, 4)
    rows[:, 3] = [num[out] for out in rows[:, 3].tolist()]
    return num, rows


class _Edges:
    """The classes (numbers) and what makes them, for the least set of classes some node makes from the
    loads: `one` for a node of one child (Keep, Coll, Proj, an Apply of one distinct operand), `many` for
    an Apply reading several.

    >>> e = _Edges(4)
    >>> e.made.add(0); e.one(0, 1); e.many((1, 2), 3); e.one(3, 2)  # 2 and 3 read each other only
    >>> sorted(e.closure())
    [0, 1]
    """

    def __init__(self, count: int):
        self.count, self.made = count, set()
        self.srcs: list = []  # arrays of the one-child nodes' children ..
        self.dsts: list = []  # .. and of the classes they make
        self.waiting: list = []  # per several-child node: [class it makes, how many children not yet made]
        self.slots: dict = defaultdict(list)  # class -> the several-child nodes reading it

    def new(self) -> int:
        self.count += 1
        return self.count - 1

    def ones(self, children: np.ndarray, dsts: np.ndarray) -> None:
        self.srcs.append(np.asarray(children, np.int64))
        self.dsts.append(np.asarray(dsts, np.int64))

    def one(self, child: int, dst: int) -> None:
        self.ones([child], [dst])

    def many(self, children, dst: int) -> None:
        kids = set(children)
        if not kids:
            self.made.add(dst)
        elif len(kids) == 1:
            self.one(next(iter(kids)), dst)
        else:
            slot = [dst, len(kids)]
            self.waiting.append(slot)
            for k in kids:
                self.slots[k].append(slot)

    def closure(self) -> set:
        """The least set holding the loads (and runs of no operand) where a node whose children are in it
        puts its class in it: a worklist from what is made, each class walked once."""
        made, slots = self.made, self.slots
        src = np.concatenate(self.srcs or [np.zeros(0, np.int64)])
        order = np.argsort(src, kind="stable")
        readers = np.concatenate(self.dsts or [np.zeros(0, np.int64)])[order].tolist()  # grouped by child
        start = np.searchsorted(src[order], np.arange(self.count + 1)).tolist()
        todo = list(made)
        while todo:
            c = todo.pop()
            for d in readers[start[c]:start[c + 1]]:
                if d not in made:
                    made.add(d)
                    todo.append(d)
            for slot in slots.get(c, ()):
                slot[1] -= 1
                if slot[1] == 0 and slot[0] not in made:
                    made.add(slot[0])
                    todo.append(slot[0])
        return made


def _applies(rows, run_rows, vid, string, num: dict, kerns: dict, lays: dict, name_of, problem: Problem,
             graph: PhysGraph, edges: _Edges) -> list:
    """Each Run row as (class it makes, children, expr key, strategy id), arity by arity, each sorted by
    what it holds (a class's Apply nodes come in this order), its edges added; a Run is mapped onto
    problem.py's priced Strategy of the same placements and kernels (asserting that the rulesets derive
    nothing the Python rules do not)."""
    codes: dict = {}  # id(layouts tuple) -> its codes (the exprs of one signature share their strategies' tuples)

    def code(lays: tuple) -> tuple:
        got = codes.get(id(lays))
        if got is None:
            got = codes[id(lays)] = (lays, tuple(x.code() for x in lays))
        return got[1]

    strategies = {(k, code(s.inputs), code(s.outputs), s.flags): s.sid for k, ss in problem.strategies.items() for s in ss}
    flags_of: dict = {}  # kernel names -> the strategy's flags
    ident = graph.ident
    out = []
    for (n, o), name in zip(RUN, run_rows):
        for dst, skey, kern, children, outs in _runs(rows.get(name, []), o, vid, string, num, kerns, lays, edges):
            key = name_of[skey]
            flags = flags_of.get(kern)
            if flags is None:
                flags = flags_of[kern] = tuple(frozenset({k}) if k else frozenset() for k in kern)
            sig = (key, tuple([ident[c][1] for c in children]), outs, flags)
            sid = strategies.get(sig)
            assert sid is not None, f"the rulesets derived a strategy the Python rules do not: {sig}"
            if o == 1 and ident[dst][0] in {ident[c][0] for c in children}:
                # a tensor computed from itself (x = saved(x) where x has no operands to recompute from:
                # saved(full()) is full()): no plan needs it, and it would close a cycle through the
                # tensor's levels, which the extractors take for acyclic (fuzz seed 32 case 1061)
                continue
            edges.many(children, dst)
            out.append((dst, children, key, sid))
    return out


def _runs(run_rows, o: int, vid, string, num: dict, kerns: dict, lays: dict, edges: _Edges):
    """The rows of one Run arity as (class it makes, expr key, kernel names, operand classes, output layout
    codes), sorted: RunOf{n}x1(dst, key, kern, out layout, operands..) by (class, key, kernels, operands),
    unique per row; Run{n}x{o}(key, kern, outs.., operands..) -> tuple by its tuple's class (an operand that
    is no class yet gets a new number, in that order)."""
    if o == 1:
        yield from sorted([(num[vid(ins[0])], string(ins[1]), kerns[vid(ins[2])], tuple([num[vid(v)] for v in ins[4:]]),
                            (lays[vid(ins[3])],)) for ins, _ in run_rows])
        return
    for dst, ins in sorted((num[vid(r)], ins) for ins, r in run_rows):
        children = tuple(num[i] if (i := vid(v)) in num else num.setdefault(i, edges.new()) for v in ins[2 + o:])
        yield dst, string(ins[0]), kerns[vid(ins[1])], children, tuple(lays[vid(v)] for v in ins[2:2 + o])


def _extend_by_class(lists: list, dst: np.ndarray, nodes: list) -> None:
    """Append nodes[i] to lists[dst[i]], dst sorted: one extend per class, not an append per node."""
    if not len(dst):
        return
    start = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]])
    for d, a, b in zip(dst[start].tolist(), start.tolist(), np.r_[start[1:], len(dst)].tolist()):
        lists[d].extend(nodes[a:b])


def _physgraph(graph: PhysGraph, made: set, count: int, loads, keeps, colls, projs, applies) -> PhysGraph:
    """The classes some node makes and their nodes whose children are all made, a class's nodes in the
    order Load, Keep, Coll, Proj, Apply (each list sorted as read_back sorts it)."""
    names = [f"c{i}" for i in range(count)]
    lists = [[] if i in made else None for i in range(count)]
    one = [(c,) for c in names]
    ok = np.zeros(count, bool)
    ok[list(made)] = True
    for dst, name in loads:
        lists[dst].append(Node("Load", (), name))
    dst, src = keeps
    keep = ok[dst] & ok[src]
    _extend_by_class(lists, dst[keep], [Node("Keep", one[c]) for c in src[keep].tolist()])
    dst, src, move, moves = colls
    keep = ok[dst] & ok[src]
    kinds, axes = [k for k, _ in moves], [ax for _, ax in moves]
    _extend_by_class(lists, dst[keep], [Node("Coll", one[c], kinds[mv], axes[mv])
                                        for c, mv in zip(src[keep].tolist(), move[keep].tolist())])
    for d, i, app in projs:
        if app in made and d in made:
            lists[d].append(Node("Proj", one[app], sid=i))
    for d, children, key, sid in applies:
        if d in made and made.issuperset(children):
            lists[d].append(Node("Apply", tuple(names[c] for c in children), key, sid))
    graph.classes = {names[i]: ns for i, ns in enumerate(lists) if ns is not None}
    graph.ident = {names[c]: key for c, key in graph.ident.items() if c in made}
    graph.index = {key: names[c] for key, c in graph.index.items() if c in made}
    return graph
