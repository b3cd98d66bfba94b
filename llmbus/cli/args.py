"""Every flag of the `llmbus` command, and the configs built from them, in one place.

Each flag's default can come from the environment: --max-num-seqs <- LLMBUS_MAX_NUM_SEQS
(argparse converts a string default with the flag's type). So compose files set
variables, and `llmbus serve` hands its children their flags the same way (`as_env`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from pathlib import Path

from llmbus.model_fetch import DEFAULT_MODEL, KNOWN_MODELS
from shared.config import (DTYPE_CHOICES, KV_CACHE_DTYPES, SCHEDULING_POLICIES, CacheConfig, GatewayConfig,
                           LoRAConfig, SchedulerConfig, SpeculativeConfig, WorkerConfig, scheduler_context)
from shared.hf.classification import classifier_of
from shared.hf.generation_config import SOURCES_HELP, default_sampling, model_eos_ids
from shared.lora_request import LoRARequest, parse_lora_modules
from shared.hf.pooling_config import unsupported_pooling

ENV_PREFIX = "LLMBUS_"
log = logging.getLogger("llmbus.gateway")


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def env(flag: str, default=None):
    value = os.environ.get(env_name(flag.lstrip("-").replace("-", "_")))
    return default if value in (None, "") else value


def env_flag(flag: str) -> bool:
    return str(env(flag, "")).lower() in ("1", "true", "yes", "on")


def as_env(args: argparse.Namespace, names: list[str]) -> dict[str, str]:
    """The named parsed flags as LLMBUS_* variables, which a child's flags default to."""
    out = {}
    for name in names:
        value = getattr(args, name)
        if value is None or value is False:
            continue
        if dataclasses.is_dataclass(value):  # a config parsed from JSON (--speculative-config)
            value = json.dumps(dataclasses.asdict(value))
        if isinstance(value, list):  # a repeated flag (--api-key): one value per line
            if not value:
                continue
            value = "\n".join(map(str, value))
        out[env_name(name)] = "1" if value is True else str(value)
    return out


def human_int(text: str) -> int:
    """vLLM's sizes: 4096, 32k (x1000), 32K (x1024), 1m, 1M, 1.5k; a whole number of tokens."""
    match = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(text))
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (4096, 32k = 32000, 32K = 32768)")
    number, unit = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[unit]
    value = float(number) * scale
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)


def json_object(text: str) -> str:
    """A flag's JSON object, checked here and kept as its text (it travels to the services
    as a variable, as it was typed)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return text


def hf_overrides(args: argparse.Namespace) -> dict | None:
    return json.loads(args.hf_overrides) if args.hf_overrides else None


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", default=env("--tokenizer"),
                        help="vLLM's: the tokenizer's folder or Hub id, where not the model's own")
    parser.add_argument(
        "--model", default=env("--model"),
        help=f"a local HF folder or a known model ({', '.join(KNOWN_MODELS)}); default {DEFAULT_MODEL}",
    )
    parser.add_argument("--max-model-len", type=human_int, default=env("--max-model-len"),
                        help="context length (default: the model's; vLLM's sizes: 32k = 32000, 32K = 32768)")
    parser.add_argument("--tokenizer-mode", default=env("--tokenizer-mode", "auto"), choices=["auto"],
                        help="vLLM's; auto only: the tokenizer's fast (Rust) implementation, as vLLM's auto")
    # vLLM's flags: the model's recommended sampling defaults (shared/hf/generation_config.py)
    parser.add_argument("--generation-config", default=env("--generation-config", "auto"), help=SOURCES_HELP)
    parser.add_argument("--override-generation-config", default=env("--override-generation-config", None),
                        help='JSON on top of the generation config, e.g. \'{"temperature": 0.5}\'')
    parser.add_argument("--revision", default=env("--revision"),
                        help="a Hub model's commit, branch or tag (vLLM's; default: main)")
    parser.add_argument("--download-dir", default=env("--download-dir"),
                        help="where Hub models are kept, in place of the Hugging Face cache (vLLM's)")
    # vLLM's, so its command lines run as typed: llmbus runs no code from a checkpoint (an
    # architecture it does not implement is refused by name), so there is nothing to trust.
    parser.add_argument("--hf-overrides", type=json_object, default=env("--hf-overrides"),
                        help='vLLM\'s: JSON over the model\'s config.json, e.g. \'{"max_position_embeddings": 8192}\'')
    parser.add_argument("--trust-remote-code", action="store_true", default=env_flag("--trust-remote-code"),
                        help="accepted for vLLM's command lines; llmbus runs no code from the checkpoint")


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default=env("--dtype", "float32"), choices=DTYPE_CHOICES,
                        help="default float32 (greedy output as transformers' in float32); auto: the "
                             "checkpoint's own, as vLLM's default (float16 runs as bfloat16 on a CPU); "
                             "half = float16, float = float32")
    parser.add_argument("--quantization", default=env("--quantization"), choices=["int8", "int4"],
                        help="with --dtype bfloat16 (a GPU's int4: or float16): int4 (4-bit weights in groups of "
                             "32; a GGUF Q4, AWQ or GPTQ checkpoint keeps its exact grid, and a 4-bit checkpoint "
                             "takes int4 without asking; on a GPU the Triton kernel) or int8 (per-channel int8 "
                             "weights, CPU only)")
    parser.add_argument("--seed", type=int, default=env("--seed"),
                        help="vLLM's: requests without a seed of their own draw from this one, so a run repeats "
                             "(default: fresh randomness; benchmarks: 0, which picks their workload too)")
    parser.add_argument("--num-kv-blocks", type=int, default=env("--num-kv-blocks"), help="exact KV cache size in blocks")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=env("--kv-cache-memory-gb"),
                        help="KV cache budget when --num-kv-blocks is not given (default 1, or vLLM's "
                             "VLLM_CPU_KVCACHE_SPACE; on a GPU, --gpu-memory-utilization's share where given)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=env("--gpu-memory-utilization"),
                        help="vLLM's: on a GPU, the share of its memory the worker may hold, the KV cache taking "
                             "what the model leaves (a CPU's cache is --kv-cache-memory-gb's, as vLLM's CPU backend)")
    parser.add_argument("--block-size", type=int, default=env("--block-size", 16))
    parser.add_argument("--kv-cache-dtype", default=env("--kv-cache-dtype", "auto"), choices=KV_CACHE_DTYPES,
                        help="auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2: one byte a value, twice "
                             "the tokens per GB (docs/performance/history.md for how often greedy output moves)")
    parser.add_argument("--attention-backend", default=env("--attention-backend"), choices=["torch", "triton"],
                        help="default: triton on a GPU, torch on CPU")
    parser.add_argument("--threads", type=int, default=env("--threads"),
                        help="torch threads for the model (default: torch's, one per core)")
    for flag, short in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"),
                        ("--data-parallel-size", "-dp")):
        parser.add_argument(flag, short, type=one_device, default=env(flag, 1),
                            help="vLLM's; 1 only: a worker runs on one device (--workers adds replicas)")
    parser.add_argument("--swap-space", type=float, default=env("--swap-space"),
                        help="vLLM's; accepted as typed: a preempted request is recomputed, as in vLLM's V1 "
                             "engine, so no CPU swap space is kept")
    parser.add_argument("--enforce-eager", action="store_true", default=env_flag("--enforce-eager"),
                        help="no CUDA graphs for decode steps (a GPU's default)")
    parser.add_argument("--max-cudagraph-capture-size", type=int, default=env("--max-cudagraph-capture-size", 256),
                        help="the largest decode batch (rows: requests and their drafts) run as a CUDA graph")
    parser.add_argument("--load-format", default=env("--load-format", "auto"), choices=["auto", "dummy"],
                        help="dummy: random weights of the config's shape (timing without a checkpoint)")
    # vLLM's LoRA flags: the adapters themselves are named to the gateway (--lora-modules)
    # or offline per request (LoRARequest); the worker reads them when first asked.
    parser.add_argument("--enable-lora", action="store_true", default=env_flag("--enable-lora"),
                        help="serve LoRA adapters on top of the model (--lora-modules names them)")
    parser.add_argument("--max-loras", type=int, default=env("--max-loras", 1),
                        help="LoRA adapters one step can mix (each takes a slot of stacked weights)")
    parser.add_argument("--max-lora-rank", type=int, default=env("--max-lora-rank", 16),
                        help="the largest LoRA rank served")
    parser.add_argument("--max-cpu-loras", type=int, default=env("--max-cpu-loras"),
                        help="adapters kept read in memory, least recently used dropped (default: --max-loras)")


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-num-seqs", type=int, default=env("--max-num-seqs", 128))
    parser.add_argument("--max-num-batched-tokens", type=human_int, default=env("--max-num-batched-tokens", 2048))
    parser.add_argument("--no-chunked-prefill", action="store_true", default=env_flag("--no-chunked-prefill"),
                        help="prefill each prompt in one step (then --max-num-batched-tokens must cover "
                             "--max-model-len)")
    _add_vllm_spellings(parser, "chunked-prefill")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=env("--long-prefill-token-threshold", 0))
    parser.add_argument("--scheduling-policy", default=env("--scheduling-policy", "fcfs"), choices=SCHEDULING_POLICIES,
                        help="priority: a request's `priority` (lower first) orders admission and preemption")
    parser.add_argument("--max-logprobs", type=int, default=env("--max-logprobs", 20),
                        help="vLLM's: the most logprobs a request may ask for (-1: the whole vocabulary)")
    parser.add_argument(
        "--no-async-scheduling", action="store_true", default=env_flag("--no-async-scheduling"),
        help="wait for each step's answer before building the next (default: keep two in flight)",
    )
    parser.add_argument("--async-scheduling", dest="no_async_scheduling", action="store_false",
                        default=argparse.SUPPRESS, help="vLLM's spelling: two steps in flight (the default)")


def add_prefix_caching_args(parser: argparse.ArgumentParser) -> None:
    """The scheduler looks prefixes up; a hybrid model's worker keeps snapshots of its
    recurrent state for them only where the cache is on: both take it."""
    parser.add_argument("--no-prefix-caching", action="store_true", default=env_flag("--no-prefix-caching"))
    _add_vllm_spellings(parser, "prefix-caching")


def _add_vllm_spellings(parser: argparse.ArgumentParser, feature: str) -> None:
    """vLLM's spellings of an on-by-default switch; the default stays --no-FEATURE's."""
    dest = f"no_{feature.replace('-', '_')}"
    parser.add_argument(f"--enable-{feature}", dest=dest, action="store_false", default=argparse.SUPPRESS,
                        help=f"vLLM's spelling: {feature.replace('-', ' ')} on (the default)")
    parser.add_argument(f"--no-enable-{feature}", dest=dest, action="store_true", default=argparse.SUPPRESS,
                        help=f"vLLM's spelling of --no-{feature}")


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    """The scheduler reserves the drafts' slots and the worker proposes them: both take it."""
    parser.add_argument(
        "--speculative-config", type=speculative_config, default=env("--speculative-config"),
        help='vLLM\'s speculative_config as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
             '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'',
    )


def one_device(value: str) -> int:
    """--tensor-parallel-size, --pipeline-parallel-size: vLLM's, where only 1 holds here."""
    size = int(value)
    if size != 1:
        raise argparse.ArgumentTypeError(
            f"{size}: a worker runs its model on one device (no tensor, pipeline or data parallelism); serve more "
            f"requests with more replicas (--workers N, or `llmbus worker` on other machines)")
    return size


def _or_exit(check, *args):
    """A start-up check's ValueError stops the command with its reason, no traceback."""
    try:
        return check(*args)
    except ValueError as exc:
        raise SystemExit(f"llmbus: {exc}") from None


def lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    """None without --enable-lora; limits that cannot hold stop the command, saying why."""
    if not args.enable_lora:
        return None
    return _or_exit(LoRAConfig, args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def lora_modules(values: list[str], max_rank: int | None = None) -> dict[str, LoRARequest]:
    """--lora-modules, each adapter's folder checked: a wrong one stops the gateway at start."""
    return _or_exit(parse_lora_modules, values, max_rank)


def speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.of(text)
    except (ValueError, TypeError) as exc:  # JSON errors are ValueErrors
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Everything the in-process engine takes (`generate`, `bench throughput`)."""
    add_model_args(parser)
    add_worker_args(parser)
    add_scheduler_args(parser)
    add_prefix_caching_args(parser)
    add_speculative_args(parser)


# ---- configs from flags ---------------------------------------------------------------------


def kv_cache_bytes(args: argparse.Namespace) -> int | None:
    return None if args.kv_cache_memory_gb is None else int(args.kv_cache_memory_gb * (1 << 30))


def cache_config(args: argparse.Namespace) -> CacheConfig:
    return CacheConfig(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=kv_cache_bytes(args),
        gpu_memory_utilization=args.gpu_memory_utilization,
        cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=not args.no_prefix_caching,
    )


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """`llmbus worker`'s model runner, from its flags."""
    return WorkerConfig(
        cache_config=cache_config(args), dtype=args.dtype, attention_backend=args.attention_backend,
        max_model_len=args.max_model_len, quantization=args.quantization, speculative_config=args.speculative_config,
        enforce_eager=args.enforce_eager, max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        load_format=args.load_format, lora_config=lora_config(args), seed=args.seed, tokenizer=args.tokenizer,
        max_num_seqs=args.max_num_seqs,
    )


def scheduler_config(args: argparse.Namespace, max_model_len: int | None = None) -> SchedulerConfig:
    """`max_model_len`: the model's, when known here; served, each worker's caps it later."""
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=scheduler_context(args.max_model_len, max_model_len, args.max_num_batched_tokens,
                                        not args.no_chunked_prefill),
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        max_logprobs=args.max_logprobs,
        num_speculative_tokens=args.speculative_config.num_speculative_tokens if args.speculative_config else 0,
        speculative_disable_by_batch_size=(args.speculative_config.disable_by_batch_size
                                           if args.speculative_config else None),
    )


def gateway_config(args: argparse.Namespace, model_name: str, model_path: str) -> GatewayConfig:
    defaults = default_sampling(model_path, args.generation_config, args.override_generation_config)
    if defaults:
        log.info("default sampling parameters from the model's generation config: %s "
                 "(--generation-config vllm to ignore them)", defaults)
    aliases = tuple(name for name in args.served_model_name or [] if name and name != model_name)
    reasoning_parser, tool_call_parser = args.reasoning_parser, args.tool_call_parser
    if _architectures(model_path) & {"GptOssForCausalLM"}:
        # gpt-oss answers in harmony, which vLLM always reads as harmony: its parsers, unless
        # others were asked for (hermes, the default, means none was)
        reasoning_parser = reasoning_parser or "openai_gptoss"
        tool_call_parser = "openai" if tool_call_parser == "hermes" else tool_call_parser
    return GatewayConfig(model_name, aliases, tuple(args.api_key), args.api_key_file, args.metrics_require_key,
                         args.max_body_bytes,
                         scheduler_resume_timeout_s=args.scheduler_resume_timeout,
                         tool_call_parser=tool_call_parser,
                         enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                         reasoning_parser=reasoning_parser,
                         default_sampling=defaults, model_eos_ids=model_eos_ids(model_path, args.generation_config),
                         unsupported_pooling=unsupported_pooling(model_path),
                         classifier=classifier_of(model_path),
                         lora_modules=lora_modules(args.lora_modules),
                         allow_runtime_lora_updating=runtime_lora_updating(),
                         chat_template=args.chat_template, allowed_origins=tuple(json.loads(args.allowed_origins)),
                         allowed_methods=tuple(json.loads(args.allowed_methods)),
                         allowed_headers=tuple(json.loads(args.allowed_headers)),
                         allow_credentials=args.allow_credentials,
                         enable_request_id_headers=args.enable_request_id_headers,
                         disable_fastapi_docs=args.disable_fastapi_docs,
                         responses_store_bytes=int(args.responses_store_mb * (1 << 20)),
                         api_server_group=args.api_server_group,
                         return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                         force_include_usage=args.enable_force_include_usage,
                         server_load_tracking=args.enable_server_load_tracking, root_path=args.root_path,
                         log_request_inputs=args.enable_log_requests, log_outputs=args.enable_log_outputs,
                         max_log_len=args.max_log_len)


def _architectures(model_path: str) -> set[str]:
    try:
        return set(json.loads((Path(model_path) / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError, AttributeError):
        return set()


def runtime_lora_updating(warn: bool = True) -> bool:
    """vLLM's switch, under vLLM's name, so a deployment's environment carries over."""
    on = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")
    if on and warn:
        log.warning("runtime LoRA updating is on: anyone with an API key may load adapters from this "
                    "machine's disk (VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    return on


def engine_kwargs(args: argparse.Namespace) -> dict:
    """`LLM(...)`'s keyword arguments from the engine flags."""
    return dict(
        hf_overrides=hf_overrides(args),
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=kv_cache_bytes(args),
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        scheduling_policy=args.scheduling_policy,
        max_logprobs=args.max_logprobs,
        attention_backend=args.attention_backend,
        threads=args.threads,
        async_scheduling=not args.no_async_scheduling,
        speculative_config=args.speculative_config,
        enforce_eager=args.enforce_eager,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        load_format=args.load_format,
        seed=args.seed,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        generation_config=args.generation_config,
        override_generation_config=json.loads(args.override_generation_config or "{}"),
        revision=args.revision,
        download_dir=args.download_dir,
        tokenizer=args.tokenizer,
    )
