"""`llmbus bench latency`: workload W0 — one request at a time (128 prompt tokens, 128
output tokens, 8 requests) through `LLM` and through transformers' `generate`, same
weights and dtype, in the same run. Prints the median inter-token latency of each and of
the memory-bandwidth bound measured in the same run (every weight read once per token)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import TYPE_CHECKING

from tqdm import tqdm

from llmbus.bench.workload import W0, BenchRequest, random_workload

if TYPE_CHECKING:  # torch is imported where it is used: every `llmbus` command imports this module
    import torch


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=W0["num_requests"])
    parser.add_argument("--input-len", type=int, default=W0["input_len"][0])
    parser.add_argument("--output-len", type=int, default=W0["output_len"][0])
    parser.add_argument("--skip-hf", action="store_true", help="measure llmbus only")


def step_times(llm, count: int | None = None) -> list[float]:
    """Seconds each step took to land, from the call on, for `count` steps or until nothing
    is left unfinished; stepped as `generate` steps (LLM.step_while: every step on the
    engine's thread, without the ~0.1 ms hand-over of a `step()` call each)."""
    times, last = [], [time.perf_counter()]

    def landed(_finished) -> None:
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    llm.step_while(lambda: llm.scheduler.has_unfinished_requests() and (count is None or len(times) < count), landed)
    return times


def llmbus_itls(llm, requests: list[BenchRequest]) -> list[float]:
    """Seconds between consecutive tokens of each request, the engine stepping alone."""
    from llmbus import SamplingParams

    itls = []
    for r in tqdm(requests, desc="llmbus", unit="req", file=sys.stderr):
        params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        llm.add_requests([r.prompt_token_ids], [params])
        itls += step_times(llm)[1:]  # (the first lands the prompt's token)
        llm.step()  # the worker drops the finished request
    return itls


def transformers_itls(model_path, dtype: torch.dtype, requests: list[BenchRequest],
                      device: torch.device | None = None) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """generate() calls put() once with the prompt, then once per new token."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    itls = []
    with torch.inference_mode():
        for r in tqdm(requests, desc="transformers", unit="req", file=sys.stderr):
            clock = Clock()
            ids = torch.tensor([r.prompt_token_ids], device=device)
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None,
                           pad_token_id=0, max_new_tokens=r.max_tokens, min_new_tokens=0, streamer=clock)
            tokens = clock.times[1:]  # [0] is the prompt
            itls += [b - a for a, b in zip(tokens, tokens[1:])]
    return itls


def run(args: argparse.Namespace) -> int:
    import torch

    from llmbus import LLM
    from llmbus.cli.args import engine_kwargs
    from llmbus.bench.roofline import measure_runner
    from llmbus.model_fetch import resolve_model
    from services.worker.loader import parse_dtype

    path = resolve_model(args.model)
    llm = LLM(str(path), **engine_kwargs(args))
    requests = random_workload(args.num_requests, (args.input_len, args.input_len),
                               (args.output_len, args.output_len), llm.runner.vocab_size, seed=args.seed)
    print(f"workload W0: {len(requests)} requests one at a time, input {args.input_len}, output "
          f"{args.output_len}, model {path}, dtype {args.dtype}, device {llm.runner.device}, "
          f"threads {torch.get_num_threads()}")
    roofline = llm.executor.call(measure_runner, llm.runner)  # torch on the runner's thread
    print(roofline.describe())
    bound_ms = roofline.min_decode_step_s * 1e3
    # Three significant digits, not two decimals: a tiny model's bound on a fast copy is
    # microseconds (0.4 MB at 83 GB/s: 0.005 ms), which two decimals would print as 0.
    results = {"dtype": args.dtype, "bandwidth_bound_ms": float(f"{bound_ms:.3g}")}
    itl = statistics.median(llmbus_itls(llm, requests)) * 1e3
    results["llmbus_itl_ms"] = round(itl, 2)
    print(f"      llmbus: median inter-token latency {itl:.1f} ms = {itl / bound_ms:.2f}x the bandwidth bound")
    if not args.skip_hf:
        device = llm.runner.device  # transformers runs where the engine ran
        del llm
        hf = statistics.median(transformers_itls(path, parse_dtype(args.dtype), requests, device)) * 1e3
        results["transformers_itl_ms"] = round(hf, 2)
        print(f"transformers: median inter-token latency {hf:.1f} ms = {hf / bound_ms:.2f}x the bandwidth bound")
        print(f"ratio llmbus/transformers inter-token latency: {itl / hf:.2f}")
    print(json.dumps(results))
    return 0
