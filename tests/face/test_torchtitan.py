"""torchtitan's own Llama3 model (torchtitan.models.llama3: fused wqkv, GQA, the complex rotary table of
ComplexRoPE, RMSNorm, SwiGLU) on 4 gloo processes (issue 11, item 4), in one launch:

- through ed.parallelize (tiny: dim 32, 4 heads, 2 KV heads, vocab 64, seq 8): forward logits and 3
  AdamW steps on the cross-entropy equal the unsharded module (float32, relative 1e-5); the parameters are
  DTensors in the forward plan's placements, and a memory bound below the replicated model's makes the
  plan shard them;
- against torchtitan's own tensor parallelism (bench/compare_tp.py's torchtitan section; dim 64, 8 heads,
  4 KV heads so that 4 ranks divide the KV heads, as torchtitan requires): its model.parallelize with
  and without sequence parallel, counted with CommDebugMode, and egraph-did's plan for the same model
  under a memory bound at which it splits every weight matrix as torchtitan does, over a forward (ours
  sends less than either) and over a forward and backward (ed.parallelize's joint plan of the step, run in
  its two parts: no more than either); every logits and gradient checked against the unsharded model
  inside the run.

The module is float32 only: ComplexRoPE computes the rotary product in float32 whatever the model's dtype
(query.float()), so a float64 copy of the module is no float64 reference. Its matrices are drawn with std 0.2
(torchtitan's init draws 0.02): tests/face/test_parallelize_models.py says why AdamW needs it (at 0.02 some
gradients are as small as AdamW's eps, where float32 rounding alone misses the tolerance).
Skipped without torchtitan (scripts/setup.sh installs it with --no-deps).
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # torch.export imports Triton, whose jit reads this once

import pytest  # noqa: E402
import torch  # noqa: E402

import egraph_did as ed  # noqa: E402

pytest.importorskip("torchtitan", reason="torchtitan (scripts/setup.sh: pip install --no-deps torchtitan==0.3.0 ...)")

from bench import compare_tp  # noqa: E402
from face.test_parallelize import distributed_parameters  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
STEPS, LR = 3, 1e-2
INIT = 0.2  # the weight matrices' std: see the module's docstring
VOCAB, BATCH, SEQ = 64, 2, 8
SIZE = dict(dim=32, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, hidden_dim=64, n_layers=2)
# bytes per device the training step's joint plan may hold: between the smallest plan the optimizer finds
# (377 KiB) and the replicated one (842 KiB), so that the plan shards the MLP weights
LIMIT = 450_000


def make_llama3() -> torch.nn.Module:
    """torchtitan's Llama3Model at the tiny size: its own init (seed 0), then every matrix redrawn with std
    INIT from the same seeded stream; the norms keep torchtitan's ones."""
    model = compare_tp.titan_llama3(**SIZE)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(std=INIT)
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, labels) for the forward and each step, the same on every rank."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH * SEQ,), generator=g))
            for _ in range(STEPS + 1)]


def train(module: torch.nn.Module) -> dict:
    """The logits at the first batch, then STEPS AdamW steps on cross_entropy(logits, labels)."""
    data = batches()
    out = {"logits": module(data[0][0]).detach()}
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    losses = []
    for tokens, labels in data[1:]:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(tokens).reshape(-1, VOCAB), labels)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    out["losses"] = torch.stack(losses)
    return out


def work(rank: int, comparison: tuple) -> dict:
    """Every rank: parallelize and train the tiny model, then the collective comparison's gloo part."""
    module = ed.parallelize(make_llama3(), ed.DeviceMesh.arange(4), (batches()[0][0],), memory_limit=LIMIT)
    got = train(module)
    got.update(distributed_parameters(module))
    got["comparison"] = compare_tp.titan3_worker(rank, *comparison)
    return got


@pytest.fixture(scope="module")
def plan_and_fusion():
    """egraph-did's plans for torchtitan's comparison model (tokens replicated, logits vocab-sharded): the
    forward's (bound compare_tp.TITAN_LIMIT) and the training step's joint plan as ed.parallelize makes it
    (bound compare_tp.STEP_LIMIT), chosen here and run on the ranks."""
    plan, fd = compare_tp.titan3_plan(compare_tp.titan_llama3(), compare_tp.titan_tokens())
    return plan, fd, compare_tp.titan3_step_plans(fd)


@pytest.fixture(scope="module")
def ranks(plan_and_fusion) -> list[dict]:
    plan, fd, split = plan_and_fusion
    tokens = compare_tp.titan_tokens()
    plans = {"forward": plan.to_json(), "step": {"first": split.first.to_json(), "second": split.second.to_json()}}
    return ed.launch(work, nprocs=4, backend="gloo", timeout=300, args=((tokens, plans, fd.bind(tokens)),))


def test_logits_and_three_adamw_steps_equal_the_unsharded_model(ranks):
    reference = make_llama3()
    want = train(reference)
    for got in ranks:
        torch.testing.assert_close(got["logits"], want["logits"], **TOL)
        torch.testing.assert_close(got["losses"], want["losses"], **TOL)
        assert got["params"].keys() == dict(reference.named_parameters()).keys()
        for n, p in reference.named_parameters():
            torch.testing.assert_close(got["params"][n], p.detach(), **TOL, msg=lambda m: f"{n}: {m}")


def test_parameters_are_dtensors_the_bound_shards_them_and_grads_share_their_placements(ranks):
    r = ranks[0]
    assert r["dtensors"] and r["grad_placements"] == r["placements"]
    assert all(got["placements"] == r["placements"] for got in ranks)
    sharded = [n for n, p in r["placements"].items() if any(q.startswith("S(") for q in p)]
    assert any("feed_forward" in n for n in sharded), r["placements"]


def test_torchtitans_own_tp_issues_megatrons_collectives_and_gives_the_models_logits(ranks):
    """Per layer two all-reduces (TP) or two all-gathers and two reduce-scatters (SP), the embedding's
    reduction, the final norm's gather (SP); the logits stay vocab-sharded (lm_head: Shard(-1)).
    titan3_worker asserts every logits (torchtitan's and ours) against the unsharded model (rtol 1e-5)."""
    titan = ranks[0]["comparison"]["titan"]
    assert titan["TP"][1] == {"all_reduce": 5}
    assert titan["TP+SP"][1] == {"reduce_scatter_tensor": 5, "all_gather_into_tensor": 5}
    assert titan["TP"][3] == titan["TP+SP"][3] == "(Shard(dim=2),)"


def test_at_the_bound_egraph_did_splits_the_weights_and_sends_no_more_than_torchtitan(ranks, plan_and_fusion):
    """At the bound (compare_tp.TITAN_LIMIT) the plan fits, splits the weight matrices 4 ways but for at most
    two it may keep whole (torchtitan splits all 12), keeps the 5 norms whole as torchtitan does, and sends no
    more than torchtitan; bytes as each rank sends them (phases * (p-1)/p * buffer: an allreduce moves what a
    reduce_scatter and an allgather move). Which two stay whole is the cost model's call under the bound (the
    embedding table, whose split costs an all-to-all, or a wo weight), not the test's. Where the plans differ,
    explain() gives each collective's reason: the step that reads its result."""
    plan, fd, _ = plan_and_fusion
    assert plan.memory <= compare_tp.TITAN_LIMIT
    matrices = [n for n in fd.params if fd[n].ndim == 2]
    split = [n for n in matrices if "DID" in plan.loop_domain(n)]
    assert len(matrices) == 12 and len(split) >= 10, split
    assert all("DIDx{4}" in plan.loop_domain(n) for n in split), split
    assert [n for n in split if "feed_forward" in n or "wqkv" in n] == [n for n in matrices if "feed_forward" in n or "wqkv" in n]
    assert not any("DID" in plan.loop_domain(n) for n in fd.params if fd[n].ndim == 1)
    ours = compare_tp.plan_records(plan)
    for variant, (records, _, _, _) in ranks[0]["comparison"]["titan"].items():
        assert compare_tp.total(ours) <= compare_tp.total(records), (variant, compare_tp.summary(ours))
    explained = plan.explain().splitlines()
    for c in plan.collectives:
        assert any(f"{c.kind}[" in line and f"{c.tensor}:" in line and " reads " in line for line in explained), c


def _step_totals(ranks, plan_and_fusion) -> tuple[float, dict[str, float]]:
    """What each rank sends over a forward and backward: ours (the joint plan's two parts), torchtitan's
    per variant (counted, plus the allreduces its Partial gradients still need). titan3_worker asserts
    every gradient, torchtitan's and ours, against the unsharded model's (rtol 1e-5)."""
    _, _, split = plan_and_fusion
    ours = compare_tp.total(compare_tp.plan_records(split.first) + compare_tp.plan_records(split.second))
    return ours, {v: compare_tp.total(records) for v, (records, _) in ranks[0]["comparison"]["step"].items()}


def test_the_step_is_one_plan_split_in_two_each_step_run_once(plan_and_fusion):
    """The forward part and the backward part are the joint plan's steps, each once; the forward saves the
    values the backward reads, and the parameters and gradients share their placements."""
    _, fd, split = plan_and_fusion
    assert len(split.first.steps) + len(split.second.steps) == len(split.joint.steps)
    assert {id(s) for s in split.first.steps}.isdisjoint(id(s) for s in split.second.steps)
    assert split.saved and all(f"saved.{v}" in split.second.inputs for v in split.saved)
    for p in fd.params:
        assert split.joint.layout_of(f"grad_{p}") == split.joint.layout_of(p), p
    assert "saves" in split.explain()


def test_forward_and_backward_egraph_did_sends_less_than_torchtitans_tp_without_sp(ranks, plan_and_fusion):
    """Without sequence parallel torchtitan's backward (partial_dtensor) gathers activations and leaves the
    wo, w2 and norm gradients Partial: more than ours."""
    ours, titan = _step_totals(ranks, plan_and_fusion)
    assert ours <= titan["TP"], (ours, titan)


def test_forward_and_backward_egraph_did_sends_no_more_than_torchtitans_tp_with_sp(ranks, plan_and_fusion):
    """One joint plan of the step, optimized under the step's memory bound: it splits every weight matrix
    torchtitan splits column-wise and the embedding and head, keeps whole only row-parallel ones (wo, w2)
    where the bound leaves room (their collectives saved), and sends no more than torchtitan's
    sequence-parallel forward and backward."""
    _, fd, split = plan_and_fusion
    assert split.joint.memory <= compare_tp.STEP_LIMIT
    whole = [n for n in fd.params if fd[n].ndim == 2 and "DID" not in split.joint.loop_domain(n)]
    assert all(n.endswith(("attention.wo.weight", "feed_forward.w2.weight")) for n in whole), whole
    ours, titan = _step_totals(ranks, plan_and_fusion)
    assert ours <= titan["TP+SP"], (ours, titan)
