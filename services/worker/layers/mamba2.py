"""Mamba2's selective state space mixer, the token mixer of Granite 4.0-H's layers that do
not attend.

One product makes the output's gate z, the convolution's input (x, B and C) and a time
step dt per head. x, B and C go through a causal depthwise convolution with SiLU
(layers/causal_conv.py); then, per head, a state S [state_size, head_dim] decays by
exp(dt A) and takes B (dt x)^T each token, and the head's output is S^T C plus D x
(layers/linear_recurrence.py: B the keys, C the queries, dt x the values; heads share B
and C by groups). The output times SiLU(z) is RMS-normed by groups and weighed, then
projected. The convolution's last inputs and S are a request's state, a row each per
request the worker holds, in place of KV blocks. As transformers' torch path computes it
(GraniteMoeHybridMambaLayer): the scan in float32, the state float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.metadata import AttentionMetadata
from services.worker.models.decoder_config import ModelConfig
from services.worker.layers.causal_conv import causal_conv
from services.worker.layers.linear_recurrence import linear_recurrence


class Mamba2Mixer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.mamba_num_heads, config.mamba_head_dim
        self.state_size, self.num_groups = config.mamba_state_size, config.mamba_num_groups
        self.inner_size = self.num_heads * self.head_dim
        self.conv_size = self.inner_size + 2 * self.num_groups * self.state_size
        self.kernel = config.mamba_conv_kernel
        self.eps = config.rms_norm_eps
        self.dt_min, self.dt_max = config.mamba_dt_limit
        bias = config.mamba_proj_bias
        self.in_proj = nn.Linear(config.hidden_size, self.inner_size + self.conv_size + self.num_heads, bias=bias)
        self.conv1d = nn.Conv1d(self.conv_size, self.conv_size, self.kernel, groups=self.conv_size,
                                bias=config.mamba_conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.zeros(self.num_heads))
        # The gated output norm's weight (by w; named apart from the model's norms)
        self.norm_weight = nn.Parameter(torch.ones(self.inner_size))
        self.out_proj = nn.Linear(self.inner_size, config.hidden_size, bias=bias)
        # A tensor-parallel rank's heads of a model with one group: the norm's group is every
        # rank's heads, its sum of squares added over the ranks (parallel/sharding.py sets it)
        self.norm_split = None

    def state_shapes(self, rows: int, dtype: torch.dtype) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """(shape, dtype) of the convolution's and of the scan's state, `rows` requests."""
        return (((rows, self.conv_size, self.kernel - 1), dtype),
                ((rows, self.num_heads, self.state_size, self.head_dim), torch.float32))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        conv_state, ssm_state = state
        gate, xbc, dt = self.in_proj(hidden).split((self.inner_size, self.conv_size, self.num_heads), dim=-1)
        xbc = F.silu(causal_conv(xbc, conv_state, self.conv1d.weight[:, 0], self.conv1d.bias, metadata))
        x, b, c = xbc.split((self.inner_size, self.num_groups * self.state_size, self.num_groups * self.state_size),
                            dim=-1)
        x = x.unflatten(-1, (self.num_heads, self.head_dim)).float()
        b, c = (t.unflatten(-1, (self.num_groups, self.state_size)).float()
                .repeat_interleave(self.num_heads // self.num_groups, dim=-2) for t in (b, c))
        # (dt in the model's dtype, as transformers: its softplus there, then float32)
        dt = F.softplus(dt + self.dt_bias).clamp(self.dt_min, self.dt_max).float()
        decay = -self.A_log.float().exp() * dt  # [tokens, heads], log
        values = x * dt.unsqueeze(-1)
        out = linear_recurrence(c, b, values, decay, ssm_state, metadata)  # (C the queries, B the keys)
        out = (out + self.D.float()[:, None] * x).flatten(1)  # [tokens, inner_size], float32
        return self.out_proj(self._gated_norm(out, gate).to(hidden.dtype))

    def _gated_norm(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """times SiLU(gate), then RMS-normed over each group's channels and weighed by w (the
        gate before the norm: Mamba2's norm_before_gate false), in float32."""
        h = (out * F.silu(gate.float())).unflatten(-1, (self.num_groups, -1))
        if self.norm_split is None:
            mean = h.pow(2).mean(-1, keepdim=True)
        else:
            squares = self.norm_split.all_reduce(h.pow(2).sum(-1, keepdim=True))
            mean = squares / (h.shape[-1] * self.norm_split.world_size)
        return self.norm_weight * (h * torch.rsqrt(mean + self.eps)).flatten(-2)
