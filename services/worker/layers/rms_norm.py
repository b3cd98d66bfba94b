"""RMSNorm with transformers' numbers: float32 statistics, the weight applied after the
cast back to the activations' dtype, so outputs stay token-identical to it.

Without the CPU kernels, the normalization is PyTorch's `F.rms_norm` on float32, which gives the same bits
as transformers' `x * rsqrt(mean(x ** 2) + eps)` (tests/test_rms_norm.py checks) in one
kernel instead of five. Against transformers' LlamaRMSNorm on this machine (best of five
timings): 1 token 21 vs 27 us in float32 and 17 vs 18 in bfloat16; 2048 tokens 3.6 vs
4.5 ms and 4.7 vs 5.4 ms. (A first, single timing that showed 18x at 2048 tokens did not
repeat.)

With a residual it is also the residual add before the norm (vLLM's fused add-norm): on
CPU both run in one pass of kernels/cpu (`add_rms_norm`: ~10 us a call from Python for a
decode token, most of it the call itself, against ~26 us of PyTorch ops in the profile),
with the same roundings; only its float32 sum of squares runs in another order (in
bfloat16 a rare last bit, in float32 a couple of float32 ulps). With `triton` (the GPU's
attention backend) it is one Triton kernel of kernels/elementwise.py, the same roundings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels.cpu as cpu_kernels
import kernels.elementwise as triton_kernels


class ResidualAdd(nn.Module):
    """Where a family has no norm before a branch (OLMo 2): RMSNorm's residual add alone, in
    its calling convention, so the decoder layer keeps one shape."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return x
        x = x + residual  # (a new tensor: the caller may hold `residual` as its input still)
        return x, x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, triton: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.shape = (hidden_size,)
        self.triton = triton

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None  # [num_tokens, hidden_size] each
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual, (norm(x + residual), x + residual), the sum possibly
        written over `residual`."""
        if self.triton and x.is_contiguous():
            return triton_kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if cpu_kernels.supports(x) and x.is_contiguous():
            return cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual  # transformers adds residual + x: the same bits
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # Lower precision: normalize in float32, round, then weigh in x's dtype.
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)
