"""Qwen3.5's linear attention, the Gated DeltaNet, over a recurrent state a request.

A hybrid model (Qwen3.5) mixes tokens with full attention in one layer of four and with
this layer in the others. It keeps no keys and values: each request's past is folded into
a fixed-size state, so a layer's memory a request does not grow with its length:
- the last `kernel - 1` inputs of a causal depthwise convolution over q, k and v
  (models/causal_conv.py);
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
products (`chunked_delta_rule`). Computed as transformers' Qwen3_5GatedDeltaNet computes
it: the recurrence in float32, the state float32, the convolution in the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.metadata import AttentionMetadata
from services.worker.model_config import ModelConfig
from services.worker.models.causal_conv import causal_conv


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_size, self.value_size = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_size = 2 * self.key_size + self.value_size  # q, k and v go through the convolution
        self.kernel = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
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
        num_tokens = hidden.shape[0]
        x = F.silu(causal_conv(self.in_proj_qkv(hidden), conv_state, self.conv1d.weight[:, 0], None, metadata))
        q, k, v = self._heads(x)
        z = self.in_proj_z(hidden)
        beta = torch.sigmoid(self.in_proj_b(hidden)).float()
        # (in float32 whatever the model's dtype, as transformers: A_log's exp would overflow float16)
        decay = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias)
        out = torch.empty(num_tokens, self.num_v_heads, self.v_dim, dtype=torch.float32, device=hidden.device)
        d = metadata.num_decodes
        if d:
            out[:d] = self._decodes(q[:d], k[:d], v[:d], decay[:d], beta[:d], recurrent_state,
                                    metadata.state_rows[:d], metadata.seq_lens[:d] > 1)
        starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for r in range(d, metadata.num_reqs):  # prefill chunks, one request at a time
            first, last = int(starts[r]), int(starts[r + 1])
            row = int(metadata.state_rows_cpu[r])
            carried = int(seq_lens[r]) > last - first  # (it computed tokens before this chunk)
            s = recurrent_state[row] if carried else torch.zeros_like(recurrent_state[row])
            out[first:last], recurrent_state[row] = chunked_delta_rule(
                q[first:last], k[first:last], v[first:last], decay[first:last], beta[first:last], s)
        return self.out_proj(self._gated_norm(out.to(hidden.dtype), z).reshape(num_tokens, self.value_size))

    @staticmethod
    def _decodes(q, k, v, decay, beta, recurrent_state, rows, carried) -> torch.Tensor:
        """One token each of `rows` requests (the step's first rows), vectorized, index ops
        only (graph-safe); a request's first token (`carried` false) starts from zeros.
        The recurrence reads the state once (queries and keys together) and writes it
        once: S~ = a S (a = exp(g), 0 for a first token), delta = beta (v - S~^T k),
        S' = S~ + k delta^T, o = S'^T q = S~^T q + (q . k) delta."""
        s = recurrent_state.index_select(0, rows)  # [requests, value heads, k_dim, v_dim]
        s.mul_((decay.exp() * carried[:, None])[..., None, None])
        read = torch.stack((k, q), dim=-2) @ s  # [requests, heads, 2, v_dim]: S~^T k and S~^T q
        delta = (v - read[..., 0, :]) * beta.unsqueeze(-1)
        s.addcmul_(k.unsqueeze(-1), delta.unsqueeze(-2))
        recurrent_state.index_copy_(0, rows, s)
        return read[..., 1, :] + (q * k).sum(-1, keepdim=True) * delta

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


CHUNK = 64  # tokens a chunk of the prefill's delta rule (matrices of CHUNK x CHUNK per head)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one request's tokens, a chunk at a time in matrix products
    (the DeltaNet papers' UT transform): q, k [tokens, heads, k_dim], v [tokens, heads,
    v_dim], decay (log) and beta [tokens, heads], float32, from `state` [heads, k_dim,
    v_dim]. Returns the outputs [tokens, heads, v_dim] and the final state.

    Within a chunk, with G_t the decay summed from its start to t and S the state before it,
    the recurrence unrolls to corrections delta = U - W S, where (I + diag(beta) L) U =
    beta v and (I + diag(beta) L) W = beta exp(G) k, L_ti = exp(G_t - G_i) k_t . k_i for
    i < t: the tokens' corrections of each other, one triangular solve for every chunk at
    once. Then, chunk after chunk, o = exp(G) q S + M delta (M_ti = exp(G_t - G_i) q_t . k_i,
    i <= t) and S <- exp(G_last) S + (exp(G_last - G) k)^T delta."""
    length = q.shape[0]
    pad = -length % CHUNK
    # Padded tokens: no decay (log 0), no step (beta 0), zero key: they change nothing.
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1).unflatten(1, (-1, CHUNK)) for t in (q, k, v))
    decay, beta = (F.pad(t, (0, 0, 0, pad)).T.unflatten(1, (-1, CHUNK)) for t in (decay, beta))
    # now [heads, chunks, CHUNK, ...]
    cumulative = decay.cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    gaps = (cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    strict = (k @ k.transpose(-1, -2)) * gaps * beta.unsqueeze(-1)
    system = torch.eye(CHUNK, device=q.device) + strict.masked_fill(causal.logical_not().logical_or(
        torch.eye(CHUNK, dtype=torch.bool, device=q.device)), 0.0)
    rhs = torch.cat((v * beta.unsqueeze(-1), k * (beta * cumulative.exp()).unsqueeze(-1)), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split((v.shape[-1], k.shape[-1]), dim=-1)
    attend = (q @ k.transpose(-1, -2)) * gaps  # M, i <= t
    q_decayed = q * cumulative.exp().unsqueeze(-1)
    k_to_end = k * (cumulative[..., -1:] - cumulative).exp().unsqueeze(-1)
    chunk_decay = cumulative[..., -1].exp()[..., None, None]
    out = torch.empty_like(u)
    for c in range(q.shape[1]):
        delta = u[:, c] - w[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + attend[:, c] @ delta
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ delta
    return out.flatten(1, 2)[:, :length].transpose(0, 1), state


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
