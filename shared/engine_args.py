"""One engine's arguments, said once: each field is an `LLM(...)` keyword, a flag of the
`llmbus` command under vLLM's name (its default also read from LLMBUS_*), and the help
docs/configuration/engine_args.md prints. The offline `LLM`, `llmbus generate` and the
benchmarks build their engine from it; `llmbus worker` and `llmbus scheduler` the configs
of their half (`worker_config`, `scheduler_config`).

A field's flag group says which commands take it: "model" every service, "worker" the
worker, "scheduler" the scheduler, "prefix_caching" and "speculative" both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field

from shared.config import (DTYPE_CHOICES, KV_CACHE_DTYPES, SCHEDULING_POLICIES, CacheConfig, LoRAConfig,
                           SchedulerConfig, SpeculativeConfig, WorkerConfig, check_limit_mm, scheduler_context)
from shared.flags import env, env_flag, human_int, json_object, one_device, one_device_size
from shared.hf.generation_config import SOURCES_HELP
from shared.kv_events import KVEventsConfig

GROUPS = ("model", "worker", "scheduler", "prefix_caching", "speculative", "data_parallel")


def arg(default, group: str, help: str = "", *, type=None, choices=None, flag: str | None = None,
        short: str | None = None, from_cli=None, on: str | None = None):
    """A field and its flag. `flag`: where the flag's name is not the field's (then `from_cli`
    turns the flag's value into the field's); `on`: a switch on by default, whose flag is
    --no-FEATURE (and vLLM's spellings of both), `on` saying what it turns on; group None:
    an `LLM(...)` keyword with no flag."""
    return field(default=default, metadata=dict(group=group, help=help, type=type, choices=choices, flag=flag,
                                                short=short, from_cli=from_cli, on=on))


def _json(text: str | None) -> dict | None:
    return json.loads(text) if text else None


def _speculative(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.of(text)
    except (ValueError, TypeError) as exc:  # (JSON's errors are ValueErrors)
        raise argparse.ArgumentTypeError(str(exc)) from exc


KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


def kv_transfer(config: str | dict | None) -> dict:
    """vLLM's kv_transfer_config: kv_role (kv_both without one), and kv_ip, kv_port where the
    worker serves its host tier to other hosts; another key is a ValueError naming it: llmbus
    moves KV through its own host tier, no connector of vLLM's."""
    value = json.loads(config) if isinstance(config, str) else (config or {})
    unknown = sorted(set(value) - {"kv_role", "kv_ip", "kv_port"})
    if unknown:
        raise ValueError(f"kv_transfer_config: {', '.join(unknown)} not supported (llmbus takes kv_role, kv_ip and "
                         "kv_port; its KV moves through the host tier, --kv-offloading-size)")
    if not isinstance(value.get("kv_ip", ""), str) or not isinstance(value.get("kv_port", 0), int):
        raise ValueError("kv_transfer_config: kv_ip is an address (a string), kv_port a number")
    return value


def kv_role(config: str | dict | None) -> str:
    """vLLM's kv_transfer_config's role (kv_both without one)."""
    role = kv_transfer(config).get("kv_role", "kv_both")
    if role not in KV_ROLES:
        raise ValueError(f"kv_transfer_config: kv_role {role!r} is not one of {', '.join(KV_ROLES)}")
    return role


def _gigabytes(gb: float | None) -> int | None:
    return None if gb is None else int(gb * (1 << 30))


_PARALLEL_HELP = "vLLM's; 1 only: a worker's ranks split its layers (--tensor-parallel-size), not its depth"


@dataclass
class EngineArgs:
    # -- the model ("model": every service reads it)
    model: str | None = arg(None, "model", "a local HF folder, a Hub id or a known model (llmbus model fetch)")
    tokenizer: str | None = arg(None, "model", "vLLM's: the tokenizer's folder or Hub id, where not the model's own")
    max_model_len: int | None = arg(None, "model", "context length (default: the model's; vLLM's sizes: 32k = "
                                    "32000, 32K = 32768)", type=human_int)
    tokenizer_mode: str = arg("auto", "model", "vLLM's; auto only: the tokenizer's fast (Rust) implementation, "
                              "as vLLM's auto", choices=["auto"])
    # the model's recommended sampling defaults (shared/hf/generation_config.py)
    generation_config: str = arg("auto", "model", SOURCES_HELP)
    override_generation_config: dict | None = arg(
        None, "model", 'JSON on top of the generation config, e.g. \'{"temperature": 0.5}\'', from_cli=_json)
    revision: str | None = arg(None, "model", "a Hub model's commit, branch or tag (vLLM's; default: main)")
    download_dir: str | None = arg(None, "model", "where Hub models are kept, in place of the Hugging Face cache "
                                   "(vLLM's)")
    hf_overrides: dict | None = arg(None, "model", 'vLLM\'s: JSON over the model\'s config.json, e.g. '
                                    '\'{"max_position_embeddings": 8192}\'', type=json_object, from_cli=_json)
    # vLLM's: the gateway holds a prompt to N images, and at 0 the workers load no image encoder
    limit_mm_per_prompt: dict | None = arg(
        None, "model", 'the most images a prompt may hold, as \'{"image": N}\' (default: no limit); 0: the language '
        'model alone, its image encoder not loaded', type=json_object, from_cli=_json)
    # vLLM's, so its command lines run as typed: llmbus runs no code from a checkpoint (an
    # architecture it does not implement is refused by name), so there is nothing to trust.
    trust_remote_code: bool = arg(False, "model", "accepted for vLLM's command lines; llmbus runs no code from the "
                                  "checkpoint")
    # -- the worker
    dtype: str = arg("float32", "worker", "default float32 (greedy output as transformers' in float32); auto: the "
                     "checkpoint's own, as vLLM's default (float16 runs as bfloat16 on a CPU); half = float16, "
                     "float = float32", choices=DTYPE_CHOICES)
    quantization: str | None = arg(
        None, "worker", "with --dtype bfloat16 (a GPU's int4: or float16): int4 (4-bit weights in groups of 32; a "
        "GGUF Q4, AWQ or GPTQ checkpoint keeps its exact grid, and a 4-bit checkpoint takes int4 without asking; on "
        "a GPU the Triton kernel) or int8 (per-channel int8 weights, CPU only)", choices=["int8", "int4"])
    seed: int | None = arg(None, "worker", "vLLM's: requests without a seed of their own draw from this one, so a "
                           "run repeats (default: fresh randomness; benchmarks: 0, which picks their workload too)",
                           type=int)
    num_kv_blocks: int | None = arg(None, "worker", "exact KV cache size in blocks", type=int)
    kv_cache_memory_bytes: int | None = arg(
        None, "worker", "KV cache budget when --num-kv-blocks is not given (default 1, or vLLM's "
        "VLLM_CPU_KVCACHE_SPACE; on a GPU, --gpu-memory-utilization's share where given)",
        type=float, flag="--kv-cache-memory-gb", from_cli=_gigabytes)
    gpu_memory_utilization: float | None = arg(
        None, "worker", "vLLM's: on a GPU, the share of its memory the worker may hold, the KV cache taking what the "
        "model leaves (a CPU's cache is --kv-cache-memory-gb's, as vLLM's CPU backend)", type=float)
    block_size: int = arg(16, "worker", type=int)
    kv_cache_dtype: str = arg("auto", "worker", "auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2: one byte a "
                              "value, twice the tokens per GB (docs/performance/history.md for how often greedy "
                              "output moves)", choices=KV_CACHE_DTYPES)
    kv_offloading_size: float | None = arg(
        None, "worker", "vLLM's: GiB of host memory for a KV tier the workers of a host share (a shared-memory file):"
        " blocks a worker computed are copied there, and a prompt whose prefix the tier holds loads it instead of "
        "computing it again, on any worker of the host (needs prefix caching)", type=float)
    kv_offloading_disk_path: str | None = arg(
        None, "worker", "a folder on a disk for a KV tier behind the host's (with --kv-offloading-disk-size): "
        "blocks the host tier gives up move there, and a prefix found there loads from it")
    kv_offloading_disk_size: float | None = arg(None, "worker", "GiB of the disk KV tier (--kv-offloading-disk-path)",
                                                type=float)
    kv_offloading_backend: str = arg("native", "worker", "vLLM's: native, llmbus's own host tier (lmcache is not "
                                     "supported)", choices=["native"])
    kv_transfer_config: str | dict | None = arg(
        None, "worker", 'vLLM\'s: \'{"kv_role": "kv_producer"}\' (a prefill worker: it computes prompts and '
        'hands them over), "kv_consumer" (a decode worker: it takes them over, their KV loaded from the host\'s '
        'tier) or "kv_both" (the default: both); `llmbus serve --prefill-workers P --decode-workers D` sets it. '
        '"kv_ip", "kv_port": where it serves its host tier to other hosts\' workers (default: every interface, '
        'a free port)', type=json_object)
    attention_backend: str | None = arg(None, "worker", "default: triton on a GPU, torch on CPU",
                                        choices=["torch", "triton"])
    threads: int | None = arg(None, "worker", "torch threads for the model (default: torch's, one per core)",
                              type=int)
    tensor_parallel_size: int = arg(1, "worker", "vLLM's: the worker's ranks (processes in one torch.distributed "
                                    "group: NCCL on GPUs, gloo on CPU), each holding a slice of every layer and "
                                    "of the KV cache", type=int, short="-tp")
    enable_expert_parallel: bool = arg(False, "worker", "vLLM's: the tensor-parallel ranks split a sparse MLP's "
                                       "experts among them, each expert whole on one rank, instead of a slice of "
                                       "every expert on every rank")
    pipeline_parallel_size: int = arg(1, "worker", _PARALLEL_HELP, type=one_device, short="-pp")
    swap_space: float | None = arg(None, "worker", "vLLM's; accepted as typed: a preempted request is recomputed, "
                                   "as in vLLM's V1 engine, so no CPU swap space is kept", type=float)
    enforce_eager: bool = arg(False, "worker", "no CUDA graphs for decode steps (a GPU's default)")
    max_cudagraph_capture_size: int | None = arg(
        None, "worker", "the largest decode batch (rows: requests and their drafts) run as a CUDA graph (default, "
        "as vLLM's: 2x --max-num-seqs, at most 512)", type=int)
    load_format: str = arg("auto", "worker", "dummy: random weights of the config's shape (timing without a "
                           "checkpoint)", choices=["auto", "dummy"])
    # vLLM's LoRA flags: the adapters themselves are named to the gateway (--lora-modules)
    # or offline per request (LoRARequest); the worker reads them when first asked.
    enable_lora: bool = arg(False, "worker", "serve LoRA adapters on top of the model (--lora-modules names them)")
    max_loras: int = arg(1, "worker", "LoRA adapters one step can mix (each takes a slot of stacked weights)",
                         type=int)
    max_lora_rank: int = arg(16, "worker", "the largest LoRA rank served", type=int)
    max_cpu_loras: int | None = arg(None, "worker", "adapters kept read in memory, least recently used dropped "
                                    "(default: --max-loras)", type=int)
    device: str | None = arg(None, None)  # offline only: "cuda" when there is one, else "cpu"
    # -- data parallelism: scheduler shards, each with workers of its own
    data_parallel_size: int = arg(1, "data_parallel", "vLLM's: scheduler shards (`llmbus serve` starts them, its "
                                  "workers spread over them; gateways route each request to one by load and "
                                  "prefix); a worker without --data-parallel-rank joins one by a hash of its id",
                                  type=int, short="-dp")
    data_parallel_rank: int | None = arg(None, "data_parallel", "vLLM's: this scheduler's shard, or the shard this "
                                         "worker joins (0 to --data-parallel-size - 1)", type=int, short="-dpn")
    # -- the scheduler
    max_num_seqs: int = arg(128, "scheduler", type=int)
    max_num_batched_tokens: int = arg(2048, "scheduler", type=human_int)
    enable_chunked_prefill: bool = arg(True, "scheduler", "prefill each prompt in one step (then "
                                       "--max-num-batched-tokens must cover --max-model-len)", on="chunked prefill on")
    long_prefill_token_threshold: int = arg(0, "scheduler", type=int)
    scheduling_policy: str = arg("fcfs", "scheduler", "priority: a request's `priority` (lower first) orders "
                                 "admission and preemption", choices=SCHEDULING_POLICIES)
    max_logprobs: int = arg(20, "scheduler", "vLLM's: the most logprobs a request may ask for (-1: the whole "
                            "vocabulary)", type=int)
    max_local_prefill_length: int = arg(
        0, "scheduler", "Dynamo's, with --prefill-workers: a new prompt with at most this many tokens left to "
        "compute on a decode worker (its prefix cache counted) is prefilled there (0: every one on a prefill "
        "worker)", type=int)
    async_scheduling: bool = arg(True, "scheduler", "wait for each step's answer before building the next "
                                 "(default: keep two in flight)", on="two steps in flight")
    kv_events_config: str | dict | None = arg(
        None, "scheduler", 'vLLM\'s: \'{"enable_kv_cache_events": true}\' publishes what enters and leaves each '
        "worker's prefix cache (BlockStored, BlockRemoved, AllBlocksCleared) on the bus, for a router to route by "
        "(docs/serving/deployment.md)", type=json_object)
    # The scheduler looks prefixes up; a hybrid model's worker keeps snapshots of its
    # recurrent state for them only where the cache is on: both take it.
    enable_prefix_caching: bool = arg(True, "prefix_caching", on="prefix caching on")
    # The scheduler reserves the drafts' slots and the worker proposes them: both take it.
    speculative_config: SpeculativeConfig | None = arg(
        None, "speculative", 'vLLM\'s speculative_config as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or '
        '\'{"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3}\' or '
        '\'{"method": "mtp", "num_speculative_tokens": 1}\' (the checkpoint\'s own MTP layer) or '
        '\'{"method": "eagle3", "model": "/models/eagle3-head"}\'', type=_speculative)

    def __post_init__(self) -> None:
        one_device_size("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {self.data_parallel_size}")
        if self.data_parallel_rank is not None and not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank {self.data_parallel_rank} is not a shard of "
                             f"data_parallel_size {self.data_parallel_size} (0 to {self.data_parallel_size - 1})")
        if self.tokenizer_mode != "auto":
            raise ValueError(f"tokenizer_mode={self.tokenizer_mode!r}: llmbus takes auto only (the fast tokenizer)")
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        KVEventsConfig.parse(self.kv_events_config)  # (a key or publisher it does not know: a ValueError)
        self.limit_mm_per_prompt = check_limit_mm(self.limit_mm_per_prompt or {})
        kv_role(self.kv_transfer_config)  # (a key or role it does not know: a ValueError)
        if (self.kv_offloading_disk_path is None) != (self.kv_offloading_disk_size is None) or \
                self.kv_offloading_disk_path is not None and self.kv_offloading_size is None:
            raise ValueError("--kv-offloading-disk-path and --kv-offloading-disk-size go together, behind a host "
                             "tier (--kv-offloading-size)")
        if self.kv_offloading_size is not None and not self.enable_prefix_caching:
            raise ValueError("--kv-offloading-size needs prefix caching: the tier is found by the prefix cache's "
                             "block hashes (drop --no-enable-prefix-caching)")

    # ---- the configs each half of the engine is built with -------------------------------

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                           kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                           gpu_memory_utilization=self.gpu_memory_utilization, cache_dtype=self.kv_cache_dtype,
                           enable_prefix_caching=self.enable_prefix_caching,
                           kv_offloading_size=_gigabytes(self.kv_offloading_size),
                           kv_offloading_disk_size=_gigabytes(self.kv_offloading_disk_size),
                           kv_offloading_disk_path=self.kv_offloading_disk_path)

    def lora_config(self) -> LoRAConfig | None:
        """None without enable_lora; limits that cannot hold are a ValueError saying why."""
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None

    def worker_config(self, tokenizer: str | None = None) -> WorkerConfig:
        """`tokenizer`: --tokenizer's folder once resolved (a Hub id is downloaded first)."""
        return WorkerConfig(
            self.cache_config(), dtype=self.dtype, attention_backend=self.attention_backend,
            max_model_len=self.max_model_len, device=self.device, quantization=self.quantization,
            speculative_config=self.speculative_config, enforce_eager=self.enforce_eager,
            # Decode rows are requests, and drafts with speculation: vLLM's 2x max_num_seqs, to 512.
            max_cudagraph_capture_size=self.max_cudagraph_capture_size or min(2 * self.max_num_seqs, 512),
            load_format=self.load_format, lora_config=self.lora_config(), seed=self.seed,
            tokenizer=tokenizer or self.tokenizer, max_num_seqs=self.max_num_seqs,
            kv_role=kv_role(self.kv_transfer_config), tensor_parallel_size=self.tensor_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            kv_ip=kv_transfer(self.kv_transfer_config).get("kv_ip", ""),
            kv_port=kv_transfer(self.kv_transfer_config).get("kv_port", 0),
            limit_mm_per_prompt=self.limit_mm_per_prompt)

    def scheduler_config(self, model_max_len: int | None = None) -> SchedulerConfig:
        """`model_max_len`: the model's, when known here; served, each worker caps it later."""
        spec = self.speculative_config
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=scheduler_context(self.max_model_len, model_max_len, self.max_num_batched_tokens,
                                            self.enable_chunked_prefill),
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_chunked_prefill=self.enable_chunked_prefill, enable_prefix_caching=self.enable_prefix_caching,
            scheduling_policy=self.scheduling_policy, max_logprobs=self.max_logprobs,
            max_local_prefill_length=self.max_local_prefill_length,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            speculative_disable_by_batch_size=spec.disable_by_batch_size if spec else None,
            speculative_probation=not spec or spec.rejection_sample_method != "synthetic")

    def kwargs(self) -> dict:
        """`LLM(model, **kwargs)`'s keywords (every field but the model)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}

    # ---- the command line ----------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *groups: str, only: tuple[str, ...] = (),
                     help: dict[str, str] | None = None) -> None:
        """The flags of the fields in `groups` (or the fields named in `only`); `help`: a
        command's own help for a field."""
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if not (meta["group"] in groups or f.name in only) or meta["group"] is None:
                continue
            text = (help or {}).get(f.name, meta["help"])
            if meta["on"]:
                _add_switch(parser, f.name, meta["on"], text)
            elif f.type == "bool":
                parser.add_argument(_flag(f), action="store_true", default=env_flag(_flag(f)), help=text)
            else:
                names = [_flag(f)] + ([meta["short"]] if meta["short"] else [])
                parser.add_argument(*names, type=meta["type"], choices=meta["choices"],
                                    default=env(_flag(f), f.default), help=text or None)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """From a command's parsed flags; a field whose flag the command lacks keeps its default."""
        values = {}
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if meta["group"] is None:
                continue
            if meta["on"]:
                dest = "no_" + _feature(f.name).replace("-", "_")
                if hasattr(args, dest):
                    values[f.name] = not getattr(args, dest)
                continue
            dest = _flag(f).lstrip("-").replace("-", "_")
            if hasattr(args, dest):
                value = getattr(args, dest)
                values[f.name] = meta["from_cli"](value) if meta["from_cli"] else value
        return cls(**values)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _feature(name: str) -> str:
    return name.removeprefix("enable_").replace("_", "-")


def _add_switch(parser: argparse.ArgumentParser, name: str, on: str, help_text: str) -> None:
    """An on-by-default switch: --no-FEATURE (its LLMBUS_NO_FEATURE variable), and vLLM's
    spellings (--enable-FEATURE and --no-enable-FEATURE; --async-scheduling), whose default
    stays --no-FEATURE's."""
    feature = _feature(name)
    dest = "no_" + feature.replace("-", "_")
    parser.add_argument(f"--no-{feature}", action="store_true", default=env_flag(f"--no-{feature}"),
                        help=help_text or None)
    parser.add_argument("--" + name.replace("_", "-"), dest=dest, action="store_false", default=argparse.SUPPRESS,
                        help=f"vLLM's spelling: {on} (the default)")
    if name.startswith("enable_"):
        parser.add_argument(f"--no-{name.replace('_', '-')}", dest=dest, action="store_true",
                            default=argparse.SUPPRESS, help=f"vLLM's spelling of --no-{feature}")
