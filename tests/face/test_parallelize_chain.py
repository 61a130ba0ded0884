"""ed.parallelize of a 6-layer transformers Llama on four gloo processes: the joint training step's plan is stamped
(a window of four layers, egraph_did/chain.py), and the logits and three AdamW steps equal the unsharded model's."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import egraph_did as ed  # noqa: E402

transformers = pytest.importorskip("transformers", reason="the `models` extra (pip install -e '.[models]')")

from face.test_parallelize_models import KWARGS, TOL, batches, make_llama, train  # noqa: E402


def work(rank: int) -> dict:
    module = ed.parallelize(make_llama(layers=6), ed.DeviceMesh.arange(4), (batches()[0][0],), kwargs=KWARGS)
    out = train(module)
    out["chain"] = module.joint_plan().joint.stats.get("chain", {}).get("layers")
    return out


def test_a_stamped_six_layer_llama_trains_on_four_gloo_ranks_as_unsharded():
    want = train(make_llama(layers=6))
    for rank, got in enumerate(ed.launch(work, nprocs=4, backend="gloo", timeout=300)):
        assert got["chain"] == 6, f"rank {rank}: the joint plan was not stamped"
        torch.testing.assert_close(got["logits"], want["logits"], **TOL, msg=f"rank {rank} logits")
        torch.testing.assert_close(got["losses"], want["losses"], **TOL, msg=f"rank {rank} losses")
