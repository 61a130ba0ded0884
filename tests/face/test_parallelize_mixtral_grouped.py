"""ed.parallelize on transformers' MixtralForCausalLM with its default experts ("grouped_mm"), 4 gloo
processes (issue 28 item 4): the tiny config of tests/face/test_parallelize_mixtral.py (4 experts, top-2,
2 layers), whose experts sort the tokens by expert (argsort), count them (histc), take offsets (cumsum),
run each expert's rows (grouped_mm, the fallback transformers exports in float32) and un-sort them
(inverse[perm] = arange: an argsort): every step a fusion op, none opaque. Logits and 3 AdamW steps equal
the unsharded model (float32 and float64, rtol 1e-5; the float64 reference runs transformers' fallback:
torch's grouped_mm takes no float64); under the memory bound the experts' weights are sharded.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # torch.export imports Triton, whose jit reads this once

import pytest  # noqa: E402
import torch  # noqa: E402

import egraph_did as ed  # noqa: E402

transformers = pytest.importorskip("transformers", reason="the `models` extra (pip install -e '.[models]')")

from face.test_parallelize_models import KWARGS, batches, collectives, train  # noqa: E402
from face.test_parallelize import distributed_parameters  # noqa: E402
from face.test_parallelize_mixtral import assert_trained_like, make_mixtral  # noqa: E402

# bytes per device of the joint plan: the replicated plan needs about 1 MB here (token rows split, every
# weight whole); under 800 kB the experts' weights are sharded (on their f axis, as the cost model chose at
# these sizes: 32 token rows of 32 features, where expert parallelism's all-reduce of the hidden rows costs
# more than splitting the features; tests/optimizer/test_expert_parallel.py has where it wins)
LIMIT = 800_000
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def work(rank: int) -> dict:
    module = ed.parallelize(make_mixtral("grouped_mm"), ed.DeviceMesh.arange(4), (batches()[0][0],),
                            kwargs=KWARGS, memory_limit=LIMIT)
    got = train(module)
    got.update(distributed_parameters(module))
    got["collectives"] = (collectives(module.forward_plan), collectives(module.backward_plan()))
    plans = (module.forward_plan, module.backward_plan())
    got["memory"] = [p.memory for p in (module.forward_plan, module.backward_plan())]
    got["ops"] = sorted({s.op for p in plans for s in p.compute_steps})
    got["rules"] = sorted({r for p in plans for s in p.compute_steps if s.op.startswith("grouped") for r in s.rules})
    return got


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return ed.launch(work, nprocs=4, backend="gloo", timeout=300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_logits_and_three_adamw_steps_equal_the_unsharded_model(ranks, dtype, monkeypatch):
    if dtype == torch.float64:  # torch's grouped_mm takes no float64: the reference runs transformers' fallback
        from transformers.integrations import moe
        monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *args: False)
    assert_trained_like(ranks, make_mixtral("grouped_mm").to(dtype), dtype)


def test_the_steps_are_fusion_ops_and_the_experts_are_sharded_under_the_bound(ranks):
    r = ranks[0]
    assert "opaque" not in r["ops"] and "opaque_grad" not in r["ops"]
    assert {"argsort", "histc", "grouped_mm", "grouped_mm_wgrad"} <= set(r["ops"]), r["ops"]
    assert r["dtensors"] and r["grad_placements"] == r["placements"]
    assert all(got["placements"] == r["placements"] for got in ranks)
    experts = {n: p for n, p in r["placements"].items() if n.endswith(EXPERTS)}
    assert len(experts) == 4 and all(p[0].startswith("S(") for p in experts.values()), experts
    assert max(r["memory"]) <= LIMIT and r["collectives"][0], r["memory"]
