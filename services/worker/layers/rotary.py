"""Rotary position embedding (the "rotate half" layout of Hugging Face Llama checkpoints).

cos/sin are tabulated once for every position up to the context; a step looks its
positions up, so prefill chunks and decodes at any offset need no special case.
Frequencies follow transformers' formulas exactly (default, linear, llama3).
"""

from __future__ import annotations

import math

import torch
from torch import nn

import kernels.cpu as cpu_kernels


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim // 2]
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        # transformers' rotate_half(x) * sin == swap_halves(x) * sin_signed, with the first half of the
        # sine negated: one flip instead of two slices, a negation and a cat per call, and
        # bit-identical, since (-a) * b == a * (-b) exactly in floating point.
        sin = emb.sin()
        self.register_buffer("sin_signed_cache", torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), -1),
                             persistent=False)
        self.head_dim = head_dim
        # cos/sin of the current step's positions: every layer shares one lookup.
        self._step: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        # The positions last checked against the table (the kernel path checks once a step).
        self._checked: torch.Tensor | None = None

    def check_positions(self, positions: torch.Tensor) -> None:
        """Raise unless every position is in the table: the CPU kernels index it unchecked."""
        if positions.numel() and int(positions.max()) >= self.cos_cache.shape[0]:
            raise IndexError(f"position {int(positions.max())} is past the rotary table "
                             f"({self.cos_cache.shape[0]} positions)")

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        x: torch.Tensor,  # [num_tokens, num_heads, head_dim]: query and key heads side by side
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Rotate every head of `x` by its token's position. Query and key heads go
        through in one call (they are adjacent in the fused qkv output): half the calls.
        On CPU, kernels/cpu rotates `x` in place in one pass (the same bits)."""
        if cpu_kernels.supports(x) and x.stride(-1) == 1 and x.stride(-2) == self.head_dim:
            if self._checked is not positions:  # once per step, not per layer
                self.check_positions(positions)
                self._checked = positions
            return cpu_kernels.rotary(x, positions, self.cos_cache, self.sin_signed_cache)
        step = self._step
        if step is None or step[0] is not positions or step[1] != x.dtype:
            cos = self.cos_cache[positions].to(x.dtype).unsqueeze(1)  # [num_tokens, 1, head_dim]
            sin = self.sin_signed_cache[positions].to(x.dtype).unsqueeze(1)
            step = self._step = (positions, x.dtype, cos, sin)
        cos, sin = step[2], step[3]
        half = self.head_dim // 2
        swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
        return x * cos + swapped * sin
