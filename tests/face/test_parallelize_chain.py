"""ed.parallelize of a 6-layer transformers Llama on four gloo processes: the joint training step's plan is stamped
(a window of four layers, egraph_did/chain.py), and the logits and three AdamW steps equal the unsharded model's."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import egraph_did as ed  # noqa: E402

transformers = pytest.importorskip("transformers", reason="the `models` extra (pip install -e '.[models]')")

from face.test_parallelize_models import INIT, KWARGS, TOL, VOCAB, batches, train  # noqa: E402


def make_llama6() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=INIT)
    return transformers.LlamaForCausalLM(cfg).eval()


def work(rank: int) -> dict:
    module = ed.parallelize(make_llama6(), ed.DeviceMesh.arange(4), (batches()[0][0],), kwargs=KWARGS)
    out = train(module)
    out["chain"] = module.joint_plan().joint.stats.get("chain", {}).get("layers")
    return out


def test_a_stamped_six_layer_llama_trains_on_four_gloo_ranks_as_unsharded():
    want = train(make_llama6())
    for rank, got in enumerate(ed.launch(work, nprocs=4, backend="gloo", timeout=300)):
        assert got["chain"] == 6, f"rank {rank}: the joint plan was not stamped"
        torch.testing.assert_close(got["logits"], want["logits"], **TOL, msg=f"rank {rank} logits")
        torch.testing.assert_close(got["losses"], want["losses"], **TOL, msg=f"rank {rank} losses")
