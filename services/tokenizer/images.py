"""Images into a prompt: transformers' processor for the checkpoint (its PIL backend,
pinned, so every replica computes the same pixels; torchvision's resizes differ in the
last bits) expands each image's placeholder into the model's image tokens and gives its
pixel values, which go on with the request as `ImageFeature`s (shared/messages/images.py).
It runs where the text is tokenized - on the tokenizer replicas, or in the offline LLM -
so the scheduler budgets the real token counts and no worker preprocesses."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shared.hf.image_models import ImageModel
from shared.messages.images import ImageFeature, pixel_hash


class ImagePrompts:
    def __init__(self, model_path: str | Path, model: ImageModel) -> None:
        from transformers import AutoProcessor  # heavy; only where images are taken

        try:
            self.processor = AutoProcessor.from_pretrained(str(model_path), backend="pil")
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the image processor of {model_path}: {exc}") from exc
        self.model = model
        # The text that marks an image in a prompt (Gemma 3's <start_of_image>): what a
        # chat message's image part becomes.
        self.placeholder: str = self.processor.image_token
        if getattr(self.processor.image_processor, "do_pan_and_scan", False):
            raise ValueError(f"{model_path}: pan-and-scan crops are not supported (do_pan_and_scan in its "
                             "preprocessor config)")

    def encode(self, text: str, images: list, add_special_tokens: bool = True,
               sources: list[bytes] | None = None) -> tuple[list[int], list[ImageFeature]]:
        """The prompt's token ids with each image's tokens in place, and the images: with
        their processed pixels, or (`sources`: each image's file) with their files instead."""
        count = text.count(self.placeholder)
        if count != len(images):
            raise ValueError(f"the prompt marks {count} image(s) with {self.placeholder!r} but {len(images)} "
                             "were given")
        out = self.processor(text=text, images=images, return_tensors="np", add_special_tokens=add_special_tokens)
        ids = out["input_ids"][0].tolist()
        spans = placeholder_runs(ids, self.model.image_token_id)
        pixels = out["pixel_values"]
        if len(spans) != len(images) or len(pixels) != len(images):
            raise ValueError(f"the processor gave {len(spans)} image spans and {len(pixels)} images for "
                             f"{len(images)} given")
        features = []
        for k, ((start, end), image) in enumerate(zip(spans, pixels)):
            data = np.ascontiguousarray(image, dtype=np.float32).tobytes()
            feature = ImageFeature(pixel_hash(image.shape, data), start, end - start, list(image.shape))
            if sources is None:
                feature.pixel_values = data
            else:
                feature.source = sources[k]
            features.append(feature)
        return ids, features


def placeholder_runs(token_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each run of `token_id` in `token_ids`."""
    runs, start = [], None
    for i, t in enumerate(token_ids):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(token_ids)))
    return runs
