"""Quantized weights on CPU, with bfloat16 activations: int8 (one scale per output
channel) and int4 (a step and an offset per group of 32 inputs).

A decode step is a matrix-vector product per weight, bound by the bytes it reads: int8
reads half of bfloat16's, int4 a quarter. Both run on llmbus's kernels
(kernels/cpu/linear_int8.cpp, linear_int4.cpp) where the CPU kernels build, and otherwise
on PyTorch's own weight-only kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`,
the ones torchao calls on CPU). PyTorch's int8 kernel is slow for many rows, so there
larger batches convert the weight to bfloat16 first and use the ordinary GEMM (measured on
this machine, the SmolLM2 576 -> 3072 projection: 1 row 0.06 ms against bfloat16's 0.11;
32 rows 0.78 ms against 0.75 converted; 512 rows 12.3 against 4.8).

Why weight-only: quantizing the activations too (fbgemm's dynamic int8 GEMM) was 3-5x
faster still, but SmolLM2's activations have outlier channels, and with one scale per
tensor its greedy output parted from float32's within a few tokens on most prompts.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels.cpu as cpu_kernels
import kernels.linear_int4 as triton_int4
from services.worker.layers import replace_linears
from services.worker.layers.moe import SparseMoE

# Rows (tokens) up to which the int8 kernel is used; above it, convert then GEMM.
INT8_KERNEL_MAX_ROWS = 16


class Int8Linear(nn.Module):
    """y = x @ (W * scale).T + b, W int8 [out, in] with one scale per output; x and y
    bfloat16. On llmbus's int8 kernel (kernels/cpu/linear_int8.cpp) where the CPU kernels
    build: int8 widened to bfloat16 in registers (exact), float32 sums, the scale once per
    output, so every row count streams the int8 bytes. Otherwise PyTorch's weight-only kernel
    (`_weight_int8pack_mm`) up to INT8_KERNEL_MAX_ROWS rows and a bfloat16 GEMM on the
    converted weight above (PyTorch's kernel is slow for many rows)."""

    KERNELS = ("llmbus", "torch")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, kernel: str | None = None,
                 input_split=None) -> None:
        super().__init__()
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        kernel = kernel or ("llmbus" if cpu_kernels.available() and self.in_features % 2 == 0 else "torch")
        if kernel not in self.KERNELS:
            raise ValueError(f"unknown int8 kernel {kernel!r}: {', '.join(self.KERNELS)}")
        self.kernel = kernel
        levels, scales = int8_grid(weight, input_split)
        if kernel == "llmbus":
            # The scales as PyTorch's kernel takes them (bfloat16), so both kernels multiply
            # by the same numbers.
            self.register_buffer("weight_packed", cpu_kernels.pack_int8(levels, scales.to(torch.bfloat16).float()))
            self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16).float())
            return
        self.register_buffer("weight_int8", levels)
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "llmbus":
            return cpu_kernels.linear_int8(x, self.weight_packed, self.out_features, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= INT8_KERNEL_MAX_ROWS:
            out = torch._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        else:
            out = rows @ (self.weight_int8.to(torch.bfloat16) * self.scales[:, None]).T
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], -1)

    @property
    def num_weights(self) -> int:
        return self.in_features * self.out_features

    @property
    def weight_bytes(self) -> int:
        """Bytes a product reads: the int8 weights and their scales."""
        if self.kernel == "llmbus":
            return self.weight_packed.numel()
        return self.weight_int8.numel() + self.scales.numel() * self.scales.element_size()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights ({self.kernel})"


# Weights in a group share one scale and one offset (as GGUF's Q4_1 blocks do).
INT4_GROUP_SIZE = cpu_kernels.INT4_GROUP_SIZE


def int8_grid(weight: torch.Tensor, input_split=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels int8 [out, in], scales [out]) with weight ~= levels * scale per output: the
    largest weight of a channel on level 127. A channel already on an int8 grid (a W8A8
    checkpoint's, widened) keeps it exactly: min/max quantization spans -128..127, so its
    largest weight may lie on level -128, and then a 128th of it is the step.

    `input_split`: the tensor-parallel group `weight`'s inputs are split over (a row-parallel
    product's slice): a channel's scale is then that of the whole channel, every rank's
    slice taken together, so the ranks hold exactly one rank's levels, cut."""
    def whole(per_channel: torch.Tensor) -> torch.Tensor:  # [out, 1]: the largest over every rank's slice
        return per_channel if input_split is None else input_split.all_max(per_channel)

    absmax = whole(weight.abs().amax(dim=1, keepdim=True))
    scales = (absmax / 127).clamp(min=1e-10)
    wider = (absmax / 128).clamp(min=1e-10)

    def on_grid(step: torch.Tensor) -> torch.Tensor:  # [out, 1]: every weight a whole number of steps
        levels = weight / step
        off = ~(levels == levels.round()).all(dim=1, keepdim=True) | (levels.amax(dim=1, keepdim=True) > 127)
        return whole(off.float()) == 0

    scales = torch.where(on_grid(wider) & ~on_grid(scales), wider, scales)
    return torch.round(weight / scales).clamp(-128, 127).to(torch.int8), scales[:, 0]


def int4_grid(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE):
    """(levels int32 [out, in] in 0..15, step [out, groups], low [out, groups]) with
    weight ~= levels * step + low per group of `group_size` inputs.

    A weight that already lies on a 16-level grid per group (a GGUF Q4_0/Q4_1 checkpoint,
    dequantized on conversion, as SmolLM2's is) keeps that exact grid: the smallest gap
    between distinct values gives the number of steps the group spans, and the span over
    that number gives the step. Others get min/max levels.
    """
    out_features, in_features = weight.shape
    w = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = w.amin(-1), w.amax(-1)
    tol = 4e-6 * w.abs().amax(-1).clamp(min=1e-30)  # [out, groups]: float32 rounding
    gaps = w.sort(-1).values.diff(dim=-1)
    step = torch.where(gaps > tol[..., None], gaps, torch.inf).amin(-1)
    # The whole span over its number of steps pins the step far more precisely than one gap.
    step = (high - low) / torch.round((high - low) / step)
    finite = torch.isfinite(step) & (step > 0)
    safe_step = torch.where(finite, step, 1.0)
    levels = torch.round((w - low[..., None]) / safe_step[..., None])
    exact = finite & (levels.amax(-1) <= 15) & (
        (levels * safe_step[..., None] + low[..., None] - w).abs().amax(-1) <= tol
    )
    step = torch.where(exact, safe_step, (high - low) / 15).clamp(min=1e-30)
    levels = torch.round((w - low[..., None]) / step[..., None]).clamp(0, 15)
    return levels.to(torch.int32).reshape(out_features, in_features), step, low


class Int4Linear(nn.Module):
    """y = x @ W.T + b with W in 4 bits per weight, a step and an offset per group of 32
    inputs; x and y bfloat16. A decode step reads a quarter of bfloat16's weight bytes.

    Three kernels: llmbus's own (kernels/cpu/linear_int4.cpp), where the CPU kernels build,
    which keeps the step and offset as float16 (GGUF's Q4_1 does the same, so SmolLM2's
    grid stays exact) and streams the packed weights at memory speed; otherwise PyTorch's
    CPU int4 kernel (the one torchao uses), with the step and offset in bfloat16. Measured
    on SmolLM2 with PyTorch's kernel: a decode step at batch 1 took 20.6 ms against
    bfloat16's 38 and int8's 23 (module path, before the fused layer); prefill 2x bfloat16's.
    On a GPU, "triton" (kernels/linear_int4.py): the same levels, step and offset (float16),
    dequantized tile by tile inside the GEMM."""

    KERNELS = ("llmbus", "torch", "triton")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 kernel: str | None = None) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        if in_features % INT4_GROUP_SIZE:
            raise ValueError(f"int4 needs input sizes divisible by {INT4_GROUP_SIZE}, not {in_features}")
        kernel = kernel or ("llmbus" if cpu_kernels.available() and dtype == torch.bfloat16 else "torch")
        if kernel not in self.KERNELS:
            raise ValueError(f"unknown int4 kernel {kernel!r}: {', '.join(self.KERNELS)}")
        self.kernel = kernel
        levels, step, low = int4_grid(weight)
        self.in_features, self.out_features = in_features, out_features
        if kernel == "llmbus":
            self.register_buffer("weight_packed", cpu_kernels.pack_int4(levels, step, low))
            # Added to the float32 sums before rounding, as the bfloat16 kernel does.
            self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).float())
            return
        if kernel == "triton":
            self.register_buffer("weight_packed", triton_int4.pack_levels(levels))  # [in / 8, out]
            self.register_buffer("step", step.T.contiguous().half())  # [in / 32, out]
            self.register_buffer("low", low.T.contiguous().half())
            self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).float())
            return
        # PyTorch's kernel takes outputs by 16s: a size that is not (Mistral 4's latent
        # projections) is padded with zero rows, sliced off after the product.
        pad = -out_features % 16
        levels, step, low = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (levels, step, low))
        self.register_buffer("weight_int4", torch._convert_weight_to_int4pack_for_cpu(levels, 1))
        # The kernel computes (level - 8) * scale + zero.
        scales_and_zeros = torch.stack([step, low + 8 * step], dim=-1)  # [out, groups, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous().to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "llmbus":
            return cpu_kernels.linear_int4(x, self.weight_packed, self.out_features, self.bias)
        rows = x.reshape(-1, self.in_features)
        if self.kernel == "triton":
            out = triton_int4.linear_int4(rows, self.weight_packed, self.step, self.low, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        out = torch._weight_int4pack_mm_for_cpu(rows, self.weight_int4, INT4_GROUP_SIZE, self.scales_and_zeros)
        out = out[:, :self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def num_weights(self) -> int:
        return self.in_features * self.out_features

    @property
    def weight_bytes(self) -> int:
        """Bytes a product reads: packed nibbles, and a scale and offset per group."""
        if self.kernel == "llmbus":
            return self.weight_packed.numel()
        if self.kernel == "triton":
            return self.weight_packed.numel() * 4 + (self.step.numel() + self.low.numel()) * 2
        sz = self.scales_and_zeros
        return self.weight_int4.numel() * self.weight_int4.element_size() + sz.numel() * sz.element_size()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 weights ({self.kernel})"


QUANTIZATIONS = ("int8", "int4")


def quantized_linear(method: str, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                     kernel: str | None = None, input_split=None) -> nn.Module:
    if method == "int8":
        return Int8Linear(weight, bias, kernel, input_split)  # bfloat16 activations, whatever `dtype` says
    if method == "int4":
        return Int4Linear(weight, bias, dtype, kernel)
    raise ValueError(f"unknown quantization {method!r}: {', '.join(QUANTIZATIONS)}")


def quantize(model: nn.Module, method: str, dtype: torch.dtype, kernel: str | None = None) -> nn.Module:
    """Replace every nn.Linear under `model` with its quantized form (in place); with the
    Triton kernel (a GPU's), but the experts of a sparse MoE, which its grouped GEMMs read
    stacked and unquantized (kernels/fused_moe.py). A tensor-parallel rank's row-parallel
    products (`input_split`, set by parallel/sharding.py) take their whole channels' scales;
    int4's groups of 32 inputs lie whole on one rank (the sizes are checked before loading)."""
    experts = {id(m) for moe in model.modules() if isinstance(moe, SparseMoE) for m in moe.experts.modules()}
    return replace_linears(model, lambda linear: None if kernel == "triton" and id(linear) in experts else
                           quantized_linear(method, linear.weight, linear.bias, dtype, kernel,
                                            getattr(linear, "input_split", None)))
