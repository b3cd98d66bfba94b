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

Every multiply keeps to 32-bit words inside int64 (a 32-bit word times a 16-bit half of
the constant < 2**48), so nothing relies on how a device wraps signed overflow.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_M16 = 0xFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
_SEED_KEY, _WORD_KEY = 0x9E3779B9, 0x85EBCA6B


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for words x in [0, 2**32), without leaving int64."""
    return (x * (c & _M16) + (((x * (c >> 16)) & _M16) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def _words(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # `>>` on int64 is arithmetic; the mask makes it the two's-complement high word.
    return x & _M32, (x >> 32) & _M32


def uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """u(seed, position) in [0, 1) with 53 random bits, float64, for int64 tensors of the
    same shape (a seed is any 64-bit integer, see `as_int64`). On a GPU in one Triton
    kernel of the same integer ops (kernels/random_draws.py): the same bits."""
    if seeds.is_cuda:
        from kernels.random_draws import uniform as uniform_kernel

        return uniform_kernel(seeds, positions)
    seed_lo, seed_hi = _words(seeds)
    pos_lo, pos_hi = _words(positions)
    h = _mix32(seed_lo ^ _SEED_KEY)
    h = _mix32(h ^ seed_hi)
    h = _mix32(h ^ pos_lo)
    a = _mix32(h ^ pos_hi)
    b = _mix32(a ^ _WORD_KEY)
    return ((a >> 5) * (1 << 26) + (b >> 6)).to(torch.float64) * (1.0 / (1 << 53))


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
