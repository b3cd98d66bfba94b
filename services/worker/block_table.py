"""Every held request's KV block ids, one row each of one persistent array.

The scheduler sends a request's blocks once and then only the blocks each step adds;
they are appended to its row here, so a step's block table is one gather of its
requests' rows instead of a list-to-array copy per request a step (vLLM's persistent
batch keeps its block table the same way). Rows are reused once a request is dropped
and the array grows when every row is taken.
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, max_blocks_per_request: int, num_rows: int = 64) -> None:
        self.max_blocks_per_request = max_blocks_per_request
        self.table = np.zeros((num_rows, max_blocks_per_request), np.int32)
        self.num_blocks = np.zeros(num_rows, np.int64)
        self._free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: lowest row first

    @property
    def num_rows_in_use(self) -> int:
        return len(self.table) - len(self._free_rows)

    def add(self, block_ids: list[int]) -> int:
        """A row for a new request holding these blocks."""
        if not self._free_rows:
            old = len(self.table)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self.table[row] = 0  # past a request's own blocks a row holds zeros, never an earlier request's ids
        self.num_blocks[row] = 0
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_request:
            raise ValueError(f"{end} blocks for one request, more than max_model_len allows "
                             f"({self.max_blocks_per_request})")
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def block_ids(self, row: int) -> list[int]:
        return self.table[row, : self.num_blocks[row]].tolist()

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), the most blocks any of them holds]: these rows' block ids, zeros
        past each row's own (attention reads a row only as far as its seq_len)."""
        width = int(self.num_blocks[rows].max()) if len(rows) else 0
        return self.table[rows, :width]
