"""Planning Llama-3-8B's training step at its real sizes on the meta device (issue 27, item 3).

The model is transformers' LlamaForCausalLM built under torch.device("meta") (32 layers, hidden 4096, GQA 32/8
heads, intermediate 14336, vocab 128256, bf16): no weight is allocated. The step is what ed.parallelize plans
on rank 0: the module (its loss from input_ids and labels, [batch, seq] on meta) exported by ed.from_torch,
then the joint forward + backward plan of every parameter's gradient (parallelize.optimize_joint: the loss
delivered whole, each parameter and its gradient in the layout the plan first loads it in, re-optimized
where they differed). The optimizer update is torch.optim's, on the shards, as under parallelize.

Seconds are this process's CPU time (time.process_time: the machine is shared), per stage: build (the meta
module), export (torch.export, non-strict), convert (the ATen graph to a fusion), then optimize_joint, and under
it each optimize pass's problem / e-graph / pricing / extraction seconds (logger 'egraph_did': optimize_joint
optimizes the free step, then again with each parameter pinned where the first plan loaded it if it loaded one in
two layouts; each optimize is 2 passes where it offers bucket pairs). The plan is
printed: every parameter's layout (one line per distinct layout of the first layer and the embeddings) and the
step's collectives by kind.

    .venv/bin/python bench/llama_meta.py [--layers 1 2 32] [--mesh 8 | --mesh 2x4] [--batch 8] [--seq 8192]
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import egraph_did as ed  # noqa: E402
from egraph_did import frontend  # noqa: E402
from egraph_did.parallelize import optimize_joint  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False)


class Loss(torch.nn.Module):
    """The causal LM's loss alone: the step's one output (ed.parallelize delivers outputs whole)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        return self.lm(input_ids, labels=labels, use_cache=False).loss


def build(layers: int, **overrides) -> torch.nn.Module:
    import transformers
    cfg = transformers.LlamaConfig(**(LLAMA3_8B | {"num_hidden_layers": layers} | overrides))
    with torch.device("meta"):
        lm = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return Loss(lm)


def mesh_of(spec: str) -> ed.DeviceMesh:
    if "x" in spec:
        dp, tp = (int(n) for n in spec.split("x"))
        return ed.DeviceMesh(torch.arange(dp * tp).reshape(dp, tp), axis_names=("dp", "tp"))
    return ed.DeviceMesh.arange(int(spec))


def plan(layers: int, mesh: ed.DeviceMesh, batch: int, seq: int, extractor: str = "greedy") -> dict:
    t = time.process_time()
    module = build(layers)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    build_s = time.process_time() - t
    assert all(p.is_meta for p in module.parameters())

    t = time.process_time()
    with torch.no_grad():
        ep = torch.export.export(module, (ids, ids), strict=False)
    export_s = time.process_time() - t
    t = time.process_time()
    fd = frontend._Converter(ep, module).run()  # what from_torch does after its export
    convert_s = time.process_time() - t

    passes = _Passes()  # every optimize pass's INFO line: optimize_joint may optimize twice, 2 passes each
    logging.getLogger("egraph_did").addHandler(passes)
    logging.getLogger("egraph_did").setLevel(logging.INFO)
    t = time.process_time()
    for name in fd.fusion.outputs:
        fd[name].set_device_mesh(mesh)  # delivered whole, as ed.parallelize pins its outputs
    wrt = [p for p in fd.params if module.get_parameter(p).requires_grad]
    split = optimize_joint(fd, list(fd.fusion.outputs), wrt, mesh, ed.CostModel.h200(), extractor)
    optimize_s = time.process_time() - t
    logging.getLogger("egraph_did").removeHandler(passes)
    assert all(p.is_meta for p in module.parameters())  # nothing materialized
    joint = split.joint
    return {"layers": layers, "mesh": str(mesh), "exprs": len(fd.fusion.exprs), "build_s": build_s,
            "export_s": export_s, "convert_s": convert_s, "optimize_s": optimize_s,
            "total_s": build_s + export_s + convert_s + optimize_s, "plan": joint, "fd": fd, "passes": passes.lines,
            "predicted_ms": joint.predicted_time * 1e3}


class _Passes(logging.Handler):
    """Collects the lines logger 'egraph_did' gives at INFO (one per optimize pass)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def describe(r: dict) -> str:
    """The plan: parameter layouts (first layer and the rest), collectives by kind, passes' stage seconds."""
    joint, fd = r["plan"], r["fd"]
    lines = []
    for p in fd.params:
        if ".layers." in p and ".layers.0." not in p:
            continue
        lines.append(f"    {p:<48} {str(joint.layout_of(p)):<10} {joint.loop_domain(p)}")
    kinds = Counter(c.kind for c in joint.collectives)
    lines.append("    collectives: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    lines += [f"    {line}" for line in r["passes"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2, 32])
    ap.add_argument("--mesh", default="8", help="ranks (8) or dp x tp (2x4)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--extractor", default="greedy", choices=["greedy", "exact"])
    args = ap.parse_args()
    mesh = mesh_of(args.mesh)
    print(f"Llama-3-8B shapes on the meta device, training step (forward + backward, ed.parallelize's joint plan), "
          f"batch {args.batch} x seq {args.seq}, bf16, mesh {mesh}, {args.extractor} extraction; CPU seconds")
    cols = ["layers", "exprs", "build_s", "export_s", "convert_s", "optimize_s", "total_s", "predicted_ms"]
    print(" | ".join(f"{c:>12}" for c in cols))
    for n in args.layers:
        r = plan(n, mesh, args.batch, args.seq, args.extractor)
        print(" | ".join(f"{r[c]:>12.3f}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in cols), flush=True)
        print(describe(r), flush=True)


if __name__ == "__main__":
    main()
