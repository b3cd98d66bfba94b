"""A finished request's `Usage` as a gateway collects it from its deltas, for the tests of
the request-level metrics."""

from __future__ import annotations

from services.gateway.generation import Usage
from shared.processing.output_processor import ChoiceDelta
from shared.sampling_params import SamplingParams


def finished_usage(prompt_lengths: list[int], tokens: list[int], reason: str = "length", n: int = 1,
                   max_tokens: int | None = 16, queue_time_s: float = 0.01,
                   prefill_time_s: float = 0.02) -> Usage:
    """Choice i (prompt i // n) gets tokens[i] tokens, one delta each, the first with the
    scheduler's queue and prefill times, the last with `reason`."""
    usage = Usage()
    usage.begin([[1] * length for length in prompt_lengths], SamplingParams(n=n, max_tokens=max_tokens))
    for index, count in enumerate(tokens):
        for position in range(count):
            first, last = position == 0, position == count - 1
            usage.count(ChoiceDelta(
                f"r-{index}", index, "x", [7], [], reason if last else None,
                queue_time_s=queue_time_s if first else None, prefill_time_s=prefill_time_s if first else None))
    return usage
