"""2-layer Llama and Mixtral training steps on four gloo processes with issue 28's strategies, equal to one
device (issue 28, "Runs"). transformers' LlamaForCausalLM (GQA 4/2 heads, rotary embeddings, RMSNorm,
SwiGLU) and MixtralForCausalLM (the same attention, 8 experts of top-2 routing through argsort, histc and
grouped_mm) exported by ed.from_torch, the loss and every parameter's gradient in one fusion (ed.grad). The
plans are made at real shapes, where the strategies pay: Llama in bf16, vocab 32000, 2 x 2048 tokens, on the
meta device (nothing allocated); Mixtral in float64 on the CPU, hidden 512, experts' width 1024, 64 tokens
(its export follows the device and dtype, and a replay needs the same ops). They are replayed at small
float64 shapes through optimize(like=) (vocab 70: shards of 18, 18, 18 and 16 classes; 2 x 10 tokens; head_dim
12; experts 8, hidden 48, width 96) and run on four gloo ranks in one launch; every rank's loss and gradients
equal transformers' own float64 forward and backward (rtol 1e-5, atol 1e-6: transformers computes the loss
in float32, whose sums the plan splits over the vocabulary shards; the largest difference measured is 4.8e-7
of gradients up to 5.3, and ed.evaluate of the same fusion on one device is 6e-8 from transformers). The
optimizer's update is not in these plans (ed.parallelize runs torch.optim on the gradients' shards).

- vocab-parallel cross-entropy, pinned (the lm head and its gradient split on the vocabulary, as
  torchtitan's loss_parallel) and chosen (every parameter free: the cost model splits the lm head itself):
  no collective moves a tensor of vocab columns, only per-row statistics (a pending max, pending sums, the
  target's logit masked per rank);
- flash attention in both: the attention is sdpa_lse forward and sdpa_backward, and no value of the plan
  is [.., seq, seq];
- expert parallelism, pinned (the experts' weights and gradients split on the experts): each rank runs the
  rows of its own experts (grouped_mm_experts) and their weight gradients (grouped_wgrad_experts), and no
  [experts, ..] tensor moves;
- context parallelism, chosen: with 2 query heads and 1 key/value head (fewer heads than ranks) at 32768
  tokens of one sequence the cost model runs attention as rings over the sequence, forward and backward
  (ring attention's kv_ring and dkv_ring), replayed at 16 tokens.

What neither a pin nor the cost model gives here (tests/optimizer has the goldens where each wins on its
own; measured at this session's code): at vocab 2048 a lm head pinned split is all-gathered (1 MiB) and the
loss runs on whole logits; context parallelism with 4 heads: the keys and values of Llama's attention pinned split on
the sequence at 16k tokens are gathered (8 MiB each) for query-sequence attention, and free, the plan splits
heads (Ulysses' all-to-alls, with 4 key/value heads) or the queries (GQA); at 32768 tokens of one sequence,
free, the plan splits the 4 heads (7.548 ms predicted; the causal ring wins where k and v stay split on the
sequence: tests/optimizer/test_ring_attention.py's causal golden); expert parallelism with the
experts' weights free (their f axis is split instead: tests/face/test_parallelize_mixtral_grouped.py): expert
rows (Pe) keep the hidden rows and their gradients on their ranks (silu's gradient is one op, silu_backward,
zero where its gradient operand is), but on NVLink the free step still shards the experts' features
(bench/results_expert_parallel_choice.txt: at Mixtral 8x7B's sizes the free step runs expert parallel over
InfiniBand only, tests/optimizer/test_expert_parallel.py)."""
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
# Mixtral's plan is made on the CPU in float64: its export follows the device and dtype (on meta, histc counts
# int ids and cumsum needs no cast; in bf16 the experts' sum is cast back), and a replay needs the same ops
MOE_BIG = dict(vocab=512, hidden=512, inter=1024, batch=1, seq=64)
EXPERTS = 8
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


def llama(vocab, hidden, inter, seq, dtype, device, heads=4, kv_heads=2) -> Loss:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=max(seq, 64), initializer_range=0.2)
    with torch.device(device):
        return Loss(transformers.LlamaForCausalLM(cfg).to(dtype))


def mixtral(vocab, hidden, inter, seq, dtype, device) -> Loss:
    """Llama's attention, 8 experts of top-2 routing (transformers' grouped experts: argsort, histc, grouped_mm)."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(seq, 64),
                                     num_local_experts=EXPERTS, num_experts_per_tok=2, initializer_range=0.2,
                                     experts_implementation="grouped_mm")
    with torch.device(device):
        return Loss(transformers.MixtralForCausalLM(cfg).to(dtype))


def export(make, vocab, hidden, inter, batch, seq, dtype, device, **heads) -> tuple[Loss, ed.FusionDefinition]:
    module = make(vocab, hidden, inter, seq, dtype, device, **heads)
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    return module, ed.from_torch(module, (ids, ids + 1))


def step(fd, pinned: tuple[str, ...] = ()):
    """The step: loss `out` (whole) and grad_<p> of every parameter; each parameter in `pinned` and its
    gradient split on their first axis."""
    g = ed.grad(fd, "out", list(fd.params))
    g["out"].set_device_mesh(MESH)
    for name in pinned:
        for t in (name, "grad_" + name):
            apply_layout(g[t], Layout.parse("[S(0)]"), MESH)
    return g


def reference(module, fd, plan, batch=SMALL["batch"], seq=SMALL["seq"]) -> tuple[dict, dict]:
    """The step's inputs (the module's weights, constants, random ids and labels) and transformers' float64
    loss and gradients."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab"], (batch, seq), generator=gen)
    labels = torch.randint(0, SMALL["vocab"], ids.shape, generator=gen)
    inputs = {"ids": ids, "labels": labels, **fd.constants}
    inputs.update({p: module.get_parameter(p).detach() for p in fd.params})
    assert set(plan.inputs) <= set(inputs), set(plan.inputs) - set(inputs)
    module.zero_grad()
    loss = module(ids, labels)
    loss.backward()
    return inputs, {"out": loss.detach(), **{"grad_" + p: module.get_parameter(p).grad for p in fd.params}}


def expert_parallel(plan) -> None:
    """each rank runs the rows of its own experts and their weight gradients (from its own rows, or from the
    rows dispatched to it: expert_dispatch_wgrad); no expert weight moves"""
    rules = {r for s in plan.compute_steps for r in s.rules}
    assert "grouped_mm_experts" in rules and rules & {"grouped_wgrad_experts", "expert_dispatch_wgrad"}, plan.explain()
    shapes = {str(c): plan.values[c.src].shape for c in plan.collectives}
    moved = [c for c, shape in shapes.items() if len(shape) == 3 and shape[0] == EXPERTS]
    assert not moved, moved


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


def strategy_plans() -> tuple[dict, dict, dict]:
    """The vocab-parallel (pinned, chosen) and expert-parallel replays, each checked for its strategy, with
    their inputs and transformers' loss and gradients: (plans, inputs, want) by name."""
    (_, big), (llama_small, small) = (export(llama, **BIG, dtype=BF16, device="meta"),
                                      export(llama, **SMALL, dtype=F64, device="cpu"))
    (_, moe_big), (moe_small, small_moe) = (export(mixtral, **MOE_BIG, dtype=F64, device="cpu"),
                                            export(mixtral, **SMALL, dtype=F64, device="cpu"))
    experts = tuple(p for p in small_moe.params if ".experts." in p)
    plans, inputs, want = {}, {}, {}
    for name, pins in (("vocab parallel pinned", (LM_HEAD,)), ("vocab parallel chosen", ())):
        plans[name] = replay(step(big, pins), step(small, pins))
        uses_the_strategies(plans[name], SMALL["vocab"], SMALL["seq"])
        inputs[name], want[name] = reference(llama_small, small, plans[name])
    plans["experts pinned"] = replay(step(moe_big, experts), step(small_moe, experts))
    expert_parallel(plans["experts pinned"])
    inputs["experts pinned"], want["experts pinned"] = reference(moe_small, small_moe, plans["experts pinned"])
    return plans, inputs, want


def ring_plan() -> tuple[dict, dict, dict]:
    """Context parallelism chosen, not pinned: Llama with 2 query heads and 1 key/value head on 4 ranks cannot
    split its heads, so at 32768 tokens of one sequence (bf16, meta) the cost model runs attention as rings
    over the sequence, forward (kv_ring) and backward (dkv_ring), every parameter free. Replayed on 16 tokens
    (4 a rank, head_dim 24). Not 12 tokens: the rotary embedding's halves of head_dim 24 are [.., 12, 12]
    there, which the check for attention scores [.., seq, seq] cannot tell apart. The bf16 plan replays in
    float64 since merge_siblings judges a replay at the plan's dtypes too (tests/rewrites/
    test_program_rewrites.py). Checked for its rings: (plans, inputs, want) of "context parallel chosen"."""
    heads, seq = dict(heads=2, kv_heads=1), 16
    _, big = export(llama, **dict(BIG, hidden=256, batch=1, seq=32768), dtype=BF16, device="meta", **heads)
    small_dims = dict(SMALL, batch=1, seq=seq)
    module, small = export(llama, **small_dims, dtype=F64, device="cpu", **heads)
    plan = replay(step(big), step(small))
    rings = sorted(f for s in plan.compute_steps for f, _ in s.flags if f in ("kv_ring", "dkv_ring"))
    assert rings == ["dkv_ring", "dkv_ring", "kv_ring", "kv_ring"], plan.explain()  # both layers, both directions
    square = [v for v in plan.values.values() if tuple(v.shape[-2:]) == (seq, seq)]
    assert not square, square
    inputs, want = reference(module, small, plan, batch=1, seq=seq)
    name = "context parallel chosen"
    return {name: plan}, {name: inputs}, {name: want}


@pytest.fixture(scope="module")
def runs():
    """Every plan of both tests run on four gloo ranks in one launch (a launch's start-up, four processes
    importing torch, is seconds of the module's time): (want by plan name, per-rank results). The plans are
    checked for their strategies as they are made: a plan without its strategy fails both tests here."""
    with pytest.MonkeyPatch.context() as mp:
        from transformers.integrations import moe
        mp.setattr(moe, "_can_use_grouped_mm", lambda *args: False)  # transformers' fallback: float64 runs
        plans, inputs, want = strategy_plans()
    for part, more in zip((plans, inputs, want), ring_plan()):
        part.update(more)
    return want, run_on_gloo(plans, inputs)


def _ranks_equal(runs, names) -> None:
    want, results = runs
    assert_ranks_equal([{n: got[n] for n in names} for got in results], {n: want[n] for n in names}, **TOL)


def test_two_layer_llama_and_mixtral_steps_with_the_strategies_pinned_and_chosen_equal_one_device_on_four_gloo_ranks(
        runs):
    _ranks_equal(runs, ("vocab parallel pinned", "vocab parallel chosen", "experts pinned"))


def test_llama_with_fewer_heads_than_ranks_at_32k_tokens_chooses_ring_attention_equal_one_device_on_four_gloo_ranks(
        runs):
    """ring_plan's context parallel plan on four gloo ranks equals transformers' float64 step."""
    _ranks_equal(runs, ("context parallel chosen",))
