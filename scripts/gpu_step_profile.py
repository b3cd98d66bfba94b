"""Where a decode step's time goes on a GPU: host work against GPU work.

For each batch size: `batch` requests of `--prompt-len` tokens are prefilled, then
`--steps` decode steps run under torch.profiler. Prints, per step: the wall time of
`LLM.step`, the runner's phases (input preparation, forward launches, sampling, which
waits for the GPU), the GPU's busy time (the sum of its kernels' times) and the number
of kernel launches, then the top host-side ops. A step whose wall time far exceeds its
GPU time is bound by launches and Python, which CUDA graphs would remove.

    python scripts/gpu_step_profile.py --model DIR [--batch 1 64] [--out $OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from llmbus import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    results = []
    for batch in args.batch:
        prompts = [[(7 * i + 13 * j) % 1000 + 10 for j in range(args.prompt_len)] for i in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 20, ignore_eos=True)
        llm.add_requests(prompts, [params] * batch)
        while any(r.num_computed_tokens < args.prompt_len for r in llm.scheduler.requests.values()):
            llm.step()
        for _ in range(5):  # warm: kernels compiled, allocator settled
            llm.step()
        walls, phases = [], []
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                start = time.perf_counter()
                llm.step()
                walls.append(time.perf_counter() - start)
                s, f, m, e = llm.runner.last_step_ns
                phases.append(((f - s) / 1e6, (m - f) / 1e6, (e - m) / 1e6))
        while llm.scheduler.has_unfinished_requests():
            llm.step()
        llm.step()
        events = prof.key_averages()
        gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_us = sum(e.self_device_time_total for e in gpu)
        launches = sum(e.count for e in gpu)
        row = {
            "batch": batch,
            "step_ms": round(statistics.median(walls) * 1e3, 3),
            "prepare_ms": round(statistics.median(p[0] for p in phases), 3),
            "forward_launch_ms": round(statistics.median(p[1] for p in phases), 3),
            "sample_ms": round(statistics.median(p[2] for p in phases), 3),
            "gpu_busy_ms_per_step": round(gpu_us / 1e3 / args.steps, 3),
            "kernels_per_step": round(launches / args.steps, 1),
        }
        print(json.dumps(row), flush=True)
        print(events.table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
        if gpu:
            print(events.table(sort_by="self_device_time_total", row_limit=10), flush=True)
        results.append(row)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_step_profile.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
