"""The decoder's attention layer: fused q/k/v, query/key norms, rotary, sinks and gates,
over a paged KV cache through the attention backend."""

from __future__ import annotations

import os

import torch
from torch import nn

import kernels.elementwise as triton_kernels
from services.worker.attention.backend import AttentionBackend
from services.worker.attention.metadata import AttentionMetadata
from services.worker.layers.lora import LoRAStack, adapted
from services.worker.layers.rms_norm import RMSNorm
from services.worker.layers.rotary import RotaryEmbedding
from services.worker.models.decoder_config import ModelConfig


def triton_elementwise(backend: AttentionBackend) -> bool:
    """Whether the element-wise work runs in Triton kernels (kernels/elementwise.py): with
    the GPU's attention backend, unless LLMBUS_TRITON_ELEMENTWISE=0 (PyTorch ops instead;
    scripts/device_check.sh sets it when the kernels fail its first check)."""
    return backend.name == "triton" and os.environ.get("LLMBUS_TRITON_ELEMENTWISE", "1") != "0"


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, triton: bool = False,
                 window: int = 0):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale if config.attention_scale is not None else self.head_dim**-0.5
        # OPT scales the queries as they leave their projection, and the scores not at all
        self.query_scale = None
        if config.scale_queries:
            self.query_scale, self.scale = self.scale, 1.0
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        # AFMoE's: the heads' output gated by sigmoid(gate_proj(x)), x the attention's input
        # (its checkpoint's self_attn.gate_proj, renamed: `gate_proj` is an MLP's half here),
        # an output element a gate; LFM3's a head a gate
        self.gate_per_head = config.attention_gate_per_head
        gates = self.num_heads if self.gate_per_head else self.q_size
        self.output_gate = nn.Linear(config.hidden_size, gates, bias=False) if config.attention_gate else None
        self.shard_sizes = (self.q_size, self.kv_size, self.kv_size)
        # LoRA adapters' products on top of qkv_proj's and o_proj's (layers/lora.py), where
        # the worker serves adapters (manager.py attaches them)
        self.qkv_lora: LoRAStack | None = None
        self.o_lora: LoRAStack | None = None
        self.rotary = rotary
        self.backend = backend
        self.position_scale = None  # Llama 4's temperature by position, where the model has one (set by its layer)
        # This layer's sliding window (0: none) and Gemma 2's soft cap on the scores
        self.window = window
        self.softcap = config.attn_logit_softcapping
        # gpt-oss: a logit per query head that each row's softmax also spreads over
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None
        # With the Triton kernels on (`triton_elementwise`), one kernel rotates queries and
        # keys and writes keys and values into the cache (kernels/elementwise.py), then the
        # backend attends over the cache. A partial rotary rotates in PyTorch.
        self.qk_norm_after_rope = config.qk_norm_after_rope  # (then the rotary cannot write the cache)
        self.rotary_writes_cache = triton and rotary.head_dim == self.head_dim and not self.qk_norm_after_rope
        self.qk_norm_over_heads = config.qk_norm_over_heads
        if config.qk_norm:  # Qwen3: over each head's head_dim (OLMo 2: over all of them), a weight for q and for k
            over = (self.num_heads, self.num_kv_heads) if config.qk_norm_over_heads else (1, 1)
            self.q_norm = RMSNorm(over[0] * self.head_dim, config.rms_norm_eps, triton=triton)
            self.k_norm = RMSNorm(over[1] * self.head_dim, config.rms_norm_eps, triton=triton)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = adapted(self.qkv_proj, self.qkv_lora, hidden)
        if self.query_scale is not None:
            qkv[:, : self.q_size] *= self.query_scale
        # Query and key heads are adjacent: rotate them in one pass, then split the result.
        qk = qkv[:, : self.q_size + self.kv_size].unflatten(-1, (self.num_heads + self.num_kv_heads, self.head_dim))
        if self.q_norm is not None and self.qk_norm_over_heads:  # OLMo 2: each token's queries, and keys, as one row
            qk = torch.cat((self.q_norm(qkv[:, : self.q_size].contiguous()),
                            self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].contiguous())),
                           dim=1).unflatten(-1, (self.num_heads + self.num_kv_heads, self.head_dim))
        elif self.q_norm is not None and not self.qk_norm_after_rope:
            qk = self._head_norms(qk, num_tokens)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.rotary_writes_cache:
            q = triton_kernels.rotary_and_cache(qk, v, positions, self.rotary.cos_cache, self.rotary.sin_signed_cache,
                                                kv_cache[0], kv_cache[1], metadata.slot_mapping, self.num_heads)
            if self.position_scale is not None:
                q = q * self.position_scale(positions, q.dtype)
            out = self.backend.forward(q, None, None, kv_cache, metadata, self.scale, self.window, self.softcap,
                                       self.sinks)
        else:
            qk = self.rotary(positions, qk)
            if self.qk_norm_after_rope:
                qk = self._head_norms(qk, num_tokens)
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            if self.position_scale is not None:
                q = q * self.position_scale(positions, q.dtype)
            out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale, self.window, self.softcap, self.sinks)
        out = out.reshape(num_tokens, self.q_size)
        if self.output_gate is not None and self.gate_per_head:
            out = (out.view(num_tokens, self.num_heads, self.head_dim)
                   * torch.sigmoid(self.output_gate(hidden)).unsqueeze(-1)).view(num_tokens, self.q_size)
        elif self.output_gate is not None:
            out = out * torch.sigmoid(self.output_gate(hidden))
        return adapted(self.o_proj, self.o_lora, out)

    def _head_norms(self, qk: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Each query and key head normed over its head_dim (Qwen3's, Hunyuan's)."""
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        # Norms as contiguous rows of head_dim (what their kernels take: with one KV head
        # the key's reshape is a strided view), then side by side again.
        q, k = (x.reshape(-1, self.head_dim).contiguous() for x in (q, k))
        return torch.cat((self.q_norm(q).view(num_tokens, self.num_heads, self.head_dim),
                          self.k_norm(k).view(num_tokens, self.num_kv_heads, self.head_dim)), dim=1)
