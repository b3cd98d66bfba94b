"""The `llmbus` command line: one subcommand per job, each a thin call into the project."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from llmbus.model_fetch import DEFAULT_MODEL, KNOWN_MODELS, ModelFetchError
from shared.config import KV_CACHE_DTYPES
from shared.logs import setup_logging


def env(flag: str, default=None):
    """Every flag's default can come from the environment: --max-num-seqs <- LLMBUS_MAX_NUM_SEQS.
    (argparse converts a string default with the flag's type.)"""
    value = os.environ.get("LLMBUS_" + flag.lstrip("-").replace("-", "_").upper())
    return default if value in (None, "") else value


def env_flag(flag: str) -> bool:
    return str(env(flag, "")).lower() in ("1", "true", "yes", "on")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=env("--model"),
        help=f"a local HF folder or a known model ({', '.join(KNOWN_MODELS)}); default {DEFAULT_MODEL}",
    )
    parser.add_argument("--max-model-len", type=int, default=env("--max-model-len"),
                        help="context length (default: the model's)")


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default=env("--dtype", "float32"), choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default=env("--quantization"), choices=["int8", "int4"],
                        help="CPU, with --dtype bfloat16: int4 (4-bit weights in groups of 32; a GGUF Q4 "
                             "checkpoint keeps its exact grid) or int8 (per-channel int8 weights)")
    parser.add_argument("--num-kv-blocks", type=int, default=env("--num-kv-blocks"), help="exact KV cache size in blocks")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=env("--kv-cache-memory-gb", 1.0),
                        help="KV cache budget when --num-kv-blocks is not given")
    parser.add_argument("--block-size", type=int, default=env("--block-size", 16))
    parser.add_argument("--kv-cache-dtype", default=env("--kv-cache-dtype", "auto"), choices=KV_CACHE_DTYPES,
                        help="auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2: one byte a value, twice "
                             "the tokens per GB (docs/performance.md for how often greedy output moves)")
    parser.add_argument("--attention-backend", default=env("--attention-backend"), choices=["torch", "triton"],
                        help="default: triton on a GPU, torch on CPU")
    parser.add_argument("--threads", type=int, default=env("--threads"),
                        help="torch threads for the model (default: torch's, one per core)")


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-num-seqs", type=int, default=env("--max-num-seqs", 128))
    parser.add_argument("--max-num-batched-tokens", type=int, default=env("--max-num-batched-tokens", 2048))
    parser.add_argument("--no-prefix-caching", action="store_true", default=env_flag("--no-prefix-caching"))
    parser.add_argument("--long-prefill-token-threshold", type=int, default=env("--long-prefill-token-threshold", 0))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Everything the in-process engine takes (`generate`, `bench throughput`)."""
    add_model_args(parser)
    add_worker_args(parser)
    add_scheduler_args(parser)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=int(args.kv_cache_memory_gb * (1 << 30)),
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=not args.no_prefix_caching,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        attention_backend=args.attention_backend,
        threads=args.threads,
    )


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from llmbus.model_fetch import fetch_model

    path = fetch_model(args.name, force=args.force)
    print(path)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from llmbus import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for out in outputs:
        print(out.outputs[0].text)
    return 0


# `llmbus bench <name>`: (name, help, module with add_args(parser) and run(args), takes engine flags)
BENCHES = [
    ("throughput", "W1 offline throughput: llmbus vs transformers static batching", "llmbus.bench.throughput", True),
    ("latency", "W0 inter-token latency: llmbus vs transformers vs the bandwidth bound", "llmbus.bench.latency", True),
    ("serve", "stream a workload at an OpenAI-compatible server", "llmbus.bench.serve", False),
    ("failover", "time from a worker's SIGKILL to its streams' next token", "llmbus.bench.failover", False),
    ("agreement", "greedy agreement of a lower precision with float32", "llmbus.bench.agreement", False),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmbus", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage models").add_subparsers(dest="model_command", required=True)
    fetch = model.add_parser("fetch", help="download and convert a known model once")
    fetch.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    fetch.add_argument("--force", action="store_true", help="convert again even if present")
    fetch.set_defaults(func=cmd_model_fetch)

    gen = sub.add_parser("generate", help="generate offline, in this process")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    for name, help_text, module, engine in BENCHES:
        bench_module = importlib.import_module(module)
        p = bench.add_parser(name, help=help_text)
        bench_module.add_args(p)
        if engine:  # it builds an in-process LLM: every engine flag applies
            add_engine_args(p)
        p.set_defaults(func=bench_module.run)

    from llmbus.service_cli import add_service_commands

    add_service_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        return args.func(args)
    except (ModelFetchError, ValueError) as exc:
        print(f"llmbus: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
