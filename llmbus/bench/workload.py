"""Fixed-seed synthetic workloads, the same for every engine compared in one run."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def random_workload(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    first_token_id: int = 16,  # skip the special tokens at the start of the vocabulary
) -> list[BenchRequest]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        prompt = [rng.randrange(first_token_id, vocab_size) for _ in range(n_in)]
        requests.append(BenchRequest(prompt, n_out))
    return requests


# W1 of the performance issue: 128 requests, input 64-512, output 32-256, all at once.
W1 = dict(num_requests=128, input_len=(64, 512), output_len=(32, 256))

# W0: latency, one request at a time.
W0 = dict(num_requests=8, input_len=(128, 128), output_len=(128, 128))
