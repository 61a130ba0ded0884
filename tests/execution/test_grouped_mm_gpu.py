"""grouped_mm on a GPU (skipped without one): a rank's block of a bf16 MoE layer's rows agrees with the float64
expert-by-expert reference, forward (expert by expert: cuBLAS beat torch._grouped_mm there) and weight gradient
(one torch._grouped_mm, CUTLASS on compute capability 9+), whole and as an expert-parallel rank's block."""
import pytest
import torch

from egraph_did.ops import _grouped_mm_block, _grouped_wgrad_block

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="torch._grouped_mm's bf16 kernel needs a GPU of compute capability 9+")


def _inputs(rows=1024, d=256, f=512, experts=8, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, d, device="cuda", generator=g).bfloat16()
    w = (torch.randn(experts, d, f, device="cuda", generator=g) / d ** 0.5).bfloat16()
    dy = torch.randn(rows, f, device="cuda", generator=g).bfloat16()
    counts = torch.tensor([0, 200, 37, 1, 300, 100, 250, 100], device="cuda")  # an empty expert; 36 rows past the end
    return x, w, dy, torch.cumsum(counts, 0)


@pytest.mark.parametrize("start, total, e_lo, e_hi", [(0, None, 0, 8), (256, 1024, 2, 6)])
def test_grouped_mm_block_on_the_gpu_is_one_call_equal_to_float64(monkeypatch, start, total, e_lo, e_hi):
    x, w, dy, offsets = _inputs()
    rows = slice(start, None if total is None else start + 256)
    x, dy, w = x[rows], dy[rows], w[e_lo:e_hi].contiguous()
    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    y = _grouped_mm_block(x, w, offsets, start, total, e_lo)
    dw = _grouped_wgrad_block(x, dy, offsets, start, total, e_lo, e_hi)
    assert len(calls) == 1  # the weight gradient (the forward runs expert by expert on a GPU: faster there)
    ref_y = _grouped_mm_block(x.double(), w.double(), offsets, start, total, e_lo)
    ref_dw = _grouped_wgrad_block(x.double(), dy.double(), offsets, start, total, e_lo, e_hi)
    # bf16 inputs, float32 accumulation: within bf16's rounding of the outputs
    assert torch.allclose(y.double(), ref_y, rtol=2e-2, atol=2e-2), (y.double() - ref_y).abs().max()
    assert torch.allclose(dw.double(), ref_dw, rtol=2e-2, atol=2e-1), (dw.double() - ref_dw).abs().max()
    assert not y[ref_y.abs().sum(1) == 0].any()  # other experts' rows and rows past the end are zero
