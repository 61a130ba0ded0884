"""Ring attention (issue 28 item 2; rewrites/ring_attention.py): sdpa and sdpa_lse with q split on the
sequence run from k and v split on the sequence as a ring, each rank attending to the key block it holds
while k and v travel on, the partial (out, logsumexp) merged by the online softmax.

Claims: bidirectional attention with q, k, v and out split on the sequence over 4 H200s, 2 heads (too few
to all-to-all over) bf16: at 4096 positions the plan all-gathers k and v (38.9 us; the ring is priced
44.1 us: four attention launches and three latencies), at 32768 it runs the ring (424.0 us against 500.0
us gathering k and v); with 32 heads at 8192 the ring (424.0 us) beats Ulysses' all-to-alls (588.0 us);
the ring simulates to the float64 single-device reference, causal or not, sdpa or sdpa_lse, lowered or
eager, on a 1-D mesh and on one axis of a 2-D one; lengths the ring cannot cut in equal blocks get no
ring and a replay of a ring plan there keeps the plain path; the egglog rule derives exactly the Python
rule's rings.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import egraph_did as ed
from egraph_did.collectives import ring_attention_simulate
from egraph_did.cost import CostModel, Link
from egraph_did.egglog_io import frozen_rows, run_text
from egraph_did.egraph import FAMILIES, lay_text, loaded
from egraph_did.expand import ALL_REWRITES
from egraph_did.layout import P, R, S, Layout, is_valid
from egraph_did.ops import ring_attention_block
from egraph_did.pins import apply_layout
from egraph_did.problem import build_problem
from egraph_did.simulate import compute_on_rank
from rewrites.ring_attention import FORMS, RULES
from tests.optimizer.test_context_parallel import attention as pinned_attention

BF16, F64 = torch.bfloat16, torch.float64
MESH = ed.DeviceMesh.arange(4)
MESH2 = ed.DeviceMesh(torch.arange(8).reshape(2, 4), axis_names=("dp", "cp"))
NO_RINGS = tuple(r for r in ALL_REWRITES if r != "collective_matmul")
# a link slow beside compute, with no latency to speak of: the ring wins at shapes simulate can afford
SLOW = dataclasses.replace(CostModel.h200(), name="slow-link", peak_flops=(("float64", 1e7), ("float32", 1e7)),
                           launch_overhead=0.0, links=(Link("slow", alpha=1e-9, bandwidth=1e6),))
SEQ = "[S(2)]"
RING_KERNELS = {"kv_ring", "dkv_ring"}  # the forward's ring and the backward's


def attention(b, h, s, d, dtype, causal=False, lse=False, mesh=MESH, lay=SEQ, sk=None):
    """out (and lse) = sdpa(q, k, v) with q, k, v and the outputs pinned in `lay` (split on the sequence)."""
    pins = dict.fromkeys(("q", "k", "v", "out", *(("lse",) if lse else ())), lay)
    return pinned_attention(b, h, s, sk or s, d, dtype, pins, causal=causal, lse=lse, mesh=mesh)


def ring_steps(plan) -> list:
    return [s for s in plan.compute_steps if any(f == "kv_ring" for f, _ in s.flags)]


def gathered(plan) -> list[str]:
    return sorted(c.tensor for c in plan.collectives if c.kind == "allgather")


def assert_simulates(fd, plan, mesh=MESH, seed=0, lowered=True):
    g = torch.Generator().manual_seed(seed)
    inputs = {t.name: torch.randn(t.shape, generator=g, dtype=F64) for t in fd.fusion.inputs}
    ref, got = ed.evaluate(fd, inputs), ed.simulate(plan, inputs, lowered=lowered)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_long_bidirectional_attention_runs_the_ring_short_gathers_k_and_v():
    short = ed.optimize(attention(1, 2, 4096, 128, BF16), MESH)
    assert not ring_steps(short) and gathered(short) == ["k", "v"], short.explain()
    assert short.predicted_time == pytest.approx(38.9e-6, rel=1e-3)
    ring_short = next(s for s in build_problem(attention(1, 2, 4096, 128, BF16), MESH, rewrites=["collective_matmul"])
                      .strategies["out"] if s.rules == ("ring_attention",))
    assert ring_short.time == pytest.approx(44.1e-6, rel=1e-3)  # offered, and priced out
    assert short.stats["ring_nodes"] > 0

    long = ed.optimize(attention(1, 2, 32768, 128, BF16), MESH)
    off = ed.optimize(attention(1, 2, 32768, 128, BF16), MESH, rewrites=NO_RINGS)
    assert [s.rules for s in ring_steps(long)] == [("ring_attention",)] and not long.collectives, long.explain()
    assert gathered(off) == ["k", "v"] and not ring_steps(off)
    assert long.predicted_time == pytest.approx(424.0e-6, rel=1e-3)
    assert off.predicted_time == pytest.approx(500.0e-6, rel=1e-3)
    text = long.explain()
    assert "ring_attention" in text and "1 collective matmul ring(s)" in text.splitlines()[0]
    small = attention(1, 2, 8, 3, F64)  # the golden plan replayed where float64 is affordable
    replay = ed.optimize(small, MESH, like=long)
    assert len(ring_steps(replay)) == 1
    assert_simulates(small, replay)


def test_with_heads_to_spare_the_ring_beats_ulysses_all_to_alls():
    on = ed.optimize(attention(1, 32, 8192, 128, BF16), MESH)
    off = ed.optimize(attention(1, 32, 8192, 128, BF16), MESH, rewrites=NO_RINGS)
    assert len(ring_steps(on)) == 1 and not on.collectives, on.explain()
    assert sorted(c.kind for c in off.collectives) == ["alltoall"] * 4, off.explain()
    assert (on.predicted_time, off.predicted_time) == (pytest.approx(424.0e-6, rel=1e-3), pytest.approx(588.0e-6, rel=1e-3))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lse", [False, True])
@pytest.mark.parametrize("lowered", [True, False])
def test_the_ring_simulates_to_the_float64_reference(causal, lse, lowered):
    fd = attention(2, 2, 12, 3, F64, causal, lse)
    plan = ed.optimize(fd, MESH, cost_model=SLOW)
    assert [s.op for s in ring_steps(plan)] == ["sdpa_lse" if lse else "sdpa"] and not plan.collectives, plan.explain()
    assert plan.predicted_time < ed.optimize(fd, MESH, cost_model=SLOW, rewrites=NO_RINGS).predicted_time
    assert_simulates(fd, plan, lowered=lowered)


def test_cross_attention_with_fewer_keys_than_queries_rings_too():
    """16 queries against 8 keys: query blocks of 4 against key blocks of 2 (with more keys than queries
    the blocks of pass-Q are the cheaper move under this model)."""
    fd = attention(1, 2, 16, 3, F64, sk=8)
    plan = ed.optimize(fd, MESH, cost_model=SLOW)
    assert len(ring_steps(plan)) == 1, plan.explain()
    assert_simulates(fd, plan)


@pytest.mark.parametrize("causal", [False, True])
def test_the_ring_runs_on_the_context_axis_of_a_2d_mesh(causal):
    """Batch split on dp, the sequence on cp (2 x 4): the ring runs over cp's groups, beside dp."""
    fd = attention(2, 2, 8, 3, F64, causal, mesh=MESH2, lay="[S(0), S(2)]")
    plan = ed.optimize(fd, MESH2, cost_model=SLOW)
    assert [dict(s.flags) for s in ring_steps(plan)] == [{"kv_ring": (1,)}], plan.explain()
    assert_simulates(fd, plan, MESH2)


@pytest.mark.parametrize("causal", [False, True])
def test_ring_blocks_merge_exactly_against_the_reference(causal):
    """ring_attention_simulate alone: 3 members, q and keys of 3 blocks of 2 positions, each member's
    block of the output and logsumexp is the reference's (a causal row sees its diagonal block first)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=F64) for _ in range(3))
    got = ring_attention_simulate(ring_attention_block, q.chunk(3, 2), k.chunk(3, 2), v.chunk(3, 2), causal, 0.7, True)
    out, lse = ring_attention_block(q, k, v, causal, 0.7)
    torch.testing.assert_close(torch.cat([o for o, _ in got], 2), out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([l for _, l in got], 2), lse, rtol=1e-12, atol=1e-12)


def test_lengths_the_ring_cannot_cut_evenly_keep_the_plain_path():
    """10 positions on 4 ranks (3, 3, 3, 1): no ring is offered, and a ring plan replayed there takes the
    strategy the ring replaced (k and v gathered), still equal to the reference."""
    fd = attention(1, 2, 10, 3, F64, causal=True)
    plan = ed.optimize(fd, MESH, cost_model=SLOW)
    assert not ring_steps(plan) and plan.stats["ring_nodes"] == 0
    golden = ed.optimize(attention(1, 2, 12, 3, F64, causal=True), MESH, cost_model=SLOW)
    assert ring_steps(golden), golden.explain()
    replay = ed.optimize(fd, MESH, like=golden)
    assert not ring_steps(replay) and gathered(replay) == ["k", "v"], replay.explain()
    assert_simulates(fd, replay)


def test_a_ring_step_outside_torch_distributed_says_how_to_run_it():
    fd = attention(1, 2, 8, 3, F64)
    plan = ed.optimize(fd, MESH, cost_model=SLOW)
    (step,) = ring_steps(plan)
    env = {v: torch.zeros(plan.values[v].shape) for v in step.reads}
    with pytest.raises(ed.errors.PlanError, match="a ring step communicates"):
        compute_on_rank(plan, step, env, 0)


def egglog_rings(problem, strat_rows=None) -> set[tuple]:
    """The ring strategies the e-graph's rules derive for attention and its backward, per expr: (key, input
    codes, output codes, flags), read from the Strat3x1 / Strat3x2 / Strat6x3 rows of each expr's signature.
    strat_rows(sig_of): Strat rows (egglog text) stated beside those the rules join."""
    m = problem.mesh.ndim
    with loaded(problem) as (eg, program, _, _, _, sig_of):
        if strat_rows is not None:
            run_text(eg, strat_rows(sig_of))
        eg.run(FAMILIES.saturate() + program.saturate())
        rows, raw = frozen_rows(eg, ["Strat3x1", "Strat3x2", "Strat6x3", "R", "P", "Pmax", "S", f"L{m}", f"K{m}"])
    place = {out: p for name, p in (("R", "R"), ("P", "P"), ("Pmax", "Pmax")) for _, out in rows.get(name, [])}
    place.update({out: f"S{raw.value_to_i64(ins[0])}" for ins, out in rows.get("S", [])})
    lay = {out: ".".join(place[v] for v in ins) for ins, out in rows.get(f"L{m}", [])}
    kern = {out: tuple(raw.value_to_string(v) for v in ins) for ins, out in rows.get(f"K{m}", [])}
    by_sig = {}
    for name, o in (("Strat3x1", 1), ("Strat3x2", 2), ("Strat6x3", 3)):
        for ins, _ in rows.get(name, []):
            k = kern[ins[1]]
            if RING_KERNELS & set(k):
                outs, operands = ins[2:2 + o], ins[2 + o:]
                by_sig.setdefault(raw.value_to_string(ins[0]), set()).add(
                    (tuple(lay[x] for x in operands), tuple(lay[x] for x in outs), k))
    return {(key, *row) for key, sig in sig_of.items() for row in by_sig.get(sig, ())}


def python_rings(problem) -> set[tuple]:
    return {(key, tuple(lay.code() for lay in s.inputs), tuple(lay.code() for lay in s.outputs),
             tuple(next(iter(f), "") for f in s.flags))
            for key, ss in problem.strategies.items() for s in ss if any(RING_KERNELS & f for f in s.flags)}


@pytest.mark.parametrize("case", ["sdpa", "sdpa_lse-causal", "2d", "uneven", "cross"])
def test_the_egglog_rule_derives_exactly_the_python_rings(case):
    mesh = MESH2 if case == "2d" else MESH
    fd = {"sdpa": lambda: attention(1, 2, 8, 3, F64),
          "sdpa_lse-causal": lambda: attention(1, 2, 8, 3, F64, causal=True, lse=True),
          "2d": lambda: attention(2, 2, 8, 3, F64, causal=True, mesh=MESH2, lay="[S(0), S(2)]"),
          "uneven": lambda: attention(1, 2, 10, 3, F64),
          "cross": lambda: attention(1, 2, 8, 3, F64, sk=12)}[case]()
    problem = build_problem(fd, mesh, SLOW, rewrites=["collective_matmul"])
    want = python_rings(problem)
    assert egglog_rings(problem) == want
    assert bool(want) == (case != "uneven")  # 10 positions cut in no 4 equal blocks: no ring either way


# ---------------------------------------------------------------------- the backward (ring_attention_backward)

# compute as slow as the link: a block's attention outlasts its transfer at shapes simulate can afford
PACED = dataclasses.replace(SLOW, name="paced", peak_flops=(("float64", 2e5), ("float32", 2e5)))
STEP_PINS = {**dict.fromkeys(("q", "g", "k", "v", "grad_q", "grad_k", "grad_v"), SEQ), "loss": "[R]"}


def attention_step(b, h, s, d, dtype, causal=False):
    """loss = sum(sdpa(q, k, v) * g) and its gradients in q, k and v, everything split on the sequence."""
    with ed.FusionDefinition() as fd:
        q, k, v, g = (fd.define_tensor((b, h, s, d), dtype, name=n) for n in "qkvg")
        fd.add_output(fd.ops.sum(fd.ops.mul(fd.ops.sdpa(q, k, v, is_causal=causal), g)), name="loss")
    step = ed.grad(fd, "loss", ["q", "k", "v"])
    for name, text in STEP_PINS.items():
        apply_layout(step[name], Layout.parse(text), MESH)
    return step


def ring_rules(plan) -> list:
    return [(s.op, s.rules) for s in plan.compute_steps if any(f in RING_KERNELS for f, _ in s.flags)]


def test_a_long_training_step_runs_attention_and_its_backward_as_rings():
    """Bidirectional, 2 heads, bf16, 4 H200s: at 32768 positions the forward is a ring and the backward
    one too (k and v travel again, each with its dk, dv accumulator): 1555.2 us against 1651.9 us
    all-gathering k and v once for both and reduce-scattering dk and dv; at 4096 the plan gathers (119.0 us)."""
    long = ed.optimize(attention_step(1, 2, 32768, 128, BF16), MESH)
    off = ed.optimize(attention_step(1, 2, 32768, 128, BF16), MESH, rewrites=NO_RINGS)
    assert ring_rules(long) == [("sdpa_lse", ("ring_attention",)), ("sdpa_backward", ("ring_attention_backward",))]
    assert [c.tensor for c in long.collectives] == ["loss"], long.explain()
    assert sorted(c.kind for c in off.collectives if c.tensor != "loss") == ["allgather"] * 2 + ["reduce_scatter"] * 2
    assert (long.predicted_time, off.predicted_time) == (pytest.approx(1555.2e-6, rel=1e-3), pytest.approx(1651.9e-6, rel=1e-3))
    short = ed.optimize(attention_step(1, 2, 4096, 128, BF16), MESH)
    assert not ring_rules(short) and short.predicted_time == pytest.approx(119.0e-6, rel=1e-3), short.explain()


def test_a_long_causal_training_step_runs_attention_and_its_backward_as_rings():
    """Causal, 2 heads, bf16, 4 H200s: each rank waits for the busiest one, the last query shard (or the first
    key shard), which meets every earlier block whole, in the ring and in the plain split alike (ops._causal_pairs).
    At 32768 positions both rings: 1378.1 us against 1474.7 us gathering k and v and reduce-scattering dk and dv;
    at 8192 no ring (197.5 us)."""
    long = ed.optimize(attention_step(1, 2, 32768, 128, BF16, causal=True), MESH)
    off = ed.optimize(attention_step(1, 2, 32768, 128, BF16, causal=True), MESH, rewrites=NO_RINGS)
    assert ring_rules(long) == [("sdpa_lse", ("ring_attention",)), ("sdpa_backward", ("ring_attention_backward",))]
    assert (long.predicted_time, off.predicted_time) == (pytest.approx(1378.1e-6, rel=1e-3), pytest.approx(1474.7e-6, rel=1e-3))
    short = ed.optimize(attention_step(1, 2, 8192, 128, BF16, causal=True), MESH)
    assert not ring_rules(short) and short.predicted_time == pytest.approx(197.5e-6, rel=1e-3), short.explain()


@pytest.mark.parametrize("lowered", [True, False])
def test_the_training_step_with_both_rings_simulates_to_the_reference(lowered):
    fd = attention_step(1, 2, 8, 3, F64)
    plan = ed.optimize(fd, MESH, cost_model=PACED)
    assert len(ring_rules(plan)) == 2 and plan.predicted_time < ed.optimize(
        fd, MESH, cost_model=PACED, rewrites=NO_RINGS).predicted_time, plan.explain()
    assert_simulates(fd, plan, lowered=lowered)


def test_the_causal_training_step_runs_both_rings_and_simulates_to_the_reference():
    """Causal rings and the plain query (or key) split are both priced at their busiest rank (every earlier
    block whole: ops._causal_pairs), so the causal step takes both rings where the non-causal one does; they
    skip the blocks above the diagonal, and the step equals the reference."""
    fd = attention_step(1, 2, 12, 3, F64, causal=True)
    plan = ed.optimize(fd, MESH, cost_model=PACED)
    assert len(ring_rules(plan)) == 2, plan.explain()
    assert_simulates(fd, plan)


@pytest.mark.parametrize("causal", [False, True])
def test_ring_backward_blocks_sum_exactly_against_the_reference(causal):
    """ring_attention_backward_simulate alone: 3 members of 2 positions each; dq of each member's rows and
    dk, dv of each member's keys are the reference backward's."""
    from egraph_did.collectives import ring_attention_backward_simulate
    from egraph_did.ops import ring_attention_backward_block
    g_ = torch.Generator().manual_seed(2)
    q, k, v, g = (torch.randn(1, 2, 6, 4, generator=g_, dtype=F64) for _ in range(4))
    out, lse = ring_attention_block(q, k, v, causal, 0.7)
    got = ring_attention_backward_simulate(ring_attention_backward_block, *(t.chunk(3, 2) for t in (g, q, k, v, out, lse)),
                                           causal, 0.7)
    want = ring_attention_backward_block(g, q, k, v, out, lse, causal, 0.7)
    for i, name in enumerate(("dq", "dk", "dv")):
        torch.testing.assert_close(torch.cat([r[i] for r in got], 2), want[i], rtol=1e-12, atol=1e-12, msg=name)


def test_the_egglog_rule_derives_exactly_the_python_backward_rings():
    problem = build_problem(attention_step(1, 2, 8, 3, F64, causal=True), MESH, SLOW, rewrites=["collective_matmul"])
    want = python_rings(problem)
    assert {f for *_, fs in want for f in fs} == {"kv_ring", "dkv_ring"}
    assert egglog_rings(problem) == want


def test_both_forms_ring_the_same_rows_of_every_plain_kind():
    """Both forms on plain rows of every kind the strategy join can make, not only this program's: on a 2x1x2
    mesh (fuzz seed 41 case 5807's, where read_back met a dkv_ring strategy the Python rule does not derive),
    3000 draws per op of a plain form on one axis and anything on the others, the rows where every layout
    fits (about 430) stated as Strat rows beside the join's: the egglog form rings exactly the rows the
    Python rule does."""
    mesh = ed.DeviceMesh(torch.arange(4).reshape(2, 1, 2))
    with ed.FusionDefinition() as fd:
        q, k = (fd.define_tensor((2, 6, 2, 3), F64, name=n) for n in "qk")
        v, g = (fd.define_tensor((2, 6, 2, 4), F64, name=n) for n in "vg")
        out, lse = fd.ops.sdpa_lse(q, k, v)
        for i, t in enumerate((out, lse, *fd.ops.sdpa_backward(g, q, k, v, out, lse))):
            fd.add_output(t, name=f"o{i}")
    problem = build_problem(fd, mesh, SLOW, rewrites=["collective_matmul"])
    rng, rows, want = random.Random(0), [], python_rings(problem)
    for key, e in problem.exprs.items():
        if e.op.name not in FORMS:  # (sdpa_lse's decomposition)
            continue
        form, args = FORMS[e.op.name], dict(e.args)
        params = tuple(p for p, t in e.args if hasattr(t, "logical_domain"))
        tensors = [args[p] for p in params] + list(e.outputs)
        for _ in range(3000):
            j = rng.choice((0, 2))
            kin = rng.choice(("", *form.kernels))
            on_j = [S(2) if p in form.seq else R for p in params] + list(form.outs_before)
            lays = tuple(Layout(tuple(p if i == j else rng.choice((R, P, S(0), S(1), S(2), S(3))) if i == 2 - j
                                      else R if rng.random() < 0.8 else rng.choice((P, S(0), S(3))) for i in range(3)))
                         for p in on_j)
            if not all(is_valid(lay, t.shape, mesh) for lay, t in zip(lays, tensors)):
                continue  # a row the join makes (Strat: every layout fits)
            ins, outs = lays[:len(params)], lays[len(params):]
            flags = tuple(frozenset({kin} if i == j and kin else ()) for i in range(3))
            rows.append((key, ins, outs, flags))
            for m in (0, 2):  # as add_attention_rings: the rule, then every layout of the ring fits
                got = RULES[form.ring](e.op.name, params, args["q"].shape[2], args["k"].shape[2], ins, outs, flags, m, 2)
                if got and all(is_valid(lay, t.shape, mesh) for lay, t in zip(got[0] + got[1], tensors)):
                    want.add((key, tuple(lay.code() for lay in got[0]), tuple(lay.code() for lay in got[1]),
                              tuple(form.flag if i == m else "" for i in range(3))))

    def strat_rows(sig_of):
        return [f'(Strat{len(ins)}x{len(outs)} "{sig_of[key]}" (K3 {" ".join(chr(34) + next(iter(f), "") + chr(34) for f in flags)}) '
                + " ".join(lay_text(lay) for lay in outs + ins) + ")" for key, ins, outs, flags in rows]
    assert egglog_rings(problem, strat_rows) == want
