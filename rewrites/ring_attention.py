"""Ring attention: attention whose key/value transfer hides behind its compute (issue 28, item 2).

A rewrite between physical steps, as the collective matmuls' (rewrites/collective_matmul.py): beside a
plan's pair "all-gather k and v on mesh axis m, then attention of the rank's query block against the whole
keys" (sdpa_query_sequence / sdpa_lse_query_sequence), it offers one step with k and v left split on the
sequence on m whose kernel runs a ring of n = mesh-axis-size steps (collectives.ring_attention_run): at
each, the rank attends to the key block it holds while that block (k and v in one buffer) travels to the
next rank, and merges the block's (out, logsumexp) into its running one by the online-softmax merge
(collectives.attention_merge, exact). Under a causal mask a rank's own block is its diagonal (masked),
earlier blocks are attended whole and later ones skipped: rank r computes r + 1 blocks, the last rank n.
The backward (ring_attention_backward) is the same ring from sdpa_backward's query-sequence strategy: each
key block travels with its dk|dv accumulator, every rank adding its part, so dk and dv end split on the
sequence where the plain step left pending sums to reduce-scatter.

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
takes the strategy the ring replaced (unringed).

>>> ring_attention.__doc__.splitlines()[0]
'sdpa(q_r, allgather_m(k), allgather_m(v)) = ring: attention of a query block runs from k and v split on the sequence on m'
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from egglog import String, eq, i64, ne, relation, var
from egglog import rule as erule

from egraph_did.layout import P, Layout, R, S, is_valid
from egraph_did.shards import local_extents

from .collective_matmul import RingsOn
from .sorts import KERNS, LAYOUTS, SIG, STRAT, Extent, Fits, Placement, Shape
from .sorts import Layout as LayoutSort
from .sorts import P as P_, R as R_, S as S_

SEQ = 2  # the sequence axis of q, k, v, g, out, lse and the gradients


@dataclass(frozen=True)
class Form:
    """What a ring of `op` changes: operands (by parameter) split on the sequence on m as q is, the key
    operands whole on m before and split after, the outputs' placements on m before and after, the kernels
    the plain strategy may name on m, and the ring's flag (its local kernel in ops.py)."""

    ring: str
    seq: tuple[str, ...]
    keys: tuple[str, ...]
    outs_before: tuple
    outs_after: tuple
    kernels: frozenset
    flag: str


FORMS = {
    "sdpa": Form("ring_attention", ("q",), ("k", "v"), (S(SEQ),), (S(SEQ),), frozenset({"q_offset"}), "kv_ring"),
    "sdpa_lse": Form("ring_attention", ("q",), ("k", "v"), (S(SEQ),) * 2, (S(SEQ),) * 2, frozenset({"q_offset"}),
                     "kv_ring"),
    "sdpa_backward": Form("ring_attention_backward", ("g", "q", "output", "lse"), ("k", "v"), (S(SEQ), P, P),
                          (S(SEQ),) * 3, frozenset({"causal_offsets"}), "dkv_ring"),
}
OPS = tuple(FORMS)
FLAG = "kv_ring"  # the forward's local kernel (ops.SDPA_RING, ops.SDPA_LSE_RING); the backward's: dkv_ring


def _with(lay: Layout, m: int, p) -> Layout:
    return Layout(tuple(p if i == m else q for i, q in enumerate(lay)))


def _ring(form: Form, params, sq: int, sk: int, ins, outs, flags, m: int, n: int):
    """The ring's (inputs, outputs) layouts from a plain strategy's, or None (see ring_attention)."""
    if any(ins[params.index(p)][m] != S(SEQ) for p in form.seq) or any(ins[params.index(p)][m] != R for p in form.keys):
        return None
    if tuple(o[m] for o in outs) != form.outs_before:
        return None
    if not flags[m] <= form.kernels or any(f for i, f in enumerate(flags) if i != m):
        return None
    if sq % n or sk % n:
        return None
    if any(p.is_shard and p.axis == SEQ for lay in (*ins, *outs) for i, p in enumerate(lay) if i != m):
        return None
    new_ins = tuple(_with(lay, m, S(SEQ)) if p in form.keys else lay for p, lay in zip(params, ins))
    return new_ins, tuple(_with(lay, m, p) for lay, p in zip(outs, form.outs_after))


def ring_attention(op: str, params, sq: int, sk: int, ins, outs, flags, m: int, n: int):
    """sdpa(q_r, allgather_m(k), allgather_m(v)) = ring: attention of a query block runs from k and v split on the sequence on m

    From a strategy of sdpa or sdpa_lse with q (and the outputs) split on the sequence on m and k, v whole
    there (kernel: none, or the causal query offset), naming no kernel on another mesh axis: the same with
    k and v split on the sequence on m. Where q's (sq) and k's (sk) lengths divide by n and no other mesh
    axis splits the sequence of any operand or output. params: the tensor operands' parameter names, in
    the order of ins. Returns the ring's (inputs, outputs) layouts, or None.
    """
    return _ring(FORMS[op], params, sq, sk, ins, outs, flags, m, n) if op in ("sdpa", "sdpa_lse") else None


def ring_attention_backward(op: str, params, sq: int, sk: int, ins, outs, flags, m: int, n: int):
    """sdpa_backward(g_r, q_r, allgather_m(k), allgather_m(v), ..) then reduce_scatter_m(dk, dv) = ring: each key block travels with its dk, dv accumulator

    From a strategy of sdpa_backward with g, q, output and lse split on the sequence on m, k and v whole
    there, dq split and dk, dv pending sums on m (sdpa_backward_query_sequence; kernel none or the causal
    offsets): the same with k, v, dk and dv split on the sequence on m. Where the lengths divide by n and no
    other mesh axis splits a sequence. Returns the ring's (inputs, outputs) layouts, or None.
    """
    return _ring(FORMS[op], params, sq, sk, ins, outs, flags, m, n) if op == "sdpa_backward" else None


RULES = {"ring_attention": ring_attention, "ring_attention_backward": ring_attention_backward}


def unringed(op: str, params, ins: tuple, outs: tuple, m: int) -> tuple[tuple, tuple]:
    """The (inputs, outputs) layouts of the plain step a ring over mesh axis m replaced: k and v whole on m
    (and, for the backward, dk and dv pending sums there).

    >>> from egraph_did.layout import Layout
    >>> s2 = Layout.from_code("S2")
    >>> ins, outs = unringed("sdpa", ("q", "k", "v"), (s2, s2, s2), (s2,), 0)
    >>> [str(lay) for lay in ins], [str(lay) for lay in outs]
    (['[S(2)]', '[R]', '[R]'], ['[S(2)]'])
    """
    form = FORMS[op]
    return (tuple(lay.replace(m, R) if p in form.keys else lay for p, lay in zip(params, ins)),
            tuple(lay.replace(m, p) for lay, p in zip(outs, form.outs_before)))


def ring_strategy(problem, e, s, m: int, ins: tuple, outs: tuple):
    """The Strategy of the ring on mesh axis m derived from s, priced as the ring runs (CostModel.ring_time):
    a step's compute is the op's at the local query block against one key block, unmasked (the last rank
    works on every earlier block whole); causal, the first step is its diagonal block (half); a step's
    transfer is one block of k and v (the backward's: and its dk|dv accumulator, in the logsumexp's dtype,
    whose last hop home runs alone)."""
    mesh, cm, n = problem.mesh, problem.cost_model, problem.mesh.shape[m]
    form = FORMS[e.op.name]
    tensors = [(p, t) for p, t in e.args if hasattr(t, "logical_domain")]
    params = [p for p, _ in tensors]
    in_shapes = [local_extents(t.shape, lay, mesh) for (_, t), lay in zip(tensors, ins)]
    out_shapes = [local_extents(t.shape, lay, mesh) for t, lay in zip(e.outputs, outs)]
    args = dict(e.args)
    causal = bool(args.get("is_causal"))
    in_bytes = sum(math.prod(sh) * t.dtype.itemsize for sh, (_, t) in zip(in_shapes, tensors))
    # a block's outputs written, then the merge (the sum) reads them and the running ones and writes them
    out_bytes = 3 * sum(math.prod(sh) * t.dtype.itemsize for sh, t in zip(out_shapes, e.outputs))
    dtype = args["q"].dtype
    full = cm.compute_time(e.op.count_flops(in_shapes, out_shapes, {**args, "is_causal": False}),
                           in_bytes + out_bytes, dtype)
    diag = cm.compute_time(e.op.count_flops(in_shapes, out_shapes, {**args, "is_causal": True}),
                           in_bytes + out_bytes, dtype) if causal else None
    kv = [(in_shapes[params.index(p)], args[p]) for p in form.keys]
    block = sum(math.prod(sh) * t.dtype.itemsize for sh, t in kv)
    # the backward (lse among its operands) carries dk|dv accumulators in the logsumexp's dtype
    acc = sum(math.prod(sh) for sh, _ in kv) * args["lse"].dtype.itemsize if "lse" in params else 0
    flags = tuple(frozenset({form.flag}) if i == m else f for i, f in enumerate(s.flags))
    rules = tuple(form.ring if i == m else r for i, r in enumerate(s.rules))
    time = cm.ring_time(n, full, block + acc, m, mesh.ndim, first=diag)
    if acc:
        time += cm.link(m, mesh.ndim).time(1, 1.0, acc)
    memory = float(sum(math.prod(sh) * t.dtype.itemsize for sh, t in zip(out_shapes, e.outputs)))
    return replace(s, sid=-1, inputs=ins, outputs=outs, flags=flags, rules=rules, time=time, memory=memory)


def add_attention_rings(problem) -> int:
    """Append to every sdpa's, sdpa_lse's and sdpa_backward's strategies the rings the rules derive from them
    (on each mesh axis of two or more ranks, into layouts that fit), priced by ring_strategy; the e-graph
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
        if e.op.name not in FORMS:
            continue
        tensors = [(p, t) for p, t in e.args if hasattr(t, "logical_domain")]
        params = tuple(p for p, _ in tensors)
        args = dict(e.args)
        rule = RULES[FORMS[e.op.name].ring]
        strategies = problem.strategies[key]
        for s in list(strategies):
            for m, n in enumerate(mesh.shape):
                if n < 2:
                    continue
                got = rule(e.op.name, params, args["q"].shape[SEQ], args["k"].shape[SEQ], s.inputs, s.outputs, s.flags, m, n)
                if got and all(is_valid(lay, t.shape, mesh) for lay, t in zip(got[0] + got[1], [t for _, t in tensors] + list(e.outputs))):
                    strategies.append(replace(ring_strategy(problem, e, s, m, *got), sid=len(strategies)))
                    added += 1
    return added


# RingLay(j, role, plain, ring): a layout of a plain attention strategy that splits no sequence off mesh axis j
# and holds on j what the form's tensor holds there before a ring (role "S": split on the sequence, unchanged;
# "R": whole, k and v; "P": a pending sum, dk and dv), and the same layout with the sequence split on j. The ring
# rule reads it per tensor. One rule that took all nine layouts of the backward apart (18 placements, 18 guards)
# was matched by egglog as if some of its atoms were absent in 3 of 15 fresh processes, on 3000 Strat rows stated
# beside a 2x1x2 problem's: 7,469,182 ring rows where the others derived 255, the same program; which rows it
# derives then depends on the process (what fuzz seed 41 case 5807 met on the device: read_back's assertion)
RingLay = relation("RingLay", i64, String, LayoutSort, LayoutSort, egg_fn="RingLay")


def egglog_rules(shape: tuple[int, ...]):
    """The rules' egglog form for meshes of this shape: from each whole-mesh strategy (Strat row) of an sdpa,
    sdpa_lse or sdpa_backward signature in a plain form of FORMS on mesh axis j (kernel none or the form's on
    j, none elsewhere), the ring's Strat row, as ring_attention and ring_attention_backward derive it."""
    md = len(shape)
    L, K = LAYOUTS[md], KERNS[md]
    sig, op = var("sig", String), var("op", String)
    e1, e2 = var("e1", i64), var("e2", i64)
    place = {"S": S_(SEQ), "R": R_(), "P": P_()}

    def code(p) -> str:
        return "R" if p == R else "P" if p == P else "S"

    for name, form in FORMS.items():
        n_out = len(form.outs_before)
        params = {"sdpa": ("q", "k", "v"), "sdpa_lse": ("q", "k", "v"),
                  "sdpa_backward": ("g", "q", "k", "v", "output", "lse")}[name]
        shapes = {x: var(f"s_{x}", Shape) for x in (*[f"out{i}" for i in range(n_out)], *params)}
        before = {**{f"out{i}": code(p) for i, p in enumerate(form.outs_before)},
                  **{p: "S" for p in form.seq}, **{p: "R" for p in form.keys}}
        plain = {x: var(f"l_{x}", LayoutSort) for x in shapes}
        # k, v and the outputs that become split; the rest (split on the sequence on j already) stay
        ring = {x: var(f"r_{x}", LayoutSort) if before[x] != "S" else plain[x] for x in shapes}
        order = list(shapes)  # outputs, then operands: the Sig and Strat rows' order
        ps = [var(f"p{i}", Placement) for i in range(md)]
        # the atoms every rule of the form shares, made once: a rule costs egglog's Python front end ~2 ms of
        # checks per atom it builds, and a 2-D mesh's template holds twice the 1-D one's rules
        strat = STRAT[(len(params), n_out)]
        head = [RingsOn(1), SIG[(len(params), n_out)](sig, op, *[shapes[y] for y in order]), eq(op).to(String(name))]
        for j, n in enumerate(shape):
            if n < 2:
                continue
            kerns = [K(*[kin if i == j else "" for i in range(md)]) for kin in ("", *sorted(form.kernels))]
            off_j = [ne(ps[i]).to(S_(SEQ)) for i in range(md) if i != j]
            for x in order:  # RingLay of each tensor's layout in this op's plain Strat rows
                lay = L(*[place[before[x]] if i == j else ps[i] for i in range(md)])
                found = RingLay(j, before[x], lay, L(*[S_(SEQ) if i == j else ps[i] for i in range(md)]))
                operands = [lay if y == x else plain[y] for y in order]
                for kern in kerns:
                    yield erule(*head, strat(sig, kern, *operands), *off_j).then(found)
            guards = [*[RingLay(j, before[x], plain[x], ring[x]) for x in order],
                      Extent(shapes["q"], SEQ, e1), eq(e1 % n).to(i64(0)), Extent(shapes["k"], SEQ, e2),
                      eq(e2 % n).to(i64(0)), *[Fits(shapes[x], ring[x]) for x in order if before[x] != "S"]]
            ringed = strat(sig, K(*[form.flag if i == j else "" for i in range(md)]), *[ring[x] for x in order])
            for kern in kerns:
                yield erule(*head, strat(sig, kern, *[plain[x] for x in order]), *guards).then(ringed)


__all__ = ["FLAG", "FORMS", "Form", "OPS", "RULES", "add_attention_rings", "egglog_rules", "ring_attention",
           "ring_attention_backward", "ring_strategy", "unringed"]
