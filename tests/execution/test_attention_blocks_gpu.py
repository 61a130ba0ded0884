"""attention_blocks on a GPU (skipped without one): each block of the keys runs in torch's fused kernels
(flash for 16-bit operands, memory-efficient for float32) on pieces of its rows and keys, merged by their
logsumexps, equal to the block's math in float64 at any query and key offset, causal or not; and a long
block allocates nothing of [queries, keys] (the scores of 8192 x 8192 per head would be 2 GiB here).

Seen on one H100 (torch 2.11, 2026-12-06; these functions as committed, run outside pytest since the
device image has no egglog): largest error against float64 2.4e-3 (bf16), 8.2e-3 (bf16, causal), 6.5e-7
(float32), 1.2e-6 (float32, causal); a diagonal block of 8192 queries x 4096 keys, 8 heads, bf16, peaked at
93 MiB over its operands (its float32 scores alone would be 1 GiB). The causal backward over a shard of the
queries and of the keys (sdpa_backward's causal_offsets kernel) likewise: relative errors against float64
at most 6.4e-3 (bf16) and 2.8e-6 (float32) for dq, dk and dv; 8192 rows x 4096 keys, 8 heads, bf16 peaked
at 153 MiB (its probabilities alone would be 1 GiB)."""
import pytest
import torch

from egraph_did.ops import (_attention_blocks, _attention_scores, _fused_backward_pieces, _fused_block, _math_block,
                            _sdpa_backward_math, lse_dtype)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's fused attention needs a GPU")
TOL = {torch.bfloat16: 2e-2, torch.float32: 2e-3}
BACKWARD_TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}  # of the largest gradient entry
# (queries, block of keys, global offset of the first query, of the first key): whole, none, a diagonal
# through the block, a block past every query, the queries starting inside the block
SPANS = [(256, 256, 0, 0), (256, 512, 512, 0), (200, 300, 100, 150), (128, 256, 0, 512), (64, 96, 32, 0)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_block_in_fused_pieces_equals_its_math(dtype, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    for sq, n, offset, key_offset in SPANS:
        q, k, v = (torch.randn(2, 4, s, 64, generator=g, device="cuda").to(dtype) for s in (sq, n, n))
        got = _fused_block(q, k, v, causal, None, offset, key_offset)
        assert got is not None, f"the fused kernels refused {dtype} at {(sq, n, offset, key_offset)}"
        want = _math_block(q.double(), k.double(), v.double(), causal, None, offset, key_offset)
        tol = TOL[dtype]
        torch.testing.assert_close(got[0].double(), want[0], rtol=tol, atol=tol)
        torch.testing.assert_close(got[1].double(), want[1], rtol=tol, atol=tol)  # -inf where a row sees none


def test_a_long_block_allocates_no_scores():
    q, k, v = (torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = _attention_blocks(q, k, v, 2, True, None, 4096, 0)  # the rank's queries 4096.. against 2 blocks
    torch.cuda.synchronize()
    assert out.shape == (1, 8, 2, 8192, 128) and lse.shape == (1, 8, 2, 8192)
    assert torch.cuda.max_memory_allocated() - base < 256 << 20, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_backward_in_fused_pieces_equals_its_math(dtype, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    for sq, n, offset, key_offset in SPANS:
        q, k, v, dout, out = (torch.randn(2, 4, s, 64, generator=g, device="cuda").to(dtype)
                              for s in (sq, n, n, sq, sq))
        lse = torch.logsumexp(_attention_scores(q.double(), k.double(), causal, None, offset, key_offset), -1)
        lse = torch.where(torch.isfinite(lse), lse + 0.5, torch.zeros_like(lse)).to(lse_dtype(dtype))  # other keys' mass too; 0 where no key is seen (0 * -inf is nan)
        got = _fused_backward_pieces(dout, q, k, v, out, lse, causal, None, offset, key_offset)
        assert got is not None, f"the fused backward refused {dtype} at {(sq, n, offset, key_offset)}"
        want = _sdpa_backward_math(*(t.double() for t in (dout, q, k, v, out, lse)), causal, None, offset, key_offset)
        for a, b in zip(got, want):  # relative to the reference's scale; exact where no query sees a key (b is 0)
            assert (a.double() - b).abs().max().item() <= BACKWARD_TOL[dtype] * b.abs().max().item()


def test_a_long_causal_backward_allocates_no_probabilities():
    q, k, v, dout = (torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    lse = torch.randn(1, 8, 8192, device="cuda") + 12
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _fused_backward_pieces(dout, q, k[:, :, :4096], v[:, :, :4096], q, lse, True, None, 2048, 0)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 256 << 20, torch.cuda.max_memory_allocated() - base
