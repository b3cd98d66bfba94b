"""Speculative decoding with a draft model (vLLM's `{"method": "draft_model", "model": ...}`):
a smaller model of the target's vocabulary proposes each request's drafts by argmax, and
the target verifies them in its step's one forward as it verifies n-gram drafts
(spec_decode.py: exact, so greedy and seeded outputs are the target's alone, whatever the
draft proposes).

The draft keeps its own KV cache under the target's block ids: the same number of blocks
and the same block tables, so a request's blocks, allocated by the scheduler for the
target, hold the draft's keys and values too (the worker's KV budget pays for both: fewer
blocks). A request's draft KV is valid up to the tokens it has caught up on; each step the
draft first computes the tokens the target accepted since (on a request's first
proposal, its whole context: the draft never relies on blocks another request filled),
which gives the first draft, then one forward per further draft. Drafts written past the
accepted tokens are overwritten by the next catch-up, as the target's rejected ones are.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from services.worker.block_table import BlockTable
from services.worker.kv_cache import allocate_kv_caches, kv_bytes_per_block
from services.worker.loader import load_model
from services.worker.models.decoder_config import ModelConfig
from services.worker.parallel.sharding import local_config
from services.worker.request_state import RequestState
from services.worker.sample.draft_position import next_drafts
from services.worker.step_inputs import StepInputs
from shared.config import SpeculativeConfig


class DraftView:
    """A request as a drafter's forward sees it: its tokens, those the drafter has computed."""

    __slots__ = ("state", "req_id", "token_ids", "num_computed_tokens", "block_row", "num_pending", "pending_token")

    def __init__(self, state: RequestState, num_computed: int, token_ids: list[int]) -> None:
        self.state, self.req_id, self.token_ids, self.block_row = state, state.req_id, token_ids, state.block_row
        self.num_computed_tokens, self.num_pending, self.pending_token = num_computed, 0, None


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, target: ModelConfig, dtype: torch.dtype, backend,
                 max_model_len: int, device: torch.device, load_format: str = "auto", tensor_parallel=None) -> None:
        """`tensor_parallel`: a rank's group, where the target is sharded: the draft is cut as
        the target is (each rank its heads and its slice of each MLP, its KV heads' cache),
        every rank drafts alike (logits gathered: the same argmax, the same seeded draws)."""
        folder = Path(config.model)
        if not (folder / "config.json").is_file():
            raise ValueError(f"speculative_config model {config.model!r} is not a model folder (no config.json)")
        draft = ModelConfig.from_folder(folder)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config model {config.model!r} has a vocabulary of {draft.vocab_size} "
                             f"tokens, the target's {target.vocab_size}: a draft must share the target's")
        if draft.recurrent_layers or draft.kv_lora_rank:
            raise ValueError(f"speculative_config model {config.model!r} ({draft.architecture}): a draft model "
                             "must be a decoder of attention layers with plain KV heads")
        self.num_speculative_tokens, self.max_model_len = config.num_speculative_tokens, max_model_len
        self.sample_drafts = config.draft_sample_method == "probabilistic"
        self.config = draft if tensor_parallel is None else local_config(draft, tensor_parallel.world_size)
        self.model = load_model(folder, self.config, dtype, backend, max_model_len, None, device, load_format,
                                tensor_parallel and (tensor_parallel, draft))
        self.backend, self.device = backend, device
        self.kv_caches: list = []
        # Each request's state and how many of its tokens the draft's cache holds (a state
        # that is not the one noted: the request came back, preempted or moved: from 0).
        self._caught_up: dict[str, tuple[RequestState, int]] = {}

    def bytes_per_block(self, block_size: int, kv_cache_dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.config, block_size, kv_cache_dtype)

    def allocate(self, num_blocks: int, block_size: int, kv_cache_dtype: torch.dtype) -> None:
        """The draft's cache: as many blocks as the target's (its pad block included)."""
        self.kv_caches = allocate_kv_caches(self.config, self.backend, num_blocks, block_size, kv_cache_dtype,
                                            False, self.device, None)

    @torch.no_grad()
    def propose(self, requests: dict[str, RequestState], num_draft_slots: dict[str, int], block_size: int,
                block_table: BlockTable, sampler=None) -> dict[str, list[int]]:
        """Up to `num_draft_slots[rid]` drafts for each request given slots (none for one
        whose grammar is still compiling)."""
        for rid in [rid for rid in self._caught_up if rid not in requests]:
            del self._caught_up[rid]
        states = [requests[rid] for rid in num_draft_slots
                  if rid in requests and not isinstance(requests[rid].matcher, Future)]
        states = [s for s in states if len(s.token_ids) + num_draft_slots[s.req_id] <= self.max_model_len]
        if not states:
            return {}
        slots = {s.req_id: min(num_draft_slots[s.req_id], self.num_speculative_tokens) for s in states}
        drafts: dict[str, list[int]] = {s.req_id: [] for s in states}
        # The catch-up: every token the draft has not computed, the last one giving the first draft.
        views = []
        for state in states:
            noted = self._caught_up.get(state.req_id)
            done = noted[1] if noted is not None and noted[0] is state else 0
            done = min(done, len(state.token_ids) - 1)  # (at least its last token: it gives the first draft)
            views.append(DraftView(state, done, state.token_ids))
            self._caught_up[state.req_id] = (state, len(state.token_ids))
        self._step(views, drafts, block_size, block_table, sampler)
        for _ in range(max(slots.values()) - 1):  # each further draft: one token a request that wants more
            views = [DraftView(state, len(state.token_ids) + len(drafts[state.req_id]) - 1,
                             state.token_ids + drafts[state.req_id]) for state in states
                     if len(drafts[state.req_id]) < slots[state.req_id]]
            if not views:
                break
            self._step(views, drafts, block_size, block_table, sampler)
        return {rid: d for rid, d in drafts.items() if d}

    def _step(self, views: list[DraftView], drafts: dict[str, list[int]], block_size: int,
              block_table: BlockTable, sampler) -> None:
        num_tokens = {v.req_id: len(v.token_ids) - v.num_computed_tokens for v in views}
        views.sort(key=lambda v: num_tokens[v.req_id] != 1)  # (decodes first, as attention takes them)
        inputs, _, last_token, _ = StepInputs.build(views, num_tokens, {}, block_size, block_table)
        input_ids, positions, metadata = inputs.to_device(self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        rows = torch.from_numpy(np.asarray(last_token, np.int64)).to(hidden.device)
        logits = self.model.compute_logits(hidden[rows])
        best = next_drafts(views, drafts, sampler, self.sample_drafts, lambda: logits, lambda: logits.argmax(dim=-1))
        for view, token in zip(views, best):
            drafts[view.req_id].append(int(token))
