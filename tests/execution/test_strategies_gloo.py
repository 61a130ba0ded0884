"""A 2-layer Llama training step on four gloo processes with issue 28's strategies, equal to one device (issue
28, "Runs"). transformers' LlamaForCausalLM (GQA 4/2 heads, rotary embeddings, RMSNorm, SwiGLU) exported by
ed.from_torch, its loss and every parameter's gradient in one fusion (ed.grad). The plans are made at real
shapes, where the strategies pay (bf16, vocab 32000, 2 x 2048 tokens, on the meta device: nothing
allocated), and replayed at small float64 ones (vocab 70: shards of 18, 18, 18 and 16 classes; 2 x 10
tokens; head_dim 12) through optimize(like=); the replays run on four gloo ranks and every rank's loss and gradients
equal transformers' own float64 forward and backward (rtol 1e-5, atol 1e-6: transformers computes the loss
in float32, whose sums the plan splits over the vocabulary shards; the largest difference measured is 4.8e-7
of gradients up to 5.3, and ed.evaluate of the same fusion on one device is 6e-8 from transformers).

- vocab-parallel cross-entropy, pinned (the lm head and its gradient split on the vocabulary, as
  torchtitan's loss_parallel) and chosen (every parameter free: the cost model splits the lm head itself):
  the logits are never moved, only per-row statistics (a pending max, pending sums, the target's logit
  masked per rank);
- flash attention in both: the attention is sdpa_lse forward and sdpa_backward, and no value of the plan
  is [.., seq, seq].

What a pin does not force here (tests/optimizer has the goldens where each strategy wins on its own): at
vocab 2048 a lm head pinned split is all-gathered (1 MiB) and the loss runs on whole logits; pinning the
keys and values of attention split on the sequence (context parallelism) at 16k tokens gathers them (8 MiB
each) for query-sequence attention, which the cost model prefers to attention_blocks' gathered queries."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # torch.export imports Triton, whose jit reads this once

import pytest  # noqa: E402
import torch  # noqa: E402

import egraph_did as ed  # noqa: E402
from egraph_did.layout import Layout  # noqa: E402
from egraph_did.pins import apply_layout  # noqa: E402

from gloo_replay import MESH, assert_ranks_equal, replay, run_on_gloo  # noqa: E402

transformers = pytest.importorskip("transformers", reason="the `models` extra (pip install -e '.[models]')")

F64, BF16 = torch.float64, torch.bfloat16
BIG = dict(vocab=32000, hidden=256, inter=512, batch=2, seq=2048)
SMALL = dict(vocab=70, hidden=48, inter=96, batch=2, seq=10)
LM_HEAD = "lm.lm_head.weight"
VOCAB_PARALLEL = {"amax_over_sharded_axis", "sum_over_sharded_axis", "take_along_sharded_axis"}
TOL = dict(rtol=1e-5, atol=1e-6)  # the loss in float32 (transformers' cast): 4.8e-7 at most, measured


class Loss(torch.nn.Module):
    """The causal LM's loss alone (its one output, delivered whole)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, labels):
        return self.lm(ids, labels=labels, use_cache=False).loss


def llama(vocab, hidden, inter, seq, dtype, device) -> Loss:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(seq, 64),
                                   initializer_range=0.2)
    with torch.device(device):
        return Loss(transformers.LlamaForCausalLM(cfg).to(dtype))


def export(vocab, hidden, inter, batch, seq, dtype, device) -> tuple[Loss, ed.FusionDefinition]:
    module = llama(vocab, hidden, inter, seq, dtype, device)
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    return module, ed.from_torch(module, (ids, ids + 1))


def step(fd, pinned: bool):
    """The step: loss `out` (whole) and grad_<p> of every parameter; pinned: the lm head and its gradient
    split on the vocabulary."""
    g = ed.grad(fd, "out", list(fd.params))
    g["out"].set_device_mesh(MESH)
    if pinned:
        for name in (LM_HEAD, "grad_" + LM_HEAD):
            apply_layout(g[name], Layout.parse("[S(0)]"), MESH)
    return g


def reference(module, fd, plan) -> tuple[dict, dict]:
    """The step's inputs (the module's weights, constants, random ids and labels) and transformers' float64
    loss and gradients."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab"], (SMALL["batch"], SMALL["seq"]), generator=gen)
    labels = torch.randint(0, SMALL["vocab"], ids.shape, generator=gen)
    inputs = {"ids": ids, "labels": labels, **fd.constants}
    inputs.update({p: module.get_parameter(p).detach() for p in fd.params})
    assert set(plan.inputs) <= set(inputs), set(plan.inputs) - set(inputs)
    module.zero_grad()
    loss = module(ids, labels)
    loss.backward()
    return inputs, {"out": loss.detach(), **{"grad_" + p: module.get_parameter(p).grad for p in fd.params}}


def uses_the_strategies(plan, vocab: int, seq: int) -> None:
    """vocab parallel: the lm head split on the vocabulary, the loss by row statistics, no collective on a
    tensor of vocab columns; flash attention: sdpa_lse and sdpa_backward, nothing [.., seq, seq]."""
    rules = {r for s in plan.compute_steps for r in s.rules}
    assert VOCAB_PARALLEL <= rules, (VOCAB_PARALLEL - rules, plan.explain())
    assert str(plan.layout_of(LM_HEAD)) == "[S(0)]" and str(plan.layout_of("grad_" + LM_HEAD)) == "[S(0)]"
    moved = [c for c in plan.collectives if plan.values[c.src].shape[-1] == vocab]
    assert not moved, [str(c) for c in moved]
    assert {"sdpa_lse", "sdpa_backward"} <= {s.op for s in plan.compute_steps}
    square = [v for v in plan.values.values() if tuple(v.shape[-2:]) == (seq, seq)]
    assert not square, square


def test_a_two_layer_llama_step_with_vocab_parallel_loss_pinned_and_chosen_equals_one_device_on_four_gloo_ranks():
    (_, big), (module, small) = export(**BIG, dtype=BF16, device="meta"), export(**SMALL, dtype=F64, device="cpu")
    plans, inputs, want = {}, {}, {}
    for name, pinned in (("pinned", True), ("chosen", False)):
        plans[name] = replay(step(big, pinned), step(small, pinned))
        uses_the_strategies(plans[name], SMALL["vocab"], SMALL["seq"])
        inputs[name], want[name] = reference(module, small, plans[name])
    assert_ranks_equal(run_on_gloo(plans, inputs), want, **TOL)
