"""N-gram speculative decoding on the worker: drafts proposed from a request's own tokens
(prompt lookup), verified in the step's one forward, accepted exactly.

The worker proposes because it holds every request's tokens at the moment that matters,
just before the forward. Each draft position is sampled exactly as the position would be
without speculation — the same penalties, bias, min_tokens and seeded draw, with the
history up to it (`DraftPosition`) — and drafts are accepted while the sample equals
them. For a one-hot draft that is exact rejection sampling, so greedy and seeded outputs
are token-identical with and without speculation, and unseeded ones have the same
distribution. The token sampled after the last accepted draft (the bonus, or the
correction) always comes with them.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from services.worker.request_state import RequestState
from services.worker.sample.draft_position import DraftPosition
from shared.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens: those that followed the latest earlier occurrence
        of the longest suffix of `token_ids` (prompt_lookup_max down to _min tokens)."""
        c = self.config
        num = min(c.num_speculative_tokens, max_drafts)
        tokens = np.asarray(token_ids)
        length = len(tokens)
        if num <= 0:
            return []
        for n in range(min(c.prompt_lookup_max, length - 1), c.prompt_lookup_min - 1, -1):
            # Every earlier window of n tokens (the suffix itself excluded).
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + num].tolist()
        return []


def num_accepted(drafts: list[int], samples: list[int]) -> int:
    """Drafts accepted: while each position's sample equals its draft."""
    accepted = 0
    while accepted < len(drafts) and samples[accepted] == drafts[accepted]:
        accepted += 1
    return accepted


def make_proposer(worker_config, target, dtype, backend, max_model_len: int, device, tensor_parallel=None,
                  model=None, folder=None, quantization=None):
    """The worker's proposer for `worker_config.speculative_config`'s method (None: no
    speculation), for the target `model` (its config `target`, read from `folder`), with
    its `synthetic` acceptance where the config asks for it. A drafter is loaded before
    the KV cache is sized (its blocks come out of the same budget), by the target's
    load_format ("dummy": random weights of its shape, for timing)."""
    config = worker_config.speculative_config
    if config is None:
        return None
    if target.recurrent_layers:
        raise ValueError(f"speculative decoding is not supported for {target.architecture}: its "
                         "recurrent layers' state cannot take back rejected drafts")
    load_format = worker_config.load_format
    if config.method == "draft_model":
        from services.worker.sample.draft_model import DraftModelProposer

        proposer = DraftModelProposer(config, target, dtype, backend, max_model_len, device, load_format,
                                      tensor_parallel)
    elif config.method in ("mtp", "eagle3"):
        from services.worker.models.eagle3 import load_eagle3
        from services.worker.models.mtp import load_mtp
        from services.worker.sample.hidden_state_drafter import HiddenStateDrafter

        drafter = load_mtp(config.model or folder, target, dtype, backend, max_model_len, quantization, device,
                           load_format, tensor_parallel and (tensor_parallel, model.shards.full)) \
            if config.method == "mtp" else \
            load_eagle3(config.model, model, dtype, backend, max_model_len, device, load_format)
        proposer = HiddenStateDrafter(config, drafter, model, backend, max_model_len, device)
    else:
        proposer = NgramProposer(config)
    if config.rejection_sample_method == "synthetic":
        from services.worker.sample.synthetic_acceptance import SyntheticAcceptance

        proposer.synthetic = SyntheticAcceptance(config)
    return proposer


def propose_drafts(proposer, requests: dict[str, RequestState], num_draft_slots: dict[str, int],
                   long_rope_threshold: int | None, block_size: int, block_table,
                   sampler=None) -> dict[str, list[int]]:
    """Drafts for the requests the scheduler gave slots: none for a request whose grammar
    is still compiling, or whose drafts would cross the longrope threshold (`sampler`: the
    target's, whose draws a model drafter's probabilistic drafts take)."""
    if proposer is None or not num_draft_slots and isinstance(proposer, NgramProposer):
        return {}  # (a model drafter catches up every step, drafting or not)
    if long_rope_threshold is not None:
        num_draft_slots = {rid: slots for rid, slots in num_draft_slots.items() if rid in requests and (
            requests[rid].long_rope or len(requests[rid].token_ids) + slots <= long_rope_threshold)}
    if not isinstance(proposer, NgramProposer):  # (a model drafter: every request's drafts in a few forwards)
        return proposer.propose(requests, num_draft_slots, block_size, block_table, sampler)
    drafts = {}
    for rid, slots in num_draft_slots.items():
        state = requests.get(rid)
        if state is not None and not isinstance(state.matcher, Future):  # a grammar still compiling: none
            proposed = proposer.propose(state.token_ids, slots)
            if proposed:
                drafts[rid] = proposed
    return drafts


def logit_rows(sample_rows: list[int], states: list[RequestState], order: list[str], drafts: dict[str, list[int]],
               last_token: np.ndarray) -> tuple[torch.Tensor, list, list[int] | range]:
    """One logits row per sampled position: a request's last token, and before it one per
    draft, each seen by the sampler with the drafts before it -> (the rows of the step's
    hidden states, what the sampler sees at each, each request's first row)."""
    if drafts:
        rows, row_states, first_row = [], [], []
        for i in sample_rows:
            state, d = states[i], drafts.get(order[i], [])
            first_row.append(len(rows))
            rows.extend(range(int(last_token[i]) - len(d), int(last_token[i]) + 1))
            row_states.extend([DraftPosition(state, d[:j]) for j in range(len(d) + 1)] if d else [state])
        return torch.tensor(rows), row_states, first_row
    # one row a request (every request, in a decode step: no index to apply)
    every = len(sample_rows) == len(states)
    rows = torch.from_numpy(last_token if every else last_token[sample_rows])
    return rows, states if every else [states[i] for i in sample_rows], range(len(sample_rows))
