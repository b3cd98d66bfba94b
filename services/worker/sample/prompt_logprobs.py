"""Prompt logprobs: each prompt token's logprob given the tokens before it, and the top-k
there, as vLLM's `prompt_logprobs` (and OpenAI's completions with echo and logprobs) give.

A prefill chunk's hidden state at position p is the distribution of token p + 1. It is
taken as the sampler takes a sampled token's logprobs — the model's own distribution, no
penalties or temperature — a slice of rows at a time (a chunk of 8192 tokens' logits over
a 49k vocabulary would be 1.6 GB at once), and brought to the host as the step is
launched: a sync, paid only by the steps that hold such a request. The entries gather in
the request's state over its chunks and leave with its first sampled token. They are
computed only for a request with no output yet: one resumed, preempted or migrated after
its first token has already sent them; one that starts again before it computes every
position again (the scheduler gives such a request no prefix cache hits).
"""

from __future__ import annotations

import torch

from services.worker.request_state import RequestState
from services.worker.sample.sampler import logprob_table, read_logprob_line

ROWS_AT_ONCE = 256


def add_chunk(model, hidden: torch.Tensor, first_row: int, start: int, length: int, state: RequestState) -> None:
    """Rows first_row.. of `hidden` [num_tokens, hidden_size] are the request's positions
    start..start+length: their entries, for the prompt tokens they predict, join
    `state.prompt_logprobs` (which holds one per position before `start`)."""
    entries, k = state.prompt_logprobs, state.sampling_params.prompt_logprobs
    end = min(start + length, state.num_prompt_tokens - 1)  # position p predicts token p + 1
    if end <= start:
        return
    if len(entries) != start:
        raise ValueError(f"prompt logprobs from position {start}, with {len(entries)} before it")
    targets = state.token_ids[start + 1 : end + 1]
    target_rows = torch.tensor(targets, device=hidden.device)
    for a in range(0, end - start, ROWS_AT_ONCE):
        b = min(a + ROWS_AT_ONCE, end - start)
        logprobs = model.compute_logits(hidden[first_row + a : first_row + b]).float().log_softmax(-1)
        for token_id, line in zip(targets[a:b], logprob_table(logprobs, target_rows[a:b], k).tolist()):
            entries.append(read_logprob_line(token_id, line, k, k))


def add_step(model, states, num_tokens, last_token, hidden, sample_rows, output, drop_requests) -> list[int]:
    """This step's prompt positions' logprobs into their requests' states; a request
    that samples now (its prompt is done) sends them. Returns the
    sampling rows less any request that failed here."""
    failed = set()
    for i, state in enumerate(states):
        if state.prompt_logprobs is None:
            continue
        n = num_tokens[state.req_id]
        try:
            add_chunk(model, hidden, int(last_token[i]) - n + 1, state.num_computed_tokens, n, state)
        except ValueError as exc:  # positions it never computed here: fail it alone
            output.request_errors[state.req_id] = f"prompt logprobs: {exc}"
            failed.add(i)
    if failed:
        drop_requests([states[i].req_id for i in failed])
        sample_rows = [i for i in sample_rows if i not in failed]
    for i in sample_rows:
        state = states[i]
        if state.prompt_logprobs is not None:
            output.prompt_logprobs[state.req_id], state.prompt_logprobs = state.prompt_logprobs, None
    return sample_rows
