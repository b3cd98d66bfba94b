"""One step's flattened inputs as host arrays, before they go to the device.

The model runner builds these with numpy; an eager step copies them into fresh device
tensors (`to_device`), a decode step on the graph path fills the persistent buffers of
decode_graphs.py with them instead. Rows are what attention sees (see
ModelRunner._prepare_inputs): decodes first, then prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.worker.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class StepInputs:
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64: each token's row of the rotary tables (its position, but longrope)
    query_start_loc: np.ndarray  # [num_rows + 1] int64
    seq_lens: np.ndarray  # [num_rows] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_table: np.ndarray  # [num_rows, max_blocks] int32
    num_decodes: int

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == self.num_rows == self.num_tokens > 0

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) in new device tensors, for an eager forward."""
        def put(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)

        query_lens = np.diff(self.query_start_loc)
        metadata = AttentionMetadata(
            num_decodes=self.num_decodes,
            num_actual_tokens=self.num_tokens,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(self.seq_lens.max()),
            query_start_loc=put(self.query_start_loc.astype(np.int32)),
            seq_lens=put(self.seq_lens.astype(np.int32)),
            slot_mapping=put(self.slot_mapping),
            block_table=put(self.block_table),
            query_start_loc_cpu=self.query_start_loc,
            seq_lens_cpu=self.seq_lens,
        )
        return put(self.input_ids), put(self.positions), metadata
