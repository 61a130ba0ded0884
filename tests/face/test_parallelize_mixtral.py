"""ed.parallelize on transformers' MixtralForCausalLM, 4 gloo processes (issue 11, item 4): a tiny config
(4 experts, top-2, GQA, 2 layers), random weights, logits and 3 AdamW steps on the cross-entropy of the
logits equal the unsharded model (float32 and float64, rtol 1e-5), as tests/face/test_parallelize_models.py
checks Llama and GPT-2 (its helpers; a launch of its own keeps each file under a minute).

The experts run as transformers' "batched_mm" implementation, the one without data-dependent shapes:
each token's top-2 experts' weights are picked by index ([experts, out, in][ids]: an embedding of the
parameter's rows, sharded or not as the plan says) and applied with bmm. The router's topk is a gather
at the first k of an argsort (fd.ops.argsort). (The default "grouped_mm" sorts tokens by expert, counts
them with histc and runs grouped_mm on per-expert row ranges: tests/face/test_parallelize_mixtral_grouped.py;
"eager" loops over the experts hit, a data-dependent count torch.export refuses.)
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # torch.export imports Triton, whose jit reads this once

import pytest  # noqa: E402
import torch  # noqa: E402

import egraph_did as ed  # noqa: E402

transformers = pytest.importorskip("transformers", reason="the `models` extra (pip install -e '.[models]')")

from face.test_parallelize_models import INIT, KWARGS, TOL, VOCAB, batches, collectives, train  # noqa: E402
from face.test_parallelize import distributed_parameters  # noqa: E402

# bytes per device the training step's joint plan holds, as the optimizer sums its values: the replicated
# plan needs 6.1 MiB, the smallest the optimizer finds 2.24 MiB; the experts hold 3/4 of the parameters, so
# the plan must shard them
LIMIT = 2_400_000
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def make_mixtral(experts: str = "batched_mm") -> torch.nn.Module:
    """The tiny Mixtral, its experts run as transformers' `experts` implementation."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2, initializer_range=INIT,
                                     experts_implementation=experts)
    return transformers.MixtralForCausalLM(cfg).eval()


def work(rank: int) -> dict:
    module = ed.parallelize(make_mixtral(), ed.DeviceMesh.arange(4), (batches()[0][0],), kwargs=KWARGS,
                            memory_limit=LIMIT)
    got = train(module)
    got.update(distributed_parameters(module))
    got["collectives"] = (collectives(module.forward_plan), collectives(module.backward_plan()))
    got["explain"] = module.forward_plan.explain()
    return got


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return ed.launch(work, nprocs=4, backend="gloo", timeout=300)


def assert_trained_like(ranks: list[dict], reference: torch.nn.Module, dtype) -> None:
    """Every rank's logits, losses and parameters after train() equal the unsharded reference's."""
    want = train(reference)
    for got in ranks:
        torch.testing.assert_close(got["logits"].to(dtype), want["logits"], **TOL)
        torch.testing.assert_close(got["losses"].to(dtype), want["losses"], **TOL)
        assert got["params"].keys() == dict(reference.named_parameters()).keys()
        for n, p in reference.named_parameters():
            torch.testing.assert_close(got["params"][n].to(dtype), p.detach(), **TOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_logits_and_three_adamw_steps_equal_the_unsharded_model(ranks, dtype):
    assert_trained_like(ranks, make_mixtral().to(dtype), dtype)


def test_parameters_are_dtensors_and_the_experts_are_sharded_under_the_bound(ranks):
    r = ranks[0]
    assert r["dtensors"] and r["grad_placements"] == r["placements"]
    assert all(got["placements"] == r["placements"] for got in ranks)
    experts = {n: p for n, p in r["placements"].items() if n.endswith(EXPERTS)}
    assert len(experts) == 4 and all(p[0].startswith("S(") for p in experts.values()), experts
    assert r["collectives"][0], "the sharded forward moves data between ranks"


def test_explain_shows_the_routers_argsort_and_no_opaque_step(ranks):
    rows = ranks[0]["explain"].splitlines()
    assert not [line for line in rows if "= opaque(" in line]
    assert len([line for line in rows if "= argsort(" in line]) == 2, rows  # one router per layer
