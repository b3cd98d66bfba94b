"""What attention needs to know about one step's flattened batch, passed explicitly."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    # Requests are ordered decodes first (one new token each), then prefill chunks.
    num_decodes: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, offsets into the flattened tokens
    seq_lens: torch.Tensor  # [num_reqs] int32, cached + new tokens of each request
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token (-1 = pad)
    block_table: torch.Tensor  # [num_reqs, max_num_blocks] int32, padded with 0
    # Host copies, so the CPU backend can loop over requests without device syncs.
    query_start_loc_cpu: np.ndarray  # [num_reqs + 1]
    seq_lens_cpu: np.ndarray  # [num_reqs]
    # Each row's request's row of the persistent batch (its block-table row), where a
    # hybrid's recurrent layers keep its state (layers/causal_conv.py, linear_recurrence.py)
    state_rows: torch.Tensor | None = None  # [num_reqs] int64
    state_rows_cpu: np.ndarray | None = None
    # Image placeholders that attend to each other both ways (Gemma 3's), for the rows
    # whose chunk holds them: row -> [start, end) positions of each image (never split
    # across steps: Request.whole_images). None: causal throughout (every other step).
    bidirectional: dict[int, list[tuple[int, int]]] | None = None
    # What a backend derives from the above once per step and reuses in every layer.
    backend_state: object = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    def decode_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A hybrid's view of the step's decodes (its first rows): each one's state row, and
        whether its request computed tokens before (its state carries on; else, a first
        token, it starts from zeros). Device ops only: graph-safe."""
        d = self.num_decodes
        return self.state_rows[:d], self.seq_lens[:d] > 1

    def prefill_states(self) -> Iterator[tuple[int, int, int, bool]]:
        """A hybrid's view of the step's prefill chunks (the rows after its decodes): each
        one's first and end token, its state row, and whether its request computed tokens
        before the chunk (its state carries on; else it starts from zeros)."""
        starts, seq_lens = self.query_start_loc_cpu, self.seq_lens_cpu
        for r in range(self.num_decodes, self.num_reqs):
            first, last = int(starts[r]), int(starts[r + 1])
            yield first, last, int(self.state_rows_cpu[r]), int(seq_lens[r]) > last - first
