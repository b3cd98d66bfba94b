"""Paged attention over the block table for one step's flattened batch.

One launch serves prefill chunks and decodes alike: a program takes BLOCK_Q query
tokens of one request and all query heads that share one KV head (GQA), so each KV
block is read once per tile, and walks that request's blocks through the block table:
causal within the new tokens, full over the cached prefix. Softmax is online, in
float32, whatever the cache dtype. A float8 cache (`--kv-cache-dtype`) is widened to the
queries' dtype as its tiles load (exact), so the products are the same as on its widened
copy.

A program's inner loop reads TILE_KEYS keys at once, gathered from TILE_KEYS / block_size
cache blocks: more bytes in flight per program than one block at a time (on an H200 a
16-key tile left decode at 0.67 of the memory bandwidth where contiguous SDPA reached
0.95; docs/design/kernels.md).

A sliding window and Gemma 2's soft cap are constexpr switches, so other models' kernels
are unchanged: SOFTCAP caps each scaled score at softcap * tanh(score / softcap) before the softmax,
and WINDOW > 0 lets a query see only its last WINDOW positions (transformers' sliding
window: key > query - WINDOW); a windowed program starts at the first tile its queries
can see, so it reads a window's keys, not the whole context's.

Sinks (gpt-oss's, a constexpr switch too): a learned logit per query head that joins each
row's softmax as one more column whose value is zero: folded into the online softmax's
final (max, sum) once, after the keys (with splits, by the reduction).

Split-KV (flash-decoding): with NUM_SPLITS > 1 each program covers one slice of the
keys and writes an unnormalised partial (acc, max, sum); `_reduce_splits_kernel` merges
the slices. It pays when few sequences with long contexts leave the GPU idle.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Keys per inner iteration (at least one cache block). Set from `python -m llmbus.bench.kernels`.
TILE_KEYS = 64


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim], or partials when NUM_SPLITS > 1
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] float32 (splits only)
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32 (splits only)
    part_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32 (splits only)
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # [num_reqs, max_num_blocks] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    scale,
    softcap,  # read when SOFTCAP
    sinks_ptr,  # [num_heads] float32, read when SINKS (and NUM_SPLITS == 1)
    stride_q_tok, stride_q_head,
    stride_o_tok, stride_o_head,
    stride_c_block, stride_c_slot, stride_c_head,
    stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr,  # GQA group size
    GROUP_PAD: tl.constexpr,  # next power of two of the group
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_SIZE: tl.constexpr,  # cache block size
    TILE_KEYS: tl.constexpr,  # keys per inner iteration, a multiple of BLOCK_SIZE
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FP32_DOT: tl.constexpr,  # products in exact float32 (no tf32): float32 queries, interpreter
    SOFTCAP: tl.constexpr,  # whether scores are soft-capped
    WINDOW: tl.constexpr,  # > 0: the sliding window, in positions
    SINKS: tl.constexpr,  # whether each head's sink joins its softmax
):
    req = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - q_len  # keys cached before this step's tokens

        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
        rows = tl.arange(0, BLOCK_M)
        q_tok = q_tile * BLOCK_Q + rows // GROUP_PAD  # token within the request's new ones
        head = kv_head * NUM_QUERIES_PER_KV + rows % GROUP_PAD
        row_valid = (q_tok < q_len) & (rows % GROUP_PAD < NUM_QUERIES_PER_KV)
        q_pos = context_len + q_tok  # absolute position: sees keys 0..q_pos
        d = tl.arange(0, BLOCK_D)
        d_valid = d < HEAD_DIM

        q_offs = (q_start + q_tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :]
        q = tl.load(query_ptr + q_offs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)

        # Keys this program covers: its split's slice of those its tile can see, cut at the tile's last position.
        kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
        kv_lo = 0
        if WINDOW > 0:  # from the tile holding the first key the tile's first query sees
            kv_lo = tl.maximum(context_len + q_tile * BLOCK_Q - WINDOW + 1, 0) // TILE_KEYS * TILE_KEYS
        split_len = tl.cdiv(tl.cdiv(seq_len - kv_lo, NUM_SPLITS), TILE_KEYS) * TILE_KEYS
        kv_start = kv_lo + split * split_len
        kv_end = tl.minimum(kv_end, kv_start + split_len)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        offs_n = tl.arange(0, TILE_KEYS)
        for start in range(kv_start, kv_end, TILE_KEYS):
            key_pos = start + offs_n
            key_valid = key_pos < kv_end  # the last tile may run past the keys (and the table)
            physical = tl.load(block_table_ptr + req * stride_bt + key_pos // BLOCK_SIZE,
                               mask=key_valid, other=0).to(tl.int64)
            kv_offs = (
                physical[:, None] * stride_c_block
                + (key_pos % BLOCK_SIZE)[:, None] * stride_c_slot
                + kv_head * stride_c_head
                + d[None, :]
            )
            kv_mask = key_valid[:, None] & d_valid[None, :]
            # A float8 cache is widened to the queries' dtype as it is read (exact).
            k = tl.load(key_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)  # [TILE_KEYS, BLOCK_D]
            if FP32_DOT:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale  # [BLOCK_M, TILE_KEYS]
            if SOFTCAP:  # softcap * tanh(s / softcap), tanh from exp (1 - 2 / (e^2x + 1): no overflow to nan)
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            visible = (key_pos[None, :] <= q_pos[:, None]) & key_valid[None, :] & row_valid[:, None]
            if WINDOW > 0:
                visible = visible & (key_pos[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows that see nothing yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(value_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
            if FP32_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        tok = q_start + q_tok
        if NUM_SPLITS == 1:
            if SINKS:  # one more column of the softmax, worth exp(sink) and no value
                sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32)
                m_all = tl.maximum(m_i, sink)
                alpha = tl.exp(m_i - m_all)
                l_i = l_i * alpha + tl.exp(sink - m_all)
                acc = acc * alpha[:, None]
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_offs = tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :]
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
        else:
            # partials are laid out contiguously: [tok, head, split, d]
            num_heads = tl.num_programs(2) // NUM_SPLITS * NUM_QUERIES_PER_KV
            base = (tok * num_heads + head) * NUM_SPLITS + split
            tl.store(part_acc_ptr + base[:, None] * HEAD_DIM + d[None, :], acc,
                     mask=row_valid[:, None] & d_valid[None, :])
            tl.store(part_max_ptr + base, m_i, mask=row_valid)
            tl.store(part_sum_ptr + base, l_i, mask=row_valid)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] float32
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32
    part_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32
    sinks_ptr,  # [num_heads] float32, read when SINKS
    stride_o_tok, stride_o_head,
    num_heads,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINKS: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    base = (tok * num_heads + head) * NUM_SPLITS
    m = tl.load(part_max_ptr + base + splits)
    l_split = tl.load(part_sum_ptr + base + splits)
    m_all = tl.max(m, 0)
    if SINKS:  # the head's sink: one more split of sum exp(sink) and no value
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_all = tl.maximum(m_all, sink)
    weight = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)  # a split that saw nothing adds 0
    total = tl.sum(weight * l_split, 0)
    if SINKS:
        total += tl.exp(sink - m_all)
    acc = tl.load(part_acc_ptr + (base + splits)[:, None] * HEAD_DIM + d[None, :], mask=(d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    max_query_len: int,
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    tile_keys: int | None = None,
    window: int = 0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    assert cache_head_dim == head_dim and value_cache.shape == key_cache.shape
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1 and query.stride(2) == 1
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert block_size in (16, 32, 64), "block_size must be 16, 32 or 64"
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    tile_keys = max(block_size, TILE_KEYS if tile_keys is None else tile_keys)
    assert tile_keys % block_size == 0 and tile_keys & (tile_keys - 1) == 0, "tile_keys: a power-of-two multiple of block_size"
    num_reqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_reqs + 1,) and block_table.shape[0] == num_reqs
    out = torch.empty_like(query) if out is None else out
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, 16 // group_pad)  # tl.dot wants at least 16 rows
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), num_kv_heads * num_splits)
    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    sinks_arg = out if sinks is None else sinks  # (unread without SINKS)
    _paged_attention_kernel[grid](
        out, part_acc, part_max, part_sum,
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
        scale,
        1.0 if softcap is None else softcap,
        sinks_arg,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0),
        NUM_QUERIES_PER_KV=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        TILE_KEYS=tile_keys,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        NUM_SPLITS=num_splits,
        # Triton's interpreter computes bf16 dots on the raw bits, so there the products run
        # in float32 too; on a GPU a bf16 cache uses bf16 tensor-core dots.
        FP32_DOT=query.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
        SOFTCAP=softcap is not None,
        WINDOW=window,
        SINKS=sinks is not None and num_splits == 1,  # (with splits the reduction takes them)
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, sinks_arg,
            out.stride(0), out.stride(1),
            num_heads,
            NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            SINKS=sinks is not None,
        )
    return out
