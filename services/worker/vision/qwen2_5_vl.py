"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's image encoders: the ViT (Qwen2.5-VL's with window attention,
2D rotary positions within each image) and the patch merger (2x2 patches into one token of
the language model's width), transformers' own modules loaded from the checkpoint's
`visual.*` tensors (gemma3.py says why transformers' modules). Qwen3-VL's also gives
"deepstack" features, merged from some of its blocks, which its language model adds to
its first layers' outputs at the image's tokens: an image's encoding is then its tokens'
embeddings and those features side by side, [tokens, hidden * (1 + deepstack layers)]
(vision/step_images.py takes them apart)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from services.worker.vision.weights import copy_weights

PREFIXES = ("model.visual.", "visual.")


class Qwen25VLImageEncoder(nn.Module):
    def __init__(self, config) -> None:  # a transformers Qwen2VLConfig, Qwen2_5_VLConfig or Qwen3VLConfig
        super().__init__()
        if config.model_type == "qwen2_vl":  # (Qwen2.5-VL's without its windows: every patch sees its image)
            from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Tower
        elif config.model_type == "qwen3_vl":
            from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Tower
        elif config.model_type == "qwen3_vl_moe":  # (the same tower as Qwen3-VL's)
            from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel as Tower
        else:
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
                Qwen2_5_VisionTransformerPretrainedModel as Tower)
        self.tower = Tower(config.vision_config)
        self.merge_size = config.vision_config.spatial_merge_size

    @staticmethod
    def reads(name: str) -> bool:
        return name.startswith(PREFIXES)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        copy_weights(self, ((name, "tower." + next(name[len(p):] for p in PREFIXES if name.startswith(p)), tensor)
                            for name, tensor in weights))

    @torch.inference_mode()
    def encode(self, pixels: list[torch.Tensor], grids: list[list[int]]) -> list[torch.Tensor]:
        """Each image's rows of patches -> its [tokens, hidden_size], all in one call (the
        tower attends within each image: its windows and cu_seqlens keep them apart)."""
        out = self.tower(torch.cat(pixels), grid_thw=torch.tensor(grids, device=pixels[0].device))
        joined = torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or ())], -1)
        return list(joined.split([t * h * w // self.merge_size**2 for t, h, w in grids]))
