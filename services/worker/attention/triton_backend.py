"""The Triton attention backend: the same interface as the PyTorch one, on the kernels."""

from __future__ import annotations

import torch
import triton

import kernels  # noqa: F401 - sets TRITON_INTERPRET on a machine without CUDA
from kernels.paged_attention import paged_attention
from kernels.reshape_and_cache import reshape_and_cache
from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.torch_backend import capped_or_windowed

# Split-KV pays when too few (sequence, KV head) programs exist to fill the GPU and each
# has a long run of keys. Set from `python -m llmbus.bench.kernels` on an H200 (132 SMs; tile of
# 64 keys; docs/design/kernels.md): with 8 or 128 programs, splitting up to ~512 programs won
# (1 x 4096: 16 splits, 2.1x faster than 8; 16 x 4096: 4, 1.15x faster than 2); from 512
# programs on, one split was best or within 3%; under 1024 keys a split only added the
# reduction's launch (1 x 512: 2 splits took 2.1x as long as 1). Slices stay >= 256 keys.
SPLIT_TARGET_PROGRAMS = 512
SPLIT_MIN_SEQ = 1024
SPLIT_MIN_KEYS = 256
MAX_SPLITS = 16


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int) -> int:
    if max_query_len != 1 or max_seq_len < SPLIT_MIN_SEQ:
        return 1
    programs = num_reqs * num_kv_heads
    if programs >= SPLIT_TARGET_PROGRAMS:
        return 1
    wanted = min(triton.cdiv(SPLIT_TARGET_PROGRAMS, programs), max_seq_len // SPLIT_MIN_KEYS, MAX_SPLITS)
    return 1 << (wanted.bit_length() - 1)  # a power of two, rounded down


class TritonAttentionBackend:
    name = "triton"

    @staticmethod
    def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device | str, values_are_keys: bool = False) -> torch.Tensor:
        # Token-major: a block's keys for all heads are one contiguous tile (the kernels
        # take strides, so other layouts work too: the stride-0 K/V of values_are_keys too).
        cache = torch.zeros(1 if values_are_keys else 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                            device=device)
        return cache.expand(2, *cache.shape[1:])

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: already in the cache
        value: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if key is not None:  # (None: the caller wrote them, kernels/elementwise.py's rotary_and_cache)
            reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        if metadata.bidirectional is not None:  # (a step with images' placeholders: rare, and the mask is theirs)
            return capped_or_windowed(query, kv_cache, metadata, scale, window, softcap, sinks)
        # A windowed layer's queries see at most `window` keys: split by those.
        keys_seen = min(metadata.max_seq_len, window) if window else metadata.max_seq_len
        num_splits = choose_num_splits(metadata.num_reqs, key_cache.shape[2], metadata.max_query_len, keys_seen)
        return paged_attention(
            query, key_cache, value_cache, metadata.block_table, metadata.query_start_loc,
            metadata.seq_lens, metadata.max_query_len, scale, num_splits=num_splits, window=window, softcap=softcap,
            sinks=sinks,
        )
