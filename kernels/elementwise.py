"""A decoder layer's element-wise work in Triton, one kernel each: the residual add with
RMSNorm, rotary embedding (`rotary_and_cache`: with the rotated keys and the values written
into their KV-cache slots, reshape_and_cache's work), SiLU-and-mul. The GPU counterparts
of kernels/cpu/elementwise.cpp, their arguments checked by the same functions.

Why: on a GPU a SmolLM2-sized decode step is ~22 kernels a layer, most of them these
element-wise ops (an add, casts, the norm, a multiply; rotary's flip, two products and a
sum; silu and a product; the cache write), each reading and writing its whole activation
and each costing a few microseconds at least even inside a CUDA graph. Fused, a layer
runs four launches for them instead of about sixteen.

The roundings are those of the PyTorch ops they replace (transformers' order), so greedy
tokens stay the same: every intermediate that PyTorch rounds to the activations' dtype
is rounded here too, in the same order; only the norm's float32 sum of squares adds up in
another order (a rare last bit, as in the CPU kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernels  # noqa: F401 - interpreter without a GPU
from kernels.cpu import check_norm_args, check_rotary_args
from kernels.reshape_and_cache import fp8_grid, round_to_fp8_grid


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """float32 `x` rounded to `dtype`'s grid (nearest even), still float32: what PyTorch's
    op in `dtype` would have stored. bfloat16 by its bits, so the result is the same under
    Triton's interpreter (whose float32 -> bfloat16 cast does not round to nearest) as on
    a GPU; the store's cast of it is then exact."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536  # (-65536: 0xFFFF0000)
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float32:
        return x
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * hidden + cols, mask=mask, other=0.0)
        x = _rounded(x.to(tl.float32) + r.to(tl.float32), dtype)  # the add rounds to x's dtype, as in PyTorch
        tl.store(residual_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Rounded back to x's dtype before the weight multiplies it (transformers' order; for
    # float32 both casts are no-ops).
    out = _rounded(_rounded(normed, dtype) * w, dtype)
    tl.store(out_ptr + row * hidden + cols, out, mask=mask)


@triton.jit
def _rotary_and_cache_kernel(
    qk_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_row,
    # Heads from num_q_heads on are keys: rotated into their cache slots (not in place),
    # each with its value head copied beside it (reshape_and_cache's work).
    v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_v_row, stride_c_block, stride_c_slot, stride_c_head, block_size, num_q_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    SATURATE: tl.constexpr,  # a float8 cache's largest finite value; 0: not float8
    MANTISSA: tl.constexpr,
    MIN_EXP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)
    mask = d < HALF
    dtype = qk_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + row)
    table = pos * (2 * HALF)
    # The tables are float32; the PyTorch path casts them to the activations' dtype first.
    cos1 = _rounded(tl.load(cos_ptr + table + d, mask=mask, other=0.0), dtype)
    cos2 = _rounded(tl.load(cos_ptr + table + HALF + d, mask=mask, other=0.0), dtype)
    sin1 = _rounded(tl.load(sin_ptr + table + d, mask=mask, other=0.0), dtype)  # negated half
    sin2 = _rounded(tl.load(sin_ptr + table + HALF + d, mask=mask, other=0.0), dtype)
    base = qk_ptr + row * stride_row + head * (2 * HALF)
    x1 = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + d, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded to x's dtype, then the sum.
    out1 = _rounded(_rounded(x1 * cos1, dtype) + _rounded(x2 * sin1, dtype), dtype)
    out2 = _rounded(_rounded(x2 * cos2, dtype) + _rounded(x1 * sin2, dtype), dtype)
    if head < num_q_heads:  # a query: in place
        tl.store(base + d, out1, mask=mask)
        tl.store(base + HALF + d, out2, mask=mask)
    else:
        slot = tl.load(slot_mapping_ptr + row)
        if slot >= 0:  # -1: padding, nothing to write
            kv_head = head - num_q_heads
            dst = (slot // block_size) * stride_c_block + (slot % block_size) * stride_c_slot + kv_head * stride_c_head
            v_base = v_ptr + row * stride_v_row + kv_head * (2 * HALF)
            v1 = tl.load(v_base + d, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(v_base + HALF + d, mask=mask, other=0.0).to(tl.float32)
            if SATURATE > 0:
                out1 = round_to_fp8_grid(out1, SATURATE, MANTISSA, MIN_EXP)
                out2 = round_to_fp8_grid(out2, SATURATE, MANTISSA, MIN_EXP)
                v1 = round_to_fp8_grid(v1, SATURATE, MANTISSA, MIN_EXP)
                v2 = round_to_fp8_grid(v2, SATURATE, MANTISSA, MIN_EXP)
            cache_dtype = key_cache_ptr.dtype.element_ty
            tl.store(key_cache_ptr + dst + d, out1.to(cache_dtype), mask=mask)
            tl.store(key_cache_ptr + dst + HALF + d, out2.to(cache_dtype), mask=mask)
            tl.store(value_cache_ptr + dst + d, v1.to(cache_dtype), mask=mask)
            tl.store(value_cache_ptr + dst + HALF + d, v2.to(cache_dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr, out_ptr,
    n,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dtype = gate_up_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    silu = _rounded(gate / (1.0 + tl.exp(-gate)), dtype)  # F.silu rounds to the dtype
    tl.store(out_ptr + row * n + cols, _rounded(silu * up, dtype), mask=mask)


def add_rms_norm(
    x: torch.Tensor,  # [rows, hidden]
    residual: torch.Tensor | None,  # [rows, hidden], updated in place to residual + x
    weight: torch.Tensor,  # [hidden], x's dtype
    eps: float,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x), or with a residual (x + residual -> residual): (RMSNorm(residual), residual)."""
    check_norm_args(x, residual, weight)
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // max(hidden, 1)
    if rows:
        block = triton.next_power_of_2(hidden)
        _add_rms_norm_kernel[(rows,)](
            x, x if residual is None else residual, weight, out, hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
        )
    return out if residual is None else (out, residual)


def rotary_and_cache(
    qk: torch.Tensor,  # [rows, num_q_heads + num_kv_heads, head_dim]: query heads then key heads, heads adjacent
    value: torch.Tensor,  # [rows, num_kv_heads, head_dim], head_dim contiguous
    positions: torch.Tensor,  # [rows] int64, each < the tables' length (see below)
    cos_table: torch.Tensor,  # [max_position, head_dim] float32 (RotaryEmbedding's)
    sin_table: torch.Tensor,  # [max_position, head_dim] float32, first half negated
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [rows] int64, -1 = padding: skipped
    num_q_heads: int,
) -> torch.Tensor:  # [rows, num_q_heads, head_dim]: the rotated queries (a view of qk)
    """Rotary over the query and key heads with the keys (rotated) and values written into
    their cache slots, in one kernel: what RotaryEmbedding then reshape_and_cache do, the
    same bytes. The positions are not checked against the tables here: that would read the
    device on the host (no CUDA graph could hold it); the runner's stay under
    max_model_len, which sizes the tables."""
    check_rotary_args(qk, positions, cos_table, sin_table)
    rows, heads, head_dim = qk.shape
    num_kv_heads = heads - num_q_heads
    if value.shape != (rows, num_kv_heads, head_dim) or value.stride(2) != 1 or value.stride(1) != head_dim:
        raise ValueError(f"value {tuple(value.shape)} with strides {value.stride()} does not match the key heads")
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride() or \
            key_cache.shape[2:] != (num_kv_heads, head_dim) or key_cache.stride(3) != 1:
        raise ValueError(f"caches {tuple(key_cache.shape)} do not hold {num_kv_heads} heads of {head_dim}")
    if rows:
        half = head_dim // 2
        _rotary_and_cache_kernel[(rows, heads)](
            qk, positions, cos_table, sin_table, qk.stride(0),
            value, key_cache, value_cache, slot_mapping,
            value.stride(0), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.shape[1],
            num_q_heads,
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half), **fp8_grid(key_cache.dtype),
        )
    return qk[:, :num_q_heads]


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [rows, 2n] (gate, then up) -> [rows, n]
    if not gate_up.is_contiguous():
        raise ValueError(f"gate_up must be contiguous, got strides {gate_up.stride()}")
    n = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype, device=gate_up.device)
    rows = gate_up.numel() // max(2 * n, 1)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, SILU_BLOCK))](gate_up, out, n, BLOCK=SILU_BLOCK)
    return out
