"""Speculative decoding by a drafter that reads the target's hidden states: a checkpoint's
own multi-token-prediction layer (vLLM's `{"method": "mtp"}`, models/mtp.py) or an EAGLE-3
head (`{"method": "eagle3"}`, models/eagle3.py). It proposes each request's drafts by
argmax, and the target verifies them as it verifies any drafts (spec_decode.py: exact, so
greedy and seeded outputs are the target's alone).

The drafter at position p reads the target's hidden state at p and the token at p + 1,
so it trails the target by a token: after a step, what it reads of the positions the
target computed is kept (`saw_step`), and at the next proposal the drafter computes every
position whose next token is now known (the catch-up, for every request that has such
rows, whether or not it drafts this step: its KV must cover the whole context), the last
of them giving the first draft; each further draft is one more forward, fed the
drafter's own output in place of the target's hidden state. Rows past the tokens
accepted (those of rejected drafts) are dropped when the target computes those positions
again. The drafter's KV cache sits under the target's block ids (its bytes come out of
the worker's budget); the KV of positions the target did not compute here (a prefix-cache
hit) is the one the request that filled those blocks left there: a difference there can
cost acceptance, never a token, since every draft is verified.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from services.worker.block_table import BlockTable
from services.worker.kv_cache import allocate_kv_caches, kv_bytes_per_block
from services.worker.request_state import RequestState
from services.worker.sample.draft_model import DraftView
from services.worker.sample.draft_position import next_drafts
from services.worker.step_inputs import StepInputs
from shared.config import SpeculativeConfig


class _Rows:
    """What a request's drafter has not read yet of the target's hidden states: from position
    `first`, one row a position, in pieces of the steps that computed them."""

    __slots__ = ("state", "first", "pieces", "done")

    def __init__(self, state: RequestState) -> None:
        self.state, self.first, self.pieces = state, -1, []
        self.done = -1  # the drafter's KV holds positions below this (-1: none computed here yet)

    @property
    def end(self) -> int:
        return self.first + sum(len(p) for p in self.pieces)

    def add(self, first: int, rows: torch.Tensor) -> None:
        """A step's rows from `first`; those it computed again (past the drafts accepted) replace the old."""
        if self.pieces and self.first <= first <= self.end:
            self.pieces = self.take_until(first - 1, drop=False)
        else:
            self.pieces, self.first = [], first
        self.pieces.append(rows)

    def take_until(self, last: int, drop: bool = True) -> list[torch.Tensor]:
        """The pieces' rows of positions first..last (with `drop`, removed: the rest kept)."""
        taken, kept, position = [], [], self.first
        for piece in self.pieces:
            n = max(0, min(len(piece), last + 1 - position))
            if n:
                taken.append(piece[:n])
            if n < len(piece):
                kept.append(piece[n:])
            position += len(piece)
        if drop:
            self.pieces, self.first = kept, max(self.first, last + 1)
        return taken


class HiddenStateDrafter:
    def __init__(self, config: SpeculativeConfig, drafter, target_model, backend, max_model_len: int,
                 device: torch.device) -> None:
        """`drafter`: an MTP layer or an EAGLE-3 head, loaded: its one layer's `config`,
        `values_are_keys`, `kept`, `predict`, `draft_ids` and `draft_logits`."""
        self.drafter, self.target, self.backend, self.device = drafter, target_model, backend, device
        self.num_speculative_tokens, self.max_model_len = config.num_speculative_tokens, max_model_len
        self.sample_drafts = config.draft_sample_method == "probabilistic"
        self.kv_caches: list = []
        self._rows: dict[str, _Rows] = {}

    def bytes_per_block(self, block_size: int, kv_cache_dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.drafter.config, block_size, kv_cache_dtype, self.drafter.values_are_keys)

    def allocate(self, num_blocks: int, block_size: int, kv_cache_dtype: torch.dtype) -> None:
        """The drafter's cache: as many blocks as the target's (its pad block included)."""
        self.kv_caches = allocate_kv_caches(self.drafter.config, self.backend, num_blocks, block_size, kv_cache_dtype,
                                            self.drafter.values_are_keys, self.device, None)

    def saw_step(self, hidden: torch.Tensor, states: list[RequestState], num_tokens: dict[str, int]) -> None:
        """What the drafter reads of a step just computed (before the states count its
        tokens), kept: a copy (a decode graph's output is overwritten)."""
        total = sum(num_tokens[s.req_id] for s in states)
        step = self.drafter.kept(self.target, hidden)[:total].clone()
        row = 0
        for state in states:
            n = num_tokens[state.req_id]
            rows = self._rows.get(state.req_id)
            if rows is None or rows.state is not state:  # (new, or back after a preemption or a move)
                rows = self._rows[state.req_id] = _Rows(state)
            rows.add(state.num_computed_tokens, step[row:row + n])
            row += n

    @torch.no_grad()
    def propose(self, requests: dict[str, RequestState], num_draft_slots: dict[str, int], block_size: int,
                block_table: BlockTable, sampler=None) -> dict[str, list[int]]:
        """The catch-up of every request with rows, and up to `num_draft_slots[rid]`
        drafts for each request given slots (none for one whose grammar is compiling)."""
        for rid in [rid for rid, rows in self._rows.items() if requests.get(rid) is not rows.state]:
            del self._rows[rid]
        slots = {rid: min(n, self.num_speculative_tokens) for rid, n in num_draft_slots.items()
                 if rid in requests and not isinstance(requests[rid].matcher, Future)
                 and len(requests[rid].token_ids) + n <= self.max_model_len}
        caught = []  # (view, its rows, whether it drafts)
        for rid, rows in self._rows.items():
            state = rows.state
            last = len(state.token_ids) - 2  # (the last position whose next token is on the host)
            start = max(rows.done, rows.first)  # (positions the main model did not compute here: as they are)
            upto = min(last, rows.end - 1)  # (a prompt's later chunks, a step in flight: not yet)
            if rows.first < 0 or upto < start:
                continue
            rows.take_until(start - 1)
            view = DraftView(state, start, state.token_ids[1:upto + 2])  # (position p reads the token at p + 1)
            caught.append((view, torch.cat(rows.take_until(upto)), rid in slots and upto == last))
            rows.done = upto + 1
        if not caught:
            return {}
        # (decodes first, as attention takes them)
        caught.sort(key=lambda c: len(c[0].token_ids) - c[0].num_computed_tokens != 1)
        views = [c[0] for c in caught]
        drafts = {rid: [] for rid in slots}
        outputs = self._step(views, torch.cat([c[1] for c in caught]), [c[2] for c in caught], drafts, block_size,
                             block_table, sampler)
        for _ in range(max(slots.values(), default=1) - 1):  # each further draft: one token a request that wants more
            wanted = [i for i, view in enumerate(views) if view.req_id in drafts
                      and 0 < len(drafts[view.req_id]) < slots[view.req_id]]
            if not wanted:
                break
            views = [DraftView(v.state, len(v.token_ids), v.token_ids + [drafts[v.req_id][-1]])
                     for v in map(views.__getitem__, wanted)]
            outputs = self._step(views, outputs[wanted], [True] * len(views), drafts, block_size, block_table,
                                 sampler)
        return {rid: d for rid, d in drafts.items() if d}

    def _step(self, views: list[DraftView], previous: torch.Tensor, drafting: list[bool], drafts: dict[str, list[int]],
              block_size: int, block_table: BlockTable, sampler) -> torch.Tensor:
        """One forward of the drafter over `views` (in order; `previous` their rows, one a
        token); a draft for each drafting view. Returns its output at each view's
        last token (a further draft's `previous`), in `views`' order."""
        num_tokens = {v.req_id: len(v.token_ids) - v.num_computed_tokens for v in views}
        inputs, _, last_token, _ = StepInputs.build(views, num_tokens, {}, block_size, block_table)
        input_ids, positions, metadata = inputs.to_device(self.device)
        normed, out = self.drafter.predict(input_ids, positions, previous, self.kv_caches[0], metadata, self.target)
        rows = torch.from_numpy(np.asarray(last_token, np.int64)).to(out.device)
        picked = [i for i, wants in enumerate(drafting) if wants]
        if picked:
            normed = normed[rows[picked]]
            best = next_drafts([views[i] for i in picked], drafts, sampler, self.sample_drafts,
                               lambda: self.drafter.draft_logits(normed, self.target),
                               lambda: self.drafter.draft_ids(normed, self.target))
            for i, token in zip(picked, best):
                drafts[views[i].req_id].append(int(token))
        return out[rows]
