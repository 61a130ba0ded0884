"""Every rule's egglog form (rewrites/: `@egglog_form(rule)`) derives exactly the per-mesh-axis rows of its
Python rule: on every numeric case of every rule and on the models, the Ax rows saturated by the family
rulesets (egraph.axis_rows) equal, expr by expr and mesh axis size by size, the strategies of
rules.axis_strategies (placements, local kernel, nestable). No rule reaches the e-graph another way: every
family has its egglog forms, and a rule without one is an error naming it."""
from __future__ import annotations

import pytest

from egraph_did import models
from egraph_did.egraph import axis_rows, check_egglog_forms
from egraph_did.problem import build_problem, op_view
from egraph_did.rewrites import ALL_RULES, Case, axis_strategies, indices
from egraph_did.rewrites.rules import EGGLOG, Rule
from tests.rewrites.test_rules import build, mesh_of


def python_rows(problem) -> dict[tuple[str, int], set[tuple]]:
    out = {}
    for key, e in problem.exprs.items():
        for d in sorted(set(problem.mesh.shape)):
            out[(key, d)] = {(tuple(p.code() for p in s.inputs), tuple(p.code() for p in s.outputs),
                              s.local.name if s.local else "", int(s.nestable)) for s in axis_strategies(op_view(e, d))}
    return out


def assert_same_rows(problem) -> None:
    egg, py = axis_rows(problem), python_rows(problem)
    for where in sorted(set(egg) | set(py)):
        e = problem.exprs[where[0]]
        assert egg.get(where, set()) == py.get(where, set()), (
            f"{e} on a mesh axis of {where[1]}: egglog only {egg.get(where, set()) - py.get(where, set())}, "
            f"Python only {py.get(where, set()) - egg.get(where, set())}")


CASES = [(r.name, c) for r in ALL_RULES for c in r.cases]


@pytest.mark.parametrize("rule_name, c", CASES, ids=[f"{n}-{c.name}" for n, c in CASES])
def test_egglog_forms_derive_the_python_rows_on_every_case(rule_name, c):
    assert_same_rows(build_problem(build(c), mesh_of(c.mesh)))


MODELS = {"mlp": lambda: models.mlp(8, 16), "gpt_layer": lambda: models.gpt_layer(2, 8, 16, 4),
          "mlp_with_backward": lambda: models.mlp_with_backward(6, 16), "attention": lambda: models.attention(2, 6, 16, 4)}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_egglog_forms_derive_the_python_rows_on_models(model):
    assert_same_rows(build_problem(MODELS[model](), mesh_of((2, 4))))


FAMILIES = ("pointwise", "views", "reduction", "aten", "grad_ops", "frontend_ops", "scans", "experts")


def test_every_rule_of_every_family_has_an_egglog_form():
    """Every registered rule, of every family, has its egglog form: none reaches the e-graph as facts."""
    assert {r.family for r in ALL_RULES} == set(FAMILIES)
    assert {r.name for r in ALL_RULES} == set(EGGLOG)
    check_egglog_forms()


def test_a_rule_without_an_egglog_form_is_an_error_naming_it():
    """A rule registered without an egglog form fails loudly, by name and family, instead of reaching the
    e-graph by a fallback (egraph_did.egraph runs the check at import)."""
    lacking = Rule("scatter_somewhere", "grad_ops", ("scatter_add",), "an identity", lambda e: iter(()))
    with pytest.raises(RuntimeError, match=r"without an egglog form: scatter_somewhere \(grad_ops\)"):
        check_egglog_forms(list(ALL_RULES) + [lacking], EGGLOG)


def _grad_and_frontend(o, w, rows, cols, s, t):
    """scatter_add along either axis, into an input or a computed value; slices and a cat of them (a rotary
    half swap) along either axis, of an input and of a computed value."""
    scattered = (o.scatter_add(w, 0, rows, o.exp(s)), o.scatter_add(o.neg(w), -1, cols, t))
    h = o.tanh(w)
    joined = (o.cat(o.slice(w, 1, 2), o.neg(o.slice(w, 1, 0, 2)), 1), o.cat(o.slice(h, 0, 3), h, 0))
    return scattered + joined


@pytest.mark.parametrize("mesh", [(4,), (2, 4), (2, 2, 2)], ids=str)
def test_grad_and_frontend_forms_on_meshes(mesh):
    """scatter_add, cat and slice beside the ops they meet in a model, with extents that 2, 4 and 8 ranks
    split unevenly, on 1-D, 2-D and 3-D meshes."""
    c = Case("grad-frontend", mesh, {"w": (7, 5), "rows": indices((9, 5), 7), "cols": indices((7, 3), 5),
                                     "s": (9, 5), "t": (7, 3)}, _grad_and_frontend)
    assert_same_rows(build_problem(build(c), mesh_of(mesh)))
