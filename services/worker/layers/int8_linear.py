"""Int8 weights on CPU: one int8 per weight and one scale per output channel, with
bfloat16 activations.

A decode step is a matrix-vector product per weight, bound by the bytes it reads:
int8 reads half of bfloat16's and a quarter of float32's. Small batches run PyTorch's
weight-only int8 kernel (`_weight_int8pack_mm`, the one torchao uses on CPU), which
converts as it multiplies; larger ones convert the weight to bfloat16 first and use the
ordinary GEMM, since that kernel is slow on many rows (measured on this machine, the
SmolLM2 576 -> 3072 projection: 1 row 0.06 ms against bfloat16's 0.11; 32 rows 0.78 ms
against 0.75 converted; 512 rows 12.3 against 4.8).

Why weight-only: quantizing the activations too (fbgemm's dynamic int8 GEMM) was
3-5x faster still, but SmolLM2's activations have outlier channels, and with one scale
per tensor its greedy output parted from float32's within a few tokens on most prompts.
"""

from __future__ import annotations

import torch
from torch import nn

# Rows (tokens) up to which the int8 kernel is used; above it, convert then GEMM.
INT8_KERNEL_MAX_ROWS = 16


class Int8Linear(nn.Module):
    """y = x @ (W * scale).T + b, W int8 [out, in]; x and y bfloat16."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        weight = weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-10)
        self.register_buffer("weight_int8", torch.round(weight / scales[:, None]).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= INT8_KERNEL_MAX_ROWS:
            out = torch._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        else:
            out = rows @ (self.weight_int8.to(torch.bfloat16) * self.scales[:, None]).T
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        out_features, in_features = self.weight_int8.shape
        return f"in_features={in_features}, out_features={out_features}, int8 weights"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear under `model` with an Int8Linear (in place)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, Int8Linear(child.weight, child.bias))
    return model
