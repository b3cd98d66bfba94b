"""`llmbus bench throughput`: one fixed workload through `LLM` and through transformers'
static batching, in the same run, on the same weights and dtype; prints both and the ratio."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

from tqdm import tqdm

from llmbus.bench.workload import W1, BenchRequest, random_workload

if TYPE_CHECKING:  # torch is imported where it is used: every `llmbus` command imports this module
    import torch


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=W1["num_requests"])
    parser.add_argument("--input-len", type=int, nargs=2, default=W1["input_len"], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=W1["output_len"], metavar=("MIN", "MAX"))
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument(
        "--hf-num-requests", type=int, default=None,
        help="run transformers on only the first N requests (default: all); rates stay comparable",
    )
    parser.add_argument("--skip-hf", action="store_true", help="measure llmbus only")
    parser.add_argument(
        "--lora-path", default=None,
        help="with --enable-lora (vLLM's benchmark flag): also run the workload with the requests spread over "
             "--max-loras adapters (this folder under as many ids), alternated with the base model; prints lora/base",
    )


def run_llmbus(llm, requests: list[BenchRequest], loras: list | None = None) -> dict:
    """`loras`: request i runs on loras[i % len(loras)] (None: the base model)."""
    from llmbus import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    lora_request = [loras[i % len(loras)] for i in range(len(requests))] if loras else None
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=True, lora_request=lora_request)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return _rates("llmbus+lora" if loras else "llmbus", requests, num_out, elapsed)


def lora_against_base(llm, requests: list[BenchRequest], path: str, max_loras: int) -> tuple[dict, dict]:
    """The workload on adapters and on the base model, alternated twice in one engine (the
    machine's speed drifts), each side's best: what the adapters' products cost."""
    from llmbus import LoRARequest

    loras = [LoRARequest(f"lora{i + 1}", i + 1, path) for i in range(max_loras)]
    runs: dict[str, list[dict]] = {"base": [], "lora": []}
    for _ in range(2):
        runs["lora"].append(run_llmbus(llm, requests, loras))
        runs["base"].append(run_llmbus(llm, requests))
    best = {side: max(results, key=lambda r: r["output_tok_s"]) for side, results in runs.items()}
    best["lora"]["adapters_run"] = sorted(lora.lora_name for lora in llm.runner.loras.in_slots)
    return best["lora"], best["base"]


def run_transformers(model_path, dtype: torch.dtype, requests: list[BenchRequest], batch_size: int,
                     device: torch.device | None = None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    pad_id = 0
    num_out = 0
    start = time.perf_counter()
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    with torch.inference_mode():
        for batch in tqdm(batches, desc="transformers", unit="batch", file=sys.stderr):
            longest = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), longest), pad_id)
            mask = torch.zeros((len(batch), longest), dtype=torch.long)
            for row, r in enumerate(batch):  # left padding, as generate expects
                ids[row, longest - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
                mask[row, longest - len(r.prompt_token_ids) :] = 1
            # A static batch runs until its longest request is done; each request counts
            # only its own tokens.
            model.generate(
                ids.to(device), attention_mask=mask.to(device), do_sample=False, eos_token_id=None, pad_token_id=pad_id,
                max_new_tokens=max(r.max_tokens for r in batch), min_new_tokens=0,
            )
            num_out += sum(r.max_tokens for r in batch)
    elapsed = time.perf_counter() - start
    return _rates("transformers", requests, num_out, elapsed)


def _rates(name: str, requests: list[BenchRequest], num_out: int, elapsed: float) -> dict:
    num_in = sum(len(r.prompt_token_ids) for r in requests)
    return {
        "engine": name,
        "requests": len(requests),
        "input_tokens": num_in,
        "output_tokens": num_out,
        "seconds": round(elapsed, 2),
        "output_tok_s": round(num_out / elapsed, 1),
        "total_tok_s": round((num_in + num_out) / elapsed, 1),
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from llmbus import LLM
    from llmbus.cli.args import engine_kwargs
    from llmbus.bench.roofline import measure_runner
    from llmbus.model_fetch import resolve_model
    from services.worker.loader import parse_dtype

    path = resolve_model(args.model)
    if args.lora_path and not args.enable_lora:
        raise SystemExit("llmbus bench throughput: --lora-path needs --enable-lora")
    llm = LLM(str(path), **engine_kwargs(args))
    requests = random_workload(
        args.num_requests, tuple(args.input_len), tuple(args.output_len),
        llm.runner.vocab_size, seed=args.seed,
    )
    print(f"workload: {len(requests)} requests, input {args.input_len}, output {args.output_len}, "
          f"seed {args.seed}, model {path}, dtype {args.dtype}, device {llm.runner.device}, "
          f"threads {torch.get_num_threads()}")
    roofline = llm.executor.call(measure_runner, llm.runner)  # torch on the runner's thread
    print(roofline.describe())
    results = [run_llmbus(llm, requests)]
    lora = None
    if args.lora_path:
        lora, base = lora_against_base(llm, requests, args.lora_path, args.max_loras)
        print(f"{'llmbus+lora':>13}: {lora['requests']} req over {args.max_loras} adapter(s), "
              f"{lora['output_tokens']} out tok in {lora['seconds']} s -> {lora['output_tok_s']} output tok/s; "
              f"base {base['output_tok_s']} output tok/s in the same run")
        lora["lora_over_base"] = round(lora["output_tok_s"] / base["output_tok_s"], 3)
        print(f"ratio lora/base (best of 2 each, alternated): output {lora['lora_over_base']:.2f}x")
    if not args.skip_hf:
        device = llm.runner.device  # transformers runs where the engine ran
        del llm  # free its KV cache before transformers loads its own copy
        hf_requests = requests[: args.hf_num_requests] if args.hf_num_requests else requests
        results.append(run_transformers(path, parse_dtype(args.dtype), hf_requests, args.hf_batch_size, device))
    for r in results:
        print(f"{r['engine']:>13}: {r['requests']} req, {r['output_tokens']} out tok in {r['seconds']} s "
              f"-> {r['output_tok_s']} output tok/s, {r['total_tok_s']} total tok/s")
    share = results[0]["total_tok_s"] / roofline.max_tokens_per_s
    results[0]["compute_bound_tok_s"] = round(roofline.max_tokens_per_s, 1)
    print(f"llmbus total tok/s = {share:.0%} of the compute bound ({roofline.max_tokens_per_s:.0f} tok/s)")
    if len(results) == 2:
        ratio = results[0]["output_tok_s"] / results[1]["output_tok_s"]
        total_ratio = results[0]["total_tok_s"] / results[1]["total_tok_s"]
        print(f"ratio llmbus/transformers: output {ratio:.2f}x, total {total_ratio:.2f}x")
    print(json.dumps(results + ([lora] if lora else [])))
    return 0
