"""The prefix cache's block hashes, as the scheduler keys its pools and as anyone that
reads its KV events (vLLM's BlockStored: shared/kv_events.py) must compute them to know
which of a prompt's blocks a worker holds: a gateway routing by cached prefix does."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

from shared.lora_request import LoRARequest

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Chained hash of one full block: it identifies the block's tokens *and* everything before.
    `extra`: what else the block's K/V depend on (image_keys: the images its placeholders stand for).

    A cryptographic digest rather than Python's `hash` so that a crafted prompt cannot
    collide with another user's cached prefix.
    """
    digest = hashlib.blake2b(parent_hash or b"", digest_size=16)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra:
        digest.update(b"|extra:" + extra)
    return digest.digest()


def image_keys(features, start: int, end: int) -> bytes:
    """The identifiers of the images whose placeholders lie in positions [start, end): two
    prompts with the same tokens there but other images hold other K/V (vLLM's mm_hashes
    in its block hashes). Blocks after an image differ through the chain."""
    return b"".join(f.identifier.encode() + b";" for f in features if f.offset < end and f.end > start)


def hash_root(long_rope: bool, lora: LoRARequest | None, cache_salt: str | None = None) -> BlockHash | None:
    """What a request's chain of block hashes starts from: the same tokens hold other keys
    and values rotated with longrope's long factors (Phi-3), or under a LoRA adapter
    (named with its id and path: an adapter reloaded under the same name, even from the
    same folder, takes a new id, and its weights may be new), so they are other blocks.
    A cache salt (vLLM's) starts another chain too, so only requests with the same salt
    share blocks; it goes last, with its length, so no salt a client picks can spell
    another root. None for the base model's short ones, as before any of them existed."""
    root = b"longrope:long" if long_rope else b""
    if lora is not None:
        root += b"|lora:%d:" % lora.lora_int_id + lora.lora_name.encode() + b"\0" + lora.lora_path.encode()
    if cache_salt is not None:
        salt = cache_salt.encode()
        root += b"|salt:%d:" % len(salt) + salt
    return root or None


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                        lora: LoRARequest | None = None, mm_features=()) -> list[BlockHash]:
    """The hashes of the prompt's full blocks as the scheduler chains them (a short prompt's:
    longrope's long root is the scheduler's to pick), its images' keys folded in."""
    return list(iter_block_hashes(token_ids, block_size, cache_salt, lora, mm_features))


def iter_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                      lora: LoRARequest | None = None, mm_features=()) -> Iterator[BlockHash]:
    """prompt_block_hashes' one at a time (a lookup that stops at its first miss computes no more)."""
    parent = hash_root(False, lora, cache_salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        parent = hash_block_tokens(parent, token_ids[start:end],
                                   image_keys(mm_features, start, end) if mm_features else b"")
        yield parent
