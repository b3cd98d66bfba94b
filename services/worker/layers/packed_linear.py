"""bfloat16 weights packed once at load for the fastest CPU product this machine has.

Two packings, chosen per process:
- llmbus's own kernel (kernels/cpu/linear_bf16.cpp), where it builds (x86-64 with AVX-512
  BF16 and a C++ compiler): it streams the weights at close to memory speed for the few
  rows of a decode step, where oneDNN reached about 18 GB/s on this machine. Its sums run
  in another order than oneDNN's, so results differ from `F.linear` by at most a rounding
  of the last bfloat16 bit (tested against a float64 product).
- oneDNN's blocked layout otherwise. `F.linear` on a plain bfloat16 weight has oneDNN
  reorder the weight on every call, which for a decode token costs as much as the product;
  packing once leaves only the product (576 -> 3072 at 1 row 0.113 -> 0.052 ms) and is
  bit-identical to `F.linear` (tested).

float32 is never packed: it stays on MKL, whose sums match transformers', so that float32
stays token-identical to transformers.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import kernels.cpu as cpu_kernels
from services.worker.layers import replace_linears

KERNELS = ("llmbus", "onednn")


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype == torch.bfloat16 and device.type == "cpu" and default_kernel() is not None


def default_kernel() -> str | None:
    if cpu_kernels.available():
        return "llmbus"
    return "onednn" if _onednn_packing_works() else None


@functools.cache
def _onednn_packing_works() -> bool:
    """Whether this build and CPU run oneDNN's packed bfloat16 product (oneDNN present, a
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
    """y = x @ W.T + b with W [out, in] bfloat16, packed for `kernel` (default: the best that loads)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str | None = None) -> None:
        super().__init__()
        weight = weight.detach().to(torch.bfloat16).contiguous()
        self.out_features, self.in_features = weight.shape
        kernel = kernel or default_kernel()
        if kernel == "llmbus" and self.in_features % 2:
            kernel = "onednn" if _onednn_packing_works() else None  # the kernel reads inputs in pairs
        if kernel not in KERNELS:
            raise ValueError(f"no packed bfloat16 product on this machine (kernel {kernel!r})")
        self.kernel = kernel
        if kernel == "llmbus":
            self.register_buffer("weight_packed", cpu_kernels.pack_bf16(weight))
            # The kernel adds the bias to its float32 sums, as oneDNN does, before rounding.
            self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16).float())
        else:
            # The hint is the batch size the layout is tuned for; decode steps are the ones
            # bound by weight reads, so tune for one row (no loss measured at 2048).
            self.register_buffer("weight_packed", torch.ops.mkldnn._reorder_linear_weight(weight, 1))
            self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "llmbus":
            return cpu_kernels.linear_bf16(x, self.weight_packed, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight_packed, self.bias, "none", [], "")

    @property
    def num_weights(self) -> int:
        return self.in_features * self.out_features

    @property
    def weight_bytes(self) -> int:
        return self.num_weights * 2

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16 packed for {self.kernel}"


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every bfloat16 nn.Linear under `model` with its packed form (in place)."""
    return replace_linears(
        model, lambda linear: PackedLinear(linear.weight, linear.bias) if linear.weight.dtype == torch.bfloat16 else None
    )
