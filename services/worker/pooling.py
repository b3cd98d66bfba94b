"""Pooling in the worker: an embedding request's vector, or a classifier's logits, from the
hidden states of a step (last-token pooling, as vLLM's for decoder models)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The token an embedding request ends with (it samples nothing): any id the vocabulary has.
EMBED_PLACEHOLDER = 0


def pool(model, hidden: torch.Tensor, rows: torch.Tensor) -> list[list[float]]:
    """The final norm's output at each row (a prompt's last position), L2-normalized, or a
    classifier's score head's raw logits there (a sync, paid only by such steps). Nothing
    samples for these requests: a model without an LM head embeds too."""
    if model.score is not None:
        return model.score(hidden[rows]).float().tolist()
    return F.normalize(hidden[rows].float(), dim=-1).tolist()
