"""Each penalized request's token counts, kept on the logits' device between steps.

Repetition, presence and frequency penalties need, for every row, which tokens the
request has seen (prompt and output) and how often each came out. Built from the
request's token list each step, that is O(context) of host work a row: 2.7 ms a step at
128 rows of 600 tokens, 8.7 ms at 2000 (measured on this CPU, tiny vocabulary), against
the ~1.5 ms a whole decode step takes on a GPU. Here a request holds one row of two
tables ([rows, vocab + 1]: output counts, and seen as 0/1) that the tokens added since
its last step are scattered into — one op for all rows, O(new tokens) — and a step's
rows are one gather. (vLLM keeps such counts in its persistent batch too.)

A request's latest token may still be on the device, sampled by the step launched before
this one (launched_step.py): it is counted from there, read on the device, so penalized
requests overlap steps like any other (`num_counted` then runs one ahead of `token_ids`
until the token lands). A row is the request's while the runner holds it (`free` on
drop); ids past the logits (a tokenizer's extras) count in a spare last column that is
cut off.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.worker.host_values import to_device
from services.worker.device_tokens import gather_device_tokens
from services.worker.request_state import RequestState


class PenaltyCounts:
    def __init__(self) -> None:
        self._output: torch.Tensor | None = None  # [capacity, vocab + 1] int32: output tokens' counts
        self._seen: torch.Tensor | None = None  # [capacity, vocab + 1] int32: 1 where prompt or output has it
        self._free: list[int] = []

    def free(self, state: RequestState) -> None:
        if self._row(state) is not None:
            self._free.append(state.penalty_row[1])
        state.penalty_row = None

    def _row(self, state: RequestState) -> int | None:
        """Its row here (a state's row is (table, row): another sampler's is none of ours)."""
        return state.penalty_row[1] if state.penalty_row is not None and state.penalty_row[0] is self else None

    def rows(self, states: Sequence, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts, seen) [len(states), vocab_size] for these rows: RequestStates, or
        spec_decode.DraftPositions (a request's tokens plus the drafts before a position)."""
        bases = [getattr(s, "state", s) for s in states]
        unique = list({id(b): b for b in bases}.values())  # (a request verifying drafts has several rows)
        self._ensure(vocab_size, device, unique)
        fresh, rows, tokens, is_output = [], [], [], []
        on_device = []  # (row, place) of each latest token still on the device
        for base in unique:
            row = self._row(base)
            if row is None:
                row = self._free.pop()
                base.penalty_row, base.num_counted = (self, row), 0
                fresh.append(row)
            new = base.token_ids[base.num_counted:]
            if new:
                rows += [row] * len(new)
                tokens += new
                is_output += [base.num_counted + i >= base.num_prompt_tokens for i in range(len(new))]
                base.num_counted += len(new)
            known = len(base.token_ids)
            if base.num_pending and base.num_counted < known + base.num_pending:
                # Only the latest pending token is addressable on the device.
                if base.num_counted != known + base.num_pending - 1:
                    raise RuntimeError(f"{base.num_pending} tokens of {base.req_id} are on the device, uncounted")
                on_device.append((row, base.pending_token))
                base.num_counted += 1
        output, seen = self._output, self._seen
        one = torch.ones((), dtype=output.dtype, device=device)  # (both tables are int32)
        if fresh:
            index = to_device(fresh, device)
            output.index_fill_(0, index, 0)
            seen.index_fill_(0, index, 0)
        if rows:
            rows_t = to_device(rows, device)
            tokens_t = to_device(np.minimum(np.asarray(tokens, dtype=np.int64), vocab_size), device)
            seen.index_put_((rows_t, tokens_t), one)
            output.index_put_((rows_t, tokens_t), to_device(is_output, device, output.dtype), accumulate=True)
        for d_rows, sampled in gather_device_tokens(on_device):  # sampled tokens: always output
            rows_t, tokens_t = to_device(d_rows, device), sampled.clamp(max=vocab_size)  # (sampled on this device)
            seen.index_put_((rows_t, tokens_t), one)
            output.index_put_((rows_t, tokens_t), one, accumulate=True)
        index = to_device([b.penalty_row[1] for b in bases], device)
        out_counts, seen_rows = output[index], seen[index]  # gathers: copies, the drafts may go in
        drafted = [(i, s.drafts) for i, s in enumerate(states) if getattr(s, "drafts", None)]
        if drafted:
            d_rows = to_device([i for i, d in drafted for _ in d], device)
            d_tokens = to_device(np.minimum([t for _, d in drafted for t in d], vocab_size).astype(np.int64), device)
            out_counts.index_put_((d_rows, d_tokens), one, accumulate=True)
            seen_rows.index_put_((d_rows, d_tokens), one)
        return out_counts[:, :vocab_size], seen_rows[:, :vocab_size]

    def _ensure(self, vocab_size: int, device: torch.device, states: list[RequestState]) -> None:
        """Rows for every one of these (distinct) states without one: the tables grow by
        doubling (rare)."""
        needed = sum(1 for s in states if self._row(s) is None)
        if self._output is not None and (self._output.device != device or self._output.shape[1] != vocab_size + 1):
            raise ValueError("penalty counts kept for another vocabulary or device")
        if needed <= len(self._free):
            return
        old = 0 if self._output is None else self._output.shape[0]
        capacity = max(2 * old, old + needed, 8)
        output = torch.zeros(capacity, vocab_size + 1, dtype=torch.int32, device=device)
        seen = torch.zeros_like(output)
        if old:
            output[:old].copy_(self._output)
            seen[:old].copy_(self._seen)
        self._output, self._seen = output, seen
        self._free.extend(range(capacity - 1, old - 1, -1))
