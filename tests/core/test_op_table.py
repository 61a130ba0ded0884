"""The op table states each fact once and the rest of the pipeline reads it: the facts agree with what
the ops do (a composite declared fusible decomposes into kernel primitives, a local kernel is one some
rule names), and modules that select ops do it by query, not by a list of names."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from egraph_did.collectives import RING_FLAGS
from egraph_did.lowering.kernel_spec import KERNEL_OPS
from egraph_did.lowering.segment import spec_from_fusion
from egraph_did.ops import KINDS, OPS, LocalKernel, ops_where
from egraph_did.rewrites import ALL_RULES

from test_ops import CASES, build
from test_rules import user_strategies

ROOT = Path(__file__).resolve().parents[2]


def test_every_kind_has_an_op_and_every_op_a_kind():
    assert {d.kind for d in OPS.values()} == set(KINDS)


def test_queries_select_by_facts():
    free = ops_where(kind="view", metadata_only=True)
    assert {"reshape", "unsqueeze", "expand", "broadcast_in_dim"} <= set(free) and "permute" not in free
    assert {"add", "pow"} <= set(ops_where(kind="pointwise", arity=2)) and "exp" not in ops_where(arity=2)
    assert {"permute", "transpose"} <= set(ops_where(permutes=True)) and "reshape" not in ops_where(permutes=True)
    reducing = ops_where(is_composite=True, reduces=True)
    assert {"softmax", "layer_norm", "var_mean", "cross_entropy"} <= set(reducing) and "gelu" not in reducing
    assert list(ops_where()) == list(OPS) and ops_where(kind="no such kind") == ()


@pytest.mark.parametrize("name", sorted(n for n, d in OPS.items() if d.is_composite))
def test_a_composite_is_fusible_exactly_when_every_case_decomposes_into_kernel_primitives(name):
    cases = [c for c in CASES if c.op == name]
    assert cases, f"no case of {name} in tests/core/test_ops.py"
    primitive = []
    for c in cases:
        fd, *_ = build(c, c.dtypes[0])
        ops = {op.op for op in spec_from_fusion(fd.fusion).ops}
        primitive.append(ops <= set(KERNEL_OPS))
    assert OPS[name].fuses == all(primitive), (
        f"{name}: declared fuses={OPS[name].fuses}, but its cases decompose into kernel primitives: {primitive}")


def test_every_local_kernel_is_named_by_a_rule_on_its_cases():
    """(The collective matmul rings are derived from these strategies, not by a rule of their own: below.)"""
    declared = {(n, k.name) for n, d in OPS.items() for k in d.local_kernels if k.name not in RING_FLAGS}
    named = set()
    for r in ALL_RULES:
        for c in r.cases:
            _, _, _, pairs = user_strategies(c)
            named |= {(e.op.name, f) for e, s in pairs for fs in s.flags for f in fs}
    assert named == declared


def test_every_ring_kernel_is_named_by_the_collective_matmul_rules():
    """Each op's ring kernels (ag_ring, rs_ring; kv_ring, dkv_ring) are what add_ring_strategies
    (add_attention_rings) derives for it on a 4-rank mesh."""
    import egraph_did as ed
    from egraph_did.problem import build_problem

    declared = {(n, k.name) for n, d in OPS.items() for k in d.local_kernels if k.name in RING_FLAGS}
    named = set()
    for op, w_shape in (("matmul", (32, 16)), ("linear", (16, 32))):
        with ed.FusionDefinition() as fd:
            x, w = fd.define_tensor((64, 32), name="x"), fd.define_tensor(w_shape, name="w")
            fd.add_output(getattr(fd.ops, op)(x, w), name="y")
        problem = build_problem(fd, ed.DeviceMesh.arange(4), rewrites=["collective_matmul"])
        named |= {(op, f) for s in problem.strategies["y"] for fs in s.flags for f in fs if f in RING_FLAGS}
    for op in ("sdpa", "sdpa_lse", "sdpa_backward"):
        with ed.FusionDefinition() as fd:
            q = fd.define_tensor((1, 2, 8, 4), name="q")
            out = getattr(fd.ops, "sdpa_lse" if op == "sdpa_lse" else "sdpa")(q, q, q)
            fd.add_output(fd.ops.sum(out[0] if op == "sdpa_lse" else out), name="y")
        problem = build_problem(ed.grad(fd, "y", ["q"]) if op == "sdpa_backward" else fd, ed.DeviceMesh.arange(4),
                                rewrites=["collective_matmul"])
        key = next(k for k, e in problem.exprs.items() if e.op.name == op)
        named |= {(op, f) for s in problem.strategies[key] for fs in s.flags for f in fs if f in RING_FLAGS}
    assert named == declared and declared


@pytest.mark.parametrize("kernel", [k for d in OPS.values() for k in d.local_kernels], ids=str)
def test_every_local_kernel_says_what_it_computes(kernel: LocalKernel):
    assert len(kernel.doc.split()) >= 8, f"local kernel {kernel.name}: its function needs a docstring"


def test_an_unknown_local_kernel_name_is_a_plan_error():
    from egraph_did.errors import PlanError
    with pytest.raises(PlanError, match="names the local kernel 'bias_twice'.*it has: bias_once"):
        OPS["linear"].local_kernel("bias_twice")


def _string_constants(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


@pytest.mark.parametrize("module", ["egraph_did/local.py", "egraph_did/problem.py", "lowering/kernel_spec.py"])
def test_modules_that_select_ops_name_none(module):
    named = sorted(_string_constants(ROOT / module) & set(OPS))
    assert not named, f"{module} names ops {named}: select them with a query on the op table (ops_where)"


def test_the_name_check_sees_a_name(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text('VIEWS = ("reshape", "permute")\n')
    assert _string_constants(planted) & set(OPS) == {"reshape", "permute"}


def test_flops_are_the_op_table_s():
    assert OPS["matmul"].count_flops([(2, 3, 4), (4, 5)], [(2, 3, 5)], {}) == 2 * 2 * 3 * 5 * 4
    causal = OPS["sdpa"].count_flops([(1, 2, 8, 4)] * 3, [(1, 2, 8, 4)], {"is_causal": True})
    assert causal < OPS["sdpa"].count_flops([(1, 2, 8, 4)] * 3, [(1, 2, 8, 4)], {"is_causal": False})
    assert OPS["add"].count_flops([(3, 4), (4,)], [(3, 4)], {}) == 12 + 4 + 12


def test_local_attrs_make_shape_attributes_local():
    assert OPS["reshape"].local_attrs({"shape": (8, 6)}, [(4, 6)]) == {"shape": (4, 6)}
    assert OPS["welford_blocks"].local_attrs({"dim": -1, "blocks": 4}, [(3, 1, 3)]) == {"blocks": 1}
    assert OPS["permute"].local_attrs is None
