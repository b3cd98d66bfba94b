"""One step's image embeddings: the rows of the flattened batch whose placeholders they
replace, and the image spans attention lets see each other both ways."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StepImages:
    rows: torch.Tensor  # [n] int64: flat token indices
    embeddings: torch.Tensor  # [n, hidden_size]
    spans: dict[int, list[tuple[int, int]]] | None  # attention row -> its images' [start, end) positions

    def apply(self, hidden: torch.Tensor, metadata) -> torch.Tensor:
        """The embedded tokens with the images' rows in place; the spans to attention."""
        metadata.bidirectional = self.spans
        return hidden.index_copy(0, self.rows, self.embeddings.to(hidden.dtype))
