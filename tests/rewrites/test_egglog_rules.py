"""Every rule's egglog form (rewrites/: `@egglog_form(rule)`) derives exactly the per-mesh-axis rows of its
Python rule: on every numeric case of every rule and on the models, the Ax rows saturated by the family
rulesets (egraph.axis_rows) equal, expr by expr and mesh axis size by size, the strategies of
rules.axis_strategies (placements, local kernel, nestable)."""
from __future__ import annotations

import pytest

from egraph_did import models
from egraph_did.egraph import ORACLE_RULES, axis_rows
from egraph_did.problem import build_problem, op_view
from egraph_did.rewrites import ALL_RULES, axis_strategies
from egraph_did.rewrites.rules import EGGLOG
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


PORTED_FAMILIES = ("pointwise", "views", "reduction", "aten")


def test_every_rule_of_the_ported_families_has_an_egglog_form():
    """No rule of these families reaches the e-graph as facts; ORACLE_RULES holds only rules of families
    written since (their Ax rows computed by the Python rule, until they get egglog forms)."""
    ported = {r.name for r in ALL_RULES if r.family in PORTED_FAMILIES}
    assert ported <= set(EGGLOG) and not ORACLE_RULES & ported
    assert ORACLE_RULES == {r.name for r in ALL_RULES} - set(EGGLOG)
