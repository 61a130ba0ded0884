"""Sharding rules, one module per family. Each rule states one identity: for an op whose operands sit on
one mesh axis as the rule says, computing the op locally on every rank yields the output in the
placement the rule gives. The optimizer takes the product of rules over mesh axes, and egglog
saturates the resulting physical e-graph from the pinned tensors.

    @rule("sum", cases=[Case("uneven", (3,), {"x": (3, 7)}, lambda o, x: o.sum(x, 1))])
    def sum_over_sharded_axis(e):
        '''sum over a sharded axis is a local sum, then a partial'''
        for a in e.sharded_reduction_axes(): yield e.strategy(out=P, x=S(a))

A rule selects its ops by name where its identity is about those ops (linear, sum), and by a query on
the op table where it is about a kind (`ops_where(kind="pointwise")`). Where the identity needs the
rank's place, the strategy names a rank-local kernel declared beside the op (`local=LINEAR_BIAS_ONCE`).

Families: pointwise, views (propagation through reshape/permute/broadcast), reduction (rfactor),
aten (linear, matmul, sdpa, embedding, gather); resharding (collectives and their cancellations) is
imported by those who use it. The registry is rewrites/rules.py. Every rule is declared with its numeric
cases, which tests/rewrites/test_rules.py evaluates on random data, both sides.
"""
from __future__ import annotations

from .rules import (ALL_RULES, PMAX, RULES, AxisStrategy, Case, Input, Operand, OpView, P, Placement, R,  # noqa: F401
                    Rule, S, axis_strategies, indices, rule)

# registering their rules, in this order
from . import aten, pointwise, reduction, views, grad_ops, frontend_ops, scans, experts  # noqa: E402,F401
