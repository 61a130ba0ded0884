"""Context parallelism (issue 28 item 2): what attention with q, k, v and the output split on the sequence
costs on 4 ranks (CostModel.h200, bf16), with and without the key blocks (attention as a reduction over the
keys: sdpa's rfactor). Per shape: the plan's collectives, the bytes each rank sends (each collective's
bytes times its registry factor: 3/4 of an allgather's result, of an alltoall's buffer, 3/2 of an
allreduce's), the predicted time and memory per device, and whether the plan runs the key blocks.

    PYTHONPATH=. .venv/bin/python -m bench.context_parallel            # this checkout
    PYTHONPATH=<a checkout without attention_blocks> python bench/context_parallel.py   # the baseline

bench/results_context_parallel.txt holds both (the baseline: main at 89f7d08).
"""
from __future__ import annotations

import torch

import egraph_did as ed
from egraph_did.collectives import KINDS
from egraph_did.errors import EgraphDidError
from egraph_did.layout import Layout
from egraph_did.pins import apply_layout

MESH = ed.DeviceMesh.arange(4)
# (heads, queries, keys, head_dim, causal, memory bound in MiB or None)
SHAPES = [
    (16, 512, 65536, 128, False, None),    # a prefill chunk against a long context
    (16, 2048, 131072, 128, False, None),
    (2, 2048, 131072, 128, False, None),   # too few heads for an all-to-all over them
    (2, 2048, 131072, 128, False, 64),
    (16, 16384, 16384, 128, True, None),   # equal lengths, causal: the classic case
    (2, 16384, 16384, 128, True, None),
]


def chunk(heads, queries, keys, dim, causal):
    """out = sdpa(q, k, v), bf16, batch 1, every tensor split on the sequence over the 4 ranks."""
    with ed.FusionDefinition() as fd:
        q = fd.define_tensor((1, heads, queries, dim), torch.bfloat16, name="q")
        k, v = (fd.define_tensor((1, heads, keys, dim), torch.bfloat16, name=n) for n in "kv")
        fd.add_output(fd.ops.sdpa(q, k, v, is_causal=causal), name="out")
    for name in ("q", "k", "v", "out"):
        apply_layout(fd[name], Layout.parse("[S(2)]"), MESH)
    return fd


def row(heads, queries, keys, dim, causal, bound) -> str:
    """One shape's line: its plan's collectives, bytes sent per rank, time, memory, key blocks or not.

    >>> "collectives" in row(2, 8, 16, 4, False, None)
    True
    """
    what = " ".join([f"[1, {heads}, {queries}, {dim}] x [1, {heads}, {keys}, {dim}]"] + ["causal"] * causal
                    + [f"under {bound} MiB"] * bool(bound))
    cm = ed.CostModel.h200(memory_limit=bound << 20 if bound else None)
    try:
        plan = ed.optimize(chunk(heads, queries, keys, dim, causal), MESH, cm)
    except EgraphDidError as e:
        return f"{what}: {type(e).__name__}: {str(e)[:120]}"
    sent = sum(KINDS[c.kind].factor(MESH.size) * c.bytes for c in plan.collectives)
    blocks = any(s.op == "attention_blocks" for s in plan.compute_steps)
    kinds = ", ".join(f"{c.kind} {c.tensor}" for c in plan.collectives)
    return (f"{what}: {len(plan.collectives)} collectives ({kinds}); {sent / 2**20:.2f} MiB sent per rank, "
            f"{plan.predicted_time * 1e6:.1f} us, {plan.memory / 2**20:.1f} MiB per device"
            + ("; key blocks" if blocks else ""))


if __name__ == "__main__":
    for shape in SHAPES:
        print(row(*shape))
