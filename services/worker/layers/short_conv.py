"""LFM2's gated short convolution, the token mixer of its layers that do not attend.

One product makes three gates of the layer's input, B, C and x; B * x goes through a
causal depthwise convolution a few tokens wide (`conv_L_cache`, 3 in the released
models: layers/causal_conv.py), whose last inputs are a request's whole state here (a
row of it per request the worker holds, in place of KV blocks, as Qwen3.5's Gated
DeltaNet keeps its own); C gates the result before the output product. As transformers'
Lfm2ShortConv computes it.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.attention.metadata import AttentionMetadata
from services.worker.models.decoder_config import ModelConfig
from services.worker.layers.causal_conv import causal_conv


class ShortConv(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.short_conv_bias
        # (each channel is on its own until the output product: a tensor-parallel rank holds
        # a slice of them, and out_proj sums over the ranks)
        channels = config.short_conv_channels or hidden
        self.channels, self.kernel = channels, config.short_conv_kernel
        self.in_proj = nn.Linear(hidden, 3 * channels, bias=bias)
        self.conv = nn.Conv1d(channels, channels, self.kernel, groups=channels, bias=bias)
        self.out_proj = nn.Linear(channels, hidden, bias=bias)

    def state_shapes(self, rows: int, dtype: torch.dtype) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """(shape, dtype) of the convolution's state, `rows` requests."""
        return (((rows, self.channels, self.kernel - 1), dtype),)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, state: tuple[torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        convolved = causal_conv(b * x, state[0], self.conv.weight[:, 0], self.conv.bias, metadata)
        return self.out_proj(c * convolved)
