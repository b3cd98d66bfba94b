"""Paged attention in plain PyTorch: the CPU path and the reference for the Triton kernels.

Decodes (one query each) arrive sorted by length and run in small padded groups over
their gathered blocks: small groups waste little on padding and keep the gathered K/V
in cache (measured: 8 per group was 6x faster than one padded batch of 64 on this CPU).
Prefill chunks run one request at a time, where the matrix work dwarfs the loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.attention.metadata import AttentionMetadata

DECODE_GROUP_SIZE = 8


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks a padded token
) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    if bool((slot_mapping < 0).any()):
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [..., num_blocks_used]
) -> torch.Tensor:  # [..., num_kv_heads, num_blocks_used * block_size, head_dim]
    blocks = cache.index_select(0, block_ids.flatten())  # [n * nb, block_size, kv_heads, head_dim]
    blocks = blocks.view(*block_ids.shape, *cache.shape[1:])
    shape = blocks.shape
    flat = blocks.reshape(*shape[:-4], shape[-4] * shape[-3], shape[-2], shape[-1])
    return flat.transpose(-3, -2)


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        block_size = kv_cache.shape[2]
        num_decodes = metadata.num_decodes
        for start in range(0, num_decodes, DECODE_GROUP_SIZE):
            end = min(start + DECODE_GROUP_SIZE, num_decodes)
            out[start:end] = self._decode(query[start:end], kv_cache, metadata, start, scale)
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for i in range(num_decodes, metadata.num_reqs):
            start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            query_len = end - start
            num_blocks = -(-seq_len // block_size)
            block_ids = metadata.block_table[i, :num_blocks]
            k = gather_kv(kv_cache[0], block_ids)[:, :seq_len]  # [num_kv_heads, seq_len, d]
            v = gather_kv(kv_cache[1], block_ids)[:, :seq_len]
            q = query[start:end].transpose(0, 1)  # [num_heads, query_len, d]
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
            out[start:end] = o.transpose(0, 1)
        return out

    def _decode(
        self,
        query: torch.Tensor,  # [group, num_heads, head_dim]: decode requests first..first+group
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        first: int,
        scale: float,
    ) -> torch.Tensor:  # [group, num_heads, head_dim]
        end = first + query.shape[0]
        block_size = kv_cache.shape[2]
        seq_lens = metadata.seq_lens[first:end]
        max_seq_len = int(metadata.seq_lens_cpu[first:end].max())
        num_blocks = -(-max_seq_len // block_size)
        block_ids = metadata.block_table[first:end, :num_blocks]
        k = gather_kv(kv_cache[0], block_ids)  # [num_decodes, num_kv_heads, L, d]
        v = gather_kv(kv_cache[1], block_ids)
        group, num_heads, head_dim = query.shape
        num_kv_heads, length = k.shape[1], k.shape[2]
        if query.dtype == torch.float32:
            # SDPA's CPU kernel: 10% faster than the matmuls below for a float32 decode
            # step at batch 32 (measured), and what transformers runs.
            mask = torch.arange(length, device=query.device)[None, :] < seq_lens[:, None]  # [group, L]
            o = F.scaled_dot_product_attention(
                query.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
            )
            return o.squeeze(2)
        # Lower precision: two batched matmuls with the query heads of one KV head stacked
        # as rows, softmax in float32. SDPA's CPU kernel is tiled for long queries; with
        # one query row in bfloat16 it was 4-8x slower than this (measured, L = 160-400).
        pad = torch.arange(length, device=query.device)[None, :] >= seq_lens[:, None]  # [group, L]
        q = query.view(group, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)  # [group, kv_heads, q_per_kv, L]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        probs = scores.softmax(-1).to(v.dtype)
        return torch.matmul(probs, v).view(group, num_heads, head_dim)
