"""merge_siblings on four gloo processes: the golden plans of tests/optimizer/test_rewrite_golden.py (gate
and up in one GEMM and one reduce_scatter; three projections in one GEMM and one all-reduce; GQA's q, k
and v of widths 8, 2 and 2 heads in one GEMM and one all-reduce), replayed at small float32 shapes with
uneven shards (hidden 10 splits 3, 3, 3, 1; 7 tokens 2, 2, 2, 1), give the single-device reference on
every rank: each rank's stacked weight rows are its own rows of every sibling. One launch runs the plans."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import egraph_did as ed
from egraph_did.launcher import launch
from egraph_did.plan import Plan
from egraph_did.runtime import run_plan

sys.path.insert(0, str(Path(__file__).parents[1] / "optimizer"))
from test_rewrite_golden import GQA, GQA_SMALL, MESH, linears, siblings  # noqa: E402


def run_both(rank: int, jobs: dict) -> dict:
    return {name: run_plan(Plan.from_json(plan), inputs) for name, (plan, inputs) in jobs.items()}


@pytest.fixture(scope="module")
def cases():
    """name -> (small plan, inputs, reference): layouts chosen at the golden bf16 shapes."""
    specs = {"gate_up": (("g", "u"), True, (8192, 4096, 128), (7, 10, 5)),
             "qkv": (("q", "k", "v"), False, (8192, 4096, 64), (7, 10, 3)),
             "gqa": (("q", "k", "v"), False, (8192, 4096, GQA), (7, 10, GQA_SMALL))}
    out = {}
    for name, (names, glu, big, small) in specs.items():
        fd = siblings(*small, names, torch.float32, glu=glu)
        plan = ed.optimize(fd, MESH, like=ed.optimize(siblings(*big, names, glu=glu), MESH))
        g = torch.Generator().manual_seed(0)
        inputs = {t.name: torch.randn(t.shape, generator=g) for t in fd.fusion.inputs}
        out[name] = (plan, inputs, ed.evaluate(fd, inputs))
    return out


def test_merged_siblings_on_four_gloo_ranks_equal_the_reference(cases):
    for plan, _, _ in cases.values():
        assert len(linears(plan)) == 1 and len(plan.collectives) == 1
    assert set(cases["gqa"][0].rewrites.values()) == {"merge_siblings"}
    results = launch(run_both, nprocs=4, args=({n: (p.to_json(), i) for n, (p, i, _) in cases.items()},), timeout=120)
    for rank, got in enumerate(results):
        for name, (_, _, ref) in cases.items():
            for out, want in ref.items():
                torch.testing.assert_close(got[name][out], want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{name}.{out} on rank {rank}: {m}")
