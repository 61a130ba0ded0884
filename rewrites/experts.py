"""Sharding rules of mixture-of-experts layers (issue 28 item 4): the grouped matmul of tokens sorted by
expert (grouped_mm: rows offsets[e-1]:offsets[e] times expert e's matrix), its weight gradient
(grouped_mm_wgrad) and the count of tokens per expert (histc).

grouped_mm shards as a matmul does on the features: w split on f gives out split on f; x and w split on
d give a pending sum. Along the rows, offsets are global row positions, so a rank that holds a shard of
the rows computes the rows of each expert that fall in its range (the local kernel 'ranged' reads the
rank's first row from the layout). Expert parallelism: w split on the experts, every rank computes the
rows of its own experts and leaves the others zero; each row belongs to exactly one expert, so the sum
over the ranks is exact: a pending sum. The same kernel serves both, and their product on two mesh axes
(a rank's rows of its experts). grouped_mm_wgrad is the transposed family: per-expert x^T g over the
rows, so the rows split give a pending sum and the experts split the output's experts.

histc counts a shard's elements, so x split on any axis gives a pending sum of counts (exact: integers).

Expert rows (Pe, a pending sum of disjoint rows): grouped_mm_experts' output holds on each rank the rows of
its own experts and zeros elsewhere. Beside P it is offered as Pe, which row-wise ops keep where P cannot
pass: f(Pe) for f(0) = 0 (silu, gelu, relu, neg, tanh, erf, abs, any cast: each row is whole on the one rank
that holds it), a slice of the columns, a product with a whole operand or with expert rows of the same
offsets (silu(gate) * up), and grouped_mm of expert rows against the weights split on the experts (the
'ranged' kernel reads only the rank's experts' rows). So an expert-parallel MLP keeps each rank's rows on
it from the first grouped matmul to the second, whose output is reduced once. "The same offsets" is a fact
of the program, not of the shapes the rules see: `expert_rows_attrs` gives the grouped matmul and the
product an attribute where their operands' rows are sorted by those offsets (a structural pass), which
the signature carries.

Token dispatch and combine (collectives.EXCHANGES): a grouped matmul whose step moves rows by one all-to-all
of counts read from the offsets at run time. expert_dispatch takes x split on its rows in blocks to expert
rows (each rank receives its experts' rows from every block and runs them); expert_combine takes x whole or
expert rows to the output split on its rows (each rank runs its experts' rows and sends each to the rank
whose block holds it), in place of reducing whole zero-padded buffers. Offered on one mesh axis alone
(nestable=False; a step runs one local kernel).

The training step (expert parallelism as Megatron's and torchtitan's token dispatchers run it: the experts'
weights and their gradients never move). The backward's grouped matmuls are the same dispatch (y's gradient
into expert rows) and combine (grad_x); the weight gradients take expert_dispatch_wgrad: one operand of
grouped_mm_wgrad expert rows (the saved hidden rows, or the hidden rows' gradient), the other split on its
rows (y's gradient, or x), dispatched by one all-to-all to the rank of its experts, which multiplies the
rows of its span only. Between them the hidden rows' gradient stays expert rows: every op of the backward
of silu(gate) * up is zero where its operands are (a rank's rows of other experts hold zeros in every
operand, so they hold zeros in the result; no rule claims an op whose f(0) != 0): products, sums and
differences of rows sorted by the same offsets (expert_rows_sum), the slices' zero fill (zeros_like is
cast(gt(t, t)): expert_rows_compare, expert_rows_mask), the cat of the halves (expert_rows_cat), saved
markers, and silu's gradient silu_backward(dy, x) = dy silu'(x) (one op, zero where dy is: expert_rows_sum).

>>> import torch
>>> from egraph_did.rewrites.rules import Operand, OpView, axis_strategies
>>> x, w, o = Operand("x", (8, 4), torch.float32), Operand("w", (4, 4, 6), torch.float32), Operand("offsets", (4,), torch.int64)
>>> out = Operand("out", (8, 6), torch.float32)
>>> [(s.rule, [str(p) for p in s.inputs], str(s.outputs[0]), str(s.local)) for s in axis_strategies(OpView("grouped_mm", (x, w, o), (), (out,), d=2))][:4]
[('grouped_mm_features', ['R', 'S(2)', 'R'], 'S(1)', 'None'), ('grouped_mm_features', ['S(1)', 'S(1)', 'R'], 'P', 'None'), ('grouped_mm_rows', ['S(0)', 'R', 'R'], 'S(0)', 'ranged'), ('grouped_mm_experts', ['R', 'S(0)', 'R'], 'P', 'ranged')]
"""
from __future__ import annotations

import torch
from egglog import rule as erule

from egraph_did.layout import PE
from egraph_did.ops import (GROUPED_MM_COMBINE, GROUPED_MM_DISPATCH, GROUPED_MM_RANGED, GROUPED_WGRAD_DISPATCH,
                            GROUPED_WGRAD_RANGED, SAVE_OP, zeros_like)

from .rules import P, S, Case, egglog_form, family_ruleset, indices, rule
from .sorts import P as P_, Pe as Pe_, R as R_, S as S_
from .sorts import AttrI, AxisMap, Extent, FloatSize, MeshSize, a, ax, d, m, n, sig, site, sx0, sy


def offsets(o, ids, experts: int):
    """The offsets of tokens sorted by expert, as transformers computes them: the cumsum of
    histc(ids, experts, 0, experts - 1) (ids >= experts fall outside: rows past offsets[-1])."""
    counts = o.histc(o.cast(ids, torch.float64), experts, 0, experts - 1)
    return o.cast(o.cumsum(counts, 0), torch.int64)


def _mm(experts: int):
    return lambda o, x, w, ids: o.grouped_mm(x, w, offsets(o, ids, experts))


def _wgrad(experts: int):
    return lambda o, x, g, ids: o.grouped_mm_wgrad(x, g, offsets(o, ids, experts))


# rows 9, experts 5 (one rank of 3 holds one expert), ids up to 5: rows of id 5 fall past offsets[-1]
MM = {"x": (9, 4), "w": (5, 4, 6), "ids": indices((9,), 6)}
MM2 = {"x": (8, 4), "w": (4, 4, 6), "ids": indices((8,), 5)}
WG = {"x": (9, 4), "g": (9, 6), "ids": indices((9,), 6)}
WG2 = {"x": (8, 4), "g": (8, 6), "ids": indices((8,), 5)}


@rule("grouped_mm", cases=[
    Case("uneven", (3,), MM, _mm(5)),
    Case("mesh2x2", (2, 2), MM2, _mm(4)),
])
def grouped_mm_features(e):
    """x @ w[e][:, shard of f] = (x @ w[e])[:, shard]; x[:, shard r] @ w[e][shard r] summed over r = x @ w[e]:
    split on f as column-parallel, on d a pending sum"""
    yield e.strategy(out=S(1), w=S(2))
    yield e.strategy(out=P, x=S(1), w=S(1))


@rule("grouped_mm", cases=[
    Case("uneven", (3,), MM, _mm(5)),
    Case("mesh2x2", (2, 2), MM2, _mm(4)),
])
def grouped_mm_rows(e):
    """grouped_mm(x, w, offsets)[shard of rows] = the rows of each expert inside the shard, times its matrix:
    offsets are global row positions, the local kernel reads the rank's first row"""
    yield e.strategy(out=S(0), x=S(0), local=GROUPED_MM_RANGED)


@rule("grouped_mm", cases=[
    Case("uneven-rows-past-the-end", (3,), MM, _mm(5)),
    Case("experts-and-rows-mesh2x2", (2, 2), MM2, _mm(4)),
    Case("nested-experts-mesh2x2", (2, 2), {"x": (6, 3), "w": (8, 3, 2), "ids": indices((6,), 8)}, _mm(8)),
])
def grouped_mm_experts(e):
    """grouped_mm(x, w, offsets) = sum_r (the rows of rank r's experts, times their matrices; other rows 0):
    expert parallelism, w split on the experts gives a pending sum (each row belongs to one expert), of
    expert rows (Pe)"""
    yield e.strategy(out=P, w=S(0), local=GROUPED_MM_RANGED)
    yield e.strategy(out=PE, w=S(0), local=GROUPED_MM_RANGED)


@rule("grouped_mm", cases=[
    Case("partials", (2,), MM2, lambda o, x, w, ids: o.grouped_mm(o.linear(x, o.full((4, 4), 0.5, torch.float64)), w,
                                                               offsets(o, ids, 4))),
    Case("partial-weights", (2,), {"x": (6, 4), "w": (4, 4, 2), "ids": indices((6,), 4)},
         lambda o, x, w, ids: o.grouped_mm(x, o.add(w, w), offsets(o, ids, 4))),
])
def grouped_mm_of_partial(e):
    """grouped_mm(sum_r x_r, w) = sum_r grouped_mm(x_r, w), and in w alike: linear in each float operand"""
    yield e.strategy(out=P, x=P)
    yield e.strategy(out=P, w=P)


@rule("grouped_mm_wgrad", cases=[
    Case("uneven", (3,), WG, _wgrad(5)),
    Case("mesh2x2", (2, 2), WG2, _wgrad(4)),
])
def grouped_wgrad_features(e):
    """out[e] = x_e^T g_e: a shard of x's features is a shard of out's axis 1, of g's one of axis 2"""
    yield e.strategy(out=S(1), x=S(1))
    yield e.strategy(out=S(2), g=S(1))


@rule("grouped_mm_wgrad", cases=[
    Case("uneven", (3,), WG, _wgrad(5)),
    Case("mesh2x2", (2, 2), WG2, _wgrad(4)),
])
def grouped_wgrad_rows(e):
    """x_e^T g_e = sum_r (x_e^T g_e over the rows of shard r): x and g split on the rows give a pending sum"""
    yield e.strategy(out=P, x=S(0), g=S(0), local=GROUPED_WGRAD_RANGED)


@rule("grouped_mm_wgrad", cases=[
    Case("uneven", (3,), WG, _wgrad(5)),
    Case("experts-and-rows-mesh2x2", (2, 2), WG2, _wgrad(4)),
])
def grouped_wgrad_experts(e):
    """out[shard of experts] = x_e^T g_e for the rank's experts only: expert parallelism's weight gradient"""
    yield e.strategy(out=S(0), local=GROUPED_WGRAD_RANGED)


@rule("grouped_mm_wgrad", cases=[
    Case("partials", (2,), WG2, lambda o, x, g, ids: o.grouped_mm_wgrad(o.add(x, x), g, offsets(o, ids, 4))),
])
def grouped_wgrad_of_partial(e):
    """out is linear in x and in g: a partial of either gives a partial"""
    yield e.strategy(out=P, x=P)
    yield e.strategy(out=P, g=P)


@rule("histc", cases=[
    Case("ids-uneven", (3,), {"ids": indices((7,), 5)}, lambda o, ids: o.histc(o.cast(ids, torch.float64), 4, 0, 3)),
    Case("mesh2x2", (2, 2), {"x": (4, 6)}, lambda o, x: o.histc(x, 5, -1.0, 1.0)),
])
def histc_of_shards(e):
    """histc(x) = sum_r histc(x[shard r]): each rank counts its elements, a pending sum of counts (of float
    counts: an integer tensor is never a pending sum, so int counts are taken of whole ids)"""
    if e.out.dtype.is_floating_point:
        for k in range(e["x"].ndim):
            yield e.strategy(out=P, x=S(k))


# ---------------------------------------------------------------------- expert rows (Pe)
# unary row-wise ops with f(0) = 0: a row that is zero on a rank stays zero there (cast: any float dtype)
# and a training step's saved(t) marker (t itself: the forward's expert rows kept for the backward)
ZERO_KEEPING = ("silu", "gelu", "relu", "neg", "tanh", "erf", "abs", "cast", SAVE_OP)


def _unsaved(tv):
    """A training step's saved(t) marker stands for t itself."""
    while tv is not None and tv.fusion is not None and (e := tv.fusion.producer(tv)) is not None \
            and e.op.name == SAVE_OP:
        tv = e.inputs[0]
    return tv


def rows_sorted_by(tv):
    """The offsets (a TensorView) whose expert order the rows of tv follow, or None: a grouped_mm's output,
    and row-wise ops of such (pointwise ops of operands with the same rows, where every such operand that
    follows offsets follows the same ones; a slice or a cat of the columns; saved markers).

    >>> import torch, egraph_did as ed
    >>> with ed.FusionDefinition() as fd:
    ...     x, w = fd.define_tensor((6, 4), name="x"), fd.define_tensor((2, 4, 8), name="w")
    ...     o = fd.define_tensor((2,), torch.int64, name="o")
    ...     h = fd.ops.grouped_mm(x, w, o)
    ...     y = fd.ops.mul(fd.ops.silu(fd.ops.slice(h, 1, 0, 4)), fd.ops.slice(h, 1, 4, 8))
    ...     fd.add_output(y, name="y")
    >>> rows_sorted_by(fd["y"]).name, rows_sorted_by(fd["x"])
    ('o', None)
    """
    memo, todo = {}, [_unsaved(tv)]
    while todo:
        t = todo[-1]
        e = t.fusion.producer(t) if t.fusion is not None else None
        if e is None or e.op.name == "grouped_mm" or t.ndim == 0:
            memo[id(t)] = _unsaved(dict(e.args)["offsets"]) if e is not None and t.ndim else None
            todo.pop()
            continue
        if e.op.name == "slice":
            rows = [e.inputs[0]] if dict(e.args)["dim"] % t.ndim != 0 else []
        elif e.op.name == "cat":
            rows = list(e.inputs) if dict(e.args)["dim"] % t.ndim != 0 else []
        elif e.op.kind == "pointwise":
            rows = [v for v in e.inputs if v.ndim == t.ndim and v.shape[0] == t.shape[0]]
        else:
            rows = []
        rows = [_unsaved(v) for v in rows]
        missing = [v for v in rows if id(v) not in memo]
        if missing:
            todo += missing
            continue
        found = {id(memo[id(v)]): memo[id(v)] for v in rows if memo[id(v)] is not None}
        memo[id(t)] = next(iter(found.values())) if len(found) == 1 else None
        todo.pop()
    return memo[id(_unsaved(tv))]


def makes_expert_rows(exprs) -> bool:
    """Whether a program may hold expert rows: it runs a grouped matmul (problem.build_problem offers Pe in
    such programs only)."""
    return any(e.op.name == "grouped_mm" for e in exprs)


def expert_rows_attrs(e) -> tuple:
    """The attribute the expert-row rules read of an expr: ("expert_rows", True) on a grouped_mm whose x
    rows are sorted by its own offsets, on a product, sum, difference, silu gradient, comparison or cat
    (SAME_ROWS) of two tensors whose rows are sorted by the same offsets, on a cast of a bool mask of such
    rows, and on a grouped_mm_wgrad whose x rows are sorted by its own offsets (("expert_rows_g", True): its
    g rows); () elsewhere. Part of the expr's signature (problem.signature, problem.op_view, egglog's
    AttrI): the layers of a model share signatures, and a product of two layers' rows is not local."""
    if e.op.name == "grouped_mm":
        args = dict(e.args)
        by = rows_sorted_by(args["x"])
        return (("expert_rows", True),) if by is not None and by is _unsaved(args["offsets"]) else ()
    if e.op.name in SAME_ROWS and len(e.inputs) == 2:
        by = [rows_sorted_by(v) for v in e.inputs]
        return (("expert_rows", True),) if by[0] is not None and by[0] is by[1] else ()
    if e.op.name == "cast" and e.inputs[0].dtype == torch.bool:
        return (("expert_rows", True),) if rows_sorted_by(e.inputs[0]) is not None else ()
    if e.op.name == "grouped_mm_wgrad":
        args = dict(e.args)
        off = _unsaved(args["offsets"])
        return tuple((name, True) for name, v in (("expert_rows", args["x"]), ("expert_rows_g", args["g"]))
                     if rows_sorted_by(v) is not None and rows_sorted_by(v) is off)
    return ()


# binary ops of two operands whose rows, sorted by the same offsets, the expert-row rules read whole on each rank
SAME_ROWS = ("mul", "add", "sub", "silu_backward", "gt", "lt", "ne", "cat")


def _swiglu(experts: int):
    """Mixtral's experts: silu(gate) * up of one grouped matmul's halves, then the second grouped matmul."""
    def body(o, x, w1, w2, ids):
        off = offsets(o, ids, experts)
        h = o.grouped_mm(x, w1, off)
        f = w1.shape[2] // 2
        return o.grouped_mm(o.mul(o.silu(o.slice(h, 1, 0, f)), o.slice(h, 1, f, 2 * f)), w2, off)
    return body


SWIGLU = {"x": (9, 4), "w1": (4, 4, 6), "w2": (4, 3, 5), "ids": indices((9,), 5)}


@rule(*ZERO_KEEPING, cases=[
    Case("unary", (2,), MM2, lambda o, x, w, ids: (lambda h: (
        o.silu(h), o.gelu(h), o.gelu(h, approximate="tanh"), o.relu(h), o.neg(h), o.tanh(h), o.erf(h), o.abs(h),
        o.cast(h, torch.float32), o.saved(h)))(o.grouped_mm(x, w, offsets(o, ids, 4)))),
    Case("uneven-rows-past-the-end", (3,), MM, lambda o, x, w, ids: o.silu(o.grouped_mm(x, w, offsets(o, ids, 5)))),
])
def expert_rows_unary(e):
    """f(rows of rank r's experts, zeros elsewhere) = f of those rows, zeros elsewhere, for f(0) = 0: expert
    rows stay on their ranks (float rows: grouped_mm's)"""
    if e["x"].dtype.is_floating_point:
        yield e.strategy(out=PE, x=PE)


@rule("slice", cases=[
    Case("columns", (2,), MM2, lambda o, x, w, ids: (lambda h: (o.slice(h, 1, 0, 3), o.slice(h, -1, 2)))(
        o.grouped_mm(x, w, offsets(o, ids, 4)))),
])
def expert_rows_slice(e):
    """(expert rows)[:, columns] = the rows' columns: a slice of the columns keeps them"""
    if e.attr("dim") % e.out.ndim != 0:
        yield e.strategy(out=PE, x=PE)


@rule("mul", cases=[
    Case("swiglu", (2,), SWIGLU, _swiglu(4)),
    Case("by-whole", (3,), {"x": (8, 4), "w": (5, 4, 6), "s": (8, 1), "ids": indices((8,), 6)},
         lambda o, x, w, s, ids: (lambda h: (o.mul(h, s), o.mul(s, h), o.mul(h, 2.0)))(
             o.grouped_mm(x, w, offsets(o, ids, 5)))),
])
def expert_rows_product(e):
    """(expert rows) * b = the rows of the product for a whole b; a * b for a, b expert rows of the same
    offsets (silu(gate) * up): each rank's rows are whole in both"""
    params = [o.param for o in e.operands]
    for q in params:
        yield e.strategy(out=PE, **{q: PE})
    if len(params) == 2 and e.attr("expert_rows"):
        yield e.strategy(out=PE, **{q: PE for q in params})


@rule("grouped_mm", cases=[
    Case("swiglu", (2,), SWIGLU, _swiglu(4)),
    Case("uneven-rows-past-the-end", (3,), {"x": (9, 4), "w1": (5, 4, 6), "w2": (5, 6, 3), "ids": indices((9,), 6)},
         lambda o, x, w1, w2, ids: (lambda off: o.grouped_mm(o.relu(o.grouped_mm(x, w1, off)), w2, off))(
             offsets(o, ids, 5))),
])
def grouped_mm_of_expert_rows(e):
    """grouped_mm(rows of rank r's experts, w[r's experts]) = rank r's rows of the output: x as expert rows
    of these offsets and w split on the experts give expert rows, or a pending sum"""
    if e.attr("expert_rows"):
        yield e.strategy(out=PE, x=PE, w=S(0), local=GROUPED_MM_RANGED)
        yield e.strategy(out=P, x=PE, w=S(0), local=GROUPED_MM_RANGED)


def _silu_backward(experts: int):
    """The backward of Mixtral's experts' silu(gate) * up as ed.grad writes it: g_gate = silu_backward(g up,
    gate), g_up = g silu(gate), joined as cat(g_gate, 0) + cat(0, g_up) (the slices' gradients: zeros_like is
    cast(gt(t, t)))."""
    def body(o, x, w1, w2, ids):
        off = offsets(o, ids, experts)
        h = o.grouped_mm(x, w1, off)
        f = w1.shape[2] // 2
        gate, up = o.slice(h, 1, 0, f), o.slice(h, 1, f, 2 * f)
        g = o.grouped_mm(x, w2, off)  # the hidden rows' gradient: rows sorted by the same offsets
        g_gate, g_up = o.silu_backward(o.mul(g, up), gate), o.mul(g, o.silu(gate))
        return o.add(o.cat(g_gate, zeros_like(o, up), 1), o.cat(zeros_like(o, gate), g_up, 1)), o.lt(gate, up), o.ne(gate, up)
    return body


SILU_BACKWARD = [Case("silu-backward", (2,), {"x": (8, 4), "w1": (4, 4, 6), "w2": (4, 4, 3), "ids": indices((8,), 5)},
                      _silu_backward(4)),
                 Case("silu-backward-uneven", (3,), {"x": (9, 3), "w1": (5, 3, 4), "w2": (5, 3, 2), "ids": indices((9,), 6)},
                      _silu_backward(5))]


@rule("add", "sub", "silu_backward", cases=SILU_BACKWARD)
def expert_rows_sum(e):
    """a + b, a - b, silu_backward(a, b) for a, b expert rows of the same offsets = expert rows: each rank's
    rows are whole in both, its other rows f(0, 0) = 0 (0 +- 0, 0 silu'(0))"""
    if e.attr("expert_rows") and len(e.operands) == 2:
        yield e.strategy(out=PE, **{o.param: PE for o in e.operands})


@rule("gt", "lt", "ne", cases=SILU_BACKWARD)
def expert_rows_compare(e):
    """a > b, a < b, a != b for a, b expert rows of the same offsets = expert rows of a mask: each rank's
    rows are whole in both, its other rows compare 0 with 0, false (zeros_like(t) is cast(gt(t, t)))"""
    if e.attr("expert_rows") and len(e.operands) == 2:
        yield e.strategy(out=PE, **{o.param: PE for o in e.operands})


@rule("cast", cases=SILU_BACKWARD)
def expert_rows_mask(e):
    """cast(mask of expert rows) = expert rows: false is 0 in every dtype"""
    if e["x"].dtype == torch.bool and e.attr("expert_rows"):
        yield e.strategy(out=PE, x=PE)


@rule("cat", cases=SILU_BACKWARD)
def expert_rows_cat(e):
    """cat(a, b, columns) for a, b expert rows of the same offsets = expert rows: each rank's rows are whole
    in both, its other rows zero in both"""
    if e.attr("expert_rows") and e.attr("dim") % e.out.ndim != 0:
        yield e.strategy(out=PE, a=PE, b=PE)


# ---------------------------------------------------------------------- token dispatch and combine (uneven all-to-alls)
# the exchange moves rows on its mesh axis alone (nestable=False: no other mesh axis splits the rows or the experts)
MM4 = {"x": (10, 3), "w": (7, 3, 2), "ids": indices((10,), 8)}  # 4 ranks of 7 experts (2, 2, 2, 1), rows 3, 3, 3, 1; ids 7 past the end
EXCHANGE_CASES = [Case("uneven-rows-past-the-end", (3,), MM, _mm(5)), Case("four-ranks-uneven", (4,), MM4, _mm(7)),
                  Case("swiglu", (2,), SWIGLU, _swiglu(4))]


@rule("grouped_mm", nestable=False, cases=EXCHANGE_CASES)
def expert_dispatch(e):
    """grouped_mm(x, w, offsets) from x split on its rows = expert rows: rank r sends each rank q the rows of its
    block that q's experts own (an all-to-all of counts read from the offsets), q runs them"""
    yield e.strategy(out=PE, x=S(0), w=S(0), local=GROUPED_MM_DISPATCH)


@rule("grouped_mm", nestable=False, cases=EXCHANGE_CASES)
def expert_combine(e):
    """grouped_mm(x, w, offsets)[block r] = the rows every rank q computed of its experts that fall in block r:
    x whole (or expert rows of these offsets), w split on the experts, out split on the rows by an all-to-all"""
    yield e.strategy(out=S(0), w=S(0), local=GROUPED_MM_COMBINE)
    if e.attr("expert_rows"):
        yield e.strategy(out=S(0), x=PE, w=S(0), local=GROUPED_MM_COMBINE)


def _wgrad_of_rows(experts: int, which: str):
    """grouped_mm_wgrad(h, g) (which="x": x expert rows of a grouped matmul, g the rows' gradient, as the
    second matmul's weight gradient) or grouped_mm_wgrad(x, h) (which="g": the first matmul's)."""
    def body(o, x, w, g, ids):
        off = offsets(o, ids, experts)
        h = o.silu(o.grouped_mm(x, w, off))
        return o.grouped_mm_wgrad(h, g, off) if which == "x" else o.grouped_mm_wgrad(x, h, off)
    return body


WGRAD_EXCHANGE_CASES = [
    Case("x-rows-uneven-past-the-end", (3,), {"x": (9, 4), "w": (5, 4, 6), "g": (9, 3), "ids": indices((9,), 6)},
         _wgrad_of_rows(5, "x")),
    Case("g-rows-uneven-past-the-end", (3,), {"x": (9, 4), "w": (5, 4, 6), "g": (9, 3), "ids": indices((9,), 6)},
         _wgrad_of_rows(5, "g")),
    Case("four-ranks-x-rows", (4,), {"x": (10, 3), "w": (7, 3, 2), "g": (10, 5), "ids": indices((10,), 8)},
         _wgrad_of_rows(7, "x")),
    Case("four-ranks-g-rows", (4,), {"x": (10, 3), "w": (7, 3, 2), "g": (10, 5), "ids": indices((10,), 8)},
         _wgrad_of_rows(7, "g")),
]


@rule("grouped_mm_wgrad", nestable=False, cases=WGRAD_EXCHANGE_CASES)
def expert_dispatch_wgrad(e):
    """grouped_mm_wgrad(x, g, offsets)[rank q's experts] = sum over q's rows of x_e^T g_e: one operand split on
    its rows in blocks, the other expert rows of these offsets; each rank sends q the rows of its block that
    q's experts own (an all-to-all of counts from the offsets), q multiplies them with its rows of the other
    (expert parallelism's weight gradient: the weights' gradients stay on their experts' ranks)"""
    if e.attr("expert_rows"):
        yield e.strategy(out=S(0), x=PE, g=S(0), local=GROUPED_WGRAD_DISPATCH)
    if e.attr("expert_rows_g"):
        yield e.strategy(out=S(0), x=S(0), g=PE, local=GROUPED_WGRAD_DISPATCH)


# ---------------------------------------------------------------------- the same identities as egglog rules
# grouped_mm's operands: x, w, offsets; grouped_mm_wgrad's: x, g, offsets

@egglog_form(grouped_mm_features)
def _grouped_mm_features(spec):
    """w split on f: out split on f; x and w split on d: a pending sum"""
    yield erule(site("grouped_mm", 3), MeshSize(d)).then(ax([R_(), S_(2), R_()], [S_(1)]),
                                                          ax([S_(1), S_(1), R_()], [P_()]))


@egglog_form(grouped_mm_rows)
def _grouped_mm_rows(spec):
    """a shard of the rows: each expert's rows inside it (ranged)"""
    yield erule(site("grouped_mm", 3), MeshSize(d)).then(ax([S_(0), R_(), R_()], [S_(0)], GROUPED_MM_RANGED))


@egglog_form(grouped_mm_experts)
def _grouped_mm_experts(spec):
    """w split on the experts: each rank its experts' rows, a pending sum or expert rows (ranged)"""
    yield erule(site("grouped_mm", 3), MeshSize(d)).then(ax([R_(), S_(0), R_()], [P_()], GROUPED_MM_RANGED),
                                                          ax([R_(), S_(0), R_()], [Pe_()], GROUPED_MM_RANGED))


@egglog_form(grouped_mm_of_partial)
def _grouped_mm_of_partial(spec):
    """linear in x and in w"""
    yield erule(site("grouped_mm", 3), MeshSize(d)).then(ax([P_(), R_(), R_()], [P_()]), ax([R_(), P_(), R_()], [P_()]))


@egglog_form(grouped_wgrad_features)
def _grouped_wgrad_features(spec):
    """x split on d: out on axis 1; g split on f: out on axis 2"""
    yield erule(site("grouped_mm_wgrad", 3), MeshSize(d)).then(ax([S_(1), R_(), R_()], [S_(1)]),
                                                                ax([R_(), S_(1), R_()], [S_(2)]))


@egglog_form(grouped_wgrad_rows)
def _grouped_wgrad_rows(spec):
    """x and g split on the rows: a pending sum (ranged)"""
    yield erule(site("grouped_mm_wgrad", 3), MeshSize(d)).then(
        ax([S_(0), S_(0), R_()], [P_()], GROUPED_WGRAD_RANGED))


@egglog_form(grouped_wgrad_experts)
def _grouped_wgrad_experts(spec):
    """out split on the experts: each rank its experts (ranged)"""
    yield erule(site("grouped_mm_wgrad", 3), MeshSize(d)).then(
        ax([R_(), R_(), R_()], [S_(0)], GROUPED_WGRAD_RANGED))


@egglog_form(grouped_wgrad_of_partial)
def _grouped_wgrad_of_partial(spec):
    """linear in x and in g"""
    yield erule(site("grouped_mm_wgrad", 3), MeshSize(d)).then(ax([P_(), R_(), R_()], [P_()]),
                                                                ax([R_(), P_(), R_()], [P_()]))


@egglog_form(histc_of_shards)
def _histc_of_shards(spec):
    """x split on any axis: a pending sum of counts (float counts)"""
    yield erule(site("histc"), Extent(sx0, a, n), FloatSize(sy, m), MeshSize(d)).then(ax([S_(a)], [P_()]))


@egglog_form(expert_rows_unary)
def _expert_rows_unary(spec):
    """f(0) = 0, one tensor operand: expert rows stay"""
    for name in spec.ops:
        yield erule(site(name), FloatSize(sx0, n), MeshSize(d)).then(ax([Pe_()], [Pe_()]))


@egglog_form(expert_rows_slice)
def _expert_rows_slice(spec):
    """a slice that keeps axis 0 (the rows) keeps them"""
    yield erule(site("slice"), AxisMap(sig, 0, 0, 0), MeshSize(d)).then(ax([Pe_()], [Pe_()]))


@egglog_form(expert_rows_product)
def _expert_rows_product(spec):
    """times a number or a whole operand; times expert rows of the same offsets (the attribute)"""
    yield erule(site("mul"), MeshSize(d)).then(ax([Pe_()], [Pe_()]))
    yield erule(site("mul", 2), MeshSize(d)).then(ax([Pe_(), R_()], [Pe_()]), ax([R_(), Pe_()], [Pe_()]))
    yield erule(site("mul", 2), AttrI(sig, "expert_rows", 1), MeshSize(d)).then(ax([Pe_(), Pe_()], [Pe_()]))


@egglog_form(grouped_mm_of_expert_rows)
def _grouped_mm_of_expert_rows(spec):
    """x expert rows of these offsets (the attribute), w split on the experts (ranged)"""
    yield erule(site("grouped_mm", 3), AttrI(sig, "expert_rows", 1), MeshSize(d)).then(
        ax([Pe_(), S_(0), R_()], [Pe_()], GROUPED_MM_RANGED), ax([Pe_(), S_(0), R_()], [P_()], GROUPED_MM_RANGED))


@egglog_form(expert_dispatch)
def _expert_dispatch(spec):
    """x split on the rows, w on the experts: expert rows (the dispatch's all-to-all)"""
    yield erule(site("grouped_mm", 3), MeshSize(d)).then(
        ax([S_(0), S_(0), R_()], [Pe_()], GROUPED_MM_DISPATCH, nestable=False))


@egglog_form(expert_combine)
def _expert_combine(spec):
    """x whole or expert rows of these offsets (the attribute), w split on the experts: out split on the rows"""
    yield erule(site("grouped_mm", 3), MeshSize(d)).then(
        ax([R_(), S_(0), R_()], [S_(0)], GROUPED_MM_COMBINE, nestable=False))
    yield erule(site("grouped_mm", 3), AttrI(sig, "expert_rows", 1), MeshSize(d)).then(
        ax([Pe_(), S_(0), R_()], [S_(0)], GROUPED_MM_COMBINE, nestable=False))


@egglog_form(expert_rows_sum)
def _expert_rows_sum(spec):
    """expert rows of the same offsets (the attribute) added, subtracted, or silu's gradient of them"""
    for name in spec.ops:
        yield erule(site(name, 2), AttrI(sig, "expert_rows", 1), MeshSize(d)).then(ax([Pe_(), Pe_()], [Pe_()]))


@egglog_form(expert_rows_compare)
def _expert_rows_compare(spec):
    """expert rows of the same offsets (the attribute) compared: a mask of expert rows"""
    for name in spec.ops:
        yield erule(site(name, 2), AttrI(sig, "expert_rows", 1), MeshSize(d)).then(ax([Pe_(), Pe_()], [Pe_()]))


@egglog_form(expert_rows_mask)
def _expert_rows_mask(spec):
    """a cast of a mask of expert rows (the attribute: a bool operand)"""
    yield erule(site("cast"), AttrI(sig, "expert_rows", 1), MeshSize(d)).then(ax([Pe_()], [Pe_()]))


@egglog_form(expert_rows_cat)
def _expert_rows_cat(spec):
    """expert rows of the same offsets (the attribute) joined on a column axis (axis 0 kept)"""
    yield erule(site("cat", 2), AxisMap(sig, 0, 0, 0), AttrI(sig, "expert_rows", 1), MeshSize(d)).then(
        ax([Pe_(), Pe_()], [Pe_()]))


@egglog_form(expert_dispatch_wgrad)
def _expert_dispatch_wgrad(spec):
    """x expert rows (the attribute) and g split on the rows, or x split and g expert rows ("expert_rows_g"):
    out split on the experts (the dispatch's all-to-all)"""
    yield erule(site("grouped_mm_wgrad", 3), AttrI(sig, "expert_rows", 1), MeshSize(d)).then(
        ax([Pe_(), S_(0), R_()], [S_(0)], GROUPED_WGRAD_DISPATCH, nestable=False))
    yield erule(site("grouped_mm_wgrad", 3), AttrI(sig, "expert_rows_g", 1), MeshSize(d)).then(
        ax([S_(0), Pe_(), R_()], [S_(0)], GROUPED_WGRAD_DISPATCH, nestable=False))

experts = family_ruleset("experts")
