"""Program rewrites (rewrites/algebra.py): every term a rewrite adds evaluates equal to the tensor it
joins, on every example (float64, random inputs); a rewrite applies to the program, never to its own
results; names are checked."""
import pytest
import torch

import egraph_did as ed
from egraph_did.errors import PlanError
from egraph_did.cost import CostModel
from egraph_did.evaluate import evaluate
from egraph_did.expand import RewriteSet, check_rewrites, expand
from egraph_did.problem import clone_fusion
from egraph_did.models import row_sum
from egraph_did.rewrites.algebra import REWRITES

EXAMPLES = [(name, ex) for name, rw in sorted(REWRITES.items()) for ex in rw.examples]


def example_fusion(ex):
    with ed.FusionDefinition() as fd:
        tensors = [fd.define_tensor(shape, torch.float64, name=n) for n, shape in ex.inputs.items()]
        outs = ex.build(fd.ops, *tensors)
        for i, out in enumerate(outs if isinstance(outs, tuple) else (outs,)):
            fd.add_output(out, name=f"out{i}")
    return fd


@pytest.mark.parametrize("name,ex", EXAMPLES, ids=[f"{n}-{ex.name}" for n, ex in EXAMPLES])
def test_every_added_term_equals_the_tensor_it_joins(name, ex):
    fd = example_fusion(ex)
    work, ops = clone_fusion(fd.fusion)
    before = len(work.exprs)
    outs = list(work.outputs.values())
    added = expand(work, ops, RewriteSet((name,), tuple((outs[i].name, outs[j].name) for i, j in ex.buckets)))
    assert added and all(eq.rewrite == name for eq in added), "the example must exercise the rewrite"
    made = {o.name for e in work.exprs[before:] for o in e.outputs}  # a multi-output op makes several terms
    assert {eq.new for eq in added} <= made and 0 < len(work.exprs) - before <= len(added)
    joined = [eq for eq in added if eq.old is not None]
    assert joined, "a rewrite adds a program equal to some tensor of the program"
    for eq in joined:
        work.outputs[f"new:{eq.new}"] = work.tensors[eq.new]
        work.outputs[f"old:{eq.old}"] = work.tensors[eq.old]
    g = torch.Generator().manual_seed(0)
    inputs = {t.name: torch.randn(t.shape, generator=g, dtype=torch.float64) for t in work.inputs}
    got = evaluate(work, inputs)
    for eq in joined:
        torch.testing.assert_close(got[f"new:{eq.new}"], got[f"old:{eq.old}"], rtol=1e-12, atol=1e-12)


def test_a_rewrite_never_applies_to_its_own_terms():
    """A chain of n adds gains one bracketing per add of the program, not every bracketing."""
    with ed.FusionDefinition() as fd:
        xs = [fd.define_tensor((3,), name=f"x{i}") for i in range(6)]
        h = xs[0]
        for x in xs[1:]:
            h = fd.ops.add(h, x)
        fd.add_output(h, name="y")
    work, ops = clone_fusion(fd.fusion)
    added = expand(work, ops, ["sum_partials_first"])
    assert len([eq for eq in added if eq.old is not None]) == 4  # (h + x) + x' for 4 of the 5 adds
    assert len(added) == 8  # each with its one new inner add


def test_numbers_and_other_shapes_are_left_alone():
    """x + a + 1.0 is not reassociated (a number is no tensor); nor a broadcast bias (another shape)."""
    with ed.FusionDefinition() as fd:
        x, a, b = fd.define_tensor((3, 4), name="x"), fd.define_tensor((3, 4), name="a"), fd.define_tensor((4,), name="b")
        fd.add_output(fd.ops.add(fd.ops.add(x, a), 1.0), name="y")
        fd.add_output(fd.ops.add(fd.ops.add(x, a), b), name="z")
    work, ops = clone_fusion(fd.fusion)
    assert expand(work, ops, ["sum_partials_first"]) == []


def three_sums(n, m, k):
    """Three add chains over tensors of three shapes, whose reassociated terms sum_partials_first adds; at
    n = m = k the three shapes are one."""
    with ed.FusionDefinition() as fd:
        x, a, b = (fd.define_tensor((n, m), name=name) for name in "xab")
        w, u = (fd.define_tensor((k, m), name=name) for name in "wu")
        z = fd.define_tensor((k, n), name="z")
        y1 = fd.ops.add(fd.ops.add(x, a), b)
        h = fd.ops.add(fd.ops.add(fd.ops.linear(x, w), fd.ops.linear(a, w)), fd.ops.linear(b, u))
        y2 = fd.ops.add(fd.ops.add(w, u), fd.ops.matmul(z, y1))
        for name, t in (("y1", y1), ("h", h), ("y2", y2)):
            fd.add_output(t, name=name)
    return fd


def test_rewritten_terms_are_named_alike_at_any_shapes():
    """The new tensors' names follow the program, not egglog's rows (whose order the shape literals move):
    a plan made at large shapes and replayed at small ones (optimize(like=)) finds its rewritten terms
    under the names it chose them by. Before, the names of the six new adds were permuted between the two
    shapes here, and the replay refused its own pins ("y1: no layout in ['[R]'] is reachable"): transformers'
    Llama step did the same on the gradient of embed_tokens."""
    def terms(fd):
        work, ops = clone_fusion(fd.fusion)
        expand(work, ops, ["sum_partials_first"])
        return {e.outputs[0].name: (e.op.name, [v.name for _, v in e.args if hasattr(v, "logical_domain")])
                for e in work.exprs[len(fd.fusion.exprs):]}
    small, big = three_sums(8, 8, 8), three_sums(64, 96, 128)
    assert len(terms(big)) == 6 and terms(small) == terms(big)
    mesh = ed.DeviceMesh.arange(4)
    for fd in (small, big):
        for name in ("y1", "h", "y2"):
            fd[name].set_device_mesh(mesh)
    plan = ed.optimize(big, mesh)
    assert any(s.key not in big.fusion.tensors for s in plan.compute_steps), "the plan takes a rewritten term"
    replay = ed.optimize(small, mesh, like=plan)
    assert sorted((s.key, s.op) for s in replay.compute_steps) == sorted((s.key, s.op) for s in plan.compute_steps)
    g = torch.Generator().manual_seed(0)
    inputs = {t.name: torch.randn(t.shape, generator=g) for t in small.fusion.inputs}
    want, got = evaluate(small, inputs), ed.simulate(replay, inputs)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


def test_a_replay_in_another_dtype_merges_the_siblings_the_plan_merged():
    """merge_siblings offers a set only where merge_can_pay's best case pays, judged at the like plan's shapes
    and dtypes: SwiGLU's gate and up at 32768 x 256 tokens in bf16 pay, in float64 (4x the bytes against the
    same launches and latencies) not. A bf16 plan replayed in float64 judged at the plan's shapes but 8-byte
    elements gained none of the merge's ten terms, so every later rewritten term shifted its name: the Llama
    step of tests/execution/test_strategies_gloo.py (2 heads, 32768 tokens) replayed the plan's [S(2)] of a
    sum of attention outputs [1, 1, 32768, 128] on RMSNorm's mean [1, 12, 1] of the same name, and refused."""
    mesh = ed.DeviceMesh.arange(4)

    def swiglu(tokens, hidden, width, dtype):
        with ed.FusionDefinition() as fd:
            x = fd.define_tensor((tokens, hidden), dtype, name="x")
            gate = fd.ops.linear(x, fd.define_tensor((width, hidden), dtype, name="w_gate"))
            up = fd.ops.linear(x, fd.define_tensor((width, hidden), dtype, name="w_up"))
            fd.add_output(fd.ops.mul(fd.ops.silu(gate), up), name="y")
        return fd

    def terms(fd, like=None):
        work, ops = clone_fusion(fd.fusion)
        expand(work, ops, ["merge_siblings"], mesh, CostModel.h200(), like)
        return [(e.outputs[0].name, e.op.name) for e in work.exprs[len(fd.fusion.exprs):]]
    big, small = swiglu(32768, 256, 512, torch.bfloat16), swiglu(12, 48, 96, torch.float64)
    assert terms(swiglu(32768, 256, 512, torch.float64)) == []  # float64 at the plan's shapes: no merge pays
    assert len(terms(big)) == 10  # the weights' views and stack, one GEMM, its view and two slices' views
    assert terms(small, like=ed.optimize(big, mesh, rewrites=())) == terms(big)


def test_a_replay_whose_fusion_lacks_a_bucketed_tensor_says_the_plan_is_of_another_program():
    """optimize(like=) offers the like plan's bucket pairs; a fusion without one of the tensors (transformers'
    Llama exported in float32 has no cast where the bf16 plan's names sum_504) was a KeyError."""
    work, ops = clone_fusion(row_sum(8, 64).fusion)
    with pytest.raises(PlanError, match="sends x and sum_504 in one buffer.*no sum_504.*another program"):
        expand(work, ops, RewriteSet(("bucket_pair",), (("x", "sum_504"),)))


def test_a_replay_of_a_plan_of_another_program_says_so():
    """optimize(like=) keeps the strategies the plan used, by tensor name: where this fusion computes a name by
    another op, the replay refused with "no layout is reachable"; now it names the tensor and both ops."""
    mesh = ed.DeviceMesh.arange(2)

    def fusion(op, rows):
        with ed.FusionDefinition() as fd:
            x = fd.define_tensor((rows, 8), name="x")
            fd.add_output(getattr(fd.ops, op)(fd.ops.sum(x, 1)), name="y")
        fd["y"].set_device_mesh(mesh)
        return fd
    plan = ed.optimize(fusion("relu", 64), mesh)
    assert ed.optimize(fusion("relu", 4), mesh, like=plan).loop_domain("y")
    with pytest.raises(PlanError, match="plan computes y by relu, this fusion by exp.*another program"):
        ed.optimize(fusion("exp", 4), mesh, like=plan)


def test_a_replay_whose_name_holds_a_term_of_other_rank_says_so():
    """The same op under the plan's name is not enough: where it is another term (here relu of x [4, 8], the
    plan's of a row sum [64]), the plan's strategies for it are another term's. As a Llama replay whose
    rewritten terms were named differently showed, that refused far from the cause (an output unreachable);
    now it names the tensor and both terms' shapes."""
    mesh = ed.DeviceMesh.arange(2)

    def fusion(rows, summed):
        with ed.FusionDefinition() as fd:
            x = fd.define_tensor((rows, 8), name="x")
            fd.add_output(fd.ops.relu(fd.ops.sum(x, 1) if summed else x), name="y")
        fd["y"].set_device_mesh(mesh)
        return fd
    plan = ed.optimize(fusion(64, summed=True), mesh)
    with pytest.raises(PlanError, match=r"plan computes y by relu of shapes \[\[64\], \[64\]\], this fusion by relu of "
                                        r"\[\[4, 8\], \[4, 8\]\].*named their terms differently"):
        ed.optimize(fusion(4, summed=False), mesh, like=plan)


def test_rewrite_names_are_checked():
    assert check_rewrites(()) == ()
    assert check_rewrites("sum_partials_first") == ("sum_partials_first",)
    with pytest.raises(PlanError, match="unknown program rewrite 'fold'.*sum_partials_first"):
        ed.optimize(row_sum(8, 64), ed.DeviceMesh.arange(2), rewrites=["fold"])


def test_siblings_merge_once_per_set_of_one_input_op_and_bias_kind():
    """q, k, v of x (widths 3, 3, 6) merge as three pairs and one triple (each set once, not per
    permutation); a sibling with a bias, a linear of another input and a matmul of x merge with none."""
    with ed.FusionDefinition() as fd:
        x, z = fd.define_tensor((5, 4), name="x"), fd.define_tensor((5, 4), name="z")
        w = {n: fd.define_tensor((3, 4), name=n) for n in ("wq", "wk", "wb", "wz")}
        w["wv"] = fd.define_tensor((6, 4), name="wv")
        outs = {n[1]: fd.ops.linear(x, w[n]) for n in ("wq", "wk", "wv")}
        outs["b"] = fd.ops.linear(x, w["wb"], fd.define_tensor((3,), name="bias"))
        outs["other"] = fd.ops.linear(z, w["wz"])
        outs["m"] = fd.ops.matmul(x, fd.define_tensor((4, 3), name="wm"))
        for n, y in outs.items():
            fd.add_output(y, name=n)
    work, ops = clone_fusion(fd.fusion)
    added = expand(work, ops, ["merge_siblings"])
    merged = [work.producer(work.tensors[eq.new]) for eq in added]
    assert sorted(e.outputs[0].shape[-1] for e in merged if e.op.name == "linear") == [6, 9, 9, 12]
    assert sorted(eq.old for eq in added if eq.old) == sorted(["q", "k", "v"] * 3)  # each in two pairs, one triple


def test_a_large_group_merges_whole_in_one_gemm():
    """Six siblings of widths 2, 4, 2, 4, 6, 2 (a set of every size would be 57 GEMMs): one GEMM of width 20,
    every output its slice (blocks of k = gcd = 2 rows), evaluated equal to the six linears."""
    widths = (2, 4, 2, 4, 6, 2)
    with ed.FusionDefinition() as fd:
        x = fd.define_tensor((3, 5), torch.float64, name="x")
        for i, o in enumerate(widths):
            fd.add_output(fd.ops.linear(x, fd.define_tensor((o, 5), torch.float64, name=f"w{i}")), name=f"y{i}")
    work, ops = clone_fusion(fd.fusion)
    added = expand(work, ops, ["merge_siblings"])
    merged = [work.producer(work.tensors[eq.new]) for eq in added]
    assert [e.outputs[0].shape for e in merged if e.op.name == "linear"] == [(3, 20)]
    assert sorted(eq.old for eq in added if eq.old) == sorted(f"y{i}" for i in range(6))
    stacks = sorted(e.outputs[0].shape for e in merged if e.op.name == "cat")
    assert stacks == [(2, k, 5) for k in (3, 4, 6, 9, 10)]  # a fold: blocks of 1, 2, 1, 2, 3, 1 rows
    g = torch.Generator().manual_seed(0)
    inputs = {t.name: torch.randn(t.shape, generator=g, dtype=torch.float64) for t in work.inputs}
    for eq in added:
        work.outputs[f"new:{eq.new}"] = work.tensors[eq.new]
    got = evaluate(work, inputs)
    for eq in added:
        if eq.old:
            torch.testing.assert_close(got[f"new:{eq.new}"], got[eq.old], rtol=1e-12, atol=1e-12)
