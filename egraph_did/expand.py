"""Expand the working program by the program rewrites of rewrites/algebra.py: encode the fusion on the
logical sort (each tensor its op's term, shapes), saturate the rewrites in egglog, and read back every
term the rewrites added as new ops of the fusion, each recorded as equal to the tensor whose class it
joined. The problem then prices them like any op; the physical e-graph holds both programs, and
extraction picks the cheaper (docs/egraph.md).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Iterable

from egglog import EGraph

from egraph_did.rewrites.algebra import REWRITES, Bucket, Rewrote, rewrite_ruleset
from egraph_did.rewrites.sorts import OPS_SORT, Def, Lit, ShapeOf, Shp, T, shape_code

from .egglog_io import frozen_rows, held_string, run_text, string_term
from .errors import PlanError
from .fusion import Fusion, Ops
from .ops import OPS

ALL_REWRITES = tuple(sorted(REWRITES))


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
    ('bucket_pair', 'sum_partials_first')
    >>> check_rewrites(["sum_partial_first"])
    Traceback (most recent call last):
    ...
    egraph_did.errors.PlanError: optimize: unknown program rewrite 'sum_partial_first'; rewrites= takes names from ['bucket_pair', 'sum_partials_first'] (None: all of them, (): none)
    """
    if rewrites is None:
        return ALL_REWRITES
    if isinstance(rewrites, str):
        rewrites = (rewrites,)
    names = tuple(sorted(set(rewrites)))
    for n in names:
        if n not in REWRITES:
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
    eg.register(ShapeOf(junk, Shp("declare")), Rewrote(junk, "declare"), Def(T("declare"), junk), Bucket(*[junk] * 8),
                *[Def(junk, OPS_SORT[op](*[junk] * len(OPS[op].signature.parameters))) for op in sorted(OPS_SORT)])
    eg.run(1, ruleset=rules)
    return eg, rules


def expand(work: Fusion, ops: Ops, rewrites: Iterable[str]) -> list[Equal]:
    """Add to `work` every term the named rewrites derive from its ops, as new ops (emitted through
    `ops`); returns what each new tensor equals. rewrites: names, or a RewriteSet, whose buckets are the
    pairs of tensors (of one dtype, neither computed from the other) bucket_pair may send in one buffer.

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
    names = tuple(sorted(rewrites))
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
            ta, tb = work.tensors[a], work.tensors[b]
            assert ta.dtype == tb.dtype, f"bucket_pair: {a} and {b} differ in dtype"
            na, nb = math.prod(ta.shape), math.prod(tb.shape)
            literals = [(na,), (nb,), tuple(ta.shape), tuple(tb.shape), na, na + nb]
            slot(0)  # the cat's axis and the first slice's start
            facts.append(f'(Bucket (T "{ident[a]}") (T "{ident[b]}") {" ".join(slot(v) for v in literals)})')
    for e in work.exprs:
        if len(e.outputs) != 1:
            continue  # multi-output ops are no rewrite's subject yet (their terms are Out(i, app))
        facts.append(f'(Def (T "{ident[e.outputs[0].name]}") (op_{e.op.name} {" ".join(slot(v) for _, v in e.args)}))')
    eg, rules = _template(names)
    with eg:
        run_text(eg, facts)
        eg.run(rules.saturate())
        ops_used = sorted(OPS_SORT)  # whatever ops a rewrite builds (the rows are read once, from one freeze)
        rows, raw = frozen_rows(eg, ["T", "Lit", "Rewrote"] + [f"op_{op}" for op in ops_used])
    name_of = {v: k for k, v in ident.items()}
    tclass = {name_of[raw.value_to_string(ins[0])]: out for ins, out in rows.get("T", [])
              if raw.value_to_string(ins[0]) in name_of}
    lclass = {raw.value_to_string(ins[0]): out for ins, out in rows.get("Lit", [])}
    tensor = {}  # class -> a tensor of the program (or a new one) holding it
    for n, c in tclass.items():
        tensor.setdefault(c, work.tensors[n])
    literal = {c: lits[text] for text, c in lclass.items() if text in lits}
    by = {ins[0]: raw.value_to_string(ins[1]) for ins, _ in rows.get("Rewrote", [])}

    def class_of(v):
        return tclass[v.name] if hasattr(v, "logical_domain") else lclass[held_string(json.dumps(v, default=str))]

    old = {(e.op.name, tuple(class_of(v) for _, v in e.args)) for e in work.exprs if len(e.outputs) == 1}
    pending = [(op, tuple(ins), out) for op in ops_used for ins, out in rows.get(f"op_{op}", [])]
    pending = [p for p in pending if (p[0], p[1]) not in old]
    made = []  # (class, operand classes, old tensor or None, new tensor), producers first
    while pending:
        ready = [p for p in pending if all(c in tensor or c in literal for c in p[1])]
        if not ready:
            break  # what is left reads a class no program tensor holds (the template's junk)
        for op, ins, out in ready:
            args = {p: tensor[c] if c in tensor else literal[c] for p, c in zip(OPS[op].signature.parameters, ins)}
            tv = ops._fusion.emit(op, **args)
            made.append((out, ins, tensor[out].name if out in tensor else None, tv.name))
            tensor.setdefault(out, tv)
        pending = [p for p in pending if p not in ready]
    rule = {}  # a term that only feeds another new one was made by that one's rewrite
    for out, ins, _, _ in reversed(made):
        rule.setdefault(out, by.get(out, names[0]))
        for c in ins:
            rule.setdefault(c, rule[out])
    return [Equal(old_name, new, rule[out]) for out, _, old_name, new in made]


__all__ = ["ALL_REWRITES", "Equal", "RewriteSet", "check_rewrites", "expand"]
