"""Gemma 3's image encoder: the SigLIP tower and the projector (average pooling to
`mm_tokens_per_image`, an RMS norm, a projection into the language model's width).

Both are transformers' own modules, loaded from the checkpoint's tensors: an image is
encoded once (the encoder cache keeps it for every chunk and request that shows it), so
the tower is a small share of a request's work beside the language model's steps, and
transformers' modules are by construction what its `get_image_features` computes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from services.worker.vision.weights import copy_weights

TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class Gemma3ImageEncoder(nn.Module):
    def __init__(self, config) -> None:  # a transformers Gemma3Config
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        super().__init__()
        self.tower = AutoModel.from_config(config.vision_config)
        self.projector = Gemma3MultiModalProjector(config)

    @staticmethod
    def reads(name: str) -> bool:
        return name.startswith(TOWER_PREFIXES + PROJECTOR_PREFIXES)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def local(name: str) -> str:
            if name.startswith(TOWER_PREFIXES):
                # (the Hub's checkpoints name the tower's own module vision_model; transformers 5 saves it without)
                return "tower." + _strip(name, TOWER_PREFIXES).removeprefix("vision_model.")
            return "projector." + _strip(name, PROJECTOR_PREFIXES)

        # (SigLIP's pooling head goes unread: Gemma 3 reads the last hidden states)
        copy_weights(self, ((name, local(name), tensor) for name, tensor in weights),
                     unused=lambda name: name.startswith("tower.head."))

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, H, W] -> [images, mm_tokens_per_image, hidden_size]"""
        hidden = self.tower(pixel_values=pixel_values).last_hidden_state
        return self.projector(hidden)

    def encode(self, pixels: list[torch.Tensor], grids) -> list[torch.Tensor]:
        """Each image's [mm_tokens_per_image, hidden_size], those of one size together."""
        out: list[torch.Tensor | None] = [None] * len(pixels)
        by_shape: dict[tuple, list[int]] = {}
        for i, image in enumerate(pixels):
            by_shape.setdefault(tuple(image.shape), []).append(i)
        for indexes in by_shape.values():
            for i, embedded in zip(indexes, self(torch.stack([pixels[i] for i in indexes]))):
                out[i] = embedded
        return out


def _strip(name: str, prefixes: tuple[str, ...]) -> str:
    return next(name[len(p):] for p in prefixes if name.startswith(p))
