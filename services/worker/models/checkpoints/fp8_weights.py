"""Checkpoints in FP8 with block scales, widened at load.

`quantization_config: {"quant_method": "fp8", "weight_block_size": [128, 128]}` is the
format DeepSeek-V3 and R1 were released in, and Qwen3's `-FP8` checkpoints: each quantized
linear weight is float8_e4m3fn, with a `weight_scale_inv` beside it holding one float32 per
block of weight_block_size weights (a row's or column's last block may be partial), the
weight being its FP8 value times its block's scale (transformers' Fp8Dequantize, vLLM's
block dequantization). Layers the config leaves unquantized come as they are.

The engine computes in bfloat16 or float32, so each weight is widened here (in float32,
then cast to the model's dtype by the loader): an FP8 checkpoint serves at its widened size.
What it saves is the download and the disk, not the memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

SCALE = ".weight_scale_inv"


def fp8_weight_block(raw_config: dict) -> tuple[int, int] | None:
    """The block of a checkpoint in FP8 with block scales (None: not one, or another
    quantization: models/checkpoints/quantized_weights.py says which are read)."""
    quant = raw_config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if not block or len(block) != 2 or min(block) < 1:
        raise ValueError(f"unsupported FP8 checkpoint without block scales (weight_block_size {block!r}): "
                         "per-block scales only (weight_scale_inv)")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"unsupported FP8 activation_scheme {quant['activation_scheme']!r}: dynamic only (the "
                         "weights are widened at load; static activation scales have no use here)")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"unsupported FP8 fmt {quant['fmt']!r}: e4m3 only")
    return int(block[0]), int(block[1])


def widen_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[..., rows, columns] FP8 values times their blocks' scales ([..., ceil(rows /
    block[0]), ceil(columns / block[1])]: stacked experts' too), in float32."""
    rows, columns = weight.shape[-2:]
    grid = (*weight.shape[:-2], -(-rows // block[0]), -(-columns // block[1]))
    if weight.dim() < 2 or tuple(scale.shape) != grid:
        raise ValueError(f"FP8 scales {tuple(scale.shape)} do not tile a weight of {tuple(weight.shape)} in blocks of "
                         f"{block} ({grid} expected)")
    scales = scale.float().repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :columns]
    return weight.float() * scales


def fp8_widened(weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each FP8 weight widened by its scales (a weight and
    its scales paired by name, whichever comes first); the rest as they are."""
    waiting: dict[str, torch.Tensor] = {}  # a weight's name -> its FP8 values or its scales, the other not yet read
    for name, tensor in weights:
        if name.endswith(SCALE):
            key, is_scale = name[: -len(SCALE)] + ".weight", True
        elif tensor.dtype == torch.float8_e4m3fn:
            key, is_scale = name, False
        else:
            yield name, tensor
            continue
        other = waiting.pop(key, None)
        if other is None:
            waiting[key] = tensor
            continue
        weight, scale = (other, tensor) if is_scale else (tensor, other)
        yield key, widen_fp8(weight, scale, block)
    if waiting:
        lone = sorted(waiting)
        raise ValueError(f"FP8 checkpoint with weights or scales unpaired: {', '.join(lone[:3])} (each FP8 weight "
                         f"needs its {SCALE} and each scale its weight)")
