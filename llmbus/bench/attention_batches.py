"""Random paged-attention steps: what the kernel tests and the kernel benchmarks feed the
attention backends and kernels (random K/V, shuffled block tables, the step's metadata)."""

from __future__ import annotations

import numpy as np
import torch

from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.torch_backend import new_kv_cache


def make_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """A step with random K/V in a cache whose blocks are shuffled (non-contiguous tables)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = perm[used : used + n]
        used += n
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    query = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=gen).to(dtype)
    metadata = AttentionMetadata(
        num_decodes=sum(1 for q in query_lens if q == 1),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.full((int(qsl[-1]),), -1, dtype=torch.int64),
        block_table=block_table,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=np.asarray(seq_lens),
    )
    return query, kv_cache, metadata


def heads_first(kv_cache: torch.Tensor) -> torch.Tensor:
    """The same cache as the PyTorch backend allocates it: heads-first in memory."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    copy = new_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, kv_cache.dtype, "cpu")
    copy.copy_(kv_cache)
    assert copy.permute(0, 3, 1, 2, 4).is_contiguous()
    return copy
