"""Write one step's new keys and values into their paged-cache slots.

A float8 cache (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`) takes the values rounded to
nearest even and saturated at the format's largest finite value, as the CPU path stores
them (services/worker/attention/kv_cache_dtype.py)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_grid(dtype: torch.dtype) -> dict:
    """The kernel's constants for a cache of `dtype`: a float8 format's largest finite value,
    mantissa bits and smallest normal exponent (all zero for any other dtype)."""
    if dtype not in _FLOAT8:
        return {"SATURATE": 0.0, "MANTISSA": 0, "MIN_EXP": 0}
    info = torch.finfo(dtype)
    return {"SATURATE": info.max, "MANTISSA": round(-math.log2(info.eps)),
            "MIN_EXP": round(math.log2(info.smallest_normal))}


@triton.jit
def round_to_fp8_grid(x, SATURATE: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """x (float32) saturated and rounded to nearest even on a float8 format's grid, so the
    cast that follows is exact: the same trick as kernels/cpu/fp8.h. (Triton's interpreter
    rounds float8 casts its own way, ties and all; a GPU's cvt.rn would agree with this.)"""
    a = tl.minimum(tl.abs(x), SATURATE)
    exponent = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXP)
    magic = ((exponent + (127 + 23 - MANTISSA)) << 23).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    # x's sign bit put back as a bit: -0.0 and tiny negatives stay negative zeros. (Not
    # `-r`: Triton negates as 0 - r, which makes +0.0 of r's zero on a GPU; H200, 2026-12-04.)
    sign = (x.to(tl.int32, bitcast=True) >> 31) << 31
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padding: skipped
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_c_block, stride_c_slot, stride_c_head,
    block_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SATURATE: tl.constexpr,  # a float8 cache's largest finite value; 0: not float8
    MANTISSA: tl.constexpr,  # a float8 cache's mantissa bits
    MIN_EXP: tl.constexpr,  # and its smallest normal exponent
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        d = tl.arange(0, BLOCK_D)
        mask = d < HEAD_DIM
        k = tl.load(key_ptr + token * stride_k_tok + head * stride_k_head + d, mask=mask)
        v = tl.load(value_ptr + token * stride_v_tok + head * stride_v_head + d, mask=mask)
        if SATURATE > 0:
            k = round_to_fp8_grid(k.to(tl.float32), SATURATE, MANTISSA, MIN_EXP)
            v = round_to_fp8_grid(v.to(tl.float32), SATURATE, MANTISSA, MIN_EXP)
        dst = block * stride_c_block + offset * stride_c_slot + head * stride_c_head + d
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    assert key_cache.shape[2:] == (num_kv_heads, head_dim)
    assert key.stride(2) == 1 and value.stride(2) == 1 and key_cache.stride(3) == 1
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        key_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        **fp8_grid(key_cache.dtype),
    )
