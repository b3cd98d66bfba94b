"""Batched sampling: one pass over the logits of every request that samples this step.

Greedy rows take the argmax; random rows draw one uniform number each and take the token
where it falls in the filtered distribution (inverse CDF, random_draws.py). A seeded
request's number is u(seed, output position), so it gets the same tokens whatever else
shares the batch, after preemption and migration, and on CPU and GPU alike; an unseeded
row gets a fresh seed from torch's global generator each step. Everything is tensor ops
on the logits' device: the caller's `.tolist()` of the sampled ids is the one sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.random_draws import as_int64, sample_inverse_cdf, uniform
from services.worker.request_state import RequestState
from shared.messages import Logprobs

_MASK = float("-inf")


def apply_penalties(logits: torch.Tensor, state: RequestState) -> None:
    """In place on one row [vocab_size]: repetition over prompt + output (as transformers),
    presence and frequency over the output (as OpenAI)."""
    params = state.sampling_params
    vocab_size = logits.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(state.token_ids)), dtype=torch.long, device=logits.device)
        seen = seen[seen < vocab_size]
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if params.presence_penalty or params.frequency_penalty:
        output = torch.tensor(state.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(output, minlength=vocab_size)[:vocab_size].to(logits.dtype)
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)


def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    top_k: torch.Tensor | None,  # [num_rows] int, 0 = off
    top_p: torch.Tensor | None,  # [num_rows] float, 1 = off
) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)
        kth = sorted_logits.gather(-1, (vocab_size - k).unsqueeze(-1))  # [num_rows, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _MASK)
    if top_p is not None:
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= (1 - top_p).unsqueeze(-1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, _MASK)
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(-1)
    threshold = min_p.unsqueeze(-1) * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _MASK)


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size] float32
        states: Sequence[RequestState],  # one per row
    ) -> tuple[list[int], list[Logprobs | None]]:
        raw = logits
        params = [s.sampling_params for s in states]
        logits = self._process(logits, states)

        greedy = [p.greedy for p in params]
        if all(greedy):
            sampled = logits.argmax(-1)
        else:
            sampled = self._sample_random(logits, states, greedy)
        sampled_ids = sampled.tolist()
        return sampled_ids, self._logprobs(raw, sampled, params)

    def _process(self, logits: torch.Tensor, states: Sequence[RequestState]) -> torch.Tensor:
        """Penalties, logit bias and min_tokens, which change the distribution greedy picks
        from too."""
        copied = False
        for i, state in enumerate(states):
            params = state.sampling_params
            banned = []
            if state.num_output_tokens < params.min_tokens:
                banned = list(params.stop_token_ids)
                if state.eos_token_id is not None and not params.ignore_eos:
                    banned.append(state.eos_token_id)
                # A stop id past the vocabulary can never be sampled: nothing to ban.
                banned = [t for t in banned if t < logits.shape[-1]]
            if not (banned or params.needs_penalties or params.logit_bias):
                continue
            if not copied:
                logits, copied = logits.clone(), True
            if params.needs_penalties:
                apply_penalties(logits[i], state)
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
                bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
                logits[i].index_add_(0, ids, bias)
            if banned:
                logits[i, banned] = _MASK
        return logits

    def _sample_random(
        self, logits: torch.Tensor, states: Sequence[RequestState], greedy: list[bool]
    ) -> torch.Tensor:
        params = [s.sampling_params for s in states]
        device = logits.device
        temperature = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], device=device)
        scaled = logits / temperature.unsqueeze(-1)
        if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
            top_k = (
                torch.tensor([p.top_k for p in params], device=device) if any(p.top_k for p in params) else None
            )
            top_p = (
                torch.tensor([p.top_p for p in params], device=device)
                if any(p.top_p < 1 for p in params) else None
            )
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        if any(p.min_p > 0 for p in params):
            scaled = apply_min_p(scaled, torch.tensor([p.min_p for p in params], device=device))
        probs = scaled.softmax(-1)
        random_ids = sample_inverse_cdf(probs, uniform(*draw_keys(states)).to(device))
        return torch.where(torch.tensor(greedy, device=device), logits.argmax(-1), random_ids)

    def _logprobs(self, raw: torch.Tensor, sampled: torch.Tensor, params) -> list[Logprobs | None]:
        """Logprobs of the model's own distribution (before penalties and temperature)."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[Logprobs | None] = [None] * len(params)
        if not rows:
            return result
        index = torch.tensor(rows, device=raw.device)
        logprobs = raw[index].log_softmax(-1)  # [num_rows_with_logprobs, vocab_size]
        chosen = sampled[index]
        chosen_lp = logprobs.gather(-1, chosen.unsqueeze(-1))  # [n, 1]
        ranks = (logprobs > chosen_lp).sum(-1) + 1
        max_k = max(params[i].logprobs for i in rows)
        top_lp, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (None, None)
        for j, i in enumerate(rows):
            k = params[i].logprobs
            ids = [int(chosen[j])] + (top_ids[j, :k].tolist() if k else [])
            lps = [float(chosen_lp[j, 0])] + (top_lp[j, :k].tolist() if k else [])
            result[i] = Logprobs(token_ids=ids, logprobs=lps, sampled_rank=int(ranks[j]))
        return result


def draw_keys(states: Sequence[RequestState]) -> tuple[torch.Tensor, torch.Tensor]:
    """(seeds, positions) of each row's draw, int64 on the host: a seeded request's own
    seed at its output position, a fresh seed from the global generator otherwise."""
    seeded = [s.sampling_params.seed is not None for s in states]
    seeds = torch.tensor([as_int64(s.sampling_params.seed) if k else 0 for s, k in zip(states, seeded)],
                         dtype=torch.int64)
    positions = torch.tensor([s.num_output_tokens if k else 0 for s, k in zip(states, seeded)], dtype=torch.int64)
    if not all(seeded):
        fresh = torch.randint(-(1 << 63), (1 << 63) - 1, (len(states),), dtype=torch.int64)
        seeds = torch.where(torch.tensor(seeded), seeds, fresh)
    return seeds, positions
