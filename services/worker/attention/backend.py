"""The attention-backend interface: the model calls one of these and never knows which."""

from __future__ import annotations

from typing import Protocol

import torch

from services.worker.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def new_kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device | str, values_are_keys: bool = False) -> torch.Tensor:
        """One layer's zeroed cache, [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
        as every backend indexes it, laid out in memory as this backend reads it fastest.
        `values_are_keys` (latent attention's, whose values are its keys): K and V one
        memory, the second a stride-0 view of the first (half the bytes; the same rows are
        written to both)."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,  # > 0: a query sees only the keys of its last `window` positions
        softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
        sinks: torch.Tensor | None = None,  # [num_heads]: gpt-oss's logit a row's softmax also spreads over
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write the new keys/values into their cache slots, then attend over the cache. (The
        Triton backend also takes key and value None: its caller wrote them already.)
        `window`: a sliding window (Mistral's, Qwen's, Gemma's), which reads only the blocks
        it covers; `softcap`: Gemma 2's; `sinks`: gpt-oss's (one more column in each
        head's softmax, dropped after it)."""
        ...


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from services.worker.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from services.worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention_backend {name!r}: torch or triton")
