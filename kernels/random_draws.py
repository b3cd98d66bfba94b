"""The sampling contract's uniform draws (services/worker/sample/random_draws.py) in one Triton
kernel: the same integer hash, so the same bits, as the numpy words the CPU runs. On a GPU
tensor ops were ~25 launches a random-sampling step for a few hundred numbers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernels  # noqa: F401 - interpreter without a GPU

BLOCK = 256


@triton.jit
def _mul32(x, C: tl.constexpr):
    """(x * C) mod 2**32 for words x in [0, 2**32), within int64 (as the PyTorch version)."""
    lo: tl.constexpr = C & 0xFFFF
    hi: tl.constexpr = C >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & 0xFFFFFFFF


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def _uniform_kernel(seeds_ptr, positions_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    seed = tl.load(seeds_ptr + i, mask=mask, other=0).to(tl.int64)
    pos = tl.load(positions_ptr + i, mask=mask, other=0).to(tl.int64)
    m32 = tl.full((BLOCK,), 0xFFFFFFFF, tl.int64)  # (an int64 constant: the literal alone would be uint32)
    h = _mix32((seed & m32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seed >> 32) & m32))
    h = _mix32(h ^ (pos & m32))
    a = _mix32(h ^ ((pos >> 32) & m32))
    b = _mix32(a ^ 0x85EBCA6B)
    bits = (a >> 5) * (1 << 26) + (b >> 6)  # 53 bits
    tl.store(out_ptr + i, bits.to(tl.float64) * (1.0 / (1 << 53)), mask=mask)


def uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """u(seed, position) in [0, 1), float64, for int64 tensors of one shape."""
    seeds, positions = seeds.contiguous(), positions.contiguous()
    out = torch.empty(seeds.shape, dtype=torch.float64, device=seeds.device)
    n = seeds.numel()
    if n:
        _uniform_kernel[(triton.cdiv(n, BLOCK),)](seeds, positions, out, n, BLOCK=BLOCK)
    return out
