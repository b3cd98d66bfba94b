"""Weights packed once at load for the fastest CPU product this machine has, in bfloat16
and float32. Two packings, chosen per process:
- llmbus's own kernel (kernels/cpu/linear.cpp), where it builds (x86-64 with AVX-512 BF16
  and a C++ compiler): it streams the weights at close to memory speed for the few rows
  of a decode step, where oneDNN reached about 18-21 GB/s on this machine, and matches or
  beats oneDNN at 128-2048 rows (scripts/cpu_kernels_bench.py). Its sums run in another
  order: bfloat16 results differ from `F.linear` by at most a rounding of the last bit,
  float32 ones by a few float32 roundings (both tested against a float64 product).
- oneDNN's blocked layout otherwise. `F.linear` on a plain bfloat16 weight has oneDNN
  reorder the weight on every call, which for a decode token costs as much as the product;
  packing once leaves only the product (576 -> 3072 at 1 row 0.113 -> 0.052 ms) and is
  bit-identical to `F.linear` (tested). In float32 it beats MKL's `F.linear` by 1.1-2.5x.

float32 thus leaves MKL, whose sums are transformers': logits move in their last bits,
and greedy output stays token-identical to transformers (16/16 of `llmbus bench
agreement`'s chat prompts, 128 tokens each, and the oracle tests).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import kernels.cpu as cpu_kernels
from kernels.cpu import huge_pages
from services.worker.layers import replace_linears
from services.worker.layers.kernel_choice import KernelChoices, Timings, measure
from services.worker.layers.quantized_linear import Int4Linear, Int8Linear

KERNELS = ("llmbus", "onednn")
DTYPES = (torch.bfloat16, torch.float32)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype in DTYPES and device.type == "cpu" and default_kernel(dtype) is not None


def default_kernel(dtype: torch.dtype = torch.bfloat16) -> str | None:
    if cpu_kernels.available():
        return "llmbus"
    return "onednn" if _onednn_packing_works(dtype) else None


@functools.cache
def _onednn_packing_works(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this build and CPU run oneDNN's packed product in `dtype` (oneDNN present,
    a bfloat16 path for this CPU); if not, the model keeps plain `F.linear`."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.eye(16, dtype=dtype), torch.ones(2, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.equal(out, x))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W [out, in] bfloat16 or float32 (activations of the same dtype),
    packed for `kernel` (default: the best that loads for the dtype)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str | None = None,
                 rows_from: int | None = None) -> None:
        """`rows_from`: with llmbus's kernel, the row count from which oneDNN's product is
        faster on this CPU (layers/kernel_choice.py): both packings are kept, and a product
        of that many rows or more takes oneDNN's (1: oneDNN's alone)."""
        super().__init__()
        if weight.dtype not in DTYPES:
            raise ValueError(f"PackedLinear packs bfloat16 or float32 weights, got {weight.dtype}")
        self.dtype = weight.dtype
        weight = weight.detach().contiguous()
        self.out_features, self.in_features = weight.shape
        kernel = kernel or default_kernel(self.dtype)
        if kernel == "llmbus" and self.dtype == torch.bfloat16 and self.in_features % 2:
            # The bfloat16 kernel reads inputs in pairs.
            kernel = "onednn" if _onednn_packing_works(self.dtype) else None
        if kernel not in KERNELS:
            raise ValueError(f"no packed {self.dtype} product on this machine (kernel {kernel!r})")
        if kernel != "llmbus" or rows_from is not None and not _onednn_packing_works(self.dtype):
            rows_from = None
        if rows_from == 1:
            kernel, rows_from = "onednn", None
        self.kernel, self.rows_from = kernel, rows_from
        self.weight_onednn = None if rows_from is None else torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.bias_onednn = None if rows_from is None or bias is None else bias.detach().to(self.dtype)
        if kernel == "llmbus":
            self.register_buffer("weight_packed", cpu_kernels.pack_weight(weight))
            # The kernel adds the bias to its float32 sums, as oneDNN does, before rounding.
            self.register_buffer("bias", None if bias is None else bias.detach().to(self.dtype).float())
        else:
            # The hint is the batch size the layout is tuned for; decode steps are the ones
            # bound by weight reads, so tune for one row (no loss measured at 2048).
            self.register_buffer("weight_packed", torch.ops.mkldnn._reorder_linear_weight(weight, 1))
            self.register_buffer("bias", None if bias is None else bias.detach().to(self.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_from is not None and x.numel() >= self.rows_from * self.in_features:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight_onednn, self.bias_onednn, "none", [], "")
        if self.kernel == "llmbus":
            return cpu_kernels.linear(x, self.weight_packed, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight_packed, self.bias, "none", [], "")

    @property
    def num_weights(self) -> int:
        return self.in_features * self.out_features

    @property
    def weight_bytes(self) -> int:
        return self.num_weights * self.dtype.itemsize

    def extra_repr(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        kernels = self.kernel if self.rows_from is None else \
            f"llmbus below {self.rows_from} rows, onednn from {self.rows_from}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {dtype} packed for {kernels}"


def move_to_huge_pages(model: nn.Module) -> None:
    """Every weight packed for llmbus's kernels under `model` (bfloat16, float32, int4, int8), side
    by side in one arena on 2 MB pages (kernels/cpu/huge_pages.py): a decode step streams
    them all, in order."""
    packed = [m for m in model.modules()
              if isinstance(m, (PackedLinear, Int4Linear, Int8Linear)) and m.kernel == "llmbus"]
    for module, weight in zip(packed, huge_pages.consolidate([m.weight_packed for m in packed])):
        module.weight_packed = weight


def time_products(weight: torch.Tensor) -> Timings:
    """llmbus's product of `weight` against oneDNN's, by row count (layers/kernel_choice.py)."""
    products = PackedLinear(weight, None, "llmbus"), PackedLinear(weight, None, "onednn")
    return measure(products, weight.shape[1], weight.dtype)


def kernel_choices() -> KernelChoices:
    """This machine's choices, measured with this file's products."""
    return KernelChoices(time_products)


def pack_linears(model: nn.Module, choices: KernelChoices | None = None) -> nn.Module:
    """Replace every bfloat16 or float32 nn.Linear under `model` with its packed form (in
    place), each shape on the products this CPU runs it fastest with (`choices`: measured or
    remembered, layers/kernel_choice.py)."""
    choices = choices or kernel_choices()

    def packed(linear: nn.Linear) -> PackedLinear | None:
        if linear.weight.dtype not in DTYPES:
            return None
        return PackedLinear(linear.weight, linear.bias, rows_from=choices.rows_from(linear.weight))

    return replace_linears(model, packed)
