"""vLLM's bad_words on a step's logits: each word's last token masked in the rows whose
output ends with the tokens before it (a one-token word: always).

Only the output counts, as in vLLM: a word the prompt ends with half-written is not
finished by the first output token. A row's latest token may still be on the device,
sampled by the step launched before this one (launched_step.py): the tokens before it
are compared on the host, and that last one on the device, so the mask needs no sync.
A draft position (spec_decode.DraftPosition) has its drafts as history, all on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.host_values import put_scalar, to_device
from services.worker.device_tokens import gather_device_tokens

_MASK = float("-inf")


def has_bad_words(state) -> bool:
    return bool(state.sampling_params.bad_words_token_ids)


def apply_bad_words(logits: torch.Tensor, states: Sequence) -> None:
    """Mask, in place, the last token of every bad word the row's output would complete."""
    rows, ids = [], []  # decided on the host
    checks = []  # (row, id, the token the device's latest must be) decided on the device
    places = []  # (index into checks, the latest token's place)
    for i, s in enumerate(states):
        words = s.sampling_params.bad_words_token_ids
        if not words:
            continue
        base = getattr(s, "state", s)  # (a draft position's request)
        pending = base.num_pending
        if pending > 1 or (pending and base is not s):  # (launched_step.reads_device_tokens_only waits)
            raise RuntimeError(f"{pending} tokens of {base.req_id} are on the device: its bad words need them")
        history = s.output_token_ids
        for word in words:
            before = len(word) - 1
            if before > len(history) + pending:
                continue
            on_host = before - pending if before else 0
            if on_host and history[len(history) - on_host:] != word[:on_host]:
                continue
            if before and pending:
                places.append((len(checks), base.pending_token))
                checks.append((i, word[-1], word[-2]))
            else:
                rows.append(i)
                ids.append(word[-1])
    device = logits.device
    if rows:
        put_scalar(logits, (to_device(rows, device), to_device(ids, device)), _MASK)
    for keys, latest in gather_device_tokens(places):
        row_ids, word_ids, expected = zip(*(checks[k] for k in keys))
        hit = latest == to_device(expected, device, latest.dtype)
        # Added, not written: two words may end in the same token of one row, one hit and
        # one not, and a write of either would undo the other (-inf + 0 stays -inf).
        logits.index_put_((to_device(row_ids, device), to_device(word_ids, device)),
                          torch.where(hit, _MASK, 0.0).to(logits.dtype), accumulate=True)
