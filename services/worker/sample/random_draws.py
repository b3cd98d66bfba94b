"""The random-number contract of sampling: a request's draw at output position i is a
function of (seed, i) alone.

One uniform number u(seed, i) in [0, 1) per sampled row, made by a counter-based hash
(Chris Wellons' "lowbias32" finalizer, chained over the 32-bit words of the seed and the
position) out of integer tensor ops. Integer ops give the same bits on every device, so a
seeded request samples the same tokens on CPU and GPU, whatever else shares its batch,
after preemption or migration, and with or without speculation (a draft position's draw
is the one that output position would get). No per-row `torch.Generator`: the draws are
batched tensors of the step's seeds and positions, so the same code runs inside a CUDA
graph.

On a CPU the hash runs in numpy's unsigned 32-bit words, whose multiplies wrap modulo
2**32 by definition (C's unsigned arithmetic): fifty-odd torch ops on 128 numbers took
0.17 ms a step there, numpy's 0.03.
"""

from __future__ import annotations

import numpy as np
import torch

_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
_SEED_KEY, _WORD_KEY = 0x9E3779B9, 0x85EBCA6B


def _mix32(x: np.ndarray) -> np.ndarray:  # uint32 words
    x = x ^ (x >> 16)
    x = x * np.uint32(_C1)
    x = x ^ (x >> 15)
    x = x * np.uint32(_C2)
    return x ^ (x >> 16)


def _words(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The low and high uint32 words of int64 values (two's complement)."""
    bits = x.numpy().view(np.uint64)
    return bits.astype(np.uint32), (bits >> np.uint64(32)).astype(np.uint32)


def uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """u(seed, position) in [0, 1) with 53 random bits, float64, for int64 tensors of the
    same shape (a seed is any 64-bit integer, see `as_int64`). On a GPU in one Triton
    kernel of the same integer ops (kernels/random_draws.py): the same bits."""
    if seeds.is_cuda:
        from kernels.random_draws import uniform as uniform_kernel

        return uniform_kernel(seeds, positions)
    seed_lo, seed_hi = _words(seeds)
    pos_lo, pos_hi = _words(positions)
    h = _mix32(seed_lo ^ np.uint32(_SEED_KEY))
    h = _mix32(h ^ seed_hi)
    h = _mix32(h ^ pos_lo)
    a = _mix32(h ^ pos_hi)
    b = _mix32(a ^ np.uint32(_WORD_KEY))
    bits = ((a >> 5).astype(np.uint64) << np.uint64(26)) | (b >> 6).astype(np.uint64)  # < 2**53
    return torch.from_numpy(bits.astype(np.float64) * (1.0 / (1 << 53)))


def as_int64(seed: int) -> int:
    """A seed of any size as the signed 64-bit integer of its low 64 bits."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [num_rows, vocab] (rows need not be normalized) for
    uniform draws `u` [num_rows]: the first token whose cumulative probability, in id
    order, passes u times the row's total. Exact categorical sampling from one number a
    row; float64 sums keep the boundaries where CPU and GPU agree but for measure ~1e-16."""
    cdf = probs.to(torch.float64).cumsum(-1)
    total = cdf[:, -1]
    # Strictly below the total, so u * total rounding up onto it cannot land past the
    # last token with probability (a zero-probability tail would follow otherwise).
    target = torch.minimum(u.to(torch.float64) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)
