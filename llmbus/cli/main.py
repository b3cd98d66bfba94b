"""The `llmbus` command line: one subcommand per job, each a thin call into the project."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from llmbus.deploy import nats_config
from llmbus.cli.args import add_engine_args, engine_kwargs
from llmbus.cli.config_file import expand_config
from llmbus.model_fetch import DEFAULT_MODEL, ModelFetchError
from llmbus.cli.services import add_service_commands
from shared.bus import BusRefused
from shared.logs import setup_logging
from shared.tracing import use_traces_endpoint


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from llmbus.model_fetch import fetch_model

    path = fetch_model(args.name, force=args.force)
    print(path)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from llmbus import LLM, LoRARequest, SamplingParams

    if args.lora_path and not args.enable_lora:
        raise SystemExit("llmbus generate: --lora-path needs --enable-lora")
    lora = LoRARequest("adapter", 1, args.lora_path) if args.lora_path else None
    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k,
    )
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, lora_request=lora)
    else:
        outputs = llm.generate(args.prompts, params, lora_request=lora)
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
    ("speculative", "the same workloads with and without speculative decoding", "llmbus.bench.speculative", True),
    ("kv-offloading", "TTFT of a prefix recomputed, loaded from the host KV tier, and pooled",
     "llmbus.bench.kv_offloading", True),
    ("disaggregation", "long prompts' TTFT and decoding streams' ITL, --workers 2 against 1 prefill + 1 decode",
     "llmbus.bench.disaggregation", False),
    ("moe", "a Qwen3-MoE-shaped model: sparse experts vs every expert densely vs transformers", "llmbus.bench.moe", True),
    ("images", "a Gemma 3-shaped model: an image's preprocessing, encoding and share of TTFT", "llmbus.bench.images",
     True),
    ("control-plane", "gateways, tokenizer, scheduler shards and NATS with instant workers: tok/s and cores a token",
     "llmbus.bench.control_plane", False),
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
    gen.add_argument("--lora-path", default=None,
                     help="a PEFT LoRA adapter folder to generate through (with --enable-lora)")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    for name, help_text, module, engine in BENCHES:
        bench_module = importlib.import_module(module)
        p = bench.add_parser(name, help=help_text)
        bench_module.add_args(p)
        if engine:  # it builds an in-process LLM: every engine flag applies
            add_engine_args(p)
            # --seed picks the workload and seeds the engine (as vLLM's benchmarks): a run repeats.
            p.set_defaults(seed=0)
        p.set_defaults(func=bench_module.run)

    add_service_commands(sub)
    nats_config.add_parser(sub)
    for name in ("serve", "scheduler", "tokenizer", "worker", "gateway", "generate"):
        # (read by expand_config before parsing; here for --help)
        sub.choices[name].add_argument("--config", metavar="FILE.yaml",
                                       help="vLLM's: this command's flags from a YAML file (the command line wins)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(expand_config(parser, sys.argv[1:] if argv is None else argv))
    setup_logging(args.verbose or os.environ.get("LLMBUS_VERBOSE") == "1")  # (the latter: a service `llmbus -v serve` started)
    use_traces_endpoint(getattr(args, "otlp_traces_endpoint", None))  # (and the services serve starts)
    try:
        return args.func(args)
    except (ModelFetchError, ValueError, BusRefused) as exc:
        print(f"llmbus: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
