"""Which fused attention kernel the training step should call on a GPU: torch's flash (FlashAttention-2),
memory-efficient (cutlass) and cuDNN attention, forward and backward, at the GPT-3 layer's per-rank
shape (8-way TP: batch 1, 12 heads, sequence 2048, head dim 128, causal, bf16), against what
F.scaled_dot_product_attention (torch.compile's choice) runs.

    python bench/attention_backends.py            # on a GPU (prints a table; commit it under bench/)
    python bench/attention_backends.py --heads 96 --seq 2048

Per backend: forward and backward GPU us (triton.testing.do_bench, median), the kernels the profiler
names, and numerics against a float64 reference (max |error| of out, lse, dq, dk, dv over the
reference's max |value|). "mixed" rows check that one backend's logsumexp feeds another's backward
(the plan's sdpa_lse and sdpa_backward are separate steps, so which pairs are interchangeable matters).
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.attention
import torch.nn.functional as F

aten = torch.ops.aten


def reference(q, k, v, g, causal, scale):
    """out, lse, dq, dk, dv in float64 by the definition."""
    q, k, v, g = (t.double().detach().requires_grad_(t is not g) for t in (q, k, v, g))
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    return out.detach(), lse.detach(), dq, dk, dv


def flash(q, k, v, g, causal, scale):
    out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    def bwd(lse_in=lse):
        return aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out, lse_in, None, None, q.shape[2], k.shape[2], 0.0, causal, None, None, scale=scale)[:3]
    return (lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)), out, lse, bwd


def efficient(q, k, v, g, causal, scale):
    res = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    out, lse = res[0], res[1]
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    def bwd(lse_in=lse):
        padded = F.pad(lse_in[..., :q.shape[2]], (0, -q.shape[2] % 32)).contiguous()
        return aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, None, out, padded, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)[:3]
    return (lambda: aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)), \
        out, lse[..., :q.shape[2]], bwd


def cudnn(q, k, v, g, causal, scale):
    def fwd():
        return aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    res = fwd()
    out, lse, cq, ck, mq, mk, seed, offset = res[:8]
    def bwd(lse_in=lse):
        if lse_in.dim() == 3 and lse.dim() == 4:
            lse_in = lse_in.unsqueeze(-1)
        return aten._scaled_dot_product_cudnn_attention_backward(
            g, q, k, v, out, lse_in, seed, offset, None, cq, ck, mq, mk, 0.0, causal, scale=scale)[:3]
    return fwd, out, lse.reshape(lse.shape[:3]) if lse.dim() == 4 else lse, bwd


def egraph_did_ops(q, k, v, g, causal, scale):
    """what a plan's sdpa_lse and sdpa_backward steps call (egraph_did.ops' fused paths)"""
    from egraph_did import ops
    out, lse = ops._fused_forward(q, k, v, causal, scale)
    def bwd(lse_in=lse):
        return ops._fused_backward(g, q, k, v, out, lse_in, causal, scale)
    return (lambda: ops._fused_forward(q, k, v, causal, scale)), out, lse, bwd


BACKENDS = {"flash": flash, "efficient": efficient, "cudnn": cudnn, "egraph-did ops": egraph_did_ops}


def kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:60] for e in prof.events() if e.device_type.name == "CUDA"})


def err(got, want) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument("--views", action="store_true", help="q, k, v, g as [b, h, s, d] views of [b, s, h, d] tensors "
                    "(as a linear's output permuted), not contiguous")
    a = ap.parse_args()
    from triton.testing import do_bench
    causal = not a.no_causal
    torch.manual_seed(0)
    shape = (a.batch, a.heads, a.seq, a.dim)
    if a.views:
        q, k, v, g = (torch.randn((a.batch, a.seq, a.heads, a.dim), device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                      for _ in range(4))
    else:
        q, k, v, g = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1.0 / math.sqrt(a.dim)
    ref = reference(q, k, v, g, causal, scale)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"q/k/v/g {list(shape)} bf16, causal={causal}, {'views of [b, s, h, d]' if a.views else 'contiguous'}")
    qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
    def default_fwd():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    o = default_fwd()
    def default_bwd():
        return torch.autograd.grad(o, (qt, kt, vt), g, retain_graph=True)
    choice = torch._fused_sdp_choice(qt, kt, vt, None, 0.0, causal, scale=None)
    print(f"torch._fused_sdp_choice: {torch.nn.attention.SDPBackend(choice).name}")
    print(f"F.scaled_dot_product_attention forward kernels: {kernels(default_fwd)}")
    print(f"its autograd backward kernels: {kernels(default_bwd)}")
    t_def_f, t_def_b = do_bench(default_fwd), do_bench(default_bwd)
    print(f"{'backend':<22}{'fwd us':>9}{'bwd us':>9}{'sum us':>9}  err out / lse / dq / dk / dv vs float64")
    print(f"{'F.sdpa default':<22}{t_def_f * 1e3:9.1f}{t_def_b * 1e3:9.1f}{(t_def_f + t_def_b) * 1e3:9.1f}")
    lses = {}
    bwds = {}
    for name, make in BACKENDS.items():
        try:
            fwd, out, lse, bwd = make(q, k, v, g, causal, scale)
            dq, dk, dv = bwd()
        except RuntimeError as e:
            print(f"{name:<22} refused: {str(e)[:120]}")
            continue
        lses[name], bwds[name] = lse, bwd
        tf, tb = do_bench(fwd), do_bench(bwd)
        errs = [err(out, ref[0]), err(lse, ref[1]), err(dq, ref[2]), err(dk, ref[3]), err(dv, ref[4])]
        print(f"{name:<22}{tf * 1e3:9.1f}{tb * 1e3:9.1f}{(tf + tb) * 1e3:9.1f}  " + " / ".join(f"{e:.1e}" for e in errs)
              + f"   lse {tuple(lse.shape)} {lse.dtype}")
        print(f"    kernels fwd {kernels(fwd)} bwd {kernels(bwd)}")
    for a_, b_ in (("flash", "cudnn"), ("cudnn", "flash")):
        if a_ in lses and b_ in bwds:
            try:
                dq, dk, dv = bwds[b_](lses[a_].contiguous())
                print(f"mixed: {a_} lse -> {b_} backward: err dq/dk/dv {err(dq, ref[2]):.1e} / {err(dk, ref[3]):.1e} / "
                      f"{err(dv, ref[4]):.1e}; lse max |{a_} - {b_}| {float((lses[a_] - lses[b_]).abs().max()):.2e}")
            except RuntimeError as e:
                print(f"mixed: {a_} lse -> {b_} backward refused: {str(e)[:120]}")


if __name__ == "__main__":
    main()
