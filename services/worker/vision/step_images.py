"""One step's image embeddings: the rows of the flattened batch whose placeholders they
replace, and the image spans attention lets see each other both ways."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StepImages:
    rows: torch.Tensor  # [n] int64: flat token indices
    # [n, hidden_size * (1 + deepstack)]: the tokens' embeddings, then (Qwen3-VL) the
    # features its first `deepstack` layers add to their outputs at those tokens
    embeddings: torch.Tensor
    spans: dict[int, list[tuple[int, int]]] | None  # attention row -> its images' [start, end) positions
    deepstack: int = 0

    def apply(self, hidden: torch.Tensor, metadata) -> torch.Tensor:
        """The embedded tokens with the images' rows in place; the spans to attention."""
        metadata.bidirectional = self.spans
        width = hidden.shape[1]
        self.deepstack = self.embeddings.shape[1] // width - 1
        return hidden.index_copy(0, self.rows, self.embeddings[:, :width].to(hidden.dtype))

    def add_deepstack(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s output with its deepstack features added at the images' tokens
        (transformers' _deepstack_process)."""
        width = hidden.shape[1]
        features = self.embeddings[:, width * (layer + 1):width * (layer + 2)].to(hidden.dtype)
        return hidden.index_add(0, self.rows, features)
