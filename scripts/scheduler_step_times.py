"""The scheduler core's own share of a decode step, apart from everything else: `batch`
running requests of `--prompt-len` tokens, each step `schedule()` and then
`update_from_output()` with one token for every request, timed apart (medians over
`--steps` steady steps). No model, no worker: quieter to compare across changes than a
whole engine step (host_step_times.py), whose forward dominates on a CPU.

    python scripts/scheduler_step_times.py [--batch 128] [--steps 600] [--runs 3]

Requests ask for vLLM's FINAL_ONLY outputs, as `LLM.generate` does, where the checkout has
them; `--output-kind delta` for a served stream's (an output a request a step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(batch: int, steps: int, prompt_len: int, output_kind: str = "final_only") -> dict[str, float]:
    """Medians in microseconds; the steps of 4000-token requests in a 4096-token context."""
    import shared.sampling_params as sp
    from services.scheduler.core.scheduler import Scheduler
    from shared.config import SchedulerConfig
    from shared.messages import EngineCoreRequest, ModelRunnerOutput

    config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=8192, max_model_len=4096)
    scheduler = Scheduler(config, num_kv_blocks=8192, block_size=16, vocab_size=1000)
    kind = getattr(sp, "RequestOutputKind", None)  # (an older checkout has none)
    params = sp.SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True,
                               **({"output_kind": kind[output_kind.upper()]} if kind else {}))
    for i in range(batch):
        scheduler.add_request(EngineCoreRequest(request_id=str(i), sampling_params=params, eos_token_id=0,
                                                prompt_token_ids=[(i * 7 + j) % 900 + 1 for j in range(prompt_len)]))
    schedule_s, update_s = [], []
    for _ in range(steps):  # (the first few prefill the prompts, 8192 tokens a step)
        start = time.perf_counter()
        step = scheduler.schedule()
        scheduled = time.perf_counter()
        answer = ModelRunnerOutput(step_id=step.step_id, req_ids=list(step.num_scheduled_tokens),
                                   sampled_token_ids=[[7] for _ in step.num_scheduled_tokens])
        landing = time.perf_counter()
        scheduler.update_from_output(step, answer)
        schedule_s.append(scheduled - start)
        update_s.append(time.perf_counter() - landing)
    return {"schedule_us": round(statistics.median(schedule_s) * 1e6, 1),
            "update_from_output_us": round(statistics.median(update_s) * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output-kind", choices=("final_only", "delta"), default="final_only",
                        help="delta: a served stream's outputs (one a request a step)")
    args = parser.parse_args()
    for _ in range(args.runs):
        print(json.dumps({"batch": args.batch, "output_kind": args.output_kind,
                          **run(args.batch, args.steps, args.prompt_len, args.output_kind)}), flush=True)


if __name__ == "__main__":
    main()
