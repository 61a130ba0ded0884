"""Ring attention: attention whose key/value transfer hides behind its compute (issue 28, item 2).

A rewrite between physical steps, as the collective matmuls' (rewrites/collective_matmul.py): beside a
plan's pair "all-gather k and v on mesh axis m, then attention of the rank's query block against the whole
keys" (sdpa_query_sequence / sdpa_lse_query_sequence), it offers one step with k and v left split on the
sequence on m whose kernel runs a ring of n = mesh-axis-size steps (collectives.ring_attention_run): at
each, the rank attends to the key block it holds while that block (k and v in one buffer) travels to the
next rank, and merges the block's (out, logsumexp) into its running one by the online-softmax merge
(collectives.attention_merge, exact). Under a causal mask a rank's own block is its diagonal (masked),
earlier blocks are attended whole and later ones skipped: rank r computes r + 1 blocks, the last rank n.

Priced by cost.CostModel.ring_time: per step the longer of one block's attention and one key/value block's
transfer (latency paid per step), the last block's attention alone; causal: the last rank's steps (the
first one its diagonal, half a block). So extraction takes it at long sequences, where a block's attention
outlasts its transfer, and not at short ones, where n latencies and n kernel launches cost more than one
all-gather's.

As the collective matmuls' rules, `ring_attention` is an executable Python spec (add_attention_rings prices
what it derives) and `egglog_rules` its egglog form (tests/optimizer/test_ring_attention.py holds both
equal); both are switched by the same name, "collective_matmul" (the rings; RingsOn). The ring cuts q and
k/v in n equal blocks: offered where both sequence lengths divide by n and no other mesh axis splits the
sequence; elsewhere (10 positions on 4 ranks) the plain path stays, and a replay (like=) of a ring plan
takes the strategy the ring replaced (collective_matmul.unringed).

>>> ring_attention.__doc__.splitlines()[0]
'sdpa(q_r, allgather_m(k), allgather_m(v)) = ring: attention of a query block runs from k and v split on the sequence on m'
"""
from __future__ import annotations

import math
from dataclasses import replace

from egglog import String, eq, i64, ne, var
from egglog import rule as erule

from egraph_did.layout import Layout, R, S, is_valid
from egraph_did.shards import local_extents

from .collective_matmul import RingsOn
from .sorts import KERNS, LAYOUTS, SIG, STRAT, Extent, Fits, Placement, Shape
from .sorts import R as R_, S as S_

OPS = ("sdpa", "sdpa_lse")  # the ops a ring runs: out, or (out, lse)
SEQ = 2  # the sequence axis of q, k, v, out and lse
FLAG = "kv_ring"  # the local kernel (ops.SDPA_RING, ops.SDPA_LSE_RING)


def _with(lay: Layout, m: int, p) -> Layout:
    return Layout(tuple(p if i == m else q for i, q in enumerate(lay)))


def ring_attention(q, k, ins: tuple[Layout, ...], outs: tuple[Layout, ...], flags, m: int, n: int):
    """sdpa(q_r, allgather_m(k), allgather_m(v)) = ring: attention of a query block runs from k and v split on the sequence on m

    From a strategy with q (and the outputs) split on the sequence on m and k, v whole there (kernel: none,
    or the causal query offset), naming no kernel on another mesh axis: the same with k and v split on the
    sequence on m. Where q's and k's lengths divide by n and no other mesh axis splits the sequence of any
    operand or output. Returns (k and v's layout) or None.
    """
    lq, lk, lv = ins
    if lq[m] != S(SEQ) or lk[m] != R or lv[m] != R or any(o[m] != S(SEQ) for o in outs):
        return None
    if not flags[m] <= {"q_offset"} or any(f for i, f in enumerate(flags) if i != m):
        return None
    if q.shape[SEQ] % n or k.shape[SEQ] % n:
        return None
    if any(p.is_shard and p.axis == SEQ for lay in (*ins, *outs) for i, p in enumerate(lay) if i != m):
        return None
    return _with(lk, m, S(SEQ)), _with(lv, m, S(SEQ))


def unringed(ins: tuple, outs: tuple, m: int) -> tuple[tuple, tuple]:
    """The (inputs, outputs) layouts of the plain attention a ring over mesh axis m replaced: k and v whole on m."""
    return (ins[0], ins[1].replace(m, R), ins[2].replace(m, R)), outs


def ring_strategy(problem, e, s, m: int, lk: Layout, lv: Layout):
    """The Strategy of the ring on mesh axis m derived from s, priced as the ring runs (CostModel.ring_time):
    a step's attention is the op's compute at the local query block against one key block, unmasked (the
    last rank attends to every earlier block whole); causal, the first step is its diagonal block (half);
    a step's transfer is one block of k and v."""
    mesh, cm, n = problem.mesh, problem.cost_model, problem.mesh.shape[m]
    q, k, v = (t for _, t in e.args if hasattr(t, "logical_domain"))
    ins = (s.inputs[0], lk, lv)
    in_shapes = [local_extents(t.shape, lay, mesh) for t, lay in zip((q, k, v), ins)]
    out_shapes = [local_extents(t.shape, lay, mesh) for t, lay in zip(e.outputs, s.outputs)]
    args = dict(e.args)
    causal = bool(args.get("is_causal"))
    in_bytes = sum(math.prod(sh) * t.dtype.itemsize for sh, t in zip(in_shapes, (q, k, v)))
    # the block's output and logsumexp written, then the merge reads them and the running pair and writes it
    out_bytes = 3 * sum(math.prod(sh) * t.dtype.itemsize for sh, t in zip(out_shapes, e.outputs))
    full = cm.compute_time(e.op.count_flops(in_shapes, out_shapes, {**args, "is_causal": False}),
                           in_bytes + out_bytes, q.dtype)
    diag = cm.compute_time(e.op.count_flops(in_shapes, out_shapes, {**args, "is_causal": True}),
                           in_bytes + out_bytes, q.dtype) if causal else None
    block = math.prod(in_shapes[1]) * k.dtype.itemsize + math.prod(in_shapes[2]) * v.dtype.itemsize
    flags = tuple(frozenset({FLAG}) if i == m else f for i, f in enumerate(s.flags))
    rules = tuple("ring_attention" if i == m else r for i, r in enumerate(s.rules))
    time = cm.ring_time(n, full, block, m, mesh.ndim, first=diag)
    return replace(s, sid=-1, inputs=ins, flags=flags, rules=rules, time=time)


def add_attention_rings(problem) -> int:
    """Append to every sdpa's and sdpa_lse's strategies the rings `ring_attention` derives from them (on
    each mesh axis of two or more ranks, into layouts that fit), priced by ring_strategy; the e-graph
    derives the same rows by `egglog_rules`. Returns how many it added.

    >>> import egraph_did as ed, torch
    >>> from egraph_did.problem import build_problem
    >>> with ed.FusionDefinition() as fd:
    ...     q = fd.define_tensor((1, 2, 8, 4), name="q")
    ...     fd.add_output(fd.ops.sdpa(q, q, q, is_causal=True), name="out")
    >>> problem = build_problem(fd, ed.DeviceMesh.arange(4), rewrites=["collective_matmul"])
    >>> sorted({(*(str(lay) for lay in s.inputs), str(s.outputs[0]), s.rules[0]) for s in problem.strategies["out"]
    ...         if s.flags[0] == {"kv_ring"}})  # q, k, v, out
    [('[S(2)]', '[S(2)]', '[S(2)]', '[S(2)]', 'ring_attention')]
    """
    if not hasattr(problem.cost_model, "ring_time"):
        return 0
    mesh, added = problem.mesh, 0
    for key, e in problem.exprs.items():
        if e.op.name not in OPS:
            continue
        q, k, v = (t for _, t in e.args if hasattr(t, "logical_domain"))
        strategies = problem.strategies[key]
        for s in list(strategies):
            for m, n in enumerate(mesh.shape):
                if n < 2:
                    continue
                got = ring_attention(q, k, s.inputs, s.outputs, s.flags, m, n)
                if got and is_valid(got[0], k.shape, mesh) and is_valid(got[1], v.shape, mesh):
                    strategies.append(replace(ring_strategy(problem, e, s, m, *got), sid=len(strategies)))
                    added += 1
    return added


def egglog_rules(shape: tuple[int, ...]):
    """The rule's egglog form for meshes of this shape: from each whole-mesh strategy (Strat row) of an sdpa
    or sdpa_lse signature with q and the outputs split on the sequence on mesh axis j, k and v whole there,
    kernel none or q_offset on j and none elsewhere, the ring's Strat row (kv_ring on j, k and v split on
    the sequence on j), as ring_attention derives it."""
    md = len(shape)
    L, K = LAYOUTS[md], KERNS[md]
    sig, op = var("sig", String), var("op", String)
    so, sl, sq, sk, sv = (var(v, Shape) for v in ("so", "sl", "sq", "sk", "sv"))
    e1, e2 = var("e1", i64), var("e2", i64)
    po, pl, pq, pk, pv = ([var(f"{c}{i}", Placement) for i in range(md)] for c in ("po", "pl", "pq", "pk", "pv"))
    for j, n in enumerate(shape):
        if n < 2:
            continue
        at = lambda ps, p: L(*[p if i == j else ps[i] for i in range(md)])  # noqa: E731
        ring = K(*[FLAG if i == j else "" for i in range(md)])
        guards = [Extent(sq, SEQ, e1), eq(e1 % n).to(i64(0)), Extent(sk, SEQ, e2), eq(e2 % n).to(i64(0)),
                  Fits(sk, at(pk, S_(SEQ))), Fits(sv, at(pv, S_(SEQ)))]
        for kin in ("", "q_offset"):
            src = K(*[kin if i == j else "" for i in range(md)])
            # sdpa: out
            yield erule(RingsOn(1), SIG[(3, 1)](sig, op, so, sq, sk, sv), eq(op).to(String("sdpa")),
                        STRAT[(3, 1)](sig, src, at(po, S_(SEQ)), at(pq, S_(SEQ)), at(pk, R_()), at(pv, R_())),
                        *guards, *[ne(p[i]).to(S_(SEQ)) for p in (po, pq, pk, pv) for i in range(md) if i != j]).then(
                STRAT[(3, 1)](sig, ring, at(po, S_(SEQ)), at(pq, S_(SEQ)), at(pk, S_(SEQ)), at(pv, S_(SEQ))))
            # sdpa_lse: out, lse
            yield erule(RingsOn(1), SIG[(3, 2)](sig, op, so, sl, sq, sk, sv), eq(op).to(String("sdpa_lse")),
                        STRAT[(3, 2)](sig, src, at(po, S_(SEQ)), at(pl, S_(SEQ)), at(pq, S_(SEQ)), at(pk, R_()),
                                      at(pv, R_())),
                        *guards, *[ne(p[i]).to(S_(SEQ)) for p in (po, pl, pq, pk, pv) for i in range(md) if i != j]).then(
                STRAT[(3, 2)](sig, ring, at(po, S_(SEQ)), at(pl, S_(SEQ)), at(pq, S_(SEQ)), at(pk, S_(SEQ)),
                              at(pv, S_(SEQ))))


__all__ = ["FLAG", "OPS", "add_attention_rings", "egglog_rules", "ring_attention", "ring_strategy", "unringed"]
