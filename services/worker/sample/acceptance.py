"""A step's sampled tokens landed in their requests' states, on the host: each request's
drafts accepted up to the first the target model disagrees with (or the grammar refuses),
the token after them, and its grammar advanced over them all."""

from __future__ import annotations

from services.worker.sample.spec_decode import num_accepted


def accept(samples, states, sample_rows, first_row, drafts, valid, order, sampled, logprobs, constrained: bool,
           synthetic=None) -> None:
    """On the host now: each request's accepted drafts and the token after them, its
    grammar advanced over them (`synthetic`: drafts accepted by chance, sample/synthetic_acceptance.py)."""
    token_ids, token_logprobs = samples.to_host()
    if not (drafts or constrained):  # (valid is only filled for constrained rows)
        for i, first in zip(sample_rows, first_row):  # one token a request, nothing to check
            token_id = token_ids[first]
            states[i].token_ids.append(token_id)
            sampled[i] = [token_id]
            if token_logprobs[first] is not None:
                logprobs[i] = [token_logprobs[first]]
        return
    for i, first in zip(sample_rows, first_row):
        state, d = states[i], drafts.get(order[i], [])
        if synthetic is not None and d and state.matcher is None:
            accepted = synthetic.num_accepted(len(d))
            out = [*d[:accepted], token_ids[first + accepted]]
        else:
            accepted = num_accepted(d[:valid.get(first, len(d))], token_ids[first:first + len(d)])
            out = token_ids[first:first + accepted + 1]
        if state.matcher is not None:
            for token_id in out:
                if state.matcher.is_terminated():
                    break
                state.matcher.accept_token(token_id)
        state.token_ids.extend(out)
        state.num_computed_tokens -= len(d) - accepted  # rejected drafts' K/V is stale
        sampled[i] = out
        logprobs[i] = [lp for lp in token_logprobs[first:first + accepted + 1] if lp is not None]
