"""Batched sampling: one pass over the logits of every request that samples this step.

Greedy rows take the argmax; random rows draw one uniform number each and take the token
where it falls in the filtered distribution (inverse CDF, random_draws.py). A seeded
request's number is u(seed, output position), so it gets the same tokens whatever else
shares the batch, after preemption and migration, and on CPU and GPU alike; an unseeded
row gets a fresh seed from torch's global generator each step. Everything is tensor ops
on the logits' device, each for all the rows that need it (penalties, bias and min_tokens
included), and the host gets sampled ids and logprobs in one copy: one sync a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.worker.sample.bad_words import apply_bad_words, has_bad_words
from services.worker.host_values import from_list, put_scalar, to_device
from services.worker.sample.penalties import PenaltyCounts
from services.worker.sample.random_draws import as_int64, sample_inverse_cdf, uniform
from services.worker.request_state import RequestState
from shared.messages import Logprobs

_MASK = float("-inf")


def apply_penalties(logits: torch.Tensor, states: Sequence[RequestState], counts: PenaltyCounts) -> None:
    """In place on rows [num_rows, vocab_size], one state a row: repetition over prompt +
    output (as transformers), presence and frequency over the output (as OpenAI), from the
    token counts `counts` keeps on the device (penalties.py). Batched: a few ops for
    all rows instead of several per row (each a kernel launch on a GPU); a row whose
    penalty is off gets the identity (x / 1, x - 0 * count)."""
    params = [s.sampling_params for s in states]
    device, dtype = logits.device, logits.dtype

    def per_row(values) -> torch.Tensor:
        return to_device(values, device, dtype).unsqueeze(-1)

    output_counts, seen = counts.rows(states, logits.shape[-1], device)
    if any(p.repetition_penalty != 1.0 for p in params):
        penalty = per_row([p.repetition_penalty for p in params])
        logits.copy_(torch.where(seen > 0, torch.where(logits > 0, logits / penalty, logits * penalty), logits))
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        output_counts = output_counts.to(dtype)
        logits -= per_row([p.frequency_penalty for p in params]) * output_counts
        logits -= per_row([p.presence_penalty for p in params]) * (output_counts > 0).to(dtype)


# How many of a row's most likely logits a CPU sorts to find its top-p threshold (see
# filter_logits): the nucleus of a trained model's row at a usual temperature is almost
# always among them (SmolLM2 at temperature 1.0 and top-p 0.95: median 39 tokens).
TOP_P_CANDIDATES = 1024


def filter_logits(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    top_k: torch.Tensor | None,  # [num_rows] int, 0 = off
    top_p: torch.Tensor | None,  # [num_rows] float, 1 = off
    min_p: torch.Tensor | None,  # [num_rows] float, 0 = off
    num_candidates: int = TOP_P_CANDIDATES,
) -> torch.Tensor:
    """The logits with each row's tokens below its threshold masked, one threshold a row
    (a logit): top-k keeps the tokens at least as likely as the k-th most likely; top-p
    then keeps the nucleus of what top-k left, the most likely tokens, each while the
    tokens more likely than it weigh less than p; min-p keeps the tokens at least min_p
    times as likely as the most likely (its logit less log(1 / min_p)), whatever the
    other two left. A token tied with the last one kept is kept too (HF's and vLLM's
    samplers keep whichever of two tied tokens their sort put first).

    Only a row's most likely logits set its thresholds. A CPU sorts those alone: torch's
    sort of a row of 49,152 float32 took 2.5 ms on this machine, more than a batch-1
    decode step of SmolLM2, numpy's 0.13 ms, and numpy's partition then sort of the top
    1024 0.05 ms; a row whose top `num_candidates` weigh less than top-p is sorted whole
    after all. A GPU sorts every row whole: cheap there, and which rows to do again would
    have to be read from the device."""
    vocab_size = logits.shape[-1]
    if top_k is None and top_p is None:  # min-p alone: the largest logit is all it reads
        values = logits.amax(-1, keepdim=True)
    elif logits.is_cuda:
        values = largest_first(logits, vocab_size)
    else:  # (on the host: reading the values costs nothing)
        largest_k = int(top_k.masked_fill(top_k >= vocab_size, 0).max()) if top_k is not None else 0
        values = largest_first(logits, min(vocab_size, max(largest_k, num_candidates if top_p is not None else 1)))
    threshold, short = _thresholds(logits, values, top_k, top_p, min_p)
    if short is not None and bool(short.any()):
        rows = short.nonzero().squeeze(-1)
        part = logits[rows]
        threshold[rows] = _thresholds(part, largest_first(part, vocab_size), *(
            None if t is None else t[rows] for t in (top_k, top_p, min_p)))[0]
    return logits.masked_fill(logits < threshold, _MASK)


def _thresholds(
    logits: torch.Tensor, values: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's smallest logit kept [num_rows, 1], from `values` [num_rows, num], its
    `num` largest logits in order; and the top-p rows those do not decide (their mass is
    under p), or None when `values` are whole rows."""
    vocab_size, num = logits.shape[-1], values.shape[-1]
    threshold = torch.full_like(values[:, :1], _MASK)
    if top_k is not None:
        on = ((top_k > 0) & (top_k < vocab_size)).unsqueeze(-1)
        k = torch.where(top_k > 0, top_k, 1).clamp(max=num)  # (a row with top-k on has k <= num)
        threshold = torch.where(on, values.gather(-1, (k - 1).unsqueeze(-1)), threshold)
    short = None
    if top_p is not None:
        # What top-k left, as probabilities over the whole row, most likely first, and the
        # mass before each: the nucleus is the tokens whose mass before is under p (a
        # prefix: it only grows). The same numbers from a row's candidates as from all of it.
        left = logits if top_k is None else logits.masked_fill(logits < threshold, _MASK)
        probs = (values - left.logsumexp(-1, keepdim=True)).exp()
        if top_k is not None:
            probs = probs.masked_fill(values < threshold, 0.0)
        cumulative = probs.cumsum(-1)
        before = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))
        p = top_p.unsqueeze(-1)
        size = torch.searchsorted(before, p)  # [num_rows, 1], >= 1 (nothing is before the first)
        threshold = torch.where(p < 1, torch.maximum(threshold, values.gather(-1, size - 1)), threshold)
        if num < vocab_size:
            short = ((p < 1) & (cumulative[:, -1:] < p)).squeeze(-1)
    if min_p is not None:  # (log(0) is -inf: off)
        threshold = torch.maximum(threshold, values[:, :1] + min_p.log().unsqueeze(-1))
    return threshold, short


def largest_first(logits: torch.Tensor, num: int) -> torch.Tensor:
    """[num_rows, num]: each row's `num` largest logits, largest first. On a CPU through
    numpy (x86-simd-sort; a partition first when num is less than the row)."""
    if logits.device.type != "cpu":
        return logits.sort(dim=-1, descending=True).values[:, :num]
    negated = -logits.float().numpy()  # (ascending of the negated: no reversed copy)
    if num < negated.shape[-1]:
        negated = np.partition(negated, num - 1, axis=-1)[:, :num]
    return torch.from_numpy(np.sort(negated, axis=-1)).neg_()


def logprob_table(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, 2 + 2k] float64 from logprobs [rows, vocab] and the chosen ids [rows]: each
    row's chosen logprob, its rank, then the top k ids and their logprobs. float64 holds
    ids, ranks and float32 logprobs exactly, so what the host needs is one copy."""
    chosen_lp = logprobs.gather(-1, chosen.unsqueeze(-1))  # [rows, 1]
    ranks = (logprobs > chosen_lp).sum(-1, keepdim=True) + 1
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([t.to(torch.float64) for t in (chosen_lp, ranks, top_ids, top_lp)], dim=-1)


def read_logprob_line(chosen_id: int, line: list[float], width_k: int, k: int) -> Logprobs:
    """One row of `logprob_table(…, width_k)`, on the host, as the k the request asked for."""
    return Logprobs(token_ids=[chosen_id] + [int(t) for t in line[2 : 2 + k]],
                    logprobs=[line[0]] + line[2 + width_k : 2 + width_k + k], sampled_rank=int(line[1]))


class Samples:
    """One step's sampled ids and the logprobs asked for, still on the logits' device.
    `ids` is what a next step's inputs read before the host knows them; `to_host` is the
    step's one copy back (started early with `start_copy`, so it can wait behind the next
    step's work on a GPU)."""

    def __init__(self, ids: torch.Tensor, flat: torch.Tensor, params, rows: list[int], max_k: int) -> None:
        self.ids, self._flat, self._params, self._rows, self._max_k = ids, flat, params, rows, max_k
        self._event = None

    @property
    def has_logprobs(self) -> bool:
        """Whether any row asked for logprobs (`to_host` gives None for every row otherwise)."""
        return bool(self._rows)

    def start_copy(self) -> None:
        if self._flat.is_cuda:
            host = torch.empty(self._flat.shape, dtype=self._flat.dtype, pin_memory=True)
            self._flat = host.copy_(self._flat, non_blocking=True)  # returns at once; the event says when
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        """Until the copy started by `start_copy` has landed (nothing to wait for otherwise)."""
        if self._event is not None:
            self._event.synchronize()

    def to_host(self) -> tuple[list[int], list[Logprobs | None]]:
        self.wait()
        flat, params, num = self._flat.tolist(), self._params, len(self._params)
        result: list[Logprobs | None] = [None] * num
        if not self._rows:
            return flat, result
        sampled_ids = [int(t) for t in flat[:num]]
        width, max_k = 2 + 2 * self._max_k, self._max_k
        for j, i in enumerate(self._rows):
            line = flat[num + j * width : num + (j + 1) * width]
            result[i] = read_logprob_line(sampled_ids[i], line, max_k, params[i].logprobs)
        return sampled_ids, result


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.penalty_counts = PenaltyCounts()  # penalized requests' token counts, kept between steps
        # vLLM's engine seed: the fresh seeds of unseeded requests' draws come from it, so a
        # run (the same requests, in the same steps) samples the same tokens again; None:
        # from torch's global generator.
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size] float32
        states: Sequence[RequestState],  # one per row
    ) -> tuple[list[int], list[Logprobs | None]]:
        return self.sample(logits, states).to_host()

    def argmax(self, logits: torch.Tensor) -> Samples:
        """`sample` for rows that are all `argmax_only` (RequestState): nothing to process,
        no logprobs to read, nothing per row on the host."""
        sampled = logits.argmax(-1)
        return Samples(sampled, sampled, (None,) * len(sampled), [], 0)  # (no row's params read: none has logprobs)

    def sample(self, logits: torch.Tensor, states: Sequence[RequestState]) -> Samples:
        raw = logits
        params = [s.sampling_params for s in states]
        logits = self._process(logits, states)
        greedy = [p.greedy for p in params]
        if all(greedy):
            sampled = logits.argmax(-1)
        else:
            sampled = self._sample_random(logits, states, greedy)
        return self._samples(raw, sampled, params)

    def draft_ids(self, logits: torch.Tensor, positions: Sequence) -> torch.Tensor:
        """A model drafter's drafts at `positions` (draft_position.DraftPosition: a request and
        the drafts before): the argmax, but for a seeded request at temperature > 0 a draw
        from the drafter's distribution processed as the target's will be, with the very
        draw u(seed, position) the target's sampler takes there. Where the drafter's
        distribution is the target's, the target samples the draft itself; where it is
        near, mostly (coupled draws). It cannot change a token: each draft is verified."""
        best = logits.argmax(-1)
        coupled = [i for i, p in enumerate(positions) if not p.sampling_params.greedy
                   and p.sampling_params.seed is not None]
        if coupled:
            index = to_device(coupled, logits.device)
            rows = [positions[i] for i in coupled]
            best[index] = self._sample_random(self._process(logits[index], rows), rows, [False] * len(rows))
        return best

    def _process(self, logits: torch.Tensor, states: Sequence[RequestState]) -> torch.Tensor:
        """Penalties, logit bias, min_tokens, allowed_token_ids and bad words, which change
        the distribution greedy picks from too: each for all the rows that ask for it at
        once, in that order."""
        penalized = [i for i, s in enumerate(states) if s.sampling_params.needs_penalties]
        bias_rows, bias_ids, bias_values, ban_rows, ban_ids = [], [], [], [], []
        allow_rows, allow_ids = [], []
        for i, state in enumerate(states):
            params = state.sampling_params
            if params.allowed_token_ids is not None:
                allow_rows += [i] * len(params.allowed_token_ids)
                allow_ids += params.allowed_token_ids
            if params.logit_bias:
                bias_rows += [i] * len(params.logit_bias)
                bias_ids += params.logit_bias.keys()
                bias_values += params.logit_bias.values()
            if state.num_output_tokens < params.min_tokens:
                banned = list(params.stop_token_ids)
                if state.eos_token_id is not None and not params.ignore_eos:
                    banned.append(state.eos_token_id)
                # A stop id past the vocabulary can never be sampled: nothing to ban.
                banned = [t for t in banned if t < logits.shape[-1]]
                ban_rows += [i] * len(banned)
                ban_ids += banned
        bad_words = any(has_bad_words(s) for s in states)
        if not (penalized or bias_rows or ban_rows or allow_rows or bad_words):
            return logits
        logits = logits.clone()
        device = logits.device
        if len(penalized) == len(states):
            apply_penalties(logits, states, self.penalty_counts)
        elif penalized:
            index = to_device(penalized, device)
            rows = logits[index]
            apply_penalties(rows, [states[i] for i in penalized], self.penalty_counts)
            logits.index_copy_(0, index, rows)
        if bias_rows:
            logits.index_put_((to_device(bias_rows, device), to_device(bias_ids, device)),
                              to_device(bias_values, device, logits.dtype), accumulate=True)
        if ban_rows:
            put_scalar(logits, (to_device(ban_rows, device), to_device(ban_ids, device)), _MASK)
        if allow_rows:  # those rows' other ids masked (the rows known here: no sync)
            keep = torch.ones_like(logits, dtype=torch.bool)
            put_scalar(keep, (to_device(sorted(set(allow_rows)), device),), False)
            put_scalar(keep, (to_device(allow_rows, device), to_device(allow_ids, device)), True)
            logits.masked_fill_(~keep, _MASK)
        if bad_words:
            apply_bad_words(logits, states)
        return logits

    def _sample_random(
        self, logits: torch.Tensor, states: Sequence[RequestState], greedy: list[bool]
    ) -> torch.Tensor:
        params = [s.sampling_params for s in states]
        device = logits.device
        temperature = to_device([1.0 if g else p.temperature for g, p in zip(greedy, params)], device, torch.float32)
        scaled = logits / temperature.unsqueeze(-1)
        top_k = to_device([p.top_k for p in params], device) if any(p.top_k > 0 for p in params) else None
        top_p = (to_device([p.top_p for p in params], device, torch.float32)
                 if any(p.top_p < 1 for p in params) else None)
        min_p = (to_device([p.min_p for p in params], device, torch.float32)
                 if any(p.min_p > 0 for p in params) else None)
        if top_k is not None or top_p is not None or min_p is not None:
            scaled = filter_logits(scaled, top_k, top_p, min_p)
        probs = scaled.softmax(-1)
        # The draws' hash on the logits' device: on the host it was ~0.3 ms a step of 128
        # rows, a few tiny kernels on a GPU (the same bits: integer ops).
        seeds, positions = draw_keys(states, self.generator)
        random_ids = sample_inverse_cdf(probs, uniform(to_device(seeds, device), to_device(positions, device)))
        if not any(greedy):
            return random_ids
        return torch.where(to_device(greedy, device), logits.argmax(-1), random_ids)

    def _samples(self, raw: torch.Tensor, sampled: torch.Tensor, params) -> Samples:
        """For the rows that ask, logprobs of the model's own distribution (before
        penalties and temperature): the chosen token's, its rank and the top k, packed
        after the sampled ids so that everything the host needs is one copy (one sync),
        not a few per row."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return Samples(sampled, sampled, params, rows, 0)
        index = to_device(rows, raw.device)
        max_k = max(params[i].logprobs for i in rows)
        table = logprob_table(raw[index].log_softmax(-1), sampled[index], max_k)
        return Samples(sampled, torch.cat([sampled.to(torch.float64), table.flatten()]), params, rows, max_k)


def draw_keys(states: Sequence[RequestState],
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(seeds, positions) of each row's draw, int64 on the host: a seeded request's own
    seed at its output position, a fresh seed from `generator` (None: the global one)
    otherwise."""
    seeded = [s.sampling_params.seed is not None for s in states]
    fresh = None
    if not all(seeded):
        fresh = torch.randint(-(1 << 63), (1 << 63) - 1, (len(states),), dtype=torch.int64, generator=generator)
        if not any(seeded):  # (most steps: no row has a seed, no row a position)
            return fresh, torch.zeros(len(states), dtype=torch.int64)
    seeds = from_list([as_int64(s.sampling_params.seed) if k else 0 for s, k in zip(states, seeded)], torch.int64)
    positions = from_list([s.num_output_tokens if k else 0 for s, k in zip(states, seeded)], torch.int64)
    if fresh is not None:
        seeds = torch.where(from_list(seeded, torch.bool), seeds, fresh)
    return seeds, positions
