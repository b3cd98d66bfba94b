"""An image in a request, as the tokenizer replica that preprocessed it hands it on: where
its placeholder tokens sit in the prompt, a hash of its pixels (the encoder cache's key
and what the prefix cache's block hashes fold in), and the pixels themselves."""

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
    pixel_values: bytes

    @property
    def end(self) -> int:
        return self.offset + self.length


def pixel_hash(shape, pixel_values: bytes) -> str:
    """A digest of the processed pixels and their shape (an attacker picking pixels cannot
    make another image's key: blake2b, as the block hashes)."""
    digest = hashlib.blake2b(repr(tuple(shape)).encode(), digest_size=16)
    digest.update(pixel_values)
    return digest.hexdigest()


def spans(features: list[ImageFeature]) -> list[tuple[int, int]]:
    """The prompt positions each image's placeholders take, in order."""
    return sorted((f.offset, f.end) for f in features)
