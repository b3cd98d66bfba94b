"""LayerNorm (mean and variance, a weight and a bias) for the LayerNorm decoders (GPT-2, OPT,
GPT-NeoX, Phi), in RMSNorm's calling convention: with a residual it is also the residual
add before the norm, (norm(x + residual), x + residual), so the decoder layer keeps one
shape whichever norm its family has.

PyTorch's `F.layer_norm` in the activations' dtype, as transformers' `nn.LayerNorm` runs
it, so outputs keep its bits. No fused kernel: these families are small or old, and their
decode steps take the module path (models/fused_decode.py refuses them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None  # [num_tokens, hidden_size] each
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)
        x = x + residual
        return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps), x
