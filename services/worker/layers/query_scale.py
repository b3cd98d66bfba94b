"""Llama 4's attention temperature by position, as Ministral 3 and Mistral 4 use it
(transformers' get_llama_4_attn_scale): each query, after rotary, times

    1 + beta * log(1 + floor(position / original_max_position_embeddings))

so 1 exactly for every position within the pretrained context, growing slowly past it
(the rope config's `llama_4_scaling_beta` and `original_max_position_embeddings`).
"""

from __future__ import annotations

import torch


class QueryScale:
    """One a model, shared by its layers: a step's scales are computed once, for the
    positions tensor the step's layers all receive."""

    def __init__(self, beta: float, original: int) -> None:
        self.beta, self.original = beta, original
        self._step: tuple[torch.Tensor, torch.dtype, torch.Tensor] | None = None

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [num_tokens, 1, 1]
        step = self._step
        if step is None or step[0] is not positions or step[1] != dtype:
            scale = 1 + self.beta * torch.log(1 + torch.floor(positions / self.original))  # (transformers' order)
            step = self._step = (positions, dtype, scale.to(dtype)[:, None, None])
        return step[2]
