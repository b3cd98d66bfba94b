"""Checkpoints saved in a layout of their family's own (the LayerNorm decoders': GPT-2, OPT,
GPT-NeoX, Phi, StarCoder2) read in the Llama layout the loader reads (models/decoder.py), by
the prefix and renames their family's record gives. Buffers some checkpoints carry (causal
masks, old rotary tables) are skipped."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from functools import cache

import torch

from services.worker.models.families.family import Family

# Buffers, not weights: GPT-2's and GPT-NeoX's causal masks, old checkpoints' rotary tables
_SKIPPED = re.compile(r"\.attn\.(masked_)?bias$|\.attention\.(masked_)?bias$|rotary_emb\.inv_freq$")


@cache
def _compiled(renames: tuple[tuple[str, str], ...]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile(pattern), replacement) for pattern, replacement in renames]


def renamed_tensors(family: Family, weights: Iterable[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The family's (name, tensor) stream in our names (unchanged where it names none)."""
    if not family.checkpoint_renames:
        yield from weights
        return
    rules = _compiled(family.checkpoint_renames)
    for name, tensor in weights:
        if _SKIPPED.search(name):
            continue
        for prefix in family.checkpoint_prefixes:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        for pattern, replacement in rules:
            renamed = pattern.sub(replacement, name)
            if renamed != name:
                name = renamed
                break
        yield name, tensor
