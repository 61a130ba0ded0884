"""Expand the working program by the program rewrites of rewrites/algebra.py: encode the fusion on the
logical sort (each tensor its op's term, shapes), saturate the rewrites in egglog, and read back every
term the rewrites added as new ops of the fusion, each recorded as equal to the tensor whose class it
joined. The problem then prices them like any op; the physical e-graph holds both programs, and
extraction picks the cheaper (docs/egraph.md).
"""
from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import dataclass
from typing import Iterable

from egglog import EGraph

from egraph_did.rewrites import collective_matmul, recompute  # noqa: F401  (recompute registers its rewrite)
from egraph_did.rewrites.algebra import REWRITES, Bucket, Member, Merge, MergedB, MergedW, MergedY, Rewrote, rewrite_ruleset
from egraph_did.rewrites.recompute import Keepable, Kept
from egraph_did.rewrites.sorts import OPS_SORT, Def, Lit, Out, ShapeOf, Shp, T, shape_code

from .egglog_io import frozen_rows, held_string, run_text, string_term
from .errors import PlanError
from .fusion import Fusion, Ops
from .ops import OPS, canonical_dtype

# program rewrites (logical: expand saturates them) and physical ones (egraph.saturate offers their steps)
PHYSICAL_REWRITES = (collective_matmul.NAME,)
ALL_REWRITES = tuple(sorted((*REWRITES, *PHYSICAL_REWRITES)))


@dataclass(frozen=True)
class Equal:
    """A tensor the rewrites added (`new`) and the tensor of the program it equals (`old`; None for a term
    that only feeds another new one), with the rewrite that made it."""

    old: str | None
    new: str
    rewrite: str


@dataclass(frozen=True)
class RewriteSet:
    """The program rewrites an optimization may apply (iterates over their names), and the pairs of tensors
    bucket_pair may send in one buffer.

    >>> rs = RewriteSet(("bucket_pair",), (("dw1", "dw2"),))
    >>> list(rs), "bucket_pair" in rs, rs.with_buckets([("a", "b")]).buckets
    (['bucket_pair'], True, (('a', 'b'),))
    """

    names: tuple[str, ...]
    buckets: tuple[tuple[str, str], ...] = ()

    def __iter__(self):
        return iter(self.names)

    def __contains__(self, name) -> bool:
        return name in self.names

    def __len__(self) -> int:
        return len(self.names)

    def with_buckets(self, pairs) -> "RewriteSet":
        """The same rewrites with these bucket pairs."""
        return RewriteSet(self.names, tuple((a, b) for a, b in pairs))


def check_rewrites(rewrites) -> tuple[str, ...]:
    """The program rewrites to apply, by name: all of them for None, none for ().

    >>> check_rewrites(None)
    ('bucket_pair', 'collective_matmul', 'merge_siblings', 'recompute', 'sum_partials_first')
    >>> check_rewrites(["sum_partial_first"])
    Traceback (most recent call last):
    ...
    egraph_did.errors.PlanError: optimize: unknown program rewrite 'sum_partial_first'; rewrites= takes names from ['bucket_pair', 'collective_matmul', 'merge_siblings', 'recompute', 'sum_partials_first'] (None: all of them, (): none)
    """
    if rewrites is None:
        return ALL_REWRITES
    if isinstance(rewrites, str):
        rewrites = (rewrites,)
    names = tuple(sorted(set(rewrites)))
    for n in names:
        if n not in ALL_REWRITES:
            raise PlanError(f"optimize: unknown program rewrite {n!r}; rewrites= takes names from "
                            f"{list(ALL_REWRITES)} (None: all of them, (): none)")
    return names


@functools.lru_cache(maxsize=8)
def _template(names: tuple[str, ...]):
    """An EGraph with the logical constructors declared and the rewrites' ruleset compiled (a problem loads
    into a pushed copy): egglog-python knows a function once the public API used it."""
    rules = rewrite_ruleset(names)
    eg = EGraph()
    junk = Lit("declare")  # a class no program names: read back never emits a term that uses it
    # ShapeOf on a class of its own: on junk (which every op's term joins) recompute's Kept would grow terms
    eg.register(ShapeOf(Lit("declare-shape"), Shp("declare")), Rewrote(junk, "declare"), Def(T("declare"), junk), Bucket(*[junk] * 8), Kept(junk), Keepable(junk),
                Merge(-1, junk, -1, *[junk] * 4), Member(-1, -1, *[junk] * 8), MergedW(-1, -1), MergedB(-1, -1), MergedY(-1),
                *[Def(junk, OPS_SORT[op](*[junk] * len(OPS[op].signature.parameters))) for op in sorted(OPS_SORT)],
                Def(junk, Out(0, junk)))  # a multi-output op's outputs, whatever rewrites are named
    eg.run(1, ruleset=rules)
    return eg, rules


# Sets of siblings offered: every set of two or more while a group has at most this many members (q, k and
# v gain three pairs and the triple: the plan picks), the whole group beyond (2^n sets would swamp the
# e-graph; the whole group is the one that saves every collective but one)
ALL_SETS_UP_TO = 3


def _sibling_key(e):
    """What siblings share: their op, input, weight dtype and in-features, and their biases' presence and
    dtype; None for an op no merge applies to (a matmul's weight must be a matrix: batched weights are no
    one GEMM's columns). Widths never part siblings: the merged GEMM is local row-parallel (x split on
    in-features) for any widths, and where a column split of the stacked weight is not local (its blocks
    are not each rank's rows of every w_i) no view rule derives it, so the e-graph prices a reshard there
    rather than a wrong local step."""
    if len(e.outputs) != 1 or e.op.name not in ("linear", "matmul") or 0 in e.outputs[0].shape[-1:]:
        return None
    x, w, *bias = e.inputs
    if w.ndim != 2 or x is w:
        return None
    inner = w.shape[1] if e.op.name == "linear" else w.shape[0]
    return (e.op.name, x.name, str(w.dtype), inner, tuple(str(b.dtype) for b in bias))


def sibling_groups(work: Fusion) -> list[list]:
    """The GEMMs of the program that merge_siblings may merge: groups of two or more linears (all with biases
    or none) or matmuls of 2-D weights that read one input, with weights of one dtype and in-features (any
    widths), in program order.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x, z = fd.define_tensor((5, 4), name="x"), fd.define_tensor((5, 4), name="z")
    ...     wq, wk, wv, wo = (fd.define_tensor((3, 4), name=n) for n in ("wq", "wk", "wv", "wo"))
    ...     for n, (a, w) in {"q": (x, wq), "k": (x, wk), "v": (x, wv), "o": (z, wo), "u": (x, fd.ops.neg(wo)),
    ...                       "kv": (x, fd.define_tensor((6, 4), name="wkv"))}.items():
    ...         fd.add_output(fd.ops.linear(a, w), name=n)
    ...     fd.add_output(fd.ops.matmul(x, fd.define_tensor((4, 2), name="wm")), name="m")
    >>> [[e.outputs[0].name for e in g] for g in sibling_groups(fd.fusion)]
    [['q', 'k', 'v', 'u', 'kv']]
    """
    groups: dict[tuple, list] = {}
    for e in work.exprs:
        key = _sibling_key(e)
        if key is not None:
            groups.setdefault(key, []).append(e)
    return [g for g in groups.values() if len(g) > 1]


def sibling_sets(group) -> list[list]:
    """The sets of a sibling group offered to merge (ALL_SETS_UP_TO), in program order.

    >>> sibling_sets("qkv"), sibling_sets("abcd")
    ([['q', 'k'], ['q', 'v'], ['k', 'v'], ['q', 'k', 'v']], [['a', 'b', 'c', 'd']])
    """
    if len(group) > ALL_SETS_UP_TO:
        return [list(group)]
    return [list(c) for n in range(2, len(group) + 1) for c in itertools.combinations(group, n)]


def merge_can_pay(group, mesh, cm, shape_of=lambda tv: tuple(tv.shape),
                  itemsize_of=lambda tv: tv.dtype.itemsize) -> bool:
    """Whether merging the set of siblings `group` can be cheaper on this mesh and cost model at best: what
    it could save (per sibling but one: a GEMM launch, a read of the input, an all-reduce's latency per
    mesh axis) against what it costs at least (stacking the weights, sharded over every rank; a cat's
    launch; slicing each output, likewise sharded). The e-graph gains the merged terms only where they
    can pay (the full-width q, k and v of a GPT-3 layer: their weights' copy alone costs more than the
    latencies saved). shape_of, itemsize_of: a tensor's shape and element size (a replay judges at the
    shapes and dtypes of the plan it replays: the same terms).

    >>> import egraph_did as ed, torch
    >>> from egraph_did.cost import CostModel
    >>> def group(tokens, hidden, *widths):
    ...     with ed.FusionDefinition() as fd:
    ...         x = fd.define_tensor((tokens, hidden), torch.bfloat16, name="x")
    ...         for i, width in enumerate(widths):
    ...             w = fd.define_tensor((width, hidden), torch.bfloat16, name=f"w{i}")
    ...             fd.add_output(fd.ops.linear(x, w), name=f"y{i}")
    ...     return sibling_groups(fd.fusion)[0]
    >>> merge_can_pay(group(8192, 4096, 128, 128), ed.DeviceMesh.arange(4), CostModel.h200())
    True
    >>> merge_can_pay(group(8192, 4096, 128, 32, 32), ed.DeviceMesh.arange(4), CostModel.h200())
    True
    >>> merge_can_pay(group(2048, 12288, 12288, 12288), ed.DeviceMesh.arange(8), CostModel.h200())
    False
    """
    x = group[0].inputs[0]
    item = itemsize_of(x)
    lead = math.prod(shape_of(x)[:-1])
    weights = sum(math.prod(shape_of(e.inputs[1])) for e in group) * item
    outs = [lead * shape_of(e.outputs[0])[-1] * item for e in group]
    hbm, launch = cm.hbm_bandwidth, cm.launch_overhead
    latency = sum(2 * cm.link(axis, mesh.ndim).alpha for axis in range(mesh.ndim))
    saves = (len(group) - 1) * (launch + math.prod(shape_of(x)) * item / hbm + latency)
    costs = launch + 2 * weights / mesh.size / hbm + sum(launch + 2 * y / mesh.size / hbm for y in outs)
    return costs < saves


def _as_in(like) -> dict:
    """merge_can_pay's shape_of and itemsize_of at the plan `like`: a tensor's shape and element size there
    (where it holds one), else its own. Both: a bf16 plan replayed in float64 judged at the plan's shapes but
    8-byte elements refused the gate/up merge the plan's 2-byte ones paid for, so the replay gained fewer
    terms, named the later ones differently and kept the plan's strategies for other terms (a Llama step's
    RMSNorm mean [1, 12, 1] given a sum's [S(2)] of [1, 1, 32768, 128]: embed_tokens' gradient unreachable)."""
    held = {v.tensor: v for v in like.values.values()} if like is not None else {}
    return {"shape_of": lambda tv: tuple(held[tv.name].shape) if tv.name in held else tuple(tv.shape),
            "itemsize_of": lambda tv: canonical_dtype(held[tv.name].dtype).itemsize if tv.name in held
            else tv.dtype.itemsize}


def merge_layout(group) -> dict:
    """The literal shapes a set of siblings merges with (rewrites/algebra.py, merge_siblings): k = gcd of the
    widths o_i blocks of b_i = o_i / k rows of each weight (columns, for matmul), the merged weight's and
    bias's shapes, the output viewed as [.., k, sum b_i] and each sibling's range [lo_i, hi_i) of its last
    axis.

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((5, 4), name="x")
    ...     for n, width in {"q": 8, "k": 2, "v": 2}.items():
    ...         fd.add_output(fd.ops.linear(x, fd.define_tensor((width, 4), name="w" + n)), name=n)
    >>> lay = merge_layout(sibling_groups(fd.fusion)[0])
    >>> lay["blocks"], lay["weight"], lay["view"], lay["ranges"]
    ([[2, 4, 4], [2, 1, 4], [2, 1, 4]], [12, 4], [5, 2, 6], [(0, 4), (4, 5), (5, 6)])
    """
    widths = [e.outputs[0].shape[-1] for e in group]
    k = math.gcd(*widths)
    rows = [o // k for o in widths]
    inner = group[0].inputs[1].shape[1 if group[0].op.name == "linear" else 0]
    ends = list(itertools.accumulate(rows))
    linear = group[0].op.name == "linear"
    biased = linear and len(group[0].inputs) == 3
    return {"blocks": [[k, b, inner] if linear else [inner, k, b] for b in rows],
            "bias_blocks": [[k, b] if biased else None for b in rows],
            "weight": [k * ends[-1], inner] if linear else [inner, k * ends[-1]],
            "bias": [k * ends[-1]] if biased else None, "axis": 1 if linear else 2,
            "view": [*group[0].outputs[0].shape[:-1], k, ends[-1]],
            "ranges": [(e - b, e) for b, e in zip(rows, ends)]}


def sibling_facts(work: Fusion, ident: dict[str, str], slot, can_pay=lambda group: True) -> list[str]:
    """The facts merge_siblings folds over, for the sets of siblings that can pay: per set, Merge (its input,
    size and merged shapes) and a Member per sibling, in program order (merge_layout's literals). slot(v)
    writes a tensor or a literal (and registers the literal for read back).

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x = fd.define_tensor((5, 4), name="x")
    ...     for n, width in {"g": 3, "u": 6}.items():
    ...         fd.add_output(fd.ops.linear(x, fd.define_tensor((width, 4), name="w" + n)), name=n)
    >>> ident = {name: f"t{i}" for i, name in enumerate(fd.fusion.tensors)}
    >>> for fact in sibling_facts(fd.fusion, ident, lambda v: ident[v.name] if hasattr(v, "name") else repr(v)):
    ...     print(fact)
    (Merge 0 t0 2 [9, 4] None [5, 3, 3] 1)
    (Member 0 0 t2 t1 None [3, 1, 4] None 0 1 [5, 3])
    (Member 0 1 t4 t3 None [3, 2, 4] None 1 3 [5, 6])
    """
    for v in (None, -1, 1, 2):
        slot(v)  # the bias slot's null, the slices' axis, the blocks' cat axes
    facts = []
    for group in sibling_groups(work):
        for members in filter(can_pay, sibling_sets(group)):
            g, lay = len(facts), merge_layout(members)
            x = members[0].inputs[0]
            merged = (lay["weight"], lay["bias"], lay["view"], lay["axis"])
            facts.append([f"(Merge {g} {slot(x)} {len(members)} {' '.join(slot(v) for v in merged)})"])
            for i, e in enumerate(members):
                y, w, b = e.outputs[0], e.inputs[1], (e.inputs[2] if len(e.inputs) == 3 else None)
                lits = (lay["blocks"][i], lay["bias_blocks"][i], *lay["ranges"][i], list(y.shape))
                facts[-1].append(f"(Member {g} {i} {slot(y)} {slot(w)} {slot(b)} {' '.join(slot(v) for v in lits)})")
    return [f for per_set in facts for f in per_set]


def _literal_key(v) -> tuple:
    """A literal's place in the order expand names new terms: numbers by value (a slice's bounds keep their
    order at any shapes, where their text would not: "10" < "8"), lists item by item.

    >>> sorted([[8, 10], [10, 12], None, 2.5, "x"], key=_literal_key)
    [None, 2.5, [8, 10], [10, 12], 'x']
    """
    if v is None or isinstance(v, bool):
        return (0, str(v))
    if isinstance(v, (int, float)):
        return (1, v)
    if isinstance(v, (list, tuple)):
        return (2, tuple(_literal_key(x) for x in v))
    return (3, str(v))


def expand(work: Fusion, ops: Ops, rewrites: Iterable[str], mesh=None, cost_model=None, like=None) -> list[Equal]:
    """Add to `work` every term the named rewrites derive from its ops, as new ops (emitted through
    `ops`); returns what each new tensor equals. rewrites: names, or a RewriteSet, whose buckets are the
    pairs of tensors (of one dtype, neither computed from the other) bucket_pair may send in one buffer.
    mesh and cost_model: merge_siblings merges only the siblings that can pay there (merge_can_pay);
    without them, every group. like: a plan of this fusion being replayed at other shapes, whose shapes
    judge that instead (the replay gains the terms the plan chose among, under the same names).

    >>> import egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x, a, b = (fd.define_tensor((4, 6), name=n) for n in "xab")
    ...     fd.add_output(fd.ops.add(fd.ops.add(x, a), b), name="y")
    >>> from egraph_did.problem import clone_fusion
    >>> work, ops = clone_fusion(fd.fusion)
    >>> [(e.old, e.new) for e in expand(work, ops, ["sum_partials_first"])]
    [(None, 'add_2'), ('y', 'add_3')]
    >>> [str(e) for e in work.exprs[-2:]]
    ['add_2 = add(a, b)', 'add_3 = add(x, add_2)']
    """
    buckets = getattr(rewrites, "buckets", ())
    names = tuple(sorted(n for n in rewrites if n in REWRITES))  # the physical ones act after saturation
    if not names or not work.exprs:
        return []
    ident = {name: f"t{i}" for i, name in enumerate(work.tensors)}
    lits: dict[str, object] = {}  # literal text -> its value

    def slot(v) -> str:
        if hasattr(v, "logical_domain"):
            return f'(T "{ident[v.name]}")'
        text = json.dumps(v, default=str)
        lits.setdefault(held_string(text), v)
        return f"(Lit {string_term(text)})"

    facts = [f'(ShapeOf (T "{ident[n]}") (Shp {string_term(shape_code(tv))}))' for n, tv in work.tensors.items()]
    if "bucket_pair" in names:
        for a, b in buckets:
            if a not in work.tensors or b not in work.tensors:  # a replay's pairs are the like plan's
                raise PlanError(f"optimize(like=plan): the plan sends {a} and {b} in one buffer, but this fusion has "
                                f"no {a if a not in work.tensors else b}: the plan is of another program (an export "
                                f"follows the module's dtype and device: a float32 module drops the casts a bf16 "
                                f"one has); plan the same program at both shapes, or optimize without like=")
            ta, tb = work.tensors[a], work.tensors[b]
            assert ta.dtype == tb.dtype, f"bucket_pair: {a} and {b} differ in dtype"
            na, nb = math.prod(ta.shape), math.prod(tb.shape)
            literals = [(na,), (nb,), tuple(ta.shape), tuple(tb.shape), na, na + nb]
            slot(0)  # the cat's axis and the first slice's start
            facts.append(f'(Bucket (T "{ident[a]}") (T "{ident[b]}") {" ".join(slot(v) for v in literals)})')
    if "merge_siblings" in names:
        can_pay = (lambda g: True) if mesh is None or cost_model is None else \
            functools.partial(merge_can_pay, mesh=mesh, cm=cost_model, **_as_in(like))
        facts += sibling_facts(work, ident, slot, can_pay)
    for e in work.exprs:
        app = f'(op_{e.op.name} {" ".join(slot(v) for _, v in e.args)})'
        if len(e.outputs) == 1:
            facts.append(f'(Def (T "{ident[e.outputs[0].name]}") {app})')
        else:  # output i of a multi-output op is the term Out(i, app)
            facts += [f'(Def (T "{ident[o.name]}") (Out {i} {app}))' for i, o in enumerate(e.outputs)]
    eg, rules = _template(names)
    with eg:
        run_text(eg, facts)
        eg.run(rules.saturate())
        ops_used = sorted(OPS_SORT)  # whatever ops a rewrite builds (the rows are read once, from one freeze)
        rows, raw = frozen_rows(eg, ["T", "Lit", "Rewrote", "Out"] + [f"op_{op}" for op in ops_used])
    name_of = {v: k for k, v in ident.items()}
    tclass = {name_of[raw.value_to_string(ins[0])]: out for ins, out in rows.get("T", [])
              if raw.value_to_string(ins[0]) in name_of}
    lclass = {raw.value_to_string(ins[0]): out for ins, out in rows.get("Lit", [])}
    # the new tensors are named in an order the program fixes, never egglog's: its row order follows class ids,
    # which the shape literals shift, so a replay at other shapes (optimize(like=)) named its rewritten terms
    # differently from the plan's and kept the wrong strategies (a Llama step: embed_tokens' gradient unreachable)
    tensor = {}  # class -> a tensor of the program (or a new one) holding it, the program's first in its order
    rank = {}  # class -> when its tensor came: the program's in program order, then the new ones as made
    for n in work.tensors:
        if n in tclass and tclass[n] not in tensor:
            tensor[tclass[n]], rank[tclass[n]] = work.tensors[n], len(rank)
    literal = {c: lits[text] for text, c in lclass.items() if text in lits}
    by = {ins[0]: raw.value_to_string(ins[1]) for ins, _ in rows.get("Rewrote", [])}

    def class_of(v):
        return tclass[v.name] if hasattr(v, "logical_domain") else lclass[held_string(json.dumps(v, default=str))]

    old = {(e.op.name, tuple(class_of(v) for _, v in e.args)) for e in work.exprs}
    pending = [(op, tuple(ins), out) for op in ops_used for ins, out in rows.get(f"op_{op}", [])]
    pending = [p for p in pending if (p[0], p[1]) not in old]
    projections: dict = {}  # a multi-output app's class -> {output index: the class of Out(i, app)}
    for ins, out in rows.get("Out", []):
        projections.setdefault(ins[1], {})[raw.value_to_i64(ins[0])] = out
    made = []  # (class, operand classes, old tensor or None, new tensor), producers first
    while pending:
        ready = [p for p in pending if all(c in tensor or c in literal for c in p[1])]
        if not ready:
            break  # what is left reads a class no program tensor holds (the template's junk)
        ready.sort(key=lambda p: (p[0], tuple((0, rank[c]) if c in tensor else (1, _literal_key(literal[c]))
                                               for c in p[1])))
        for op, ins, out in ready:
            args = {p: tensor[c] if c in tensor else literal[c] for p, c in zip(OPS[op].signature.parameters, ins)}
            tvs = ops._fusion.emit(op, **args)
            outs = {None: out} if not isinstance(tvs, tuple) else projections.get(out, {})
            for i, c in outs.items():
                tv = tvs if i is None else tvs[i]
                made.append((c, ins, tensor[c].name if c in tensor else None, tv.name))
                if c not in tensor:
                    tensor[c], rank[c] = tv, len(rank)
        pending = [p for p in pending if p not in ready]
    rule = {}  # a term that only feeds another new one was made by that one's rewrite
    for out, ins, _, _ in reversed(made):
        rule.setdefault(out, by.get(out, names[0]))
        for c in ins:
            rule.setdefault(c, rule[out])
    return [Equal(old_name, new, rule[out]) for out, _, old_name, new in made]


__all__ = ["ALL_REWRITES", "Equal", "RewriteSet", "check_rewrites", "expand", "merge_can_pay", "merge_layout", "sibling_facts", "sibling_groups", "sibling_sets"]
