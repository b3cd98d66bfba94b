"""Images into a prompt: transformers' processor for the checkpoint (its PIL backend,
pinned, so every replica computes the same pixels; torchvision's resizes differ in the
last bits) expands each image's placeholder into the model's image tokens and gives its
pixel values, which go on with the request as `ImageFeature`s (shared/messages/images.py).
It runs where the text is tokenized - on the tokenizer replicas, or in the offline LLM -
so the scheduler budgets the real token counts and no worker preprocesses."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shared.hf.image_models import MARKERS, ImageModel
from shared.messages.images import ImageFeature, pixel_hash


class ImagePrompts:
    def __init__(self, model_path: str | Path, model: ImageModel) -> None:
        from transformers import AutoImageProcessor, AutoProcessor  # heavy; only where images are taken

        self.model = model
        try:
            if model.family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
                # transformers' Qwen-VL processors also hold a video processor, which needs
                # torchvision (not installed: its operators do not load with a CPU build of
                # torch); its image processor and tokenizer serve alone, and its text step
                # is one replacement (expand_image_tokens)
                self.processor = None
                self.image_processor = AutoImageProcessor.from_pretrained(str(model_path), backend="pil")
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
                self.token = "<|image_pad|>"
            else:
                self.processor = AutoProcessor.from_pretrained(str(model_path), backend="pil")
                self.image_processor, self.token = self.processor.image_processor, self.processor.image_token
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the image processor of {model_path}: {exc}") from exc
        # The text that marks an image in a prompt (Gemma 3's <start_of_image>, Qwen2.5-VL's
        # <|vision_start|><|image_pad|><|vision_end|>): what a chat's image part becomes
        # where the template takes a string.
        self.placeholder: str = MARKERS.get(model.family, self.token)
        if getattr(self.image_processor, "do_pan_and_scan", False):
            raise ValueError(f"{model_path}: pan-and-scan crops are not supported (do_pan_and_scan in its "
                             "preprocessor config)")

    def encode(self, text: str, images: list, add_special_tokens: bool = True,
               sources: list[bytes] | None = None) -> tuple[list[int], list[ImageFeature]]:
        """The prompt's token ids with each image's tokens in place, and the images: with
        their processed pixels, or (`sources`: each image's file) with their files instead."""
        count = text.count(self.token)
        if count != len(images):
            raise ValueError(f"the prompt marks {count} image(s) with {self.placeholder!r} but {len(images)} "
                             "were given")
        if self.processor is not None:
            out = self.processor(text=text, images=images, return_tensors="np", add_special_tokens=add_special_tokens)
            ids, pixels, grids = out["input_ids"][0].tolist(), list(out["pixel_values"]), [[]] * len(images)
        else:
            out = self.image_processor(images=images, return_tensors="np")
            grids = out["image_grid_thw"].tolist()
            ids = self.tokenizer(expand_image_tokens(text, self.token, grids, self.model.merge_size),
                                 add_special_tokens=add_special_tokens)["input_ids"]
            pixels = np.split(out["pixel_values"], np.cumsum([t * h * w for t, h, w in grids])[:-1])
        spans = placeholder_runs(ids, self.model.image_token_id)
        if len(spans) != len(images) or len(pixels) != len(images):
            raise ValueError(f"the processor gave {len(spans)} image spans and {len(pixels)} images for "
                             f"{len(images)} given")
        features = []
        for k, ((start, end), image, grid) in enumerate(zip(spans, pixels, grids)):
            data = np.ascontiguousarray(image, dtype=np.float32).tobytes()
            feature = ImageFeature(pixel_hash(image.shape, data, grid), start, end - start, list(image.shape),
                                   grid=grid)
            if sources is None:
                feature.pixel_values = data
            else:
                feature.source = sources[k]
            features.append(feature)
        return ids, features


def expand_image_tokens(text: str, token: str, grids: list[list[int]], merge_size: int) -> str:
    """Each image token of the text as many times as its image has tokens after merging
    (transformers' Qwen2_5_VLProcessor.replace_image_token, image by image in order)."""
    pieces = text.split(token)
    out = [pieces[0]]
    for piece, (t, h, w) in zip(pieces[1:], grids):
        out += [token * (t * h * w // merge_size**2), piece]
    return "".join(out)


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
