"""bfloat16 weights prepacked once for oneDNN, the CPU library behind PyTorch's bfloat16 GEMM.

`F.linear` on a plain bfloat16 weight has oneDNN reorder the weight into its blocked
layout on every call; for a decode token that reorder costs as much as the product.
Packing once at load time (what `torch.compile`'s CPU backend does when it freezes
weights) leaves only the product. Measured on this machine, SmolLM2's shapes, one call:
576 -> 3072 at 1 row 0.113 -> 0.052 ms, 32 rows 0.33 -> 0.27, 2048 rows 17.4 -> 16.7;
the tied LM head at 1 row 3.36 -> 2.16 ms. The result is bit-identical to `F.linear`'s
(checked at 1 to 2048 rows; tests/test_packed_linear.py keeps checking).

float32 is not packed: oneDNN's float32 kernel is as much faster, but its sums run in
another order than MKL's, which `F.linear` and transformers use, and float32 stays
token-identical to transformers.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from services.worker.layers import replace_linears


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype == torch.bfloat16 and device.type == "cpu" and _packing_works()


@functools.cache
def _packing_works() -> bool:
    """Whether this build and CPU run the packed bfloat16 product (oneDNN present, a
    bfloat16 path for this CPU); if not, the model keeps plain `F.linear`."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.eye(16, dtype=torch.bfloat16), torch.ones(2, 16, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.equal(out, x))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W [out, in] bfloat16 in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().to(torch.bfloat16).contiguous()
        self.out_features, self.in_features = weight.shape
        # The hint is the batch size the layout is tuned for; decode steps are the ones
        # bound by weight reads, so tune for one row (the figures above: no loss at 2048).
        self.register_buffer("weight_packed", torch.ops.mkldnn._reorder_linear_weight(weight, 1))
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight_packed, self.bias, "none", [], "")

    @property
    def num_weights(self) -> int:
        return self.in_features * self.out_features

    @property
    def weight_bytes(self) -> int:
        return self.num_weights * 2

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16 prepacked"


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every bfloat16 nn.Linear under `model` with its packed form (in place)."""
    return replace_linears(
        model, lambda linear: PackedLinear(linear.weight, linear.bias) if linear.weight.dtype == torch.bfloat16 else None
    )
