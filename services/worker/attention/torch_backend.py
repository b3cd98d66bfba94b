"""Paged attention in plain PyTorch: the CPU path and the reference for the Triton kernels.

The cache keeps the logical shape every backend shares, [2, num_blocks, block_size,
num_kv_heads, head_dim], but this backend allocates it heads-first in memory
([2, num_kv_heads, num_blocks, block_size, head_dim], permuted back): gathering a
request's blocks for one head is then a single copy that lands in the layout the matmuls
want, instead of a gather followed by a transposing copy (measured: 8 decodes over 512
tokens, 537 -> 292 us per layer in bfloat16). Any cache of the logical shape works;
other layouts only cost a copy more.

Decodes (one query each) arrive sorted by length and run in small padded groups over
their gathered blocks: small groups waste little on padding and keep the gathered K/V
in cache (measured: 8 per group was 6x faster than one padded batch of 64 on this CPU
with a token-major cache; with the heads-first one, 16 per group beat 8 and 32 on 64
decodes of 64-512-token prompts: median decode forward 161-170 ms against 195-210 and
183-185 in bfloat16; 271-327 against 343-405 in float32).
Prefill chunks run one request at a time, where the matrix work dwarfs the loop.

bfloat16 and float32 go to the CPU kernels where they load: decodes to
kernels/cpu/paged_decode_attention.cpp, which reads each key and value once in place
(no gathered copy, no padding); prefill chunks to kernels/cpu/paged_prefill_attention.cpp
(flash-attention over the request's blocks: ~3x SDPA in bfloat16, ~2x in float32, on a
512-token prompt). The paths below are what runs without them.

An 8-bit float cache (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`) is written by the CPU
kernels' conversion, or by PyTorch's (the same bits, tested); every read widens it to the
query's dtype first: exactly, as every float8 value is a bfloat16 one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels.cpu as cpu_kernels
from kernels.cpu import huge_pages
from services.worker.attention.kv_cache_dtype import FP8_MAX, to_cache_dtype
from services.worker.attention.metadata import AttentionMetadata

DECODE_GROUP_SIZE = 16


def widen(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache values in the query's dtype (a no-op for a cache of that dtype)."""
    return x if x.dtype == dtype else x.to(dtype)


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, values_are_keys: bool = False) -> torch.Tensor:
    """Zeros of logical shape [2, num_blocks, block_size, num_kv_heads, head_dim], heads-first
    in memory; on the CPU on 2 MB pages where Linux offers them (kernels/cpu/huge_pages.py:
    decode attention reads scattered blocks, 10-17% faster without a TLB walk per 4 KB).
    `values_are_keys`: one half's memory, seen twice (backend.py)."""
    shape = (1 if values_are_keys else 2, num_kv_heads, num_blocks, block_size, head_dim)
    if torch.device(device).type == "cpu":
        cache = huge_pages.empty(math.prod(shape), dtype).zero_().view(shape)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    return cache.expand(2, *shape[1:]).permute(0, 2, 3, 1, 4)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], any layout
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks a padded token
    padded: bool | None = None,  # whether any slot is -1 (None: look)
) -> None:
    if (kv_cache.dtype in FP8_MAX and kv_cache.device.type == "cpu"
            and cpu_kernels.kv_format(key.dtype, kv_cache.dtype) is not None and cpu_kernels.available()):
        cpu_kernels.write_kv(key, value, kv_cache, slot_mapping)  # converts as PyTorch does, in one pass
        return
    if padded is None:
        padded = bool((slot_mapping < 0).any())
    if padded:
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    if kv_cache.dtype != key.dtype:
        # index_copy_ takes no float8: copy the bytes.
        key, value = to_cache_dtype(key, kv_cache.dtype), to_cache_dtype(value, kv_cache.dtype)
        if kv_cache.dtype in FP8_MAX:
            kv_cache, key, value = kv_cache.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    # [num_slots, num_kv_heads, head_dim]: a view in either layout (blocks and slots nest).
    kv_cache[0].flatten(0, 1).index_copy_(0, slot_mapping, key)
    kv_cache[1].flatten(0, 1).index_copy_(0, slot_mapping, value)


def head_major_ids(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Rows of a heads-first cache viewed as [num_kv_heads * num_blocks, block_size, d] that
    hold `block_ids` for each head in turn: [num_kv_heads * block_ids.numel()]."""
    heads = torch.arange(num_kv_heads, device=block_ids.device)[:, None] * num_blocks
    return (heads + block_ids.flatten()[None, :]).flatten()


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [..., num_blocks_used]
    rows: torch.Tensor | None = None,  # head_major_ids(block_ids, ...), if the caller has it
) -> torch.Tensor:  # [num_kv_heads, ..., num_blocks_used * block_size, head_dim], contiguous
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    heads_first = cache.permute(2, 0, 1, 3)  # [num_kv_heads, num_blocks, block_size, head_dim]
    if heads_first.is_contiguous():
        # A gather along the first dimension copies whole rows (index_select's fast path;
        # along the second it was 3x slower, measured at batch 32).
        if rows is None:
            rows = head_major_ids(block_ids, num_kv_heads, num_blocks)
        blocks = heads_first.reshape(num_kv_heads * num_blocks, block_size, head_dim).index_select(0, rows)
    else:
        blocks = heads_first.index_select(1, block_ids.flatten())
    return blocks.view(num_kv_heads, *block_ids.shape[:-1], -1, head_dim)


@dataclass(slots=True)
class _DecodeGroup:
    start: int
    end: int
    block_ids: torch.Tensor  # [group, num_blocks]
    rows: torch.Tensor  # head_major_ids(block_ids): what gather_kv reads
    keep: torch.Tensor  # [group, 1, 1, L] bool: position within the request's sequence
    pad: torch.Tensor  # [group, 1, L] bool: the opposite


@dataclass(slots=True)
class _StepState:
    """Derived once per step, used by every layer."""

    slots_padded: bool
    decode_groups: list[_DecodeGroup]  # empty when the CPU kernel takes the decodes
    kernel_decodes: bool
    kernel_prefills: bool = False


class TorchAttentionBackend:
    name = "torch"
    new_kv_cache = staticmethod(new_kv_cache)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        block_size = kv_cache.shape[2]
        state = metadata.backend_state
        if not isinstance(state, _StepState):
            state = metadata.backend_state = self._step_state(metadata, query, kv_cache)
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping, state.slots_padded)
        if window >= metadata.max_seq_len:
            # The window holds every key of the step: plain causal attention (the SDPA and
            # grouped paths where the CPU kernels do not load, not the per-request loop).
            window = 0
        if sinks is not None or metadata.bidirectional is not None or (
                (window or softcap is not None) and not state.kernel_prefills):
            # (the CPU kernels, where they load, take windows and caps below; not sinks, nor images' spans)
            return capped_or_windowed(query, kv_cache, metadata, scale, window, softcap, sinks)
        if state.kernel_decodes:
            decodes = cpu_kernels.paged_decode_attention(
                query[: metadata.num_decodes], kv_cache, metadata.block_table, metadata.seq_lens, scale, window, softcap
            )
            if metadata.num_decodes == metadata.num_reqs:
                return decodes
        if len(state.decode_groups) == 1 and metadata.num_decodes == metadata.num_reqs:
            return self._decode(query, kv_cache, state.decode_groups[0], scale)  # one group of decodes
        out = torch.empty_like(query)
        if state.kernel_decodes:
            out[: metadata.num_decodes] = decodes
        for group in state.decode_groups:
            out[group.start : group.end] = self._decode(query[group.start : group.end], kv_cache, group, scale)
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for i in range(metadata.num_decodes, metadata.num_reqs):
            start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            query_len = end - start
            num_blocks = -(-seq_len // block_size)
            block_ids = metadata.block_table[i, :num_blocks]
            if state.kernel_prefills:
                out[start:end] = cpu_kernels.paged_prefill_attention(query[start:end], kv_cache, block_ids, seq_len, scale,
                                                                     window, softcap)
                continue
            k = widen(gather_kv(kv_cache[0], block_ids)[:, :seq_len], query.dtype)  # [num_kv_heads, seq_len, d]
            v = widen(gather_kv(kv_cache[1], block_ids)[:, :seq_len], query.dtype)
            # A leading batch dimension of 1: SDPA's CPU flash kernel takes 4-D inputs, and
            # 3-D ones fell to a path 3x slower (bf16, 512-token prompt: 14.1 vs 4.3 ms a layer).
            q = query[start:end].transpose(0, 1)[None]  # [1, num_heads, query_len, d]
            k, v = k[None], v[None]
            if query_len == seq_len:
                o = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                # The new tokens sit at the end of the sequence: each sees the cached prefix
                # and the new tokens up to itself.
                q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [query_len, seq_len]
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
                )
            out[start:end] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _step_state(metadata: AttentionMetadata, query: torch.Tensor, kv_cache: torch.Tensor) -> _StepState:
        """Block ids and masks of each decode group, built once instead of once per layer."""
        slots_padded = bool((metadata.slot_mapping < 0).any())
        kernels = cpu_kernels.attention_supported(query, kv_cache)
        if kernels:
            return _StepState(slots_padded, [], kernel_decodes=metadata.num_decodes > 0, kernel_prefills=True)
        cache_blocks, block_size, num_kv_heads = kv_cache.shape[1:4]
        groups = []
        device = metadata.block_table.device
        for start in range(0, metadata.num_decodes, DECODE_GROUP_SIZE):
            end = min(start + DECODE_GROUP_SIZE, metadata.num_decodes)
            max_seq_len = int(metadata.seq_lens_cpu[start:end].max())
            num_blocks = -(-max_seq_len // block_size)
            block_ids = metadata.block_table[start:end, :num_blocks]
            keep = torch.arange(num_blocks * block_size, device=device)[None, :] < metadata.seq_lens[start:end, None]
            keep = keep[:, None, None, :]  # [group, 1, 1, L]: over SDPA's [group, heads, 1, L]
            pad = ~keep[:, 0]  # [group, 1, L]: over the matmuls' [kv_heads, group, q_per_kv, L]
            rows = head_major_ids(block_ids, num_kv_heads, cache_blocks)
            groups.append(_DecodeGroup(start, end, block_ids, rows, keep, pad))
        return _StepState(slots_padded, groups, kernel_decodes=False)

    @staticmethod
    def _decode(
        query: torch.Tensor,  # [group, num_heads, head_dim]: one decode group
        kv_cache: torch.Tensor,
        group: _DecodeGroup,
        scale: float,
    ) -> torch.Tensor:  # [group, num_heads, head_dim]
        k = widen(gather_kv(kv_cache[0], group.block_ids, group.rows), query.dtype)  # [num_kv_heads, group, L, d]
        v = widen(gather_kv(kv_cache[1], group.block_ids, group.rows), query.dtype)
        size, num_heads, head_dim = query.shape
        num_kv_heads = k.shape[0]
        if query.dtype == torch.float32:
            # SDPA's CPU kernel: 10% faster than the matmuls below for a float32 decode
            # step at batch 32 (measured), and what transformers runs.
            o = F.scaled_dot_product_attention(
                query.unsqueeze(2), k.transpose(0, 1), v.transpose(0, 1), attn_mask=group.keep, scale=scale,
                enable_gqa=True,
            )
            return o.squeeze(2)
        # Lower precision: two batched matmuls with the query heads of one KV head stacked
        # as rows, softmax in float32. SDPA's CPU kernel is tiled for long queries; with
        # one query row in bfloat16 it was 4-8x slower than this (measured, L = 160-400).
        q = query.view(size, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
        scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)  # [kv_heads, group, q_per_kv, L]
        scores.masked_fill_(group.pad, float("-inf"))
        probs = scores.softmax(-1).to(v.dtype)
        return torch.matmul(probs, v).transpose(0, 1).reshape(size, num_heads, head_dim)


def capped_or_windowed(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], written
    metadata: AttentionMetadata,
    scale: float,
    window: int,  # 0: none
    softcap: float | None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:
    """Attention with a sliding window, a soft cap or sinks, one request at a time: scores
    in float32, soft-capped, masked causally and to the window, each head's sink a last
    column of its softmax (dropped after it), as transformers' eager attention computes
    them. A windowed request reads only the blocks from its first
    query's window on, so a long context costs a window's reading, not the context's.
    SDPA takes neither a soft cap nor a window: where the CPU kernels (which take both)
    do not load - another dtype, another head size - this loop runs such layers. A
    request's product is [kv_heads, q_per_kv * query_len, keys], batched over heads. Images'
    placeholders that attend both ways (metadata.bidirectional) take this loop too, any layer.
    Decodes in padded groups of 16, as the unwindowed path runs
    them, were tried and were slower at 32 decodes over 1024 keys (median of 30
    alternated calls): 0.72x in bfloat16 with Gemma-2-2B's heads (8 query heads of 256
    dims, 4 KV heads), 0.37x with Mistral's (32 of 128, 8 KV heads); a request's K/V
    stays in cache here, a group's does not. Only with one KV head (gemma-3-1b) did
    groups win (3x in bfloat16, 0.5x in float32)."""
    block_size = kv_cache.shape[2]
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    out = torch.empty_like(query)
    qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    for i in range(metadata.num_reqs):
        start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        query_len = end - start
        if query_len == 0:
            continue
        first_query = seq_len - query_len  # the position of the request's first new token
        first_key = max(0, first_query - window + 1) if window else 0
        first_block = first_key // block_size
        block_ids = metadata.block_table[i, first_block : -(-seq_len // block_size)]
        offset = first_block * block_size  # the position of the first gathered key
        k = widen(gather_kv(kv_cache[0], block_ids)[:, : seq_len - offset], query.dtype)  # [kv_heads, keys, d]
        v = widen(gather_kv(kv_cache[1], block_ids)[:, : seq_len - offset], query.dtype)
        # [kv_heads, q_per_kv * query_len, d]: a KV head's query heads stacked as rows
        q = query[start:end].view(query_len, num_kv_heads, num_heads // num_kv_heads, head_dim).permute(1, 2, 0, 3)
        scores = torch.matmul(q.reshape(num_kv_heads, -1, head_dim), k.transpose(-1, -2)).float().mul_(scale)
        if softcap is not None:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        q_pos = torch.arange(first_query, seq_len, device=query.device)
        k_pos = torch.arange(offset, seq_len, device=query.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        for lo, hi in metadata.bidirectional.get(i, ()) if metadata.bidirectional else ():
            # an image's placeholders see each other both ways (transformers' token_type_ids mask)
            visible |= ((q_pos >= lo) & (q_pos < hi))[:, None] & ((k_pos >= lo) & (k_pos < hi))[None, :]
        if window:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        scores = scores.view(num_kv_heads, -1, query_len, seq_len - offset).masked_fill_(~visible, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1).to(v.dtype).view(num_kv_heads, -1, seq_len - offset)
        else:
            sink = sinks.float().view(num_kv_heads, -1, 1, 1).expand(-1, -1, query_len, 1)
            probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1].to(v.dtype)
            probs = probs.reshape(num_kv_heads, -1, seq_len - offset)
        o = torch.matmul(probs, v).view(num_kv_heads, num_heads // num_kv_heads, query_len, head_dim)
        out[start:end] = o.permute(2, 0, 1, 3).reshape(query_len, num_heads, head_dim)
    return out
