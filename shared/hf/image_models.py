"""Which checkpoints take images, and how their prompts mark them: read from config.json,
the same way by the tokenizer replicas (which preprocess images), the offline LLM and the
worker (which encodes them). And reading an image's file, as each of them does."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path

from shared.hf.model_folder import config_or_empty

# Architecture -> how llmbus encodes its images (services/worker/vision/). The families
# whose text alone is served otherwise (Mistral Small 3.1, EXAONE 4.5, Qwen3.5) are not here yet.
IMAGE_ARCHITECTURES = {"Gemma3ForConditionalGeneration": "gemma3", "Qwen2VLForConditionalGeneration": "qwen2_vl",
                       "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
                       "Qwen3VLForConditionalGeneration": "qwen3_vl", "Qwen3VLMoeForConditionalGeneration": "qwen3_vl"}
# What a prompt writes for an image, where it is not the processor's image token itself
MARKERS = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
           "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
           "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>"}


@dataclass(frozen=True, slots=True)
class ImageModel:
    family: str  # IMAGE_ARCHITECTURES' value
    image_token_id: int  # the placeholder an image's embeddings replace
    # Whether an image's placeholders attend to each other both ways in prefill (Gemma 3's
    # token_type_ids mask): an image then never spans two prefill chunks.
    bidirectional: bool
    # Qwen-VL's MRoPE: how many of a head's rotary frequencies turn with each of an image
    # token's (time, height, width) positions; None: one position a token
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False  # Qwen3-VL's: the sections' frequencies interleaved (t, h, w, t, h, w, ...)
    merge_size: int = 1  # patches merged into one token along each side (Qwen-VL's 2)


def image_model(folder: str | Path) -> ImageModel | None:
    """How this folder's model takes images; None where it takes none."""
    raw = config_or_empty(folder)
    family = next((IMAGE_ARCHITECTURES[a] for a in raw.get("architectures") or () if a in IMAGE_ARCHITECTURES), None)
    if family is None or not isinstance(raw.get("vision_config"), dict):
        return None
    token = raw.get("image_token_id", raw.get("image_token_index"))
    if not isinstance(token, int):
        raise ValueError(f"{folder}/config.json names no image_token_index: its images have no placeholder")
    if family == "gemma3":
        return ImageModel(family, token, bidirectional=True)
    text = raw.get("text_config") or raw  # (the first Qwen2.5-VL releases: the text's keys at the top)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or raw.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if not section:
        raise ValueError(f"{folder}/config.json names no mrope_section: its images' positions are unknown")
    return ImageModel(family, token, bidirectional=False, mrope_section=tuple(section),
                      mrope_interleaved=family == "qwen3_vl" or bool(rope.get("mrope_interleaved")),
                      merge_size=raw["vision_config"].get("spatial_merge_size", 2))


def no_images_why(folder: str | Path) -> str:
    """What a request with images is told by a model that takes none."""
    archs = ", ".join(config_or_empty(folder).get("architectures") or ()) or "this model"
    return (f"{archs} takes no images in llmbus (image inputs are served for "
            f"{', '.join(sorted(IMAGE_ARCHITECTURES))})")


def read_image(data: bytes, index: int):
    """An image file's pixels (PIL), or a ValueError naming which image is not one."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # (a truncated or corrupt file fails here, not in the processor)
    except Exception as exc:  # PIL's errors: UnidentifiedImageError, DecompressionBombError, OSError, ...
        raise ValueError(f"image {index} cannot be read as an image: {exc}") from None
    return image


def data_url_bytes(url: str) -> bytes:
    """The file in a base64 data URL (data:image/png;base64,...); ValueError otherwise."""
    header, _, data = url.partition(",")
    if not header.startswith("data:") or not header.endswith(";base64"):
        raise ValueError("a data URL's image must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64: {exc}") from None
