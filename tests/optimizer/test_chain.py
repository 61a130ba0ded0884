"""A chain of identical layers planned as a window of four and stamped (egraph_did/chain.py): the stitched plan
equals the whole graph's on small deep programs (both extractors) and computes what one device does; layers
that differ are not merged."""
import torch
import pytest

import egraph_did as ed
from egraph_did import models
from egraph_did.chain import find_chain, stitch, window
from egraph_did.layout import Layout, S
from egraph_did.pins import apply_layout

F64 = torch.float64


def stack(widths, hidden=16, extra_relu_at=None):
    """A residual MLP per width: h + w2 gelu(w1 h), layer i's weights l<i>.w1, l<i>.w2."""
    with ed.FusionDefinition() as fd:
        h = fd.define_tensor((8, hidden), F64, name="x")
        for i, w in enumerate(widths):
            w1 = fd.define_tensor((w, hidden), F64, name=f"l{i}.w1")
            w2 = fd.define_tensor((hidden, w), F64, name=f"l{i}.w2")
            a = fd.ops.gelu(fd.ops.linear(h, w1))
            if i == extra_relu_at:
                a = fd.ops.relu(a)
            h = fd.ops.add(h, fd.ops.linear(a, w2))
        fd.add_output(h, name="y")
    return fd


def training(layers, mesh):
    fd = models.gpt_training_step(2, 16, 32, 4, F64, layers=layers)
    for name in ("x", "target"):
        apply_layout(fd[name], Layout((S(1),)), mesh)
    return fd


def inputs_of(fd, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {tv.name: torch.randn(tv.shape, generator=g, dtype=tv.dtype) for tv in fd.fusion.inputs}
    if "step" in out:
        out["step"] = torch.ones_like(out["step"])
    return {k: v.abs() if k.startswith("exp_avg_sq.") else v for k, v in out.items()}  # second moments: >= 0


def assert_one_device(plan, fd):
    inputs = inputs_of(fd)
    got, want = ed.simulate(plan, inputs), ed.evaluate(fd, inputs)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-9, msg=k)


def kinds(plan):
    return sorted(c.kind for c in plan.collectives)


def test_find_chain_gives_every_layer_of_a_training_step_its_forward_backward_and_update():
    fusion = models.gpt_training_step(1, 16, 32, 2, F64, layers=6).fusion
    chain = find_chain(fusion)
    assert chain.layers == 6
    assert len({len(b) for b in chain.blocks[1:-1]}) == 1  # the middle layers are one program
    in_blocks = {i for b in chain.blocks for i in b}
    shared = [str(e) for i, e in enumerate(fusion.exprs) if i not in in_blocks]
    assert shared == ["next.step = add(step, 1.0)"]  # read by every layer's AdamW: of no layer
    block3 = {o.name for i in chain.blocks[3] for o in fusion.exprs[i].outputs}
    assert {"grad_l3.wq", "next.l3.wq", "next.exp_avg.l3.wq"} <= block3


def test_the_window_holds_the_first_two_middle_and_last_layers():
    fusion = models.gpt_training_step(1, 16, 32, 2, F64, layers=7).fusion
    w = window(find_chain(fusion))
    layers = {t.name.split(".")[0] for t in w.inputs if t.name.startswith("l")}
    assert layers == {"l0", "l1", "l2", "l6"}
    assert {"next.l6.wq", "next.l2.wq", "loss"} <= set(w.outputs) and "next.l4.wq" not in w.outputs


@pytest.mark.parametrize("widths, why", [([32] * 6, None), ([32, 32, 48, 32, 32, 32], "a wider layer"),
                                         ([32] * 4, "too short")])
def test_layers_that_differ_or_too_few_are_not_merged(widths, why):
    chain = find_chain(stack(widths).fusion)
    assert (chain is None) == (why is not None)


def test_a_middle_layer_with_another_op_is_not_merged():
    assert find_chain(stack([32] * 6, extra_relu_at=3).fusion) is None
    plan = ed.optimize(stack([32] * 6, extra_relu_at=3), ed.DeviceMesh.arange(2))
    assert "chain" not in plan.stats


def test_a_middle_layer_pinned_otherwise_is_not_merged():
    fd = stack([32] * 6)
    mesh = ed.DeviceMesh.arange(2)
    _ = fd["l3.w1"].set_device_mesh(mesh)  # only layer 3's weight pinned (replicated)
    assert find_chain(fd.fusion) is None


def test_forward_chain_plan_equals_the_whole_graph_and_one_device():
    mesh = ed.DeviceMesh.arange(4)

    def fd():
        f = models.gpt_layer(2, 16, 32, 4, F64, layers=6)
        for name in ("x", "y"):
            apply_layout(f[name], Layout((S(1),)), mesh)
        return f
    chained, whole = ed.optimize(fd(), mesh), ed.optimize(fd(), mesh, chain=False)
    assert chained.stats["chain"]["layers"] == 6 and "chain" not in whole.stats
    assert chained.predicted_time == pytest.approx(whole.predicted_time, rel=1e-12)
    assert kinds(chained) == kinds(whole)
    assert_one_device(chained, fd())


@pytest.fixture(scope="module")
def greedy_step_plan():
    """The 5-layer training step's stamped plan on 2 ranks by the default extractor (greedy), as the tests that
    read it would make it: made once."""
    mesh = ed.DeviceMesh.arange(2)
    return ed.optimize(training(5, mesh), mesh)


@pytest.mark.parametrize("extractor", ["greedy", "exact"])
def test_training_step_chain_plan_equals_the_whole_graph_with_both_extractors(extractor, request):
    mesh = ed.DeviceMesh.arange(2)
    chained = (request.getfixturevalue("greedy_step_plan") if extractor == "greedy"
               else ed.optimize(training(5, mesh), mesh, extractor=extractor))
    whole = ed.optimize(training(5, mesh), mesh, extractor=extractor, chain=False)
    assert chained.stats["chain"]["layers"] == 5
    assert chained.predicted_time == pytest.approx(whole.predicted_time, rel=1e-9)
    assert kinds(chained) == kinds(whole)
    assert len(chained.steps) == len(whole.steps)
    assert_one_device(chained, training(5, mesh))


def test_stitched_plan_explains_round_trips_and_names_every_layers_tensors(greedy_step_plan):
    """The 5-layer step's stamped plan (the window holds l0, l1, l2 and l4; l3 is stamped): every layer's
    tensors named, the stamped layer's and the last one's in explain()."""
    mesh = ed.DeviceMesh.arange(2)
    fd = training(5, mesh)
    plan = greedy_step_plan
    assert plan.stats["chain"]["layers"] == 5
    assert set(plan.outputs) == set(fd.fusion.outputs)
    assert {f"l{i}.wq" for i in range(5)} <= set(plan.inputs)
    back = ed.Plan.from_json(plan.to_json())
    assert back.predicted_time == pytest.approx(plan.predicted_time) and len(back.steps) == len(plan.steps)
    text = plan.explain()
    assert "grad_l4.wq" in text and "next.l3.w1" in text and "grad_l3.wq" in text and "next.l4.w1" in text
    assert all(c.why for c in plan.collectives)  # each collective says which step reads what it made
    assert plan.memory == plan.memory_breakdown()["total"] > 0


def test_under_a_memory_bound_the_stamped_plan_is_taken_where_it_fits():
    mesh = ed.DeviceMesh.arange(2)
    free = ed.optimize(stack([32] * 6), mesh)
    assert free.stats["chain"]["layers"] == 6
    roomy = ed.optimize(stack([32] * 6), mesh, cost_model=ed.CostModel.h200(memory_limit=free.memory))
    assert roomy.stats["chain"]["layers"] == 6 and roomy.predicted_time == pytest.approx(free.predicted_time)
    assert roomy.cost_model.memory_limit == free.memory
    tight = ed.CostModel.h200(memory_limit=int(free.memory * 0.8))  # the whole graph finds a plan that fits
    bounded = ed.optimize(stack([32] * 6), mesh, cost_model=tight)
    assert "over the bound" in bounded.stats["chain_refused"] and bounded.memory <= tight.memory_limit
    whole = ed.optimize(stack([32] * 6), mesh, cost_model=tight, chain=False)
    assert bounded.predicted_time == pytest.approx(whole.predicted_time)


def test_a_bucket_offer_beside_the_last_layer_is_kept_where_it_was(greedy_step_plan):
    """Llama-3-8B's step on 2x4 offered bucket_pair a pair of a middle layer's and the last layer's norm-weight
    gradients: the last layer's has no counterpart a middle layer reads, and stitching refused the whole window
    (the 32 layers were planned as one graph, 412 s). An offer is not a step: it is kept beside layer L-2."""
    mesh = ed.DeviceMesh.arange(2)
    found = find_chain(training(5, mesh).fusion)
    small = window(found)
    planned = ed.optimize(small, mesh, chain=False)
    planned.buckets.append(["grad_l2.ln1_w", "grad_l4.ln1_w"])
    plan = stitch(planned, found, small)
    assert sorted(p for p in plan.buckets if "grad_l4.ln1_w" in p) == [["grad_l2.ln1_w", "grad_l4.ln1_w"],
                                                                       ["grad_l3.ln1_w", "grad_l4.ln1_w"]]
    assert len(plan.steps) == len(greedy_step_plan.steps)


def test_no_chain_in_a_replay():
    mesh = ed.DeviceMesh.arange(2)
    free = ed.optimize(stack([32] * 6), mesh)
    replay = ed.optimize(stack([32] * 6), mesh, like=free)
    assert "chain" not in replay.stats and replay.predicted_time == pytest.approx(free.predicted_time)


def test_chain_must_be_a_bool():
    with pytest.raises(ed.PlanError, match="chain must be True or False"):
        ed.optimize(stack([32] * 6), ed.DeviceMesh.arange(2), chain="yes")


def test_a_transformers_llama_joint_step_is_stamped_and_equals_the_whole_graph():
    """transformers' Llama (6 layers) exported by from_torch, its forward and backward in one fusion as
    ed.parallelize plans it: layers found from the module's parameter names, the plan stamped, equal to the
    whole graph's and to one device (transformers computes the loss in float32: 1e-6)."""
    transformers = pytest.importorskip("transformers")
    from egraph_did.parallelize import joint_fusion
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

    class Loss(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids, labels):
            return self.lm(ids, labels=labels, use_cache=False).loss
    module = Loss(transformers.LlamaForCausalLM(cfg).to(F64))
    ids = torch.randint(0, 64, (2, 16))
    fd = ed.from_torch(module, (ids, ids))
    mesh = ed.DeviceMesh.arange(2)
    for name in fd.fusion.outputs:
        fd[name].set_device_mesh(mesh)
    joint = joint_fusion(fd, list(fd.fusion.outputs), list(fd.params), {}, mesh)
    chained, whole = ed.optimize(joint, mesh), ed.optimize(joint, mesh, chain=False)
    assert chained.stats["chain"]["layers"] == 6
    assert chained.predicted_time == pytest.approx(whole.predicted_time, rel=1e-9)
    g = torch.Generator().manual_seed(1)
    inputs = {tv.name: torch.randn(tv.shape, dtype=tv.dtype, generator=g) * 0.2 if tv.dtype.is_floating_point
              else torch.randint(0, 64, tv.shape, generator=g).to(tv.dtype) for tv in joint.inputs}
    got, want = ed.simulate(chained, inputs), ed.evaluate(joint, inputs)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=k)
