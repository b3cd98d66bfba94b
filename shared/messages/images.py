"""An image in a request, as the tokenizer replica that preprocessed it hands it on: where
its placeholder tokens sit in the prompt, a hash of its pixels (the encoder cache's key
and what the prefix cache's block hashes fold in), and the image itself.

Offline the processed pixels go along (`pixel_values`: no bus between the processor and
the worker). Served, the image's own file goes along (`source`, as the client sent it):
processed pixels are float32 and large (one of Gemma 3's 896x896 images is 9.6 MB, past
the bus's 8 MB max_payload, and a step of several would be more), while files are what
the gateway caps (max_body_bytes); a worker that has not encoded the image yet runs the
same pinned processor on the file (services/worker/vision/encoder.py), so the pixels are
the tokenizer replica's, bit for bit (checked against the hash)."""

from __future__ import annotations

import hashlib

import msgspec

from shared.messages.wire import WIRE


class ImageFeature(msgspec.Struct, **WIRE):
    """vLLM's MultiModalFeatureSpec for one image: its placeholders are prompt positions
    [offset, offset + length); `pixel_values` the processor's output (float32 bytes, C
    order, of `shape`), so every worker encodes what transformers' processor gave."""

    identifier: str  # pixel_hash(): equal pixels, equal key
    offset: int
    length: int
    shape: list[int]
    pixel_values: bytes = b""  # offline: the processor's output, float32 in C order, of `shape`
    source: bytes = b""  # served: the image file (PNG, JPEG, ...) the pixels are processed from
    grid: list[int] = []  # Qwen-VL's: the image's (time, height, width) in patches

    @property
    def end(self) -> int:
        return self.offset + self.length


class PromptWithImages(list):
    """A prompt's token ids (a list, as every prompt is) with the images they hold, as a
    tokenizer replica answers a chat with image parts."""

    __slots__ = ("mm_features",)

    def __init__(self, token_ids, mm_features: list[ImageFeature]) -> None:
        super().__init__(token_ids)
        self.mm_features = mm_features


def pixel_hash(shape, pixel_values: bytes, grid=()) -> str:
    """A digest of the processed pixels, their shape and grid (an attacker picking pixels
    cannot make another image's key: blake2b, as the block hashes)."""
    digest = hashlib.blake2b(repr((tuple(shape), tuple(grid))).encode(), digest_size=16)
    digest.update(pixel_values)
    return digest.hexdigest()


def spans(features: list[ImageFeature]) -> list[tuple[int, int]]:
    """The prompt positions each image's placeholders take, in order."""
    return sorted((f.offset, f.end) for f in features)
