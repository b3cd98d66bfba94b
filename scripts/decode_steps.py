"""Time the engine's decode steps at one batch size: the figures of the step table in
docs/performance.md, and a torch.profiler table with --profile.

    python scripts/decode_steps.py --batch 32 --dtype bfloat16 [--quantization int4]
        [--kv-cache-dtype fp8] [--prompt-len 128] [--profile]

Each request has a 128-token prompt (--prompt-len) and 64 output tokens, all submitted at
once; steps that still prefill (the first ceil(batch * prompt / 2048)) are reported apart.
"""

from __future__ import annotations

import argparse
import statistics
import time

from llmbus import LLM, SamplingParams
from llmbus.bench.workload import random_workload

OUTPUT, BUDGET = 64, 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="then profile 10 decode steps")
    args = parser.parse_args()

    PROMPT = args.prompt_len
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_num_batched_tokens=BUDGET,
              kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory_bytes=4 << 30)
    requests = random_workload(args.batch, (PROMPT, PROMPT), (OUTPUT, OUTPUT), llm.runner.vocab_size)
    prompts = [r.prompt_token_ids for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)] * args.batch
    llm.add_requests(prompts, params)
    times = []
    while llm.scheduler.has_unfinished_requests():
        start = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - start)
    num_prefill = -(-args.batch * PROMPT // BUDGET)
    print(f"{args.dtype} {args.quantization or ''} batch {args.batch}: prefill steps (ms) "
          f"{[round(t * 1e3) for t in times[:num_prefill]]}, decode median "
          f"{statistics.median(times[num_prefill:]) * 1e3:.1f} ms")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        llm.add_requests(prompts, params)
        for _ in range(num_prefill + 3):
            llm.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                llm.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
