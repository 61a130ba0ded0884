"""Plan quality: how good are egraph-did's plans?

1. Greedy-DAG against exact extraction on random fusions: the gap distribution. This reuses
   bench/extraction_gap.py (its random fusions and report), with a smaller default case count.
2. Our plans against two baselines on the same models, priced by the same cost model:
   - Megatron: the hand-written layouts of Megatron-LM, as pins (column-parallel q/k/v and first MLP
     weight, row-parallel output projections; TP: the block's x and y replicated; SP: x and y split
     along the sequence). Everything the layout fixes is pinned; ed.optimize then only places the
     collectives between pinned layouts, which for these pins are Megatron's (checked by the counts).
   - DTensor-style propagation: the user pins inputs and weights as one would with distribute_tensor
     (x as the scenario says, weights Shard(0), layer-norm weights replicated), then layouts propagate
     op by op, greedily, with no lookahead and no cost model: each op takes its first sharded input's
     layout where a simple rule allows (pointwise ops keep it; linear keeps a batch/sequence split of x,
     or turns a Shard(0) weight into a split of the output's last axis; reshape keeps a split of an
     axis before the first reshaped one; permute moves it; reductions, norms and sdpa keep a split
     of an axis they do not reduce), else the output is replicated. Every tensor is then pinned to
     its propagated layout and priced by ed.optimize with everything pinned (the redistributions a
     DTensor program would run between them). This is a simplification of DTensor, kept honest:
     real DTensor has more per-op strategies (it picks the one with the cheapest redistribution of
     its inputs), so treat this as a lower bound on what a hand-pinned DTensor program gets without
     parallelize_module plans; with them, the user writes Megatron's layout (the Megatron row).

3. --training: greedy against exact extraction on small training steps (mlp_training_step, gpt_training_step;
   AdamW; 2 and 4 ranks; x and target free or sequence-sharded): optimize's plan with each extractor, its passes
   and seconds. Both plan the step as a loop (optimize.loop_pins); the gap is what greedy's loops miss.

    .venv/bin/python bench/plan_quality.py [--cases 40] [--skip-gap]
    .venv/bin/python bench/plan_quality.py --training [--part 0/1]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import egraph_did as ed
from egraph_did import models
from egraph_did.layout import Layout, P, R, S, is_valid
from egraph_did.pins import apply_layout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BF16 = torch.bfloat16
MESH = ed.DeviceMesh.arange(8)
COL = ("wq", "wk", "wv", "w1")  # column-parallel: out-features split
ROW = ("wo", "w2")  # row-parallel: in-features split


def _pin(tv, layout):
    apply_layout(tv, layout, MESH)


def megatron(fd, seq_axis: int | None):
    """Pin Megatron's layout: x, y replicated (TP) or split along seq_axis (SP), column/row-parallel
    weights, and every intermediate as the same propagation derives it from those (heads split
    through attention, a pending sum after each row-parallel linear)."""
    def weights(tv):
        base = tv.name.split(".")[-1]
        return Layout((S(0),)) if base in COL else Layout((S(1),)) if base in ROW else Layout((R,))
    return dtensor_propagation(fd, seq_axis, weights)


def _rule(e, lay_in: dict) -> Layout:
    """The DTensor-style output layout of expression e from its inputs' layouts (see the docstring)."""
    out = e.outputs[0]
    args = dict(e.args)
    op = e.op.name
    if op == "linear":
        x, w = args["x"], args["weight"]
        lx, lw = lay_in[x.name][0], lay_in[w.name][0]
        if lw.is_shard and lw.axis == 0:  # column parallel (x gathered first if it is split)
            return Layout((S(out.ndim - 1),))
        if lw.is_shard and lx.is_shard and lx.axis == x.ndim - 1:  # row parallel: a pending sum
            return Layout((P,))
        if lx.is_shard and lx.axis < x.ndim - 1 and not lw.is_shard:
            return Layout((S(lx.axis),))
        return Layout((R,))
    first = next(((tv, lay_in[tv.name]) for tv in e.inputs if lay_in[tv.name][0].is_shard), None)
    if first is None:
        return Layout((R,))
    tv, lay = first
    a = lay[0].axis
    if op == "reshape":
        si, so = tv.shape, out.shape
        if si[:a] == so[:a] and len(so) > a + 1 and si[a] == so[a] * so[a + 1]:
            return Layout((S(a),))  # split axis a: the shard stays on its outer part
        if si[:a] == so[:a] and len(si) > a + 1 and so[a] == si[a] * si[a + 1]:
            return Layout((S(a),))  # merge a with the next: the shard is the outer part
        k = next((i for i, (p, q) in enumerate(zip(si, so)) if p != q), min(len(si), len(so)))
        return Layout((S(a),)) if a < k else Layout((R,))
    if op == "permute":
        return Layout((S(list(args["dims"]).index(a)),))
    if op in ("layer_norm", "softmax", "rms_norm"):
        return Layout((S(a),)) if tv is args["x"] and a < tv.ndim - 1 else Layout((R,))
    if op == "sdpa":
        return Layout((S(a),)) if tv is args["q"] and a in (0, 1) and lay_in[args["k"].name] == lay \
            and lay_in[args["v"].name] == lay else Layout((R,))
    if tv.ndim == out.ndim and tv.shape == out.shape:  # pointwise
        return lay
    return Layout((R,))


def dtensor_propagation(fd, seq_axis: int | None, weights=None):
    """Pin x as the scenario says and weights Shard(0) (layer-norm weights replicated), or as
    `weights(tv)` says, then propagate layouts op by op."""
    lay = {}
    x_lay = Layout((R,)) if seq_axis is None else Layout((S(seq_axis),))
    for tv in fd.fusion.inputs:
        lay[tv.name] = x_lay if tv.name == "x" else weights(tv) if weights else \
            Layout((S(0),)) if tv.ndim == 2 else Layout((R,))
        _pin(tv, lay[tv.name])
    for e in fd.fusion.exprs:
        out = e.outputs[0]
        got = _rule(e, lay)
        if not is_valid(got, out.shape, MESH):
            got = Layout((R,))
        lay[out.name] = got
        name = next((k for k, v in fd.fusion.outputs.items() if v is out), None)
        if name is None:
            _pin(out, got)
    _pin(fd["y"], x_lay)  # the block hands back what it was given
    return fd


def compare() -> None:
    cases = [
        ("MLP, 32 tok, h 8192", lambda: models.mlp(32, 8192, BF16), None, 0),
        ("MLP, 8192 tok, h 4096", lambda: models.mlp(8192, 4096, BF16), None, 0),
        ("GPT layer, s 256, h 4096", lambda: models.gpt_layer(1, 256, 4096, 32, BF16), None, 1),
        ("GPT layer, s 8192, h 4096", lambda: models.gpt_layer(1, 8192, 4096, 32, BF16), None, 1),
    ]
    print(f"\n{'model':<28}{'case':<6}{'layout':<26}{'time us':>8}{'MiB moved':>11}  collectives")
    for name, make, _, seq in cases:
        for scen, axis in (("TP", None), ("SP", seq)):
            rows = []
            ours = make()
            io = Layout((R,)) if axis is None else Layout((S(axis),))
            _pin(ours["x"], io), _pin(ours["y"], io)
            rows.append(("egraph-did (x, y pinned)", lambda: ed.optimize(ours, MESH)))
            rows.append(("Megatron (pinned)", lambda: ed.optimize(megatron(make(), axis), MESH)))
            rows.append(("DTensor-style propagation", lambda: ed.optimize(dtensor_propagation(make(), axis), MESH)))
            for label, run in rows:
                try:
                    plan = run()
                    kinds = {}
                    for c in plan.collectives:
                        kinds[c.kind] = kinds.get(c.kind, 0) + 1
                    print(f"{name:<28}{scen:<6}{label:<26}{plan.predicted_time * 1e6:>8.1f}"
                          f"{sum(c.bytes for c in plan.collectives) / 2**20:>11.2f}  "
                          + " ".join(f"{k}:{n}" for k, n in sorted(kinds.items())))
                except ed.EgraphDidError as e:
                    print(f"{name:<28}{scen:<6}{label:<26}  no plan: {str(e)[:80]}")


TRAINING_SHAPES = {"mlp": [(64, 32), (256, 64), (1024, 256), (4096, 1024)],  # (tokens, hidden), fp32
                   "gpt": [(1, 64, 64, 4), (1, 128, 128, 4), (2, 128, 256, 4), (1, 512, 512, 8)]}  # (batch, seq, hidden, heads), bf16


def training_step(kind: str, shape: tuple, ranks: int, seq_sharded: bool):
    """(fusion, mesh) of one small training step of bench's --training sweep; x and target split along the
    tokens (mlp) or the sequence (gpt) where seq_sharded.

    >>> fd, mesh = training_step("mlp", (64, 32), 2, True)
    >>> fd["x"].loop_str(), fd["x"].mesh is mesh
    ('[DIDx{2}, s/2, h]', True)
    """
    mesh = ed.DeviceMesh.arange(ranks)
    fd = models.mlp_training_step(*shape) if kind == "mlp" else models.gpt_training_step(*shape, BF16)
    if seq_sharded:
        for name in ("x", "target"):
            apply_layout(fd[name], Layout((S(0 if kind == "mlp" else 1),)), mesh)
    return fd, mesh


def training_gap(part: int = 0, parts: int = 1) -> list[str]:
    """One line per step (the cases part::parts of the sweep): greedy's and exact's plans of it, and the gap."""
    import time
    cases = [(k, shape, ranks, ss) for ranks in (2, 4) for k in ("mlp", "gpt") for shape in TRAINING_SHAPES[k]
             for ss in (False, True)]
    lines = []
    for kind, shape, ranks, ss in cases[part::parts]:
        plans = {}
        for extractor in ("greedy", "exact"):
            t0 = time.perf_counter()
            plans[extractor] = (ed.optimize(*training_step(kind, shape, ranks, ss), extractor=extractor),
                                time.perf_counter() - t0)
        (g, g_s), (e, e_s) = plans["greedy"], plans["exact"]
        lines.append(f"{kind} {shape} ranks {ranks} {'seq-sharded' if ss else 'free'}: greedy {g.predicted_time * 1e6:9.2f} us "
                     f"({len(g.stats['passes'])} passes, {g_s:5.1f} s)  exact {e.predicted_time * 1e6:9.2f} us ({e.method}, "
                     f"{len(e.stats['passes'])} passes, {e_s:5.1f} s)  gap {g.predicted_time / e.predicted_time - 1:+.2%}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=40, help="random fusions for greedy vs exact")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-gap", action="store_true")
    ap.add_argument("--training", action="store_true", help="greedy vs exact on small training steps, only")
    ap.add_argument("--part", default="0/1", help="--training: the share i/n of the steps to run (for parallel runs)")
    args = ap.parse_args()
    if args.training:
        part, parts = map(int, args.part.split("/"))
        for line in training_gap(part, parts):
            print(line, flush=True)
        return
    if not args.skip_gap:
        import extraction_gap
        print("== greedy-DAG vs exact extraction on random fusions (bench/extraction_gap.py) ==")
        argv, sys.argv = sys.argv, ["extraction_gap.py", "--cases", str(args.cases), "--seed", str(args.seed)]
        try:
            extraction_gap.main()
        finally:
            sys.argv = argv
    print("\n== our plans vs Megatron's layouts vs DTensor-style propagation (8x H200, bf16, same cost model) ==")
    compare()


if __name__ == "__main__":
    main()
