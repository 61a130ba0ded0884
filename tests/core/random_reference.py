"""An independent reference of dropout's random stream (egraph_did.ops.random_bits), in Python integers:
no torch, no int64, every product reduced mod 2**32 as the hash states it. The op table's torch version
must give these bits exactly, on any device and under any sharding."""
from __future__ import annotations

import torch

M32 = 0xFFFFFFFF


def fmix32(h: int) -> int:
    """murmur3's 32-bit finalizer.

    >>> fmix32(0), fmix32(1)
    (0, 1364076727)
    """
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def bits(seed: int, counter: int) -> int:
    """The 32 random bits of one counter under one seed (a Python int, negative allowed: two's complement).

    >>> 0 <= bits(-5, 2 ** 40 + 3) < 2 ** 32
    True
    """
    seed &= (1 << 64) - 1
    k0 = fmix32((seed & M32) ^ 0x9E3779B9)
    k1 = fmix32(((seed >> 32) & M32) ^ k0 ^ 0x7F4A7C15)
    return fmix32(fmix32((counter & M32) ^ k0) ^ (counter >> 32) ^ k1)


def keep_mask(seed: int, p: float, shape, offset: int = 0) -> torch.Tensor:
    """The bool keep-mask of dropout(x, seed, p, offset) for x of `shape`: element i (row-major) is kept
    where bits(seed, offset + i) >= round(p * 2**32).

    >>> keep_mask(7, 0.0, (2, 2)).all().item(), keep_mask(7, 1.0, (3,)).any().item()
    (True, False)
    """
    t = min(round(p * 2 ** 32), 2 ** 32)
    n = 1
    for e in shape:
        n *= e
    return torch.tensor([bits(seed, offset + i) >= t for i in range(n)], dtype=torch.bool).reshape(tuple(shape))


def dropout(x: torch.Tensor, seed: int, p: float, offset: int = 0) -> torch.Tensor:
    """x * mask / (1 - p) through torch (differentiable in x, so autograd gives the reference gradient).

    >>> dropout(torch.ones(4), 3, 0.0).tolist()
    [1.0, 1.0, 1.0, 1.0]
    """
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return x * (keep_mask(seed, p, x.shape, offset).to(x.dtype) * scale)
