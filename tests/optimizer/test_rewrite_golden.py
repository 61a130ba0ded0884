"""Golden tests of the rewrites that change the program (issue 9, item 3): with the rewrite, the extracted
plan is strictly cheaper than the best plan with it switched off, and simulates equal to the single-device
reference. Shapes and tolerances as tests/optimizer/test_golden_plans.py (bf16 plans on 4 H200s, replayed
in float64 at small shapes: rtol 1e-9, atol 1e-10)."""
import pytest
import torch

import egraph_did as ed
from egraph_did import models
from egraph_did.layout import Layout, S

from test_golden_plans import BF16, F64, MESH, check_numerics, kinds, pin


def test_parallel_residual_adds_partial_sums_before_one_allreduce():
    """y = x + attn(ln(x)) + mlp(ln(x)) under tensor parallelism: attn and mlp end in row-parallel linears
    (partial sums); x + (attn + mlp) pays one all-reduce, (x + attn) + mlp as written pays for two."""
    def layer(shape=(1, 32, 8192, 64), dtype=BF16):
        fd = models.parallel_residual_layer(*shape, dtype)
        pin(fd, "x"), pin(fd, "y")
        return fd

    plan = ed.optimize(layer(), MESH)
    written = ed.optimize(layer(), MESH, rewrites=())
    exact = ed.optimize(layer(), MESH, extractor="exact")
    assert kinds(plan) == ["allreduce"]
    assert len(written.collectives) == 3 and not written.rewrites  # two reductions, and a re-gather
    assert plan.predicted_time < written.predicted_time - 10e-6  # at least the saved collective's latency
    assert exact.predicted_time == pytest.approx(plan.predicted_time, rel=1e-9)
    (ar,) = plan.collectives
    assert plan.values[ar.src].tensor in plan.rewrites  # the all-reduce moves attn + mlp, a new term
    assert set(plan.rewrites.values()) == {"sum_partials_first"}
    assert "sum_partials_first" in plan.explain()
    small = check_numerics(plan, layer((1, 4, 16, 4), F64))
    assert small.rewrites == plan.rewrites


def test_rewrites_off_runs_the_program_as_written():
    fd = models.parallel_residual_layer(1, 4, 16, 4)
    plan = ed.optimize(fd, MESH, rewrites=())
    assert not plan.rewrites
    assert {s.key for s in plan.compute_steps} <= {t.name for t in fd.fusion.all_tensors()}


def test_data_parallel_weight_gradients_share_one_allreduce():
    """The MLP backward with tokens split (data parallel): both weight gradients are partial sums over the
    ranks; bucket_pair sends them in one buffer, one all-reduce's latency instead of two (the flat copies
    in and out cost less than the latency they save at these sizes)."""
    def backward(tokens=8192, hidden=256, dtype=BF16):
        fd = models.mlp_with_backward(tokens, hidden, dtype)
        for n in ("x", "dy", "y", "dx"):
            pin(fd, n, Layout((S(0),)))
        pin(fd, "dw1"), pin(fd, "dw2")
        return fd

    plan = ed.optimize(backward(), MESH)
    written = ed.optimize(backward(), MESH, rewrites=())
    assert kinds(written) == ["allreduce", "allreduce"]
    assert kinds(plan) == ["allreduce"]
    (ar,) = plan.collectives
    assert ar.bytes == sum(c.bytes for c in written.collectives)  # the same bytes, one latency
    assert plan.predicted_time < written.predicted_time
    assert plan.buckets == [["dw2", "dw1"]] and set(plan.rewrites.values()) == {"bucket_pair"}
    assert "bucket_pair" in plan.explain()
    check_numerics(plan, backward(16, 8, F64))


def test_no_bucket_where_copies_cost_more_than_the_latency():
    """At hidden 2048 the gradients are 32 MiB each: packing them costs more than a latency, and the plan
    keeps two all-reduces."""
    fd = models.mlp_with_backward(8192, 2048, BF16)
    for n in ("x", "dy", "y", "dx"):
        pin(fd, n, Layout((S(0),)))
    pin(fd, "dw1"), pin(fd, "dw2")
    plan = ed.optimize(fd, MESH)
    assert kinds(plan) == ["allreduce", "allreduce"]
    assert not plan.buckets and plan.stats["bucket_pairs_offered"] == 0  # not even offered: the estimate says so
