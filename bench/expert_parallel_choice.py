"""Why the cost model does not choose expert parallelism (issue 28 item 4): transformers' MixtralSparseMoeBlock
at Mixtral 8x7B's sizes (8 experts, top-2, hidden 4096, experts' width 14336; bf16 on the meta device), its
forward or a training step (the loss mean(y^2) and every parameter's gradient, ed.grad), planned on 4 or 8
ranks under CostModel.h200 (and on 2 nodes of 4 GPUs under CostModel.h200_multinode) with the tokens x split (as data or sequence parallelism hands them) or whole,
with and without a memory bound. Two plans per case: every parameter free, and the experts' weights (and in
the step their gradients) pinned split on the experts. Per plan: the predicted time, memory per device, the
layouts chosen for the experts' weights, the grouped rules run and the collectives; for the pinned plan also
the time of the collectives of the hidden rows (the [tokens * top-k, width] tensors between the two grouped
matmuls) and the predicted time without them: the plan that expert parallelism would be if each rank's
hidden rows stayed on it, as they do in expert-parallel training.

    PYTHONPATH=. .venv/bin/python bench/expert_parallel_choice.py                 # the cases below
    PYTHONPATH=. .venv/bin/python bench/expert_parallel_choice.py 4096 4 step split none
    PYTHONPATH=. .venv/bin/python bench/expert_parallel_choice.py 4096 2x4 forward whole none   # 2 nodes

bench/results_expert_parallel_choice.txt holds a run.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # torch.export imports Triton, whose jit reads this once

import torch  # noqa: E402

import egraph_did as ed  # noqa: E402
from egraph_did.collectives import EXCHANGE_FLAGS, exchange_bytes  # noqa: E402
from egraph_did.errors import EgraphDidError  # noqa: E402
from egraph_did.layout import Layout  # noqa: E402
from egraph_did.pins import apply_layout  # noqa: E402

HIDDEN, WIDTH, EXPERTS, TOP_K = 4096, 14336, 8, 2
WEIGHTS = ("b.experts.gate_up_proj", "b.experts.down_proj")
GIB = 2 ** 30
# (tokens, ranks, "forward" | "step", tokens "split" | "whole", memory bound in GiB or None)
# (bounds: 4 GiB per device holds no plan of 16384 tokens with the experts' weights whole, 2.625 GiB)
CASES = [(t, p, what, x, bound) for what in ("forward", "step") for t in (4096, 16384) for p in (4, 8)
         for x in ("split", "whole") for bound in ((None,) if t == 4096 else (None, 4, 6))]
# two nodes of 4 GPUs (CostModel.h200_multinode: InfiniBand between the nodes); pinned: the experts over the nodes
CASES += [(4096, (2, 4), what, x, None) for what in ("forward", "step") for x in ("split", "whole")]


class Block(torch.nn.Module):
    """The MoE block's output, or the loss mean(y^2) of it in float32 (a scalar for ed.grad)."""

    def __init__(self, block, loss: bool):
        super().__init__()
        self.b, self.loss = block, loss

    def forward(self, x):
        y = self.b(x)
        y = y[0] if isinstance(y, tuple) else y
        return y.float().square().mean() if self.loss else y


def fusion(tokens: int, mesh, step: bool, split: bool, pin: bool):
    """The block's forward (x and out pinned) or step (x pinned, the loss whole), on the meta device; pin:
    the experts' weights (and their gradients) split on the experts."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=WIDTH, num_local_experts=EXPERTS,
                                     num_experts_per_tok=TOP_K, experts_implementation="grouped_mm")
    with torch.device("meta"):
        block = Block(MixtralSparseMoeBlock(cfg).to(torch.bfloat16), loss=step)
        x = torch.empty(1, tokens, HIDDEN, dtype=torch.bfloat16)
    fd = ed.from_torch(block, (x,))
    if step:
        fd = ed.grad(fd, "out", list(fd.params))
    def lay(p):  # p on every mesh axis
        return Layout(tuple([Layout.parse(f"[{p}]")[0]] * mesh.ndim))
    apply_layout(fd["x"], lay("S(1)" if split else "R"), mesh)
    apply_layout(fd["out"], lay("R" if step or not split else "S(1)"), mesh)
    experts = Layout.parse("[S(0)]" if mesh.ndim == 1 else "[S(0), R]")  # on a 2-D mesh: over the nodes
    for name in WEIGHTS if pin else ():
        for t in (name, "grad_" + name) if step else (name,):
            apply_layout(fd[t], experts, mesh)
    return fd


def hidden_rows(plan, tokens: int) -> list:
    """The collectives of [tokens * top-k, width or 2 * width] tensors: the rows between the grouped matmuls."""
    return [c for c in plan.collectives
            if tuple(plan.values[c.src].shape) in ((tokens * TOP_K, WIDTH), (tokens * TOP_K, 2 * WIDTH))]


def exchanges(plan) -> list[tuple]:
    """(flag, step, bytes, seconds) of each grouped_mm step that dispatches or combines by an all-to-all inside
    it (collectives.EXCHANGES), as the cost model prices it (a rank's share of the rows, balanced routing)."""
    out = []
    for s in plan.compute_steps:
        for flag, (m, *_) in s.flags:
            if flag in EXCHANGE_FLAGS:
                # the dispatch moves the operand split on its rows: grouped_mm's x, grouped_mm_wgrad's x or g
                split = [v for k, v in s.operands.items() if k in ("x", "g") and plan.values[v].layout[m].is_shard]
                rows = plan.values[s.outputs[0] if EXCHANGE_FLAGS[flag].src == "spans" else split[0]]
                n = plan.mesh.shape[m]
                itemsize = getattr(torch, str(rows.dtype).replace("torch.", "")).itemsize  # a plan's dtype is text
                b = exchange_bytes(rows.shape[0], rows.shape[1], itemsize, n)
                out.append((flag, s.key, b, plan.cost_model.exchange_time(b, n, m, plan.mesh.ndim)))
    return out


def describe(tag: str, plan, tokens: int) -> list[str]:
    """A plan's lines: time, memory, the experts' layouts and rules, collectives (MiB)."""
    lay = ", ".join(f"{n.split('.')[-1]} {plan.layout_of(n)}" for n in WEIGHTS)
    rules = sorted({r for s in plan.compute_steps if s.op.startswith("grouped") for r in s.rules})
    coll = ", ".join(f"{c.kind} {c.tensor} {c.bytes / 2 ** 20:g}" for c in plan.collectives)
    out = [f"  {tag}: {plan.predicted_time * 1e6:.1f} us, {plan.memory / GIB:.2f} GiB; experts {lay}; {' '.join(rules)}",
           f"    collectives (MiB): {coll}"]
    ex = exchanges(plan)
    if ex:
        out.append("    exchanges (MiB a rank, balanced): " + ", ".join(f"{f} {k} {b / 2 ** 20:g} ({t * 1e6:.1f} us)"
                                                                   for f, k, b, t in ex))
    rows = hidden_rows(plan, tokens)
    if rows:
        t = sum(c.time for c in rows)
        out.append(f"    hidden rows moved: {sum(c.bytes for c in rows) / 2 ** 20:g} MiB in {len(rows)} collectives, "
                   f"{t * 1e6:.1f} us; without them {(plan.predicted_time - t) * 1e6:.1f} us")
    return out


def case(tokens: int, ranks: int, what: str, x: str, bound) -> list[str]:
    """Both plans of one case."""
    if isinstance(ranks, tuple):
        mesh = ed.DeviceMesh(torch.arange(ranks[0] * ranks[1]).reshape(ranks).tolist(), axis_names=("node", "gpu"))
        cm = ed.CostModel.h200_multinode(memory_limit=bound * GIB if bound else None)
    else:
        mesh = ed.DeviceMesh.arange(ranks)
        cm = ed.CostModel.h200(memory_limit=bound * GIB if bound else None)
    where = f"{ranks} ranks" if isinstance(ranks, int) else f"{ranks[0]} nodes x {ranks[1]} GPUs"
    lines = [f"{tokens} tokens, {where}, {what}, x {x}" + (f", under {bound} GiB" if bound else "")]
    for tag, pin in (("free", False), ("weights pinned on the experts", True)):
        t0 = time.perf_counter()
        try:
            plan = ed.optimize(fusion(tokens, mesh, what == "step", x == "split", pin), mesh, cm)
            lines += describe(tag, plan, tokens)
        except EgraphDidError as e:
            lines.append(f"  {tag}: {type(e).__name__}: {str(e)[:150]}")
        lines[-1] += f" [{time.perf_counter() - t0:.1f} s]"
    return lines


if __name__ == "__main__":
    args = sys.argv[1:]
    cases = CASES if not args else [(int(args[0]), tuple(map(int, args[1].split("x"))) if "x" in args[1] else int(args[1]),
                                     args[2], args[3], None if args[4] == "none" else float(args[4]))]
    for c in cases:
        print("\n".join(case(*c)), flush=True)
