"""The fix-ups a family's record names (Family.tensor_fixups), each a step on the checkpoint's
(name, tensor) stream before the loader reads names: stacked experts split, fused products
split or joined, names of a layout of the family's own."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from services.worker.layers.gated_delta_net import key_head_grouped_tensors
from services.worker.models.checkpoints.gpt_oss_weights import gpt_oss_tensors
from services.worker.models.checkpoints.hybrid_tensors import (
    gated_query_tensors,
    granite_hybrid_tensors,
    nemotron_h_tensors,
    olmo_hybrid_tensors,
)
from services.worker.models.decoder_config import ModelConfig

Tensors = Iterable[tuple[str, torch.Tensor]]


def _conv1d_transposed(weights: Tensors, config: ModelConfig) -> Tensors:
    """GPT-2's products stored transposed (Conv1D: [in, out])."""
    for name, tensor in weights:
        yield name, (tensor.T if tensor.dim() == 2 and ".layers." in name else tensor)


def _qkv_interleaved_by_head(weights: Tensors, config: ModelConfig) -> Tensors:
    """GPT-NeoX's fused q/k/v rows, [heads, (q, k, v), head_dim, ...], as ours: [(q, k, v), heads, ...]."""
    heads = config.num_attention_heads
    for name, tensor in weights:
        if ".qkv_proj." in name:
            rows = tensor.shape[0]
            tensor = tensor.reshape(heads, 3, rows // (3 * heads), *tensor.shape[1:]).transpose(0, 1)
            tensor = tensor.reshape(rows, *tensor.shape[3:])
        yield name, tensor


TENSOR_FIXUPS: dict[str, Callable[[Tensors, ModelConfig], Tensors]] = {
    "gpt_oss_experts": lambda weights, config: gpt_oss_tensors(weights),
    "gated_queries": lambda weights, config: gated_query_tensors(weights, config.num_attention_heads, config.head_dim),
    "key_head_grouped": key_head_grouped_tensors,
    "granite_hybrid": lambda weights, config: granite_hybrid_tensors(weights, bool(config.moe_layers)),
    "nemotron_h": nemotron_h_tensors,
    "olmo_hybrid": lambda weights, config: olmo_hybrid_tensors(weights),
    "conv1d_transposed": _conv1d_transposed,
    "qkv_interleaved_by_head": _qkv_interleaved_by_head,
}
