"""Multi-head latent attention (MLA): DeepSeek-V3's, over the paged KV cache.

Each token's keys and values come from one small latent: `kv_a_proj_with_mqa` makes a
`kv_lora_rank` vector c (normed by `kv_a_layernorm`) and a `qk_rope_head_dim` key k_pe
that rotates and is shared by every head; `kv_b_proj` expands c into each head's
unrotated key (W_UK c) and value (W_UV c). Queries come from `q_proj`, or through a latent
of their own (`q_a_proj`, `q_a_layernorm`, `q_b_proj`), each head's [nope | pe] dims.

What the cache holds is the latent, not the expanded heads (vLLM's layout; transformers
caches the latent too): one KV "head" of [c | k_pe] a token, kv_lora_rank + qk_rope_head_dim
wide (576 for DeepSeek-V3, against 128 heads x (192 + 128) expanded: ~71x less). Attention
runs on it as multi-query attention with the key matrices absorbed into the queries:

    q_nope . (W_UK c) + q_pe . k_pe  ==  (W_UK^T q_nope) . c + q_pe . k_pe

so each head's query becomes [W_UK^T q_nope | q_pe] against the one cached row [c | k_pe].
The values are the same rows: attention's output's first kv_lora_rank dims are the
softmax-weighed sum of the c's, which W_UV turns into each head's value output (the
linearity lets the expansion come after the sum). The backends read keys and values from
the cache's two halves; here those are one memory (the runner's `values_are_keys`: V a
stride-0 view of K), the same rows written to both.

`kv_b_proj` is kept a plain weight (not an nn.Linear): its two halves are read per head in
the absorbed products, so quantizing or packing it (as the loader does to linear layers)
would take the matrices this needs.

DeepSeek lays each head's rotating dims out in interleaved pairs (`rope_interleave`, true
in its configs); the loader reorders those rows to the rotate-half layout (`rope_rows_as_halves`), which leaves q_pe . k_pe as
it is (layers/rotary.py's interleaved_as_halves, for GLM's heads, says why).
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.attention.backend import AttentionBackend
from services.worker.attention.metadata import AttentionMetadata
from services.worker.layers.rms_norm import RMSNorm
from services.worker.layers.rotary import RotaryEmbedding, interleaved_as_halves
from services.worker.models.decoder_config import ModelConfig

# transformers' DeepseekV3RMSNorm for the two latents, built without the config's eps
LATENT_NORM_EPS = 1e-6


class PlainWeight(nn.Module):
    """A weight read as a tensor, not applied as a linear layer (see the module's doc)."""

    def __init__(self, rows: int, columns: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, columns))


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 triton: bool = False) -> None:
        super().__init__()
        self.num_heads = heads = config.num_attention_heads
        self.rank, self.nope, self.pe = config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        qk_dim = self.nope + self.pe
        hidden = config.hidden_size
        if config.q_lora_rank:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, triton)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk_dim, bias=False)
        else:  # (DeepSeek-V2-Lite's: one projection)
            self.q_proj = nn.Linear(hidden, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.pe, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, triton)
        self.kv_b_proj = PlainWeight(heads * (self.nope + self.v_dim), self.rank)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=False)
        self.scale = config.attention_scale
        self.rotary = rotary  # over qk_rope_head_dim
        self.backend = backend
        self.position_scale = None  # (set by the decoder layer where the model has one)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, heads, rank = hidden.shape[0], self.num_heads, self.rank
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, heads, self.nope + self.pe)
        latent = self.kv_a_proj_with_mqa(hidden)  # [num_tokens, rank + pe]
        c = self.kv_a_layernorm(latent[:, :rank].contiguous())
        # The queries' rotating dims and the shared key's, rotated in one call
        pe = self.rotary(positions, torch.cat((q[..., self.nope:], latent[:, None, rank:]), dim=1))
        w = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, rank)
        # Each head's unrotated query through its W_UK, into the latent's space: [tokens, heads, rank]
        q_latent = torch.bmm(q[..., : self.nope].transpose(0, 1), w[:, : self.nope]).transpose(0, 1)
        query = torch.cat((q_latent, pe[:, :heads]), dim=-1)
        if self.position_scale is not None:  # (Mistral 4's, by position: layers/query_scale.py)
            query = query * self.position_scale(positions, query.dtype)
        key = torch.cat((c, pe[:, heads]), dim=-1).unsqueeze(1)  # [tokens, 1, rank + pe]: keys and values
        out = self.backend.forward(query, key, key, kv_cache, metadata, self.scale)
        # The weighed sum of latents, through each head's W_UV: [tokens, heads, v_dim]
        values = torch.bmm(out[..., :rank].transpose(0, 1), w[:, self.nope:].transpose(1, 2)).transpose(0, 1)
        return self.o_proj(values.reshape(num_tokens, heads * self.v_dim))


def rope_rows_as_halves(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A checkpoint tensor with its rotating rows (each query head's last qk_rope_head_dim,
    the latent's last ones) reordered from DeepSeek's interleaved pairs to rotate-half;
    any other tensor as it is."""
    pe = config.qk_rope_head_dim
    if name.endswith((".q_proj.weight", ".q_b_proj.weight")):
        head = config.qk_nope_head_dim + pe
    elif name.endswith(".kv_a_proj_with_mqa.weight"):
        head = config.kv_lora_rank + pe
    else:
        return tensor
    return interleaved_as_halves(tensor, head, pe, start=head - pe)
