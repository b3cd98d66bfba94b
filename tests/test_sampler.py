"""The sampler on hand-made logits and RequestStates; SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.sample.random_draws import as_int64, sample_inverse_cdf, uniform

from services.worker.request_state import RequestState
from services.worker.sample.penalties import PenaltyCounts
from services.worker.sample.sampler import Sampler, apply_penalties, filter_logits, largest_first
from shared.messages import Logprobs
from shared.sampling_params import SamplingParams

EOS = 0


def state(
    prompt=(1, 2, 3),
    output=(),
    eos: int | None = EOS,
    req_id: str = "r",
    **params,
) -> RequestState:
    return RequestState(
        req_id=req_id,
        token_ids=list(prompt) + list(output),
        num_prompt_tokens=len(prompt),
        sampling_params=SamplingParams(**params),
        eos_token_id=eos,
        block_row=0,
        num_computed_tokens=len(prompt) + len(output),
    )


def logits_of(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32).repeat(rows, 1)


@pytest.fixture(autouse=True)
def _fixed_global_rng():
    """Unseeded rows draw from torch's global generator: fix it so every run is the same."""
    torch.manual_seed(1234)


def sample(logits: torch.Tensor, states) -> list[int]:
    return Sampler()(logits, states)[0]


# ---- greedy -------------------------------------------------------------------------------


def test_greedy_picks_the_argmax_of_every_row():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0], [-3.0, -2.0, -1.0, -1.5]])
    states = [state(temperature=0.0, req_id=str(i)) for i in range(3)]
    assert sample(logits, states) == [1, 0, 2]


def test_a_temperature_below_the_greedy_epsilon_is_greedy():
    logits = logits_of([0.3, 0.2, 0.5], rows=50)
    assert sample(logits, [state(temperature=1e-6) for _ in range(50)]) == [2] * 50


def test_greedy_rows_stay_greedy_beside_random_rows():
    logits = logits_of([0.1, 0.6, 0.3], rows=40)
    states = [state(temperature=0.0 if i % 2 else 1.0, req_id=str(i)) for i in range(40)]
    sampled = sample(logits, states)
    assert sampled[1::2] == [1] * 20
    assert set(sampled[0::2]) > {1}  # the random rows do sample


def test_the_input_logits_are_not_modified():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    before = logits.clone()
    st = state(prompt=[3], output=[3, 2], repetition_penalty=2.0, presence_penalty=1.0,
               min_tokens=5, stop_token_ids=[1], temperature=0.7)
    Sampler()(logits, [st])
    assert torch.equal(logits, before)


# ---- random sampling and seeds ------------------------------------------------------------


def test_random_sampling_follows_the_distribution():
    sampled = sample(logits_of([0.75, 0.25], rows=4000), [state(eos=None) for _ in range(4000)])
    share = sampled.count(0) / 4000
    assert abs(share - 0.75) < 0.03


def test_temperature_flattens_the_distribution():
    rows = 4000
    hot = sample(logits_of([0.9, 0.1], rows), [state(eos=None, temperature=100.0)] * rows)
    assert abs(hot.count(0) / rows - 0.5) < 0.05  # 0.9 : 0.1 at T=100 is about 0.51
    cold = sample(logits_of([0.6, 0.4], rows), [state(eos=None, temperature=0.05)] * rows)
    assert cold.count(0) / rows > 0.99  # (0.6/0.4)**20 : 1


def _noisy_logits(seed: int, rows: int, vocab: int = 64) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_a_seeded_request_samples_the_same_token_alone_or_in_a_batch():
    row = _noisy_logits(0, 1)
    others = _noisy_logits(1, 4)
    for seed in range(100):
        seeded = state(seed=seed, eos=None, req_id="seeded")
        alone = sample(row, [seeded])[0]
        batch = torch.cat([others[:2], row, others[2:]])
        neighbours = [
            state(eos=None, req_id="x"),  # unseeded random
            state(eos=None, seed=seed + 1, req_id="y"),  # another seed
            state(eos=None, top_k=3, top_p=0.5, min_p=0.1, req_id="z"),  # other filters
            state(eos=None, temperature=0.0, req_id="g"),  # greedy
        ]
        in_batch = sample(batch, neighbours[:2] + [seeded] + neighbours[2:])[2]
        assert in_batch == alone, f"seed {seed}"


def test_a_seeded_request_repeats_its_token_for_the_same_step():
    row = _noisy_logits(2, 1)
    st = state(seed=7, eos=None, output=[5, 6])
    assert len({sample(row, [st])[0] for _ in range(10)}) == 1


def test_different_seeds_sample_different_tokens_somewhere():
    row = _noisy_logits(3, 1)
    tokens = {sample(row, [state(seed=seed, eos=None)])[0] for seed in range(50)}
    assert len(tokens) > 5


def test_a_seeded_request_draws_new_noise_at_each_output_position():
    row = _noisy_logits(4, 1)
    tokens = {sample(row, [state(seed=11, eos=None, output=[9] * n)])[0] for n in range(30)}
    assert len(tokens) > 5


# ---- the random-number contract (random_draws.py) ---------------------------------------


def _reference_uniform(seed: int, position: int) -> float:
    """The contract written again with Python integers: what every device must compute."""
    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    seed &= (1 << 64) - 1
    h = mix((seed & 0xFFFFFFFF) ^ 0x9E3779B9)
    h = mix(h ^ (seed >> 32))
    h = mix(h ^ (position & 0xFFFFFFFF))
    a = mix(h ^ (position >> 32))
    b = mix(a ^ 0x85EBCA6B)
    return ((a >> 5) * (1 << 26) + (b >> 6)) / (1 << 53)


@given(st.lists(st.tuples(st.integers(-(1 << 63), (1 << 64) - 1), st.integers(0, (1 << 40))), min_size=1, max_size=20))
def test_the_draws_are_the_contracts_for_any_seed_and_position(keys):
    seeds = torch.tensor([as_int64(seed) for seed, _ in keys], dtype=torch.int64)
    positions = torch.tensor([pos for _, pos in keys], dtype=torch.int64)
    assert uniform(seeds, positions).tolist() == [_reference_uniform(seed, pos) for seed, pos in keys]


@settings(max_examples=25, deadline=None)  # (Triton's interpreter: slow to start each call)
@given(st.lists(st.tuples(st.integers(-(1 << 63), (1 << 64) - 1), st.integers(0, (1 << 40))), min_size=1, max_size=300))
def test_the_gpus_draws_kernel_is_the_contract_too(keys):
    """kernels/random_draws.py, what a GPU runs (here under the interpreter)."""
    from kernels.random_draws import uniform as uniform_kernel

    seeds = torch.tensor([as_int64(seed) for seed, _ in keys], dtype=torch.int64)
    positions = torch.tensor([pos for _, pos in keys], dtype=torch.int64)
    assert uniform_kernel(seeds, positions).tolist() == [_reference_uniform(seed, pos) for seed, pos in keys]


def test_the_draws_are_uniform_and_independent_across_positions():
    from scipy.stats import chisquare

    positions = torch.arange(20000, dtype=torch.int64)
    for seed in (0, 1, -1, 12345678901234):
        u = uniform(torch.full_like(positions, seed), positions)
        assert 0 <= float(u.min()) and float(u.max()) < 1
        assert chisquare(torch.histc(u.float(), bins=20, min=0, max=1).tolist()).pvalue > 1e-4
        # consecutive positions are not correlated: pairs fall evenly in a 5 x 5 grid
        cells = (u[:-1] * 5).long() * 5 + (u[1:] * 5).long()
        assert chisquare(torch.bincount(cells, minlength=25).tolist()).pvalue > 1e-4


def test_inverse_cdf_sampling_follows_the_distribution_and_never_picks_a_zero():
    from scipy.stats import chisquare

    probs = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0])
    n = 30000
    u = uniform(torch.full((n,), 99, dtype=torch.int64), torch.arange(n))
    picked = sample_inverse_cdf(probs.repeat(n, 1), u)
    counts = torch.bincount(picked, minlength=6)
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0]
    assert chisquare(counts[[1, 3, 4]].tolist(), [0.1 * n, 0.6 * n, 0.3 * n]).pvalue > 1e-4
    # the extremes of u land on the first and last tokens with probability
    assert sample_inverse_cdf(probs[None], torch.tensor([0.0])).item() == 1
    assert sample_inverse_cdf(probs[None], torch.tensor([1 - 2**-53])).item() == 4


def test_a_seeded_row_takes_the_token_its_draw_names():
    logits = _noisy_logits(8, 1)
    for seed, output in [(3, 0), (3, 5), (-7, 2), (1 << 70, 1)]:
        st_ = state(seed=seed, eos=None, output=[1] * output, temperature=0.8)
        u = torch.tensor([_reference_uniform(seed, output)], dtype=torch.float64)
        expected = sample_inverse_cdf((logits / 0.8).softmax(-1), u).item()
        assert sample(logits, [st_]) == [expected]


def test_sampled_frequencies_match_temperature_and_top_k_chi_square():
    from scipy.stats import chisquare

    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, -2.0]])
    rows = 20000
    sampled = sample(logits.repeat(rows, 1), [state(eos=None, temperature=0.7, top_k=4)] * rows)
    expected = (logits[0, :4].double() / 0.7).softmax(-1) * rows
    counts = torch.bincount(torch.tensor(sampled), minlength=6)
    assert counts[4:].tolist() == [0, 0]
    assert chisquare(counts[:4].tolist(), expected.tolist()).pvalue > 1e-4


# ---- top-k, top-p, min-p ------------------------------------------------------------------


def test_top_k_only_ever_picks_among_the_k_largest_logits():
    row = _noisy_logits(5, 1, vocab=50)
    top5 = set(row[0].topk(5).indices.tolist())
    rows = 200
    sampled = sample(row.repeat(rows, 1), [state(eos=None, top_k=5, temperature=3.0)] * rows)
    assert set(sampled) <= top5
    assert len(set(sampled)) >= 3  # it does sample, not just take the argmax


def test_top_k_applies_per_row():
    row = _noisy_logits(6, 1, vocab=50)
    top2 = set(row[0].topk(2).indices.tolist())
    rows = 200
    states = [state(eos=None, top_k=2 if i % 2 else 0, temperature=5.0) for i in range(rows)]
    sampled = sample(row.repeat(rows, 1), states)
    assert set(sampled[1::2]) <= top2
    assert len(set(sampled[0::2]) - top2) > 5  # rows without top-k range over the vocabulary


def test_top_p_only_picks_from_the_nucleus():
    probs = [0.05, 0.3, 0.1, 0.5, 0.05]
    rows = 200
    # The smallest set reaching 0.75 is {3 (0.5), 1 (0.3)}.
    sampled = sample(logits_of(probs, rows), [state(eos=None, top_p=0.75)] * rows)
    assert set(sampled) == {1, 3}
    # 0.85 needs token 2 (0.1) too.
    sampled = sample(logits_of(probs, rows), [state(eos=None, top_p=0.85)] * rows)
    assert set(sampled) == {1, 2, 3}


def test_a_tiny_top_p_keeps_the_most_likely_token():
    rows = 100
    sampled = sample(logits_of([0.2, 0.3, 0.5], rows), [state(eos=None, top_p=0.01)] * rows)
    assert sampled == [2] * rows


def _sorted_top_k_top_p(logits, top_k, top_p):
    """What HF's and vLLM's samplers do, and this one did: sort each row, top-k by the k-th
    value, top-p by the cumulative probability in ascending order (the reference)."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    kth = sorted_logits.gather(-1, (vocab - k).unsqueeze(-1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum <= (1 - top_p).unsqueeze(-1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits), cum


_FILTER_ROWS = st.lists(st.tuples(st.integers(0, 2**31), st.sampled_from([0, 1, 2, 5, 40, 300, 5000]),
                                  st.sampled_from([1.0, 0.999, 0.95, 0.9, 0.5, 0.1, 1e-4]),
                                  st.sampled_from([0.3, 1.0, 3.0, 30.0])), min_size=1, max_size=6)


def _filter_inputs(rows, vocab=2000):
    """Rows of logits of different spreads (30: a peaked row, 0.3: a flat one), bf16's
    values as a model gives them, with each row's top-k and top-p."""
    logits = torch.stack([(torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * spread)
                          .bfloat16().float() for seed, _, _, spread in rows])
    return logits, torch.tensor([k for _, k, _, _ in rows]), torch.tensor([p for _, _, p, _ in rows])


@given(st.lists(st.lists(st.sampled_from([float("-inf"), -1.5, 0.0, 0.25, 2.0, 1e30, -3e-8]), min_size=1, max_size=9),
                min_size=1, max_size=4).filter(lambda rows: len({len(r) for r in rows}) == 1))
def test_a_cpu_sorts_logits_as_torch_does(rows):
    logits = torch.tensor(rows)
    expected = logits.sort(dim=-1, descending=True).values
    for num in range(1, logits.shape[-1] + 1):  # (a partition first, but for the whole row)
        assert torch.equal(largest_first(logits, num), expected[:, :num])


_MIN_P = st.sampled_from([0.0, 0.01, 0.05, 0.3])


@settings(max_examples=60, deadline=None)
@given(_FILTER_ROWS, st.lists(_MIN_P, min_size=6, max_size=6), st.sampled_from([1, 4, 64, 1024]))
def test_filters_from_a_rows_candidates_equal_filters_from_the_whole_row(rows, min_ps, num_candidates):
    """A CPU sorts only each row's most likely logits, and the rows whose candidates weigh
    less than top-p whole: every row comes out as if each had been sorted whole."""
    logits, top_k, top_p = _filter_inputs(rows)
    min_p = torch.tensor(min_ps[: len(rows)])
    for k, p, m in [(top_k, top_p, min_p), (top_k, None, None), (None, top_p, None), (None, None, min_p)]:
        whole = filter_logits(logits, k, p, m, num_candidates=logits.shape[-1])
        assert torch.equal(filter_logits(logits, k, p, m, num_candidates=num_candidates), whole)


@settings(max_examples=60, deadline=None)
@given(_FILTER_ROWS, _MIN_P)
def test_min_p_keeps_what_a_probability_threshold_keeps_but_at_its_rounding(rows, min_p):
    """min-p as a logit (the top one less log(1 / min_p)) keeps what vLLM's probabilities
    keep (min_p times the top one), after top-k and top-p, but where a token's
    probability is within float32 rounding of the threshold."""
    logits, top_k, top_p = _filter_inputs(rows)
    min_ps = torch.full((len(rows),), min_p)
    kept = filter_logits(logits, top_k, top_p, min_ps) > float("-inf")
    before = filter_logits(logits, top_k, top_p, None)
    probs = before.softmax(-1)
    top = probs.amax(-1, keepdim=True)
    reference = probs >= min_ps.unsqueeze(-1) * top
    near = (probs - min_ps.unsqueeze(-1) * top).abs() <= 1e-4 * top  # (a logit of 100 is 8e-6 apart from the next)
    assert torch.equal(kept | near, reference | near)


@settings(max_examples=60, deadline=None)
@given(_FILTER_ROWS)
def test_top_k_top_p_keep_what_a_sort_keeps_but_ties_at_the_boundary(rows):
    """The kept tokens are the sorting reference's, but where a token's cumulative mass is
    within float32 rounding of 1 - p (the two sum in different orders), and but that a
    token tied with the last one kept is kept too (the reference keeps whichever of the
    tied tokens its sort put first)."""
    logits, top_k, top_p = _filter_inputs(rows)
    kept = filter_logits(logits, top_k, top_p, None) > float("-inf")
    reference, cum = _sorted_top_k_top_p(logits, top_k, top_p)
    reference_kept = reference > float("-inf")
    for row in range(len(rows)):
        if not torch.equal(kept[row], reference_kept[row]):
            threshold = logits[row][kept[row]].min()
            extra = kept[row] & ~reference_kept[row]
            near = ((cum[row] - (1 - top_p[row])).abs() < 1e-5).any()
            assert near or (not (reference_kept[row] & ~kept[row]).any() and (logits[row][extra] == threshold).all())


def test_top_p_keeps_the_fewest_tokens_whose_mass_reaches_p_exactly():
    probs = [0.5, 0.25, 0.125, 0.0625, 0.0625]  # 0.5 + 0.25 is 0.75: no third token
    kept = filter_logits(logits_of(probs), None, torch.tensor([0.75]), None) > float("-inf")
    assert kept[0].tolist() == [True, True, False, False, False]


def test_a_token_tied_with_the_last_one_top_p_keeps_is_kept_too():
    logits, top_p = logits_of([0.5, 0.2, 0.2, 0.1]), torch.tensor([0.65])  # 0.65 needs one of the 0.2s
    kept = filter_logits(logits, None, top_p, None) > float("-inf")
    assert kept[0].tolist() == [True, True, True, False]
    reference_kept = _sorted_top_k_top_p(logits, torch.tensor([0]), top_p)[0] > float("-inf")
    assert reference_kept.sum() == 2  # whichever 0.2 its sort put first


def test_min_p_only_picks_tokens_above_min_p_times_the_top_probability():
    probs = [0.4, 0.05, 0.1, 0.3, 0.15]
    rows = 200
    # Threshold 0.3 * 0.4 = 0.12: tokens 0, 3 and 4 remain.
    sampled = sample(logits_of(probs, rows), [state(eos=None, min_p=0.3)] * rows)
    assert set(sampled) == {0, 3, 4}


# ---- penalties ----------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0])
    # Seen: 0 and 1 in the prompt, 4 in the output; 2, 3 and 5 are unseen.
    apply_penalties(logits.unsqueeze(0), [state(prompt=[0, 1], output=[4, 4], repetition_penalty=2.0)], PenaltyCounts())
    assert logits.tolist() == [1.0, -4.0, 1.0, -1.0, 0.25, 3.0]


def test_presence_and_frequency_penalties_apply_to_output_tokens_only():
    logits = torch.zeros(5)
    st = state(prompt=[0, 1], output=[2, 2, 3], presence_penalty=1.0, frequency_penalty=0.5)
    apply_penalties(logits.unsqueeze(0), [st], PenaltyCounts())
    # token 2: 2 * 0.5 + 1.0; token 3: 1 * 0.5 + 1.0; prompt tokens 0 and 1 untouched.
    assert logits.tolist() == [0.0, 0.0, -2.0, -1.5, 0.0]


def test_negative_presence_penalty_raises_output_tokens():
    logits = torch.zeros(3)
    apply_penalties(logits.unsqueeze(0), [state(prompt=[0], output=[1], presence_penalty=-0.5)], PenaltyCounts())
    assert logits.tolist() == [0.0, 0.5, 0.0]


def test_penalties_ignore_token_ids_outside_the_logits():
    logits = torch.zeros(3)
    st = state(prompt=[7], output=[1, 9], repetition_penalty=2.0, frequency_penalty=1.0)
    apply_penalties(logits.unsqueeze(0), [st], PenaltyCounts())
    assert logits.tolist() == [0.0, -1.0, 0.0]


def test_a_presence_penalty_flips_the_greedy_choice():
    logits = torch.tensor([[0.0, 2.0, 1.8, 0.0]])
    plain = state(output=[1], temperature=0.0, eos=None)
    assert sample(logits, [plain]) == [1]
    penalized = state(output=[1], temperature=0.0, eos=None, presence_penalty=0.5)
    assert sample(logits, [penalized]) == [2]


def test_a_frequency_penalty_grows_with_the_count():
    logits = torch.tensor([[0.0, 2.0, 1.5, 0.0]])
    once = state(output=[1], temperature=0.0, eos=None, frequency_penalty=0.4)
    assert sample(logits, [once]) == [1]  # 2.0 - 0.4 > 1.5
    twice = state(output=[1, 1], temperature=0.0, eos=None, frequency_penalty=0.4)
    assert sample(logits, [twice]) == [2]  # 2.0 - 0.8 < 1.5


def test_a_repetition_penalty_flips_the_greedy_choice_away_from_a_prompt_token():
    logits = torch.tensor([[0.0, 2.0, 1.5, 0.0]])
    assert sample(logits, [state(prompt=[1], temperature=0.0, eos=None)]) == [1]
    st = state(prompt=[1], temperature=0.0, eos=None, repetition_penalty=1.5)
    assert sample(logits, [st]) == [2]  # 2.0 / 1.5 < 1.5


# ---- min_tokens -----------------------------------------------------------------------------


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[5.0, 1.0, 4.0, 3.0]])  # EOS (0) first, stop id 2 second
    params = dict(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert sample(logits, [state(output=[], **params)]) == [3]
    assert sample(logits, [state(output=[1], **params)]) == [3]
    assert sample(logits, [state(output=[1, 1], **params)]) == [0]


def test_min_tokens_with_ignore_eos_still_bans_stop_token_ids():
    logits = torch.tensor([[4.0, 1.0, 5.0, 3.0]])
    st = state(temperature=0.0, min_tokens=1, stop_token_ids=[2], ignore_eos=True)
    assert sample(logits, [st]) == [0]


def test_min_tokens_keeps_eos_out_of_random_samples():
    rows = 200
    logits = logits_of([0.9, 0.05, 0.05], rows)
    sampled = sample(logits, [state(min_tokens=1)] * rows)
    assert EOS not in sampled
    assert set(sampled) == {1, 2}


def test_min_tokens_ignores_stop_token_ids_outside_the_vocabulary():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    st = state(temperature=0.0, min_tokens=1, stop_token_ids=[1, 1000], eos=None)
    assert sample(logits, [st]) == [2]


# ---- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_those_of_the_raw_logits_with_the_sampled_token_first():
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0, 3.0, 0.0]])
    ids, lps = Sampler()(logits, [state(temperature=0.0, logprobs=3)])
    (lp,) = lps
    assert isinstance(lp, Logprobs)
    expected = torch.log_softmax(logits[0], -1)
    assert ids == [4]
    assert lp.token_ids == [4, 4, 1, 3]
    assert lp.logprobs == pytest.approx([expected[i].item() for i in (4, 4, 1, 3)], abs=1e-6)
    assert lp.logprobs[1:] == sorted(lp.logprobs[1:], reverse=True)
    assert lp.sampled_rank == 1


def test_logprobs_ignore_penalties_and_rank_the_sampled_token_in_the_raw_distribution():
    logits = torch.tensor([[3.0, 2.0, 0.5, 1.0, -1.0]])
    # EOS (0) is banned by min_tokens, so greedy takes token 1: rank 2 of the raw logits.
    ids, (lp,) = Sampler()(logits, [state(temperature=0.0, min_tokens=1, logprobs=2)])
    expected = torch.log_softmax(logits[0], -1)
    assert ids == [1]
    assert lp.token_ids == [1, 0, 1]
    assert lp.logprobs == pytest.approx([expected[1].item(), expected[0].item(), expected[1].item()])
    assert lp.sampled_rank == 2
    # Token 3 is fourth of five when both 0 and 1 are out of the way.
    st = state(temperature=0.0, min_tokens=1, stop_token_ids=[1], logprobs=0, eos=EOS)
    logits2 = torch.tensor([[3.0, 2.0, 0.5, 0.7, -1.0]])
    ids, (lp,) = Sampler()(logits2, [st])
    assert ids == [3]
    assert lp.token_ids == [3]
    assert lp.sampled_rank == 3


def test_logprobs_are_returned_only_for_rows_that_ask():
    logits = _noisy_logits(8, 3, vocab=10)
    states = [state(temperature=0.0, req_id="a"), state(temperature=0.0, logprobs=5, req_id="b"),
              state(temperature=0.0, logprobs=0, req_id="c")]
    ids, lps = Sampler()(logits, states)
    assert lps[0] is None
    assert len(lps[1].token_ids) == 6
    assert lps[1].token_ids[0] == ids[1]
    assert lps[1].token_ids[1:] == logits[1].topk(5).indices.tolist()
    assert lps[2].token_ids == [ids[2]]
    assert lps[2].sampled_rank == 1


def test_logprobs_of_a_random_sample_match_its_rank():
    rows = 200
    logits = logits_of([0.1, 0.4, 0.2, 0.3], rows)
    ids, lps = Sampler()(logits, [state(eos=None, logprobs=1)] * rows)
    rank_of = {1: 1, 3: 2, 2: 3, 0: 4}
    for token, lp in zip(ids, lps):
        assert lp.token_ids == [token, 1]
        assert lp.sampled_rank == rank_of[token]
        assert lp.logprobs[0] == pytest.approx(math.log([0.1, 0.4, 0.2, 0.3][token]), abs=1e-5)
    assert set(ids) == {0, 1, 2, 3}


# ---- SamplingParams validation --------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=-0.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(n=0), "n"),
        (dict(logprobs=-2), "logprobs"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop=["ok", ""]), "stop"),
    ],
)
def test_invalid_sampling_params_raise_a_value_error_naming_the_parameter(kwargs, names):
    with pytest.raises(ValueError, match=rf"\b{names}\b"):
        SamplingParams(**kwargs)


def test_valid_edge_values_are_accepted():
    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=1, top_k=-1, min_p=1.0)
    assert params.greedy
    assert params.top_k == 0  # -1 means off, stored as 0
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    assert SamplingParams(stop="END").stop == ["END"]


# ---- logit_bias, end to end against transformers' sequence_bias ----------------------------


def test_logit_bias_matches_transformers_sequence_bias(tiny_llama):
    from llmbus import LLM, SamplingParams
    from tiny_models import hf_greedy

    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    free = hf_greedy(tiny_llama, prompts, 12)
    banned, boosted = free[0][0], free[1][3]
    bias = {banned: -100.0, boosted: 3.0}
    expected = hf_greedy(tiny_llama, prompts, 12, sequence_bias={(t,): b for t, b in bias.items()})
    llm = LLM(str(tiny_llama))
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=bias))
    assert [o.outputs[0].token_ids for o in got] == expected
    assert banned not in got[0].outputs[0].token_ids
    forced = llm.generate(prompts, SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True,
                                                  logit_bias={boosted: 100.0}))
    assert all(o.outputs[0].token_ids == [boosted] * 6 for o in forced)
    with pytest.raises(ValueError, match="logit_bias token id"):
        llm.generate(prompts, SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))


def test_allowed_token_ids_match_transformers_restricted_to_them(tiny_llama):
    """vLLM's allowed_token_ids against transformers' prefix_allowed_tokens_fn: greedy
    among the allowed ids, beside an unrestricted request; sampled draws stay among them."""
    from llmbus import LLM, SamplingParams
    from tiny_models import hf_greedy

    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    free = hf_greedy(tiny_llama, prompts, 10)
    allowed = sorted({*range(100, 140), free[0][1]} - {free[0][0]})  # its first greedy pick not among them
    expected = hf_greedy(tiny_llama, prompts[:1], 10, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    llm = LLM(str(tiny_llama))
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [expected[0], free[1]] and got[0] != free[0]
    sampled = llm.generate(prompts, SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True,
                                                   allowed_token_ids=[7, 9, 11]))
    assert all(set(o.outputs[0].token_ids) <= {7, 9, 11} for o in sampled)
    with pytest.raises(ValueError, match="allowed_token_ids token id"):
        llm.generate(prompts, SamplingParams(max_tokens=2, allowed_token_ids=[10**6]))
    with pytest.raises(ValueError, match="non-empty list"):
        SamplingParams(allowed_token_ids=[])


def test_repetition_penalty_matches_transformers_across_steps_beside_unpenalized_requests(tiny_llama):
    """The counts the sampler keeps between steps (penalties.py) against transformers'
    repetition_penalty over prompt and output, in a batch where only some rows are
    penalized, and again once the first requests' rows are free for new ones."""
    from llmbus import LLM, SamplingParams
    from tiny_models import hf_greedy, random_prompts

    prompts = random_prompts([3, 9, 4, 17], seed=3)
    penalized = hf_greedy(tiny_llama, prompts, 24, repetition_penalty=1.8)
    plain = hf_greedy(tiny_llama, prompts, 24)
    assert penalized != plain  # the penalty changes what greedy picks here
    llm = LLM(str(tiny_llama))
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8 if i % 2 else 1.0)
              for i in range(len(prompts))]
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == [penalized[i] if i % 2 else plain[i] for i in range(len(prompts))]


# ---- the batched logits processing against a row-by-row reference -------------------------


def reference_process(logits: torch.Tensor, states) -> torch.Tensor:
    """Penalties, bias and min_tokens one row at a time, as the sampler did before it
    batched them: the batched ops must give these bits."""
    logits = logits.clone()
    vocab_size = logits.shape[-1]
    for row, st in zip(logits, states):
        p = st.sampling_params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(st.token_ids)), dtype=torch.long)
            seen = seen[seen < vocab_size]
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            counts = torch.bincount(torch.tensor(st.output_token_ids, dtype=torch.long),
                                    minlength=vocab_size)[:vocab_size].to(logits.dtype)
            row -= p.frequency_penalty * counts
            row -= p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.logit_bias:
            row.index_add_(0, torch.tensor(list(p.logit_bias)), torch.tensor(list(p.logit_bias.values())))
        if st.num_output_tokens < p.min_tokens:
            banned = [t for t in [*p.stop_token_ids, st.eos_token_id] if t is not None and t < vocab_size]
            row[banned] = float("-inf")
    return logits


VOCAB = 24
row_states = st.builds(
    lambda prompt, output, rep, freq, pres, bias, min_tokens, stops: state(
        prompt=prompt, output=output, eos=3, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
        logit_bias=bias, min_tokens=min_tokens, stop_token_ids=stops),
    st.lists(st.integers(0, VOCAB + 4), min_size=1, max_size=12),  # ids past the logits too
    st.lists(st.integers(0, VOCAB - 1), max_size=12),
    st.sampled_from([1.0, 1.0, 0.5, 1.3, 2.0]),
    st.sampled_from([0.0, 0.0, 0.7, -0.4, 2.0]),
    st.sampled_from([0.0, 0.0, 1.0, -1.5]),
    st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100, width=32), max_size=4),
    st.integers(0, 6),
    st.lists(st.integers(0, VOCAB + 2), max_size=2),
)


@given(st.lists(row_states, min_size=1, max_size=6), st.integers(0, 2**31))
def test_batched_penalties_bias_and_min_tokens_give_the_row_by_row_bits(states, seed):
    logits = torch.randn(len(states), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    assert torch.equal(Sampler()._process(logits, states), reference_process(logits, states))


@given(st.lists(st.sampled_from([None, 0, 1, 5]), min_size=1, max_size=6), st.integers(0, 2**31))
def test_logprobs_in_one_copy_are_the_ones_read_row_by_row(wanted, seed):
    logits = torch.randn(len(wanted), VOCAB, generator=torch.Generator().manual_seed(seed))
    states = [state(temperature=0.0, eos=None, logprobs=k, req_id=str(i)) for i, k in enumerate(wanted)]
    sampled, logprobs = Sampler()(logits, states)
    assert sampled == logits.argmax(-1).tolist()
    for row, k, got in zip(logits, wanted, logprobs):
        if k is None:
            assert got is None
            continue
        lp = row.log_softmax(-1)
        top = lp.topk(k)
        assert got.token_ids == [int(row.argmax())] + top.indices.tolist()
        assert got.logprobs == [float(lp.max())] + top.values.tolist()
        assert got.sampled_rank == int((lp > lp.max()).sum()) + 1


# ---- penalties' token counts kept between steps (penalties.py) ------------------------


def reference_counts(token_ids, num_prompt, vocab):
    """What the counts must be, from the whole token list (ids past the logits dropped)."""
    output = torch.zeros(vocab, dtype=torch.int32)
    seen = torch.zeros(vocab, dtype=torch.int32)
    for i, t in enumerate(token_ids):
        if t < vocab:
            seen[t] = 1
            output[t] += i >= num_prompt
    return output, seen


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_counts_kept_between_steps_equal_counts_from_the_whole_history(data):
    """Steps append tokens (some past the vocabulary), requests come and go (rows reused,
    the tables grown), rows are drafts of a request: every step's rows equal a count of
    each row's whole history."""
    from services.worker.sample.draft_position import DraftPosition

    vocab = 12
    tokens = st.integers(0, vocab + 3)
    counts = PenaltyCounts()
    live = []
    for step in range(data.draw(st.integers(1, 6))):
        for _ in range(data.draw(st.integers(0, 4))):  # new requests
            prompt = data.draw(st.lists(tokens, min_size=1, max_size=6))
            live.append(state(prompt=prompt, output=data.draw(st.lists(tokens, max_size=3)),
                              req_id=f"r{step}-{len(live)}", repetition_penalty=1.5))
        for s in list(live):
            if data.draw(st.booleans()) and len(live) > 1:  # dropped: its row goes back
                counts.free(s)
                live.remove(s)
            else:
                s.token_ids += data.draw(st.lists(tokens, max_size=3))
        if not live:
            continue
        # A request verifying drafts has a row per position: itself, then with each draft.
        rows = [row for s in live for row in ([s, DraftPosition(s, data.draw(st.lists(tokens, min_size=1, max_size=2)))]
                                              if data.draw(st.booleans()) else [s])]
        output, seen = counts.rows(rows, vocab, torch.device("cpu"))
        for i, row in enumerate(rows):
            base = getattr(row, "state", row)
            want_output, want_seen = reference_counts(row.token_ids, base.num_prompt_tokens, vocab)
            assert torch.equal(output[i], want_output) and torch.equal(seen[i], want_seen)


def test_a_request_counted_by_another_sampler_is_counted_afresh():
    st_ = state(prompt=[1, 2], output=[3], repetition_penalty=2.0)
    first, second = PenaltyCounts(), PenaltyCounts()
    first.rows([st_], 8, torch.device("cpu"))
    output, seen = second.rows([st_], 8, torch.device("cpu"))
    assert output[0].tolist() == [0, 0, 0, 1, 0, 0, 0, 0] and seen[0].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("params", [
    dict(temperature=0.5), dict(presence_penalty=0.5), dict(frequency_penalty=-0.5), dict(repetition_penalty=1.2),
    dict(logit_bias={4: 1.0}), dict(allowed_token_ids=[4, 5]), dict(min_tokens=1), dict(logprobs=0),
    dict(prompt_logprobs=0), dict(bad_words_token_ids=[[4]]), dict(structured_outputs={"regex": "a"}),
    dict(embed=True, max_tokens=1),
])
def test_only_plain_greedy_requests_take_the_argmax_path_and_it_samples_what_sample_does(params):
    """RequestState.argmax_only (the runner's shortest path: Sampler.argmax, no per-row
    work) is false for anything that changes or reads the distribution; for plain greedy
    rows the argmax path's ids and logprobs are sample()'s."""
    from shared.sampling_params import StructuredOutputsParams

    if "structured_outputs" in params:
        params = {**params, "structured_outputs": StructuredOutputsParams(**params["structured_outputs"])}
    assert state(temperature=0, **{k: v for k, v in params.items() if k != "temperature"}).argmax_only is (
        "temperature" in params)  # (greedy with any of the others: not argmax-only)
    assert not state(**params).argmax_only
    plain = [state(temperature=0, req_id=str(i)) for i in range(5)]
    assert all(s.argmax_only for s in plain)
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    sampler = Sampler()
    assert sampler.argmax(logits).to_host() == sampler.sample(logits, plain).to_host()


@pytest.mark.parametrize("logits", ["random", "model"])
def test_sampler_times_script_times_every_kind_of_request(logits):
    """scripts/sampler_times.py, behind docs/performance/history.md's sampling figures, runs and
    reports each kind of request for the batch asked, on either kind of logits."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "sampler_times.py"
    result = subprocess.run([sys.executable, str(script), "--batch", "2", "--logits", logits, "--vocab", "512",
                             "--runs", "1", "--repeats", "2"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    [row] = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert row["batch"] == 2 and row["top_p_ms"] > 0 and row["llama_cpp_defaults_vs_greedy"] > 0
    assert row["vocab"] == (512 if logits == "random" else 49152)  # (the model's own vocabulary)
