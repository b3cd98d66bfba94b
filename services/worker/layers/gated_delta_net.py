"""Qwen3.5's linear attention, the Gated DeltaNet, over a recurrent state a request.

A hybrid model (Qwen3.5) mixes tokens with full attention in one layer of four and with
this layer in the others. It keeps no keys and values: each request's past is folded into
a fixed-size state, so a layer's memory a request does not grow with its length:
- the last `kernel - 1` inputs of a causal depthwise convolution over q, k and v
  (layers/causal_conv.py);
- per value head, a [key_dim, value_dim] matrix S, which each token t decays by exp(g_t),
  corrects towards its value (the delta rule: S += k_t (beta_t (v_t - S^T k_t))^T) and
  reads with its query (o_t = S^T q_t), queries and keys L2-normed.
That state is this layer's "KV cache": the runner allocates it (`state_shapes`) a row per
request it can hold, found by the request's block-table row (`AttentionMetadata.state_rows`),
in place of KV blocks, as vLLM keeps a Mamba layer's state. A request starting at position
0 starts from zeros, whatever the row held, so a row needs no clearing; one cannot start
anywhere else (a prefix-cache hit), which is why a hybrid model runs without the prefix
cache.

Decodes (one token a request) are vectorized over the step's requests with index ops
only, so a decode step reads nothing on the host and replays from the CUDA-graph buffers;
a prefill chunk runs a request at a time, its tokens a chunk of 64 at a time in matrix
products (layers/linear_recurrence.py). Computed as transformers' Qwen3_5GatedDeltaNet computes
it: the recurrence in float32, the state float32, the convolution in the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.metadata import AttentionMetadata
from services.worker.models.decoder_config import ModelConfig
from services.worker.layers.causal_conv import causal_conv
from services.worker.layers.linear_recurrence import linear_recurrence


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_size, self.value_size = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_size = 2 * self.key_size + self.value_size  # q, k and v go through the convolution
        self.kernel = config.linear_conv_kernel_dim
        self.eps = config.linear_norm_eps or config.rms_norm_eps
        self.beta_scale = config.linear_beta_scale  # (OLMo Hybrid's 2: beta in [0, 2])
        hidden = config.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, self.conv_size, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_size, bias=False)  # the output's gate
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)  # beta, the delta rule's step
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)  # the decay's time step
        self.conv1d = nn.Conv1d(self.conv_size, self.conv_size, self.kernel, groups=self.conv_size, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        # The output's RMSNorm over each value head, weighing by w (not 1 + w, as the
        # model's other norms: so not named like them, which the loader offsets)
        self.norm_weight = nn.Parameter(torch.ones(self.v_dim))
        self.out_proj = nn.Linear(self.value_size, hidden, bias=False)

    def state_shapes(self, rows: int, dtype: torch.dtype) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """(shape, dtype) of the convolution's and of the recurrence's state, `rows` requests."""
        return (((rows, self.conv_size, self.kernel - 1), dtype),
                ((rows, self.num_v_heads, self.k_dim, self.v_dim), torch.float32))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        conv_state, recurrent_state = state
        x = F.silu(causal_conv(self.in_proj_qkv(hidden), conv_state, self.conv1d.weight[:, 0], None, metadata))
        q, k, v = self._heads(x)
        z = self.in_proj_z(hidden)
        beta = torch.sigmoid(self.in_proj_b(hidden)).float()
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        # (in float32 whatever the model's dtype, as transformers: A_log's exp would overflow float16)
        decay = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias)
        out = linear_recurrence(q, k, v, decay, recurrent_state, metadata, beta)
        return self.out_proj(self._gated_norm(out.to(hidden.dtype), z).flatten(1))

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[tokens, conv_size] -> queries and keys [tokens, value heads, k_dim] (a key head
        serves value heads in consecutive groups), L2-normed in float32, the queries scaled
        by 1/sqrt(k_dim); values [tokens, value heads, v_dim] in float32."""
        q, k, v = x.split((self.key_size, self.key_size, self.value_size), dim=-1)
        group = self.num_v_heads // self.num_k_heads
        q, k = (t.unflatten(-1, (self.num_k_heads, self.k_dim)).repeat_interleave(group, dim=-2).float()
                for t in (q, k))
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * self.k_dim**-0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        return q, k, v.unflatten(-1, (self.num_v_heads, self.v_dim)).float()

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each value head, then times silu(z), as transformers' RMSNormGated."""
        h = out.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.norm_weight * h.to(out.dtype)
        return (h * F.silu(z.unflatten(-1, (self.num_v_heads, self.v_dim)).float())).to(out.dtype)


def key_head_grouped_tensors(weights, config: ModelConfig):
    """Qwen3-Next's checkpoints hold the DeltaNet's input products grouped by key head:
    in_proj_qkvz's rows a key head at a time (its query, its key, then the values and the
    gates z of the value heads it serves), in_proj_ba's likewise (their betas, then their
    decays' time steps). Regrouped at load into Qwen3.5's products, which this layer runs:
    in_proj_qkv (every query, every key, every value, as the convolution takes them),
    in_proj_z, in_proj_b, in_proj_a; a value head keeps its index (key head g's j-th is g
    * group + j), so the convolution's channels and the heads' parameters read as written."""
    key_heads, k_dim, v_dim = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    group = config.linear_num_value_heads // key_heads
    for name, tensor in weights:
        if name.endswith(".in_proj_qkvz.weight"):
            q, k, v, z = tensor.unflatten(0, (key_heads, -1)).split((k_dim, k_dim, group * v_dim, group * v_dim), dim=1)
            prefix = name.removesuffix("qkvz.weight")
            yield prefix + "qkv.weight", torch.cat([t.flatten(0, 1) for t in (q, k, v)])
            yield prefix + "z.weight", z.flatten(0, 1)
        elif name.endswith(".in_proj_ba.weight"):
            b, a = tensor.unflatten(0, (key_heads, -1)).split((group, group), dim=1)
            prefix = name.removesuffix("ba.weight")
            yield prefix + "b.weight", b.flatten(0, 1)
            yield prefix + "a.weight", a.flatten(0, 1)
        else:
            yield name, tensor
