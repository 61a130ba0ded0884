"""Planning a model built on the meta device (issue 27, item 3): no weight is allocated until the plan is
known. from_torch folds the constants a module computes (rotary tables, the causal mask) on the CPU, with
transformers' rotary inverse frequencies recomputed from the config, so a tiny Llama built under
torch.device("meta") exports the program the CPU model exports and its training step is planned alike. Under
ed.parallelize the parameters become meta DTensors in the plan's placements; the README's recipe
(module.to_empty, then each rank copies its slice of the checkpoint) makes them real, and the module then
computes what the CPU model computes. Skipped without transformers (the `models` extra).
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # torch.export imports Triton, whose jit reads this once

import pytest  # noqa: E402
import torch  # noqa: E402

import egraph_did as ed  # noqa: E402
from egraph_did.parallelize import optimize_joint  # noqa: E402

transformers = pytest.importorskip("transformers", reason="the `models` extra (pip install -e '.[models]')")

VOCAB, BATCH, SEQ = 64, 2, 8
KWARGS = {"use_cache": False}
# bytes per device, below what the replicated step holds, so that the plan shards the weights
LIMIT_1 = 300_000  # one layer on 4 ranks
LIMIT_2 = 550_000  # two layers on 2 ranks (the smallest plan found needs 486 KiB)


def make_llama(device: str = "cpu", layers: int = 2) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.2)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg).eval()


def ids(device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).to(device)


def test_a_llama_on_meta_exports_the_cpu_program_and_its_constants():
    cpu = ed.from_torch(make_llama(), (ids(),), KWARGS)
    meta = ed.from_torch(make_llama("meta"), (ids("meta"),), KWARGS)
    assert str(meta) == str(cpu)
    assert meta.constants.keys() == cpu.constants.keys() and len(cpu.constants) == 2  # the rotary cos and sin
    for name, value in cpu.constants.items():
        assert meta.constants[name].device.type == "cpu"
        torch.testing.assert_close(meta.constants[name], value, rtol=0, atol=0)


def test_a_llama_on_meta_plans_its_training_step_as_on_the_cpu():
    """The joint forward + backward plan parallelize makes (4 ranks, a bound that shards; one layer, to keep
    it fast): the same layout for every parameter and the same collectives, no parameter materialized."""
    mesh = ed.DeviceMesh.arange(4)
    plans = {}
    for device in ("cpu", "meta"):
        model = make_llama(device, layers=1)
        fd = ed.from_torch(model, (ids(device),), KWARGS)
        for name in fd.fusion.outputs:
            fd[name].set_device_mesh(mesh)  # delivered whole, as parallelize pins its outputs
        plans[device] = optimize_joint(fd, list(fd.fusion.outputs), list(fd.params), mesh,
                                       ed.CostModel.h200(LIMIT_1)).joint
        assert all(p.is_meta == (device == "meta") for p in model.parameters())
    cpu, meta = plans["cpu"], plans["meta"]
    assert {p: meta.layout_of(p) for p in meta.inputs} == {p: cpu.layout_of(p) for p in cpu.inputs}
    assert any(not layout.is_replicated for layout in map(cpu.layout_of, cpu.inputs))  # the bound shards
    assert [(c.kind, c.tensor, c.bytes) for c in meta.collectives] == [(c.kind, c.tensor, c.bytes)
                                                                        for c in cpu.collectives]
    assert meta.predicted_time == cpu.predicted_time


def work(rank: int) -> dict:
    """Every rank: parallelize the meta model, then load the CPU model's weights into the shards (the README's
    recipe) and run a forward."""
    from torch.distributed.tensor import distribute_tensor

    mesh = ed.DeviceMesh.arange(2)
    module = ed.parallelize(make_llama("meta"), mesh, (ids(),), kwargs=KWARGS, memory_limit=LIMIT_2)
    placements = {n: p.placements for n, p in module.named_parameters()}
    was_meta = all(p.is_meta for p in module.parameters())
    module.to_empty(device="cpu")  # each rank allocates its shards, uninitialized
    checkpoint = make_llama().state_dict()  # stands for the checkpoint file (safetensors, DCP)
    with torch.no_grad():
        for name, p in module.named_parameters():
            mine = distribute_tensor(checkpoint[name], p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(mine.to_local())  # this rank's slice, no communication
    with torch.no_grad():
        logits = module(ids(), **KWARGS).logits
    return {"placements": placements, "was_meta": was_meta, "logits": logits}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return ed.launch(work, nprocs=2, backend="gloo", timeout=300)


def test_parallelize_keeps_a_meta_model_on_meta_and_the_loaded_shards_compute_the_model(ranks):
    want = make_llama()(ids(), **KWARGS).logits
    for got in ranks:
        assert got["was_meta"]
        assert any(p[0].is_shard() for p in got["placements"].values())
        torch.testing.assert_close(got["logits"], want, rtol=1e-5, atol=1e-5)
