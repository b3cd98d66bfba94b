"""One step's flattened inputs as host arrays, before they go to the device.

The model runner builds these with numpy; an eager step copies them into fresh device
tensors (`to_device`), a decode step on the graph path fills the persistent buffers of
decode_graphs.py with them instead. Rows are what attention sees (see
`build`): decodes first, then prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.worker import host_values
from services.worker.attention.metadata import AttentionMetadata
from services.worker.block_table import BlockTable
from services.worker.request_state import RequestState


@dataclass(slots=True)
class StepInputs:
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64: each token's row of the rotary tables (its position, but longrope)
    query_start_loc: np.ndarray  # [num_rows + 1] int64
    seq_lens: np.ndarray  # [num_rows] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_table: np.ndarray  # [num_rows, max_blocks] int32
    num_decodes: int
    state_rows: np.ndarray  # [num_rows] int64: each row's request's block-table row (a hybrid's state there)

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
            return host_values.to_device(array, device)

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
            state_rows=put(self.state_rows),
            state_rows_cpu=self.state_rows,
        )
        return put(self.input_ids), put(self.positions), metadata

    @classmethod
    def build(
        cls, states: list[RequestState], num_tokens: dict[str, int], drafts: dict[str, list[int]], block_size: int,
        block_table: BlockTable, long_offset: int | None = None, fed_back: torch.Tensor | None = None,
    ) -> tuple[StepInputs, list[int], np.ndarray, list | torch.Tensor]:
        """The step's flattened inputs. Rows are what attention sees: one per request, or,
        for a request verifying drafts, one per token it computes, each a one-token decode
        at its own position over the cache up to it. So a step of decodes and verifies is
        still decode-only (the fused decode path), and each draft position is computed as a
        decode of it would be. Also returns the requests that sample this step and the
        flat index of each request's last token, and the tokens to read from the device
        (launched_step.py): `fed_back`, the step launched last's ids, where that step
        sampled row i for states[i] (LaunchedStep.fed_back) and each decodes it now."""
        num_states = len(states)
        # Each request's numbers, read in one pass over the states (a pass each cost more
        # than the array work after it at 128 requests).
        per_state = np.array([(s.num_computed_tokens, num_tokens[s.req_id], len(s.token_ids), s.num_pending,
                               s.block_row) for s in states], np.int64).reshape(num_states, 5)
        if not drafts and int(per_state[:, 1].sum()) == num_states:  # (every request computes >= 1 token)
            return cls._decodes(states, per_state, block_size, block_table, long_offset, fed_back)
        return cls._any_rows(states, per_state, drafts, block_size, block_table, long_offset)

    @classmethod
    def _decodes(
        cls, states: list[RequestState], per_state: np.ndarray, block_size: int, block_table: BlockTable,
        long_offset: int | None, fed_back: torch.Tensor | None = None,
    ) -> tuple[StepInputs, list[int], np.ndarray, list | torch.Tensor]:
        """`build` for a step of one token a request and no drafts, most steps of a busy
        engine: one row a request, so none of `_any_rows`' mapping between requests, rows
        and tokens (57 -> 32-40 us at 128 requests: docs/performance/history.md)."""
        num_states = len(states)
        req_starts, _, known, pending, block_rows = per_state.T
        plain = req_starts < known  # a decode of a token the host knows
        on_device = (pending > 0) & ~plain  # one a launched step sampled, on the device
        if not (plain | on_device).all():  # (a decode has one or the other; `_any_rows` says what is wrong)
            return cls._any_rows(states, per_state, {}, block_size, block_table, long_offset)
        input_ids = np.zeros(num_states, np.int64)
        if fed_back is not None and on_device.all():  # (every token where the last step sampled it, in order)
            from_device = fed_back
        else:
            plain_at = np.flatnonzero(plain).tolist()
            input_ids[plain_at] = [states[i].token_ids[s] for i, s in zip(plain_at, req_starts[plain_at].tolist())]
            device_at = np.flatnonzero(on_device).tolist()
            from_device = list(zip(device_at, [states[i].pending_token for i in device_at]))
        rows = np.arange(num_states)
        positions = req_starts.copy()
        table = block_table.gather(block_rows)
        slot_mapping = _slots(table, rows, positions, block_size)
        if long_offset is not None:
            positions += _long_rope(states) * long_offset
        inputs = cls(
            input_ids=input_ids, positions=positions, query_start_loc=np.arange(num_states + 1),
            seq_lens=req_starts + 1, slot_mapping=slot_mapping, block_table=table, num_decodes=num_states,
            state_rows=block_rows,
        )
        # A request samples once caught up: its token is the last it knows of.
        sample_rows = np.flatnonzero(req_starts + 1 == known + pending).tolist()
        return inputs, sample_rows, rows, from_device

    @classmethod
    def _any_rows(
        cls, states: list[RequestState], per_state: np.ndarray, drafts: dict[str, list[int]], block_size: int,
        block_table: BlockTable, long_offset: int | None,
    ) -> tuple[StepInputs, list[int], np.ndarray, list]:
        num_states = len(states)
        req_starts, req_lens, known, pending, block_rows = per_state.T
        rows_of = np.fromiter((1 + len(drafts[s.req_id]) if s.req_id in drafts else 1 for s in states),
                              np.int64, num_states) if drafts else np.ones(num_states, np.int64)
        first_row = np.zeros(num_states + 1, np.int64)
        np.cumsum(rows_of, out=first_row[1:])
        num_rows = int(first_row[-1])
        req_of_row = np.repeat(np.arange(num_states), rows_of)
        split = rows_of[req_of_row] > 1  # a row of a request verifying drafts
        query_lens = np.where(split, 1, req_lens[req_of_row])
        starts = req_starts[req_of_row] + np.where(split, np.arange(num_rows) - first_row[req_of_row], 0)
        query_start_loc = np.zeros(num_rows + 1, np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        seq_lens = starts + query_lens

        # positions: each row's run start..start+len, laid end to end
        row_of_token = np.repeat(np.arange(num_rows), query_lens)
        positions = np.arange(total) - query_start_loc[row_of_token] + starts[row_of_token]

        input_ids = np.empty(total, np.int64)
        from_device = []  # (flat index, where its token is on the device): a launched step's token
        token_at = query_start_loc[first_row]  # each request's first token in the flat batch
        req_ends = req_starts + req_lens
        # Each request's tokens, the common case first: a decode of a known token.
        plain = (req_lens == 1) & (req_ends <= known) & (rows_of == 1)
        plain_at = np.flatnonzero(plain)
        input_ids[token_at[plain_at]] = [states[i].token_ids[s] for i, s in zip(plain_at.tolist(),
                                                                               req_starts[plain_at].tolist())]
        # Then, with steps overlapped (a GPU's every decode), a decode of the token a
        # launched step sampled, which only the device holds (launch made sure of it).
        on_device = (pending > 0) & (req_ends > known)
        device_at = np.flatnonzero(on_device)
        if len(device_at):
            flat = token_at[device_at]
            input_ids[flat] = 0
            from_device = list(zip(flat.tolist(), [states[i].pending_token for i in device_at.tolist()]))
        for i in np.flatnonzero(~(plain | on_device)).tolist():
            state, start, end = states[i], int(req_starts[i]), int(req_ends[i])
            d = drafts.get(state.req_id)
            input_ids[token_at[i] : token_at[i + 1]] = (
                state.token_ids[start:end] if d is None else state.token_ids[start:] + d
            )
        # A request samples once caught up: its step ends past every token it knows of.
        sample_rows = np.flatnonzero(req_ends == known + pending + rows_of - 1).tolist()
        block_table = block_table.gather(block_rows)[req_of_row]
        slot_mapping = _slots(block_table, row_of_token, positions, block_size)
        if long_offset is not None:
            # longrope: a request's tokens rotate with the long factors when it was past the
            # threshold as it came to this worker (RequestState.long_rope); the long rows of
            # the tables follow the short ones.
            long = _long_rope(states)[req_of_row][row_of_token]
            positions = positions + long * long_offset
        num_decodes = int(np.searchsorted(query_lens != 1, True))  # decodes come first
        inputs = cls(
            input_ids=input_ids, positions=positions, query_start_loc=query_start_loc, seq_lens=seq_lens,
            slot_mapping=slot_mapping, block_table=block_table, num_decodes=num_decodes,
            state_rows=block_rows[req_of_row],
        )
        return inputs, sample_rows, token_at[1:] - 1, from_device


def _slots(block_table: np.ndarray, table_rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Each token's KV-cache slot: its row's block holding its position, at its offset there."""
    return block_table[table_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size


def _long_rope(states: list[RequestState]) -> np.ndarray:
    """Whether each request's tokens rotate with longrope's long factors."""
    return np.fromiter((s.long_rope for s in states), np.bool_, len(states))
