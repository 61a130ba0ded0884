"""The e-graph's typed sorts, which every ruleset in rewrites/ is written over (docs/egraph.md).

Logical: T, a tensor of the program: a named term `T("h3")` per tensor, unioned with the op constructor
that defines it (one per op of the op table, `op_linear(T("x"), T("w1"), Lit("null"))`: every parameter
a T, a literal attribute or an absent operand a `Lit` of its JSON). Shape facts: `ShapeOf(t, Shp(code))`
per tensor, `Rank`, `Extent`, `FloatSize` and `Fits` (a layout fits the shape) once per distinct shape.

Program structure: `Site{n}x{o}(key, sig, outputs.., tensor operands..)` per op application (key: its
first output's name). What the sharding rules join on is its signature `sig`, one per distinct op, shapes
and attributes (the layers of a model share theirs): `Sig{n}x{o}(sig, op, output shapes.., operand
shapes..)`, `Param(sig, i, name)`, the op's axis correspondence `AxisMap(sig, operand, in axis, out axis)`
(an output axis that is that operand axis, unchanged), `Reduced(sig, axis)`, `AttrS(sig, name, value)`,
`AttrI` and `ReshapeBlock`.

Physical: D. `Held(t, layout, level)` (unextractable) names the class of every way to hold t in a layout
after `level` mesh axes of collectives; `Load`, `Keep`, `Coll` and `Run{n}x{o}` (a rank-local op) make
its members. Placements are R, P, Pmax, Pe and S(axis); a layout is L1/L2/L3 of one placement per mesh axis.

Sharding rules derive `Ax{n}x{o}(sig, d, operand placements.., output placements.., kernel, nestable)`:
on one mesh axis of d devices the op runs locally with these placements (kernel: the rank-local
variant's name, "" for the reference). egraph_did.egraph joins them over the mesh axes.

>>> str(Held(T("x"), L2(S(0), R()), 1))
'Held(T("x"), L2(S(0), R()), 1)'
"""
from __future__ import annotations

import inspect
import json

from egglog import Expr, String, StringLike, function, i64, i64Like, relation, var

from egraph_did.ops import OPS


class Placement(Expr):
    """How a tensor sits on one mesh axis."""


@function(egg_fn="R")
def R() -> Placement:
    """Replicated."""


@function(egg_fn="P")
def P() -> Placement:
    """A pending sum: every rank holds a summand."""


@function(egg_fn="Pmax")
def Pmax() -> Placement:
    """A pending max: every rank holds a candidate."""


@function(egg_fn="Pe")
def Pe() -> Placement:
    """A pending sum of expert rows: every rank holds the rows of its own experts, zeros elsewhere."""


@function(egg_fn="S")
def S(axis: i64Like) -> Placement:
    """Tensor axis `axis` split over the mesh axis."""


class Layout(Expr):
    """One placement per mesh axis."""


@function(egg_fn="L1")
def L1(p0: Placement) -> Layout:
    """A layout on a 1-D mesh."""


@function(egg_fn="L2")
def L2(p0: Placement, p1: Placement) -> Layout:
    """A layout on a 2-D mesh."""


@function(egg_fn="L3")
def L3(p0: Placement, p1: Placement, p2: Placement) -> Layout:
    """A layout on a 3-D mesh."""


LAYOUTS = {1: L1, 2: L2, 3: L3}


class Kern(Expr):
    """The rank-local kernel per mesh axis ("" where the op's reference runs)."""


@function(egg_fn="K1")
def K1(k0: StringLike) -> Kern: ...


@function(egg_fn="K2")
def K2(k0: StringLike, k1: StringLike) -> Kern: ...


@function(egg_fn="K3")
def K3(k0: StringLike, k1: StringLike, k2: StringLike) -> Kern: ...


KERNS = {1: K1, 2: K2, 3: K3}


class Tensor(Expr):
    """A logical tensor."""


@function(egg_fn="T")
def T(name: StringLike) -> Tensor:
    """The tensor called `name` (egglog sees the index "t3": user names may hold any character)."""


@function(egg_fn="Lit")
def Lit(json: StringLike) -> Tensor:
    """A literal attribute (or an absent operand, "null") in an op's parameter slot."""


@function(egg_fn="Out")
def Out(index: i64Like, app: Tensor) -> Tensor:
    """Output `index` of a multi-output op application."""


class Shape(Expr):
    """A tensor's dtype and extents, as one code ("float32:8,64")."""


@function(egg_fn="Shp")
def Shp(code: StringLike) -> Shape: ...


Def = relation("Def", Tensor, Tensor, egg_fn="Def")  # the tensor is the term (a rule unions them: one rebuild)
Input = relation("Input", Tensor, String, egg_fn="Input")  # a free input, bound in any whole layout it fits
LoadIn = relation("LoadIn", Tensor, String, Layout, egg_fn="LoadIn")  # an input bound in this layout (a pin)
ShapeOf = relation("ShapeOf", Tensor, Shape, egg_fn="ShapeOf")
Rank = relation("Rank", Shape, i64, egg_fn="Rank")
Extent = relation("Extent", Shape, i64, i64, egg_fn="Extent")  # shape, axis, extent
FloatSize = relation("FloatSize", Shape, i64, egg_fn="FloatSize")  # a float dtype's bytes
Fits = relation("Fits", Shape, Layout, egg_fn="Fits")  # no rank empty, sharded axes exist
# fits but leaves some rank empty (5 over 4: 2, 2, 1, 0): only ops of empty_shards compute on it
FitsEmpty = relation("FitsEmpty", Shape, Layout, egg_fn="FitsEmpty")
FitsAny = relation("FitsAny", Shape, Layout, egg_fn="FitsAny")  # Fits or FitsEmpty
Valid = relation("Valid", Tensor, Layout, egg_fn="Valid")  # t may be held so (Fits, or a pin)
MeshSize = relation("MeshSize", i64, egg_fn="MeshSize")  # a mesh axis of this many devices exists
OpKind = relation("OpKind", String, String, egg_fn="OpKind")  # op name, kind (the op table's)
Param = relation("Param", String, i64, String, egg_fn="Param")  # sig, operand index, parameter name
AxisMap = relation("AxisMap", String, i64, i64, i64, egg_fn="AxisMap")  # sig, operand, in axis, out axis
Reduced = relation("Reduced", String, i64, egg_fn="Reduced")  # sig, reduced axis of operand 0
AttrS = relation("AttrS", String, String, String, egg_fn="AttrS")  # sig, attribute, value (attr_text)
AttrI = relation("AttrI", String, String, i64, egg_fn="AttrI")  # sig, attribute, integer value
# sig, input axis, inner extent, output axis, inner extent: a reshape's group of merged or split axes, by
# its outermost non-unit axis on each side and the product of the group's extents inside it
# sig, operand, output axis, placement: under broadcasting (pointwise ops, matmul's batch axes), output
# axis i reads the operand's axis in this placement (rewrites/pointwise.py derives it)
Bcast = relation("Bcast", String, i64, i64, Placement, egg_fn="Bcast")
ReshapeBlock = relation("ReshapeBlock", String, i64, i64, i64, i64, egg_fn="ReshapeBlock")
NoPartial = relation("NoPartial", Placement, egg_fn="NoPartial")  # R or a split: no pending reduction
Apart = relation("Apart", Placement, Placement, egg_fn="Apart")  # not the same split
NestOK = relation("NestOK", i64, Placement, Placement, egg_fn="NestOK")  # nestable flag, p, q
# two mesh axes' local kernels that one step runs (local.run_local runs one): equal, or either the reference ""
KernOK = relation("KernOK", String, String, egg_fn="KernOK")
Connect = relation("Connect", Placement, Placement, String, egg_fn="Connect")  # src, dst, collective kind

# (tensor operands, outputs) of the op applications the e-graph holds: up to 4 operands and 2 outputs, and
# attention's backward (sdpa_backward: g, q, k, v, out, lse -> dq, dk, dv). Each arity has its own relations
# and physical rules, so only those ops use are declared
ARITIES = tuple((n, o) for n in (0, 1, 2, 3, 4) for o in (1, 2)) + ((6, 3),)
# key, signature, outputs.., tensor operands..: an op application of the program
SITE = {(n, o): relation(f"Site{n}x{o}", String, String, *([Tensor] * (o + n)), egg_fn=f"Site{n}x{o}")
        for n, o in ARITIES}
# signature, op, output shapes.., operand shapes..: what the sharding rules see of an op application (its op,
# shapes and, in AxisMap/Reduced/AttrS/AttrI/ReshapeBlock/Param, attributes): applications alike share one
SIG = {(n, o): relation(f"Sig{n}x{o}", String, String, *([Shape] * (o + n)), egg_fn=f"Sig{n}x{o}")
       for n, o in ARITIES}
AX = {(n, o): relation(f"Ax{n}x{o}", String, i64, *([Placement] * (n + o)), String, i64, egg_fn=f"Ax{n}x{o}")
      for n, o in ARITIES}

# signature, per-axis kernels, output layouts.., operand layouts..: op applications of this signature run on
# the whole mesh so (the join of Ax over the mesh axes, egraph_did.egraph.program_rules)
STRAT = {(n, o): relation(f"Strat{n}x{o}", String, Kern, *([Layout] * (o + n)), egg_fn=f"Strat{n}x{o}")
         for n, o in ARITIES}
# key, kernels, outputs.., operands.., output layouts.., operand layouts..: a strategy of one op application
# (Site joined with its signature's Strat before the physical rules, which then join it with Held alone)
PLAN = {(n, o): relation(f"Plan{n}x{o}", String, Kern, *([Tensor] * (o + n)), *([Layout] * (o + n)),
                         egg_fn=f"Plan{n}x{o}") for n, o in ARITIES}


class D(Expr):
    """A physical value: a logical tensor held in some layout on every rank."""


@function(egg_fn="Held", unextractable=True)
def Held(t: Tensor, layout: Layout, level: i64Like) -> D:
    """The class of every way to hold t in `layout` after `level` mesh axes (0..mesh ndim)."""


@function(egg_fn="Load")
def Load(name: StringLike, layout: Layout) -> D:
    """Input `name` bound in `layout`: every rank receives its shard."""


@function(egg_fn="Keep")
def Keep(d: D) -> D:
    """d unchanged, one level up (a mesh axis on which no collective runs)."""


@function(egg_fn="Coll")
def Coll(kind: StringLike, axis: i64Like, dst: Layout, d: D) -> D:
    """d after collective `kind` over mesh axis `axis`, which leaves it in layout `dst`."""


@function(egg_fn="Proj")
def Proj(index: i64Like, d: D) -> D:
    """Output `index` of the multi-output op application d."""


def _constructor(name: str, params: list[tuple[str, type]], out: type, doc: str):
    """An egglog constructor `name`(params) -> out, built from a table (egglog reads the signature)."""
    def fn(*args): ...
    sig = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=tp) for p, tp in params]
    fn.__signature__ = inspect.Signature(sig, return_annotation=out)
    fn.__annotations__ = {p: tp for p, tp in params} | {"return": out}
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return function(egg_fn=name)(fn)


RUN = {(n, o): _constructor(f"Run{n}x{o}", [("key", StringLike), ("kern", Kern)] + [(f"out{i}", Layout) for i in range(o)]
                            + [(f"in{i}", D) for i in range(n)], D,
                            f"An expr run rank-locally ({n} operands, {o} outputs) under per-axis kernels kern.")
       for n, o in ARITIES}

# One logical constructor per op of the op table, every parameter a Tensor (a literal: Lit(json)).
OPS_SORT = {name: _constructor(f"op_{name}", [(p, Tensor) for p in op.signature.parameters], Tensor,
                               f"The logical op {name} (egraph_did.ops.OPS[{name!r}]).")
            for name, op in OPS.items()}


def shape_code(tv) -> str:
    """A tensor's dtype and extents as the one code of its Shape term.

    >>> import torch
    >>> from types import SimpleNamespace
    >>> shape_code(SimpleNamespace(dtype=torch.float32, shape=(8, 64)))
    'float32:8,64'
    """
    return f"{str(tv.dtype).replace('torch.', '')}:{','.join(map(str, tv.shape))}"


def attr_text(value) -> str:
    """An attribute's value as egglog holds it (AttrS, Lit): its JSON, double quotes made single.

    >>> attr_text("none"), attr_text(True)
    ("'none'", 'true')
    """
    return json.dumps(value, default=str).replace('"', "'")


# ---------------------------------------------------------------------- writing a rule (rewrites/ families)
# The variables every family's rules share: `site(op, n, o)` binds sig, an application signature of op, its
# output shapes sy, sy1 and its operand shapes sx0..sx3; `ax(ins, outs)` is the row the rule derives for
# mesh axes of d devices.

sig, op = var("sig", String), var("op", String)
d, a, b, i, r, n, m = (var(v, i64) for v in ("d", "a", "b", "i", "r", "n", "m"))
sy, sy1, sy2 = var("sy", Shape), var("sy1", Shape), var("sy2", Shape)
sx0, sx1, sx2, sx3, sx4, sx5 = (var(f"sx{j}", Shape) for j in range(6))


def site(op_name, n_in: int = 1, n_out: int = 1):
    """The atom matching a signature of `op_name` (a name or the variable op) with n_in tensor operands.

    >>> str(site("sum"))
    'Sig1x1(sig, "sum", sy, sx0)'
    """
    return SIG[(n_in, n_out)](sig, op_name, *(sy, sy1, sy2)[:n_out], *(sx0, sx1, sx2, sx3, sx4, sx5)[:n_in])


def ax(ins, outs, kernel=None, nestable: bool = True):
    """The Ax row: on a mesh axis of d devices, op applications of signature sig run locally from operands
    placed `ins` to outputs placed `outs` under `kernel` (a LocalKernel of the op table; None: the op's
    reference).

    >>> str(ax([S(a)], [P()]))
    'Ax1x1(sig, d, S(a), P(), "", 1)'
    """
    return AX[(len(ins), len(outs))](sig, d, *ins, *outs, String(kernel.name if kernel else ""), i64(int(nestable)))
