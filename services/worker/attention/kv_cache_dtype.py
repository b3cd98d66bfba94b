"""The KV cache's dtype (`--kv-cache-dtype`): the model's own, or one byte of float8.

Float8 values past the format's largest finite one saturate to it in every path that
writes the cache (`to_cache_dtype` here, kernels/cpu/fp8.h, kernels/reshape_and_cache.py),
so that all of them store the same bytes; PyTorch's own cast would give inf for e5m2.
"""

from __future__ import annotations

import torch

# shared.config.KV_CACHE_DTYPES names these; "auto" keeps the model's dtype.
FLOAT8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {dtype: torch.finfo(dtype).max for dtype in FLOAT8.values()}  # 448, 57344


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return FLOAT8.get(name, model_dtype)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype in FP8_MAX:
        return x.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return x.to(dtype)
