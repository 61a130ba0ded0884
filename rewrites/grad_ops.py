"""Sharding rules of the ops gradients add: scatter_add, the adjoint of take_along_axis (the gradient of
embedding, take_along_axis and cross_entropy). With the rows of an embedding's ids split over ranks
(data parallel), each rank scatters its own rows and the table's gradient is a partial; with the table
split over its rows (vocab parallel), each rank scatters the ids it owns."""
from __future__ import annotations

from egglog import rule as erule

from egraph_did.ops import SCATTER_ADD_LOCAL

from .rules import P, S, Case, egglog_form, family_ruleset, indices, rule
from .sorts import P as P_, R as R_, S as S_
from .sorts import AttrI, AxisMap, MeshSize, a, ax, b, d, sig, site


def _dim(e) -> int:
    return e.attr("dim") % e.out.ndim


def _rows(o, x, i, s):
    return o.scatter_add(x, 0, i, s)


def _cols(o, x, i, s):
    return o.scatter_add(x, -1, i, s)


@rule("scatter_add", cases=[
    Case("rows", (2,), {"x": (4, 6), "i": indices((3, 6), 4), "s": (3, 6)}, _rows),
    Case("cols-uneven-mesh2x2", (2, 2), {"x": (5, 3), "i": indices((5, 4), 3), "s": (5, 4)}, _cols),
])
def scatter_other_axis(e):
    """x.scatter_add(d, i, s)[shard of axis a != d] = x[shard].scatter_add(d, i[shard], s[shard]): the
    slices along another axis scatter apart"""
    for a in range(e.out.ndim):
        if a != _dim(e):
            yield e.strategy(out=S(a), x=S(a), index=S(a), src=S(a))


@rule("scatter_add", cases=[
    Case("rows-uneven", (3,), {"x": (4, 2), "i": indices((7, 2), 4), "s": (7, 2)}, _rows),
    Case("rows-mesh2x2", (2, 2), {"x": (3, 2), "i": indices((8, 2), 3), "s": (8, 2)}, _rows),
])
def scatter_sources_partial(e):
    """x.scatter_add(d, i, s) = sum_r x_r.scatter_add(d, i_r, s_r) over the ranks' shares of the sources
    along d, x a partial or added on one rank only: a partial"""
    d = _dim(e)
    yield e.strategy(out=P, x=P, index=S(d), src=S(d))
    yield e.strategy(out=P, index=S(d), src=S(d), local=SCATTER_ADD_LOCAL)


@rule("scatter_add", cases=[
    Case("rows-uneven", (3,), {"x": (7, 2), "i": indices((9, 2), 7), "s": (9, 2)}, _rows),
    Case("cols-mesh2x2-nested", (2, 2), {"x": (2, 13), "i": indices((2, 20), 13), "s": (2, 20)}, _cols),
])
def scatter_into_owned_positions(e):
    """x.scatter_add(d, i, s)[rank r's part along d] = x_r.scatter_add(d, i - start_r, s where i is in
    r's part): each rank adds the sources it owns (vocab-parallel embedding gradient)"""
    yield e.strategy(out=S(_dim(e)), x=S(_dim(e)), local=SCATTER_ADD_LOCAL)


# ---------------------------------------------------------------------- the same identities as egglog rules
# Each derives the per-mesh-axis relation Ax (rewrites/sorts.py) for scatter_add from its axis facts
# (egraph._axis_facts: AttrI(sig, "dim", the scatter axis), AxisMap(sig, 0, a, a) for every other axis). The
# tensor operands are positional, in the op's signature order: x, index, src.

@egglog_form(scatter_other_axis)
def _scatter_other_axis(spec):
    """x.scatter_add(d, i, s)[shard of axis a != d] = x[shard].scatter_add(d, i[shard], s[shard])"""
    yield erule(site("scatter_add", 3), AxisMap(sig, 0, a, b), MeshSize(d)).then(ax([S_(a)] * 3, [S_(b)]))


@egglog_form(scatter_sources_partial)
def _scatter_sources_partial(spec):
    """x.scatter_add(d, i, s) = sum_r x_r.scatter_add(d, i_r, s_r), sources split along d: a partial (x a
    partial, or replicated and added on one rank only)"""
    yield erule(site("scatter_add", 3), AttrI(sig, "dim", a), MeshSize(d)).then(
        ax([P_(), S_(a), S_(a)], [P_()]), ax([R_(), S_(a), S_(a)], [P_()], SCATTER_ADD_LOCAL))


@egglog_form(scatter_into_owned_positions)
def _scatter_into_owned_positions(spec):
    """x.scatter_add(d, i, s)[rank r's part along d] = x_r.scatter_add(d, i - start_r, s where i is r's)"""
    yield erule(site("scatter_add", 3), AttrI(sig, "dim", a), MeshSize(d)).then(
        ax([S_(a), R_(), R_()], [S_(a)], SCATTER_ADD_LOCAL))


grad_ops = family_ruleset("grad_ops")
