"""`llmbus serve` on the GPU: served W0 inter-token latency against offline's, in one run,
with the worker overlapping steps (the GPU's default, services/worker/shell/served_steps.py) and
without (LLMBUS_OVERLAP_STEPS=0), and served greedy tokens against offline's.

    python scripts/served_check.py --assets .gpu_assets/smollm2 --out $OUT [--cpu]

The model is the assets' config with random weights (`--load-format dummy`, seeded: the
served and offline engines hold the same weights). Each server is started as a user
starts one (`python -m llmbus serve`, NATS and every service as child processes), W0 (one
request at a time) measured by `llmbus bench serve`, and offline W0 by the engine stepping
alone (`llmbus bench latency`'s clock). Writes $OUT/served.json:

- served_w0_itl_ms_smollm2_bf16, served_w0_itl_ms_no_overlap: median ITL at the client
- offline_w0_itl_ms_smollm2_bf16: the same requests through `LLM` in this process
- served_minus_offline_itl_ms: the bus's and the services' share (the target: <= 1 ms)
- served_greedy_equals_offline: a few prompts' greedy tokens, served (both modes) against offline
- served_b128_output_tok_s, offline_b128_output_tok_s, served_over_offline_b128: `--batch`
  (128) requests sent at once, served (overlapping) and through `LLM`, the same lengths
- served_decode_b128_step_ms: the served worker's median period between consecutive steps
  that decode all `--batch` requests (its LLMBUS_STEP_LOG): against gpu_figures' GPU busy
  time of such a step, the served path's GPU share, where the scheduling, stepping and
  detokenizing that one offline thread does run in processes of their own
- gpu_busy_ms_decode_b128, served_gpu_busy_fraction_decode_b128: the GPU's kernel time in
  such a step (gpu_figures' profile, of this run's offline engine: the same model and
  graphs) and its share of the served step's period: the issue's GPU-busy figure with the
  host's work split across the services' processes

Needs nats-server and the services' packages (docs/design/kernels.md lists the wheels);
`--cpu` runs it on CPU for the tests (any model folder: its config, random weights).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_server(assets: str, dtype: str, overlap: str, log: Path, capture: int,
                 step_log: Path) -> tuple[subprocess.Popen, str]:
    from llmbus.deploy.serve import start_serve

    return start_serve(["--model", assets, "--served-model-name", "m", "--load-format", "dummy", "--dtype", dtype,
                        "--max-cudagraph-capture-size", str(capture)], log,
                       {"LLMBUS_OVERLAP_STEPS": overlap, "LLMBUS_STEP_LOG": str(step_log)}, cwd=ROOT)


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def served_bench(url: str, args, num_requests: int, concurrency: int) -> dict:
    """`llmbus bench serve`: its summary (the last JSON line)."""
    result = subprocess.run(
        [sys.executable, "-m", "llmbus", "bench", "serve", "--base-url", url, "--model", "m",
         "--num-requests", str(num_requests), "--concurrency", str(concurrency),
         "--input-len", str(args.input_len), str(args.input_len),
         "--output-len", str(args.output_len), str(args.output_len), "--vocab-size", str(args.vocab_size)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    if result.returncode != 0:
        raise RuntimeError(f"bench serve failed: {result.stderr[-2000:]}")
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def decode_step_periods(step_log: Path, batch: int) -> list[float]:
    """Milliseconds from one step's start to the next's, between consecutive steps that
    each decode `batch` requests and nothing else (the worker's step log)."""
    steps = [json.loads(line) for line in step_log.read_text().splitlines() if line.strip()]
    return [(after["start_ns"] - before["start_ns"]) / 1e6 for before, after in zip(steps, steps[1:])
            if before["reqs"] == before["decodes"] == batch and after["reqs"] == after["decodes"] == batch
            and before["pid"] == after["pid"]]


def served_greedy(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import httpx

    out = []
    for prompt in prompts:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
                "ignore_eos": True, "return_tokens_as_token_ids": True}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        resp.raise_for_status()
        out.append([int(t.removeprefix("token_id:")) for t in resp.json()["choices"][0]["logprobs"]["tokens"]])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", required=True, help="a model folder: its config and tokenizer")
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=128,
                        help="the batched run's requests, all at once (the issue's batch-128 decode step)")
    args = parser.parse_args()

    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("no GPU (--cpu tests the script)")
        return 0
    if args.cpu:
        args.num_requests, args.input_len, args.output_len, args.batch = 2, 8, 8, 4
    from llmbus import LLM, SamplingParams
    from llmbus.bench.latency import llmbus_itls
    from llmbus.bench.workload import random_workload
    from gpu_figures import gpu_busy_ms  # (scripts/, beside this one: imported on CPU too, so its test sees it)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "served_check.log"
    dtype = "float32" if args.cpu else "bfloat16"
    capture = args.batch  # graphs up to the batched run's rows (W0 decodes one)
    config = json.loads((Path(args.assets) / "config.json").read_text())
    args.vocab_size = min(config["vocab_size"], 32000)
    report: dict = {"command": "python scripts/served_check.py " + " ".join(sys.argv[1:]),
                    # (LLMBUS_API_SERVER_COUNT=N in the environment: llmbus serve runs N gateways)
                    "api_server_count": int(os.environ.get("LLMBUS_API_SERVER_COUNT", "1"))}
    prompts = [r.prompt_token_ids for r in random_workload(3, (args.input_len, args.input_len), (8, 8),
                                                           args.vocab_size, seed=5)]
    served_tokens = {}
    for overlap, key in (("1", "served_w0_itl_ms_smollm2_bf16"), ("0", "served_w0_itl_ms_no_overlap")):
        started = time.perf_counter()
        step_log = out / f"steps_{overlap}.jsonl"
        step_log.unlink(missing_ok=True)
        proc, url = start_server(args.assets, dtype, overlap, log, capture, step_log)
        try:
            summary = served_bench(url, args, args.num_requests, 1)
            served_tokens[overlap] = served_greedy(url, prompts, args.output_len)
            if overlap == "1":  # the batched run: every request at once, all decoding together
                batched = served_bench(url, args, args.batch, args.batch)
                periods = decode_step_periods(step_log, args.batch)
                report["served_b128_output_tok_s"] = batched["output_tok_s"]
                report["served_decode_b128_step_ms"] = round(statistics.median(periods), 3) if periods else None
        finally:
            stop_server(proc)
            step_log.unlink(missing_ok=True)  # (the figures are in served.json; $OUT takes few files)
        report[key] = summary["itl_ms"]["p50"]
        report[key.replace("itl", "tpot")] = summary["tpot_ms"]["mean"]
        print(json.dumps({"overlap": overlap, "itl_ms": summary["itl_ms"], "tpot_ms": summary["tpot_ms"],
                          "failed": summary["failed"], "s": round(time.perf_counter() - started, 1)}), flush=True)

    llm = LLM(args.assets, dtype=dtype, load_format="dummy", max_cudagraph_capture_size=capture,
              device="cpu" if args.cpu else None)
    requests = random_workload(args.num_requests, (args.input_len, args.input_len),
                               (args.output_len, args.output_len), args.vocab_size, seed=0)
    itls = llmbus_itls(llm, requests)
    batched = random_workload(args.batch, (args.input_len, args.input_len), (args.output_len, args.output_len),
                              args.vocab_size, seed=1)
    started = time.perf_counter()
    done = llm.generate([r.prompt_token_ids for r in batched],
                        SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True), use_tqdm=False)
    rate = sum(len(o.outputs[0].token_ids) for o in done) / (time.perf_counter() - started)
    report["offline_b128_output_tok_s"] = round(rate, 1)
    if not args.cpu and report.get("served_decode_b128_step_ms"):
        busy = gpu_busy_ms(llm, args.batch, args.input_len, 11)
        report["gpu_busy_ms_decode_b128"] = round(busy, 3)
        report["served_gpu_busy_fraction_decode_b128"] = round(busy / report["served_decode_b128_step_ms"], 3)
    report["served_over_offline_b128"] = round(report["served_b128_output_tok_s"] / report["offline_b128_output_tok_s"], 3)
    report["offline_w0_itl_ms_smollm2_bf16"] = round(statistics.median(itls) * 1e3, 3)
    report["served_minus_offline_itl_ms"] = round(report["served_w0_itl_ms_smollm2_bf16"]
                                                  - report["offline_w0_itl_ms_smollm2_bf16"], 3)
    # One at a time, as they were served: a batch of several may round otherwise in bfloat16.
    offline_tokens = [llm.generate([p], SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True),
                                   use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    report["served_greedy_equals_offline"] = all(t == offline_tokens for t in served_tokens.values())
    print(json.dumps(report), flush=True)
    (out / "served.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["served_greedy_equals_offline"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
