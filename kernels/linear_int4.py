"""4-bit weights with 16-bit activations on a GPU: y = x @ W.T + b, W dequantized tile by tile
inside the GEMM (the W4A16 shape of vLLM's AWQ/GPTQ Triton kernels).

The weights as `--quantization int4` holds them everywhere (layers/quantized_linear.py's
int4_grid): a level 0..15 per weight, and a step and an offset (float16) per group of 32
inputs, W = level * step + low. The levels are packed eight to an int32 along the inputs,
[K / 8, N], so a tile's words are contiguous along N (coalesced), and an AWQ or GPTQ
checkpoint's levels land here unchanged. A decode step reads a quarter of bfloat16's weight
bytes (plus 4 bytes of step and offset per 32 weights): where a step is bound by reading
the weights (batch 1 on an 8B model), that is the speed-up to expect.

Each program takes BLOCK_M rows and BLOCK_N outputs; for each BLOCK_K inputs it loads the
words of those inputs (each word once per row of eight it holds: the loads repeat within a
tile, served by the cache), shifts out each input's level, scales it by its group's step and
offset into the activations' dtype and runs tl.dot in float32 sums. No host read of device
data, grid fixed by the shapes: a CUDA graph can take it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

GROUP = 32  # inputs per step and offset, as the CPU kernel's (kernels/cpu INT4_GROUP_SIZE)
BLOCK_M = 16  # tl.dot's smallest tile


@triton.jit
def _linear_int4_kernel(
    x_ptr,  # [M, K] activations
    q_ptr,  # [K // 8, N] int32: level of input 8w + j in bits 4j..4j+3 of word w
    step_ptr,  # [K // GROUP, N] float16
    low_ptr,  # [K // GROUP, N] float16
    bias_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N]
    M, N, K,
    stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_ym, stride_yn,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_in = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=(offs_m < M)[:, None] & k_in[None, :], other=0.0)
        w_mask = k_in[:, None] & (offs_n < N)[None, :]
        words = tl.load(q_ptr + (k // 8)[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=w_mask, other=0)
        levels = (words >> ((k % 8) * 4)[:, None]) & 0xF  # [BLOCK_K, BLOCK_N]
        group = (k // GROUP)[:, None] * stride_sg + offs_n[None, :] * stride_sn
        step = tl.load(step_ptr + group, mask=w_mask, other=0.0).to(tl.float32)
        low = tl.load(low_ptr + group, mask=w_mask, other=0.0).to(tl.float32)
        w = levels.to(tl.float32) * step + low
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def pack_levels(levels: torch.Tensor) -> torch.Tensor:
    """[N, K] levels 0..15 -> [K // 8, N] int32, input 8w + j in bits 4j..4j+3 of word w."""
    n, k = levels.shape
    if k % 8 or int(levels.min()) < 0 or int(levels.max()) > 15:
        raise ValueError(f"pack_levels: levels [{n}, {k}] need K % 8 == 0 and values in 0..15")
    eight = levels.T.reshape(k // 8, 8, n).to(torch.int64)
    words = (eight << (4 * torch.arange(8, device=levels.device))[None, :, None]).sum(1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def linear_int4(
    x: torch.Tensor,  # [M, K] bfloat16 or float16 (float32: exact dots, for tests)
    packed: torch.Tensor,  # [K // 8, N] int32 (pack_levels)
    step: torch.Tensor,  # [K // GROUP, N] float16
    low: torch.Tensor,  # [K // GROUP, N] float16
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x's dtype
    m, k = x.shape
    n = packed.shape[1]
    assert packed.dtype == torch.int32 and packed.shape == (k // 8, n) and k % GROUP == 0, (packed.shape, x.shape)
    assert step.shape == low.shape == (k // GROUP, n) and step.dtype == low.dtype == torch.float16
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_n = min(64, triton.next_power_of_2(n))
    block_k = 64 if k % 64 == 0 else GROUP
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n))
    _linear_int4_kernel[grid](
        x, packed, step, low, bias if bias is not None else y, y, m, n, k,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1), step.stride(0), step.stride(1),
        y.stride(0), y.stride(1),
        GROUP=GROUP, HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        # Exact float32 products for float32 activations and under the interpreter (which
        # computes 16-bit dots on the raw bits); tensor-core dots on a GPU otherwise.
        FP32_DOT=x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
    )
    return y
