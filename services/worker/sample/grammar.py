"""Grammar masking in the sampling step: each constrained row's logits masked by its
matcher (shared/structured_output.py builds the matchers), with drafts checked against the
grammar, and the rows whose matcher is still compiling held back."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

# How long a step with only grammar-waiting requests waits for a compile (see split_ready).
GRAMMAR_WAIT_S = 0.05


def mask(logits: torch.Tensor, jobs: list[tuple[int, object, list[int]]], vocab_size: int,
         plain_greedy: frozenset[int] = frozenset()) -> list[int]:
    """In place, for each (first row, matcher, drafts): row first + j gets -inf on every
    token the grammar does not allow after the drafts before it. Returns, per job, how
    many drafts the grammar accepts: rows past the first one it refuses are not masked
    and must not be accepted. Each matcher is rolled back to where it was.

    `plain_greedy` rows take the argmax of these very logits (greedy, nothing applied
    after the mask, no logprobs read from them): one whose argmax the grammar allows
    samples it masked or not, so on a CPU only the others are masked. Applying the
    mask is most of its cost there (~0.1 ms a row of 49k logits), and a model that
    knows the format mostly picks an allowed token."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab_size)
    rows, valid = [], []
    for first, matcher, drafts in jobs:
        num_valid = 0
        for j in range(len(drafts) + 1):
            if matcher.is_terminated():  # a draft was the stop token: nothing follows
                break
            matcher.fill_next_token_bitmask(bitmask, first + j)
            rows.append(first + j)
            if j == len(drafts) or not matcher.accept_token(drafts[j]):
                break
            num_valid += 1
        if num_valid:
            matcher.rollback(num_valid)
        valid.append(num_valid)
    if plain_greedy and logits.device.type == "cpu":
        rows = _rows_to_mask(logits, bitmask, rows, plain_greedy)
    if rows:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return valid


def plain_greedy(state) -> bool:
    """Whether a row samples the argmax of the logits as the grammar leaves them: greedy,
    no penalties, bias or min_tokens ban after the mask, and no logprobs read from it."""
    params = state.sampling_params
    return (params.greedy and not params.needs_penalties and not params.logit_bias and params.logprobs is None
            and params.allowed_token_ids is None and state.num_output_tokens >= params.min_tokens)


def _rows_to_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], plain_greedy) -> list[int]:
    """The rows whose mask can change what they sample: all but the plain greedy rows
    whose argmax the bitmask allows (bit t % 32 of word t // 32)."""
    candidates = [r for r in rows if r in plain_greedy]
    if not candidates:
        return rows
    index = torch.tensor(candidates)
    top = logits[index].argmax(-1)
    words = bitmask.shape[1]  # logits may be wider (padding rows): those ids are never allowed
    allowed = ((bitmask[index, (top // 32).clamp(max=words - 1)] >> (top % 32)) & 1).bool() & (top < words * 32)
    keep = {r for r, ok in zip(candidates, allowed.tolist()) if ok}
    return [r for r in rows if r not in keep]


def split_ready(states: list, rows: list[int], wait_s: float | None = 0.0) -> tuple[list[int], list[int], dict[int, str]]:
    """Rows that may sample now, rows whose matcher is still compiling, and rows whose
    compile failed (row -> why). A ready matcher replaces its future in the state.
    `wait_s`: how long to wait for a compile to finish first (when nothing else would);
    None: for every compile to finish (none is left pending)."""
    compiling = [states[i].matcher for i in rows if isinstance(states[i].matcher, Future)]
    if wait_s is None:
        wait(compiling)
    elif wait_s and compiling and not any(f.done() for f in compiling):
        wait(compiling, wait_s, FIRST_COMPLETED)
    ready, pending, failed = [], [], {}
    for i in rows:
        state = states[i]
        if isinstance(state.matcher, Future):
            if not state.matcher.done():
                pending.append(i)
                continue
            if state.matcher.exception() is not None:
                failed[i] = str(state.matcher.exception())
                continue
            state.matcher = state.matcher.result()
        ready.append(i)
    return ready, pending, failed


def wait_s(states: list, sample_rows: list[int], recurrent: bool) -> float | None:
    """How long a step whose constrained rows include a compile in flight waits for one
    (split_ready's wait_s): a step of nothing but requests waiting for their grammars a
    little, rather than come straight back to compute the same token again; a hybrid's
    (`recurrent`) for every compile, its recurrent layers having folded this step's tokens
    into their state, which cannot compute them again; any other not at all."""
    if recurrent:
        return None
    only_waiting = len(sample_rows) == len(states) and all(isinstance(s.matcher, Future) for s in states)
    return GRAMMAR_WAIT_S if only_waiting else 0.0
