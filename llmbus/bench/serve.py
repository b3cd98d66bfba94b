"""`llmbus bench serve`: stream a fixed workload at any OpenAI-compatible server and report
the figures `vllm bench serve` gives (TTFT, ITL, TPOT, E2E percentiles, throughput).

Prompts go as token ids (or text from a JSONL file), `ignore_eos` asks for exactly
`max_tokens`; output tokens are counted from the server's usage report when it sends
one, else one per streamed chunk.

`--compare-structured` runs a workload twice in each pair, once unconstrained and once
with every request held to a JSON schema (vLLM's `structured_outputs`), in the order
plain-structured, structured-plain, ...: the ratio is what constraining all traffic
costs. Both sides have the same prompt lengths (the second other tokens, which the
prefix cache has not seen), and the schema cannot end before `max_tokens`, so both
generate the same number of tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

import httpx

from llmbus.bench.streaming_client import one_request, print_summary, summarize
from llmbus.bench.workload import W1, random_workload
from shared.event_loop import run as run_loop


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="model name the server expects")
    parser.add_argument("--num-requests", type=int, default=W1["num_requests"])
    parser.add_argument("--input-len", type=int, nargs=2, default=W1["input_len"], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=W1["output_len"], metavar=("MIN", "MAX"))
    parser.add_argument("--vocab-size", type=int, default=49152, help="for random token-id prompts")
    parser.add_argument("--dataset", default=None, help='JSONL of {"prompt": str, "max_tokens": int}')
    parser.add_argument(
        "--text", default=None, metavar="TOKENIZER",
        help="send the random prompts as text, decoded with this model's tokenizer (a fetched "
             "name or a folder), so the server's tokenizers are on the path",
    )
    # vLLM's bench serve sampling flags: greedy unless asked, so runs compare the same tokens;
    # the rest are sent only when given (llama.cpp's server takes them too).
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--service-cpu", action="store_true",
        help="also report the CPU used over the run by each llmbus service process on this machine, "
             "the NATS server, this client, and the whole machine (in cores)",
    )
    parser.add_argument(
        "--compare-offline", default=None, metavar="MODEL",
        help="afterwards run the same workload through the offline LLM on this model "
             "(in this process, server idle) and print the served/offline throughput ratio",
    )
    parser.add_argument("--offline-max-num-seqs", type=int, default=None,
                        help="offline max_num_seqs (default: --concurrency, like the server sees)")
    parser.add_argument("--offline-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="offline dtype: the server's, for a fair ratio")
    parser.add_argument("--offline-quantization", default=None, choices=["int8", "int4"])
    parser.add_argument("--offline-kv-cache-memory-gb", type=float, default=1.0,
                        help="offline KV cache budget: the server's, for a fair ratio")
    parser.add_argument(
        "--compare-structured", action="store_true",
        help="each pair: the prompts unconstrained and all held to a JSON schema; prints the throughput ratio",
    )
    parser.add_argument(
        "--repeat", type=int, default=1,
        help="with --compare-offline: this many served/offline pairs, each on new prompts (seed, "
             "seed + 1, ...), in the order served-offline, offline-served, ...; the ratio is over "
             "all pairs, so a machine whose speed drifts during the run biases neither side",
    )


def sampling_fields(args) -> dict:
    """The requests' sampling fields, by their API (and SamplingParams) names."""
    given = {"top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    return {"temperature": args.temperature, **{k: v for k, v in given.items() if v is not None}}


def load_requests(args) -> list[tuple[str | list[int], int]]:
    if args.dataset:
        with open(args.dataset) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [(r["prompt"], int(r.get("max_tokens", 128))) for r in rows][: args.num_requests]
    workload = random_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len),
                               args.vocab_size, args.seed)
    if args.text:
        from transformers import AutoTokenizer

        from llmbus.model_fetch import resolve_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.text))
        # Decoded ids re-encode to about as many tokens; the server's usage counts the real ones.
        return [(tokenizer.decode(r.prompt_token_ids), r.max_tokens) for r in workload]
    return [(r.prompt_token_ids, r.max_tokens) for r in workload]


# People as JSON, more of them than any max_tokens can hold: a realistic grammar (strings,
# bounded integers, fixed keys) that never lets a request stop early.
STRUCTURED_SCHEMA = {
    "type": "array", "minItems": 100_000, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"type": "string", "maxLength": 24}}}}


async def stream_workload(args, requests, extra: dict | None = None) -> dict:
    url = args.base_url.rstrip("/") + "/v1/completions"
    extra = {**sampling_fields(args), **(extra or {})}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    semaphore = asyncio.Semaphore(args.concurrency)
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, headers=headers) as client:

        async def limited(prompt, max_tokens):
            async with semaphore:
                return await one_request(client, url, args.model, prompt, max_tokens, extra)

        if requests:
            # vLLM's initial single-prompt test run: the server is answering before the clock
            # starts, and what its first request pays once (kernels compiled, caches filled)
            # is not one measured request's. Its prompt is the first one's, shifted, so the
            # prefix cache holds nothing the workload sends.
            [(prompt, max_tokens)] = _uncached(requests[:1], args.vocab_size)
            test = await one_request(client, url, args.model, prompt, max_tokens, extra)
            if not test.ok:
                raise SystemExit(f"initial test run failed: {test.error or 'no tokens came back'}")
        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration)


def offline_engine(args):
    from llmbus import LLM

    return LLM(args.compare_offline, max_num_seqs=args.offline_max_num_seqs or args.concurrency,
               dtype=args.offline_dtype, quantization=args.offline_quantization,
               kv_cache_memory_bytes=int(args.offline_kv_cache_memory_gb * (1 << 30)))


def run_offline(llm, requests, sampling: dict) -> dict:
    from llmbus import SamplingParams

    prompts = [p if isinstance(p, list) else llm.tokenizer.encode(p) for p, _ in requests]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, **sampling) for _, m in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    duration = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(p) for p in prompts)
    return {"duration_s": round(duration, 2), "output_tokens": out_tokens,
            "output_tok_s": round(out_tokens / duration, 1),
            "total_tok_s": round((in_tokens + out_tokens) / duration, 1)}


SERVICES = ("gateway", "tokenizer", "scheduler", "worker")


def service_cpu_times() -> dict[int, tuple[str, float]]:
    """pid -> (name, user + system CPU seconds) of every local `llmbus <service>` process,
    of the NATS server, of this client process, of the whole machine (pid -1) and stolen by the hypervisor (-2)."""
    import psutil

    found = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        cmdline = proc.info["cmdline"] or []
        times = proc.info["cpu_times"]
        if times is None:
            continue
        name = None
        if proc.info["pid"] == os.getpid():
            name = "client"  # this benchmark: it shares the machine with the server
        elif proc.info["name"] == "nats-server":
            name = "nats"
        else:
            for i, part in enumerate(cmdline[:-1]):
                if part == "llmbus" and cmdline[i + 1] in SERVICES:
                    name = cmdline[i + 1]
                    break
        if name:
            found[proc.info["pid"]] = (name, times.user + times.system)
    machine = psutil.cpu_times()
    found[-1] = ("machine", machine.user + machine.system + machine.nice + getattr(machine, "irq", 0.0)
                 + getattr(machine, "softirq", 0.0))
    # Time the hypervisor gave this VM's CPUs to someone else (a shared host).
    found[-2] = ("steal", getattr(machine, "steal", 0.0))
    return found


def cpu_report(before: dict, after: dict, wall_s: float) -> dict[str, float]:
    """CPU seconds per process kind over the run, as a share of one core."""
    used: dict[str, float] = {}
    for pid, (service, seconds) in after.items():
        used[service] = used.get(service, 0.0) + seconds - before.get(pid, (service, 0.0))[1]
    return {service: round(seconds / wall_s, 3) for service, seconds in sorted(used.items())}


def run(args) -> int:
    if args.compare_structured:
        return run_structured(args)
    if args.repeat > 1 and not args.compare_offline:
        raise SystemExit("--repeat needs --compare-offline or --compare-structured")
    llm = offline_engine(args) if args.compare_offline else None
    pairs, first_seed = [], args.seed
    for i in range(args.repeat):
        args.seed = first_seed + i  # new prompts for each pair: no side reuses cached prefixes
        requests = load_requests(args)
        offline = None
        if llm is not None and i % 2 == 1:  # odd pairs: offline first
            offline = run_offline(llm, requests, sampling_fields(args))
        summary = serve_once(args, requests)
        if llm is not None:
            offline = offline or run_offline(llm, requests, sampling_fields(args))
            summary["offline"] = offline
            summary["served_over_offline"] = round(summary["output_tok_s"] / offline["output_tok_s"], 3)
            print(f"offline LLM: {offline['output_tok_s']} output tok/s, {offline['total_tok_s']} total tok/s "
                  f"in {offline['duration_s']} s")
            print(f"served/offline output throughput: {summary['served_over_offline']:.3f}")
        print(json.dumps(summary))
        pairs.append(summary)
    if len(pairs) > 1:
        # Over all pairs: total tokens over total time on each side.
        served = sum(p["output_tokens"] for p in pairs) / sum(p["duration_s"] for p in pairs)
        offline = sum(p["offline"]["output_tokens"] for p in pairs) / sum(p["offline"]["duration_s"] for p in pairs)
        ratios = ", ".join(f"{p['served_over_offline']:.3f}" for p in pairs)
        print(f"over {len(pairs)} pairs (each: {ratios}): served {served:.1f}, offline {offline:.1f} output tok/s "
              f"-> served/offline {served / offline:.3f}")
    return 0 if all(p["failed"] == 0 for p in pairs) else 1


def run_structured(args) -> int:
    """Pairs of (unconstrained, all constrained) runs on the same prompts, order alternating."""
    constrained = {"structured_outputs": {"json": STRUCTURED_SCHEMA}}
    pairs, first_seed = [], args.seed
    for i in range(args.repeat):
        args.seed = first_seed + i
        requests = load_requests(args)
        order = ["plain", "structured"] if i % 2 == 0 else ["structured", "plain"]
        # The side that runs second gets the same lengths with other tokens: the same
        # prompts would be prefix-cache hits for it.
        pair = {side: serve_once(args, requests if k == 0 else _uncached(requests, args.vocab_size),
                                 constrained if side == "structured" else None)
                for k, side in enumerate(order)}
        pair["structured_over_plain"] = round(pair["structured"]["output_tok_s"] / pair["plain"]["output_tok_s"], 3)
        print(f"structured/plain output throughput: {pair['structured_over_plain']:.3f}")
        print(json.dumps(pair))
        pairs.append(pair)
    if len(pairs) > 1:
        def rate(side):
            return sum(p[side]["output_tokens"] for p in pairs) / sum(p[side]["duration_s"] for p in pairs)

        ratios = ", ".join(f"{p['structured_over_plain']:.3f}" for p in pairs)
        print(f"over {len(pairs)} pairs (each: {ratios}): plain {rate('plain'):.1f}, structured "
              f"{rate('structured'):.1f} output tok/s -> structured/plain {rate('structured') / rate('plain'):.3f}")
    return 0 if all(p[side]["failed"] == 0 for p in pairs for side in ("plain", "structured")) else 1


def _uncached(requests, vocab_size: int):
    return [([(t + 1) % vocab_size for t in prompt] if isinstance(prompt, list) else "~ " + prompt, max_tokens)
            for prompt, max_tokens in requests]


def serve_once(args, requests, extra: dict | None = None) -> dict:
    cpu_before = service_cpu_times() if args.service_cpu else {}
    started = time.perf_counter()
    summary = run_loop(stream_workload(args, requests, extra))
    print_summary(summary)
    if args.service_cpu:
        summary["service_cores"] = cpu_report(cpu_before, service_cpu_times(), time.perf_counter() - started)
        print("cores used over the run:", ", ".join(f"{k} {v:.2f}" for k, v in summary["service_cores"].items()))
    return summary
