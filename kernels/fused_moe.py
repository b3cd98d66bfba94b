"""A sparse MoE layer's expert products as two grouped GEMMs (vLLM's `fused_moe` design).

Each (token, slot) pair of the router's top-k is one row of work. `align_by_expert` sorts
the pairs by expert and pads each expert's run to a multiple of BLOCK_M (pad entries are
the sentinel `num_pairs`), so every block of BLOCK_M sorted rows belongs to one expert; a
program of `_grouped_gemm_kernel` takes one such block and BLOCK_N output columns, loads
its rows of A by pair (token rows for the first product, pair rows for the second) and
multiplies them by its expert's weight, read from the experts stacked [E, N, K]. The
second product multiplies each row by its routing weight; the k rows of a token are then
summed. Everything is device ops of shapes fixed by (num_tokens, top_k, num_experts):
no host read of expert counts, so a CUDA graph can take it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16  # tl.dot's smallest tile


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [max_rows], padded with num_pairs; the expert of each block of
    block_m rows [max_rows // block_m], num_experts for blocks past the last)."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    # scatter_add, not bincount: bincount sizes its output from the ids' maximum, read on the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    max_rows = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[expert_of]
    sorted_ids = torch.full((max_rows,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_ids[(padded_end - padded)[expert_of] + rank] = order
    block_starts = torch.arange(0, max_rows, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)  # num_experts past the end
    return sorted_ids, block_experts


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows of A, K]: tokens (A_ROW_DIV = top_k) or pairs (A_ROW_DIV = 1)
    b_ptr,  # [E, N, K]
    c_ptr,  # [num_pairs, N]
    weights_ptr,  # [num_pairs] routing weights (MUL_WEIGHTS)
    sorted_ids_ptr,  # [max_rows]
    block_experts_ptr,  # [max_rows // BLOCK_M]
    num_pairs, num_experts, N, K,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < num_experts:
        pair = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pair < num_pairs
        row = pair // A_ROW_DIV
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            a = tl.load(a_ptr + row[:, None] * stride_am + k[None, :] * stride_ak,
                        mask=valid[:, None] & (k < K)[None, :], other=0.0)
            b = tl.load(b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + k[:, None] * stride_bk,
                        mask=(k < K)[:, None] & (offs_n < N)[None, :], other=0.0)
            if FP32_DOT:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        if MUL_WEIGHTS:
            acc = acc * tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
        tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
                 mask=valid[:, None] & (offs_n < N)[None, :])


def _grouped_gemm(a, b, c, weights, sorted_ids, block_experts, a_row_div: int, mul_weights: bool) -> None:
    num_pairs, n = c.shape
    k = b.shape[2]
    block_n = min(64, triton.next_power_of_2(n))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, block_experts,
        num_pairs, b.shape[0], n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, MUL_WEIGHTS=mul_weights, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        # Exact float32 products for float32 weights and under the interpreter (which
        # computes bf16 dots on the raw bits); bf16 tensor-core dots on a GPU otherwise.
        FP32_DOT=a.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
    )


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w_gate_up: torch.Tensor,  # [E, 2 * intermediate, hidden]: gate rows, then up rows
    w_down: torch.Tensor,  # [E, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    b_gate_up: torch.Tensor | None = None,  # [E, 2 * intermediate] (gpt-oss's biased experts)
    b_down: torch.Tensor | None = None,  # [E, hidden]
    activate=None,  # [pairs, 2 * intermediate] -> [pairs, intermediate]; None: SiLU-and-mul
) -> torch.Tensor:  # [num_tokens, hidden]
    """Biased experts add their biases to each pair's rows by its expert (device gathers),
    and weigh the down product after its bias, as transformers orders it."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, _ = w_gate_up.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    sorted_ids, block_experts = align_by_expert(topk_ids, num_experts)
    num_pairs = num_tokens * top_k
    gate_up = torch.empty(num_pairs, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w_gate_up, gate_up, topk_weights, sorted_ids, block_experts, top_k, False)
    experts = topk_ids.flatten()  # each pair's (token-major, as the pairs are)
    if b_gate_up is not None:
        gate_up += b_gate_up[experts]
    act = F.silu(gate_up[:, : two_i // 2]) * gate_up[:, two_i // 2 :] if activate is None else activate(gate_up)
    out = torch.empty(num_pairs, w_down.shape[1], dtype=x.dtype, device=x.device)
    pair_weights = topk_weights.flatten().contiguous()
    _grouped_gemm(act.contiguous(), w_down, out, pair_weights, sorted_ids, block_experts, 1, b_down is None)
    if b_down is not None:
        out = (out + b_down[experts]) * pair_weights[:, None]
    return out.view(num_tokens, top_k, -1).sum(1)
