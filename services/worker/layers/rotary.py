"""Rotary position embedding (the "rotate half" layout of Hugging Face Llama checkpoints).

cos/sin are tabulated once for every position up to the context; a step looks its
positions up, so prefill chunks and decodes at any offset need no special case.
Frequencies follow transformers' formulas exactly (default, linear, llama3, yarn, longrope).
"""

from __future__ import annotations

import math

import torch
from torch import nn

import kernels.cpu as cpu_kernels


def interleaved_as_halves(rows: torch.Tensor, head_dim: int, rotary_dim: int = 0, start: int = 0) -> torch.Tensor:
    """A query or key projection's output rows (a weight, a bias, a LoRA B: dim 0 is heads
    x head_dim) for a rotary that turns interleaved pairs (GLM's: dims 2i and 2i+1 by
    frequency i), reordered to the rotate-half layout (dims i and i + rotary_dim/2) every
    kernel here computes. Attention reads queries and keys only through their dot product,
    which one permutation of both leaves as it is, so the model is unchanged, the KV cache
    holding keys in the new order. `rotary_dim` as the config has it (0: the whole head);
    the rotating dims begin at `start` of each head (DeepSeek's come last)."""
    rotary_dim = rotary_dim or head_dim
    order = torch.cat([torch.arange(start), start + torch.arange(0, rotary_dim, 2),
                       start + torch.arange(1, rotary_dim, 2), torch.arange(start + rotary_dim, head_dim)])
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, head_dim, *rows.shape[1:])[:, order].reshape(rows.shape)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict, long: bool = False) -> torch.Tensor:
    """[head_dim // 2] (head_dim: the rotating dims). longrope: the short factors, or with
    `long` the long ones, dividing the frequencies as transformers writes it."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta**exponents)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, exponents)
    inv_freq = 1.0 / (theta**exponents)  # [head_dim // 2]
    if rope_type == "proportional":
        # LFM3's and Gemma 4's: the first partial_rotary_factor of the frequencies, the rest
        # zero (their dims keep still), over the whole head; divided by `factor` as
        # transformers writes it
        turning = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq = torch.cat([inv_freq[:turning], torch.zeros(head_dim // 2 - turning)])
        return inv_freq / scaling.get("factor", 1.0)
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


def _yarn_inv_freq(dim: int, theta: float, scaling: dict, exponents: torch.Tensor) -> torch.Tensor:
    """YaRN: each frequency between its extrapolated (as trained) and interpolated (divided
    by `factor`) value, by a linear ramp over the dims whose wavelengths fall between
    beta_fast and beta_slow rotations of the original context (transformers' formula)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (no singularity)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    pos_freqs = theta**exponents
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def rope_attention_factor(scaling: dict) -> float:
    """transformers' scale of cos and sin: longrope's and YaRN's, given or from the
    context's growth (YaRN's with DeepSeek's mscale pair where given); 1 for the others."""
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor = scaling["factor"]
    if rope_type == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))

    def mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


class RotaryEmbedding(nn.Module):
    """`rotary_dim` < head_dim: only the leading dims of each head rotate (partial rotary).
    longrope: the tables hold the short factors' rows for positions 0..max_position-1, then
    the long factors' (`long_offset` on): the caller picks a token's row (ModelRunner)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict, rotary_dim: int = 0) -> None:
        super().__init__()
        dim = rotary_dim or head_dim
        positions = torch.arange(max_position, dtype=torch.float32)
        tables = [rope_inv_freq(dim, theta, scaling)]
        self.long_offset = None
        if scaling.get("rope_type") == "longrope":
            tables.append(rope_inv_freq(dim, theta, scaling, long=True))
            self.long_offset = max_position
        # [rows, dim]: positions times each table's frequencies, one table after the other
        emb = torch.cat([torch.cat((positions[:, None] * f[None, :],) * 2, dim=-1) for f in tables])
        scale = rope_attention_factor(scaling)
        self.inv_freq, self.scale = tables[0], scale  # (Qwen-VL's image tokens' rows: vision/mrope.py)
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos_cache", cos, persistent=False)
        # transformers' rotate_half(x) * sin == swap_halves(x) * sin_signed, with the first half of the
        # sine negated: one flip instead of two slices, a negation and a cat per call, and
        # bit-identical, since (-a) * b == a * (-b) exactly in floating point.
        self.register_buffer("sin_signed_cache", torch.cat((-sin[:, : dim // 2], sin[:, dim // 2 :]), -1),
                             persistent=False)
        self.head_dim = dim  # the dims that rotate
        self.full_head_dim = head_dim
        # cos/sin of the current step's positions: every layer shares one lookup.
        self._step: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        # The positions last checked against the table (the kernel path checks once a step).
        self._checked: torch.Tensor | None = None

    @classmethod
    def identity(cls, head_dim: int, max_position: int) -> "RotaryEmbedding":
        """A layer that does not rotate (SmolLM3's NoPE layers): cos 1 and sin 0 at every
        position, which every path's rotation (x * cos + swapped * sin, in the C kernels,
        PyTorch and Triton alike) returns bit for bit, so no path needs a case of its own."""
        rotary = cls(head_dim, max_position, 10000.0, {"rope_type": "default"})
        rotary.cos_cache.fill_(1.0)
        rotary.sin_signed_cache.zero_()
        return rotary

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
        On CPU, kernels/cpu rotates `x` in place in one pass (the same bits), a partial
        rotary's leading dims too. (With the Triton backend the attention layer rotates in
        kernels/elementwise.py's rotary_and_cache instead, the cache write with it, from
        these tables.)"""
        if cpu_kernels.supports(x) and x.stride(-1) == 1 and x.stride(-2) == self.full_head_dim:
            if self._checked is not positions:  # once per step, not per layer
                self.check_positions(positions)
                self._checked = positions
            return cpu_kernels.rotary(x, positions, self.cos_cache, self.sin_signed_cache)  # partial too
        if self.head_dim < self.full_head_dim:  # partial: rotate the leading dims, keep the rest
            return torch.cat((self._rotate(positions, x[..., : self.head_dim]), x[..., self.head_dim :]), dim=-1)
        return self._rotate(positions, x)

    def _rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        step = self._step
        if step is None or step[0] is not positions or step[1] != x.dtype:
            cos = self.cos_cache[positions].to(x.dtype).unsqueeze(1)  # [num_tokens, 1, head_dim]
            sin = self.sin_signed_cache[positions].to(x.dtype).unsqueeze(1)
            step = self._step = (positions, x.dtype, cos, sin)
        cos, sin = step[2], step[3]
        half = self.head_dim // 2
        swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
        return x * cos + swapped * sin
