"""Small configs, one per component, validated where they are made."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.hf.classification import Classifier

SCHEDULING_POLICIES = ("fcfs", "priority")


def scheduler_context(asked: int | None, model: int | None, max_num_batched_tokens: int,
                      enable_chunked_prefill: bool) -> int:
    """A scheduler's context (max_model_len): the one asked for, else the model's (served, each
    worker caps it later: Scheduler.for_worker). Without chunked prefill a prompt must fit in
    one step's budget, so that caps a context nobody asked for; one asked for past it is
    SchedulerConfig's error."""
    context = asked or model or (1 << 31)
    if not enable_chunked_prefill and not asked:
        context = min(context, max_num_batched_tokens)
    return context


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # requests running at once
    max_num_batched_tokens: int = 2048  # the token budget of one step
    max_model_len: int = 2048  # context: prompt + output, capped by model and cache
    # Cap on one request's share of a step's budget (0 = no cap), so a long prompt
    # cannot starve the decodes running beside it.
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    # The scheduler owns every block pool, so the prefix cache is its to turn off.
    enable_prefix_caching: bool = True
    # Speculative decoding: draft slots reserved per decoding request and step (0 = off),
    # and the running batch beyond which no request speculates (None: never off).
    num_speculative_tokens: int = 0
    speculative_disable_by_batch_size: int | None = None
    # Whether a request whose drafts keep failing stops speculating (not under synthetic
    # acceptance, whose rates are set, not earned)
    speculative_probation: bool = True
    # vLLM's: "fcfs", or "priority" (a request's `priority`, lower first, then arrival, orders
    # the waiting queue, and the running request last in that order is the one preempted).
    scheduling_policy: str = "fcfs"
    # vLLM's: the most logprobs (and prompt_logprobs) a request may ask for; -1: the whole
    # vocabulary. Each asked for is a column of a [rows, vocab] top-k and of the copy back.
    max_logprobs: int = 20
    # Dynamo's conditional disaggregation: a new prompt with at most this many tokens left
    # to compute on a decode worker (its prefix cache counted) is prefilled there, not
    # handed over; 0: every new prompt goes to a prefill worker.
    max_local_prefill_length: int = 0

    def __post_init__(self) -> None:
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the whole vocabulary) or non-negative, got {self.max_logprobs}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be non-negative")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must cover max_model_len ({self.max_model_len})"
            )


# vLLM's --dtype values: its other spellings, and "auto" (the checkpoint's: loader.resolve_dtype)
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "half", "float")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

# The most the gateway waits for a structured-output spec's check: a tokenizer replica's
# compiling child starting (the vocabulary loaded: ~2 s for SmolLM2 here) plus its compile
# timeout (5 s by default; --structured-outputs-compile-timeout may not leave less than 5 s
# of this for the child's start).
STRUCTURED_CHECK_TIMEOUT_S = 30.0


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # exact number of blocks; wins over the memory budget
    # The budget when num_kv_blocks is not given; None: gpu_memory_utilization's share on a
    # GPU where that is given, else the default (services/worker/kv_cache.py: kv_cache_budget).
    kv_cache_memory_bytes: int | None = None
    # vLLM's: on a GPU, the share of its memory this worker may hold, the KV cache taking
    # what the loaded model and a step's work leave of it. A CPU's cache is the budget's.
    gpu_memory_utilization: float | None = None
    # "auto": the model's dtype; "fp8" (= "fp8_e4m3") or "fp8_e5m2": one byte per value,
    # twice the tokens in the same memory and half the bytes for attention to read.
    cache_dtype: str = "auto"
    # The scheduler's flag, which the worker needs too: a hybrid model's worker keeps
    # snapshots of its recurrent state for the prefix cache only where it is on.
    enable_prefix_caching: bool = True
    # vLLM's --kv-offloading-size (GiB on the command line): a host-memory KV tier of this
    # many bytes shared by the workers of a host (services/worker/kv_tier.py); None: none.
    kv_offloading_size: int | None = None
    # Its file (services/worker/kv_tier.py: tier_path); None: a tier of the process alone
    kv_offloading_path: str | None = None
    # A disk tier behind it (--kv-offloading-disk-path, --kv-offloading-disk-size): bytes,
    # and the folder its file goes in; None: none.
    kv_offloading_disk_size: int | None = None
    kv_offloading_disk_path: str | None = None

    def __post_init__(self) -> None:
        if self.kv_offloading_size is not None and self.kv_offloading_size < 1:
            raise ValueError("kv_offloading_size must be positive")
        if (self.kv_offloading_disk_size is None) != (self.kv_offloading_disk_path is None):
            raise ValueError("a disk KV tier takes both kv_offloading_disk_path and kv_offloading_disk_size")
        if self.kv_offloading_disk_size is not None and (self.kv_offloading_disk_size < 1
                                                         or self.kv_offloading_size is None):
            raise ValueError("kv_offloading_disk_size must be positive, behind a host tier (kv_offloading_size)")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(slots=True)
class GatewayConfig:
    model_name: str
    # vLLM's further --served-model-name names: clients may ask for them; answers name model_name
    model_aliases: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()  # any of them opens /v1 (`Authorization: Bearer KEY`)
    api_key_file: str | None = None  # more keys, one per line, read again on SIGHUP
    metrics_require_key: bool = False  # /metrics behind the key too (/health stays open)
    max_body_bytes: int = 4 << 20
    idle_timeout_s: float = 300.0  # a request whose engine stays silent this long fails
    # How long requests in flight wait for a scheduler to come back and resume them.
    scheduler_resume_timeout_s: float = 30.0
    tool_call_parser: str = "hermes"  # how tool_choice auto reads the model's calls (parsers/tool/)
    # GET /tokenizer_info (vLLM's flag): the tokenizer's special tokens and chat template,
    # which lm-evaluation-harness's remote tokenizer reads. Off by default, as there.
    enable_tokenizer_info_endpoint: bool = False
    reasoning_parser: str | None = None  # vLLM's: the thinking apart from the content (parsers/reasoning.py)
    # The model's sampling defaults for fields a request leaves out (generation_config.py)
    default_sampling: dict = field(default_factory=dict)
    # The file's eos_token_id: those beyond the tokenizer's EOS end a request (generation_config.py)
    model_eos_ids: tuple[int, ...] = ()
    # Why /v1/embeddings cannot serve this model as it asks (shared/hf/pooling_config.py), or None
    unsupported_pooling: str | None = None
    # A sequence classifier's labels and activation (shared/hf/classification.py): /classify
    # serves it, and embeddings are refused; None: not a classifier
    classifier: Classifier | None = None
    # vLLM's --lora-modules: the adapters clients may name as their `model` (name -> LoRARequest)
    lora_modules: dict = field(default_factory=dict)
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter
    allow_runtime_lora_updating: bool = False
    # vLLM's --chat-template (a file or the template): the tokenizers render with it, and
    # /tokenizer_info shows it
    chat_template: str | None = None
    # CORS, vLLM's flags and defaults (any origin, method and header; no credentials): a
    # browser's page may call the API, with its key, as it may call vLLM's
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # vLLM's: X-Request-Id on every response, the request's own or a new one
    enable_request_id_headers: bool = False
    # vLLM's --disable-fastapi-docs: no /docs, /redoc, /openapi.json
    disable_fastapi_docs: bool = False
    # The Responses API's stored responses (store.py): at most this much memory,
    # the least recently used dropped first; 0 stores none
    responses_store_bytes: int = 256 << 20
    # The gateways serving one port together (`llmbus serve --api-server-count`) share an
    # id: a scrape of /metrics at any of them is answered with all of theirs ("": alone)
    api_server_group: str = ""
    # vLLM's API server flags
    return_tokens_as_token_ids: bool = False  # the request field's default
    force_include_usage: bool = False  # every stream ends with its usage
    server_load_tracking: bool = False  # GET /load
    root_path: str = ""  # the prefix a proxy serves the API under
    # vLLM's request logging: --enable-log-requests adds a line as each request arrives (its
    # prompt and parameters), --enable-log-outputs its choices' text to its finished line,
    # each prompt, text and id list cut to --max-log-len (None: whole)
    log_request_inputs: bool = False
    log_outputs: bool = False
    max_log_len: int | None = None
    # Images in chats (services/gateway/media.py), vLLM's flags: the hosts http(s) image
    # URLs may name (empty: any), the folder file:// ones must lie under (None: none may),
    # the most images a prompt holds ({"image": N}; absent: any number); and why this
    # model takes none (shared/hf/image_models.py), None where it takes them
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    limit_mm_per_prompt: dict = field(default_factory=dict)
    no_images_why: str | None = "this model takes no images"

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be positive")
        if self.idle_timeout_s <= 0:
            raise ValueError("idle_timeout_s must be positive")
        if self.responses_store_bytes < 0:
            raise ValueError("responses_store_bytes must not be negative")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError("max_log_len must not be negative")
        check_limit_mm(self.limit_mm_per_prompt)


def check_limit_mm(limit: dict) -> dict:
    """vLLM's limit_mm_per_prompt: {"image": N}, N >= 0 ({}: no limit); anything else is a
    ValueError naming it."""
    other = sorted(set(limit) - {"image"})
    if other or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in limit.values()):
        raise ValueError(f"limit_mm_per_prompt takes {{\"image\": N}} (N >= 0) only, got {limit}")
    return limit


@dataclass(slots=True)
class LoRAConfig:
    """vLLM's LoRA flags (--enable-lora turns these on): how many adapters one step can
    mix (each a slot of stacked weights in the worker), the largest rank a slot holds, and
    how many adapters the worker keeps read from disk (least recently used dropped)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")


# A big batch is compute-bound: drafts pay there only at high acceptance (W1, 128 at once,
# 0.96 accepted: 1.064x; at middling acceptance not measured yet), so by default only
# batches of up to 8 speculate (docs/performance/history.md).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


# vLLM's names of the MTP method from before it had one name (its config maps them so)
MTP_METHODS = ("deepseek_mtp", "glm4_moe_mtp", "glm4_moe_lite_mtp")


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`. "ngram" (prompt lookup): the worker proposes up to
    `num_speculative_tokens` drafts from the tokens that followed the latest earlier
    occurrence of the context's last n tokens, n from `prompt_lookup_max` down to
    `prompt_lookup_min`. "draft_model": `model`, a smaller model of the target's
    vocabulary (its folder, once the llmbus command or LLM resolved its name), proposes
    them by argmax (services/worker/sample/draft_model.py). "mtp": the checkpoint's own
    multi-token-prediction layer (DeepSeek-V3's, GLM-4.5's) proposes them from the target's
    hidden states, vLLM's older per-family names (MTP_METHODS) meaning it too; "eagle3":
    `model`, an EAGLE-3 head trained for the target, proposes them from three of the
    target's layers' hidden states (services/worker/sample/hidden_state_drafter.py)."""

    method: str = "ngram"
    model: str | None = None  # the draft model's or head's folder (draft_model, eagle3); mtp: the target's when None
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # With more requests running than this, none speculates (vLLM's V0 name): a big
    # batch's step is bound by compute, not by reading the weights, and a draft costs
    # what it saves.
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    # vLLM's benchmarking knob: "synthetic" accepts each draft with a set probability
    # (given those before it accepted) instead of checking it, so a speed figure can be
    # read at a chosen acceptance length; the text is then not the model's.
    rejection_sample_method: str = "strict"
    # vLLM's: a model drafter's drafts by argmax ("greedy"), or ("probabilistic") for a
    # seeded request at temperature > 0 drawn from the drafter's distribution with the draw
    # the target's sampler takes at that position (sample/sampler.py's draft_ids): drafts
    # that agree with the target more often, never another output (each is verified)
    draft_sample_method: str = "greedy"
    synthetic_acceptance_length: float | None = None  # mean tokens a drafting step, in [1, k + 1]
    synthetic_acceptance_rates: list[float] | None = None  # or each position's rate, k of them

    def __post_init__(self) -> None:
        if self.method in MTP_METHODS:
            self.method = "mtp"
        if self.method not in ("ngram", "draft_model", "mtp", "eagle3"):
            raise ValueError("speculative_config method must be ngram, draft_model, mtp or eagle3, got "
                             f"{self.method!r}")
        if self.method in ("draft_model", "eagle3") and self.model is None \
                or self.method == "ngram" and self.model is not None:
            raise ValueError(f"speculative_config method {self.method} takes a `model` (the drafter's folder)"
                             if self.model is None else f"speculative_config method {self.method} takes no `model`")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        self._check_synthetic()
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError(f"draft_sample_method must be greedy or probabilistic, got {self.draft_sample_method!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    def _check_synthetic(self) -> None:
        k, length, rates = (self.num_speculative_tokens, self.synthetic_acceptance_length,
                            self.synthetic_acceptance_rates)
        if self.rejection_sample_method not in ("strict", "synthetic"):
            raise ValueError("rejection_sample_method must be strict or synthetic, got "
                             f"{self.rejection_sample_method!r}")
        if self.rejection_sample_method == "strict":
            if length is not None or rates is not None:
                raise ValueError("synthetic_acceptance_length and synthetic_acceptance_rates take "
                                 'rejection_sample_method "synthetic"')
        elif (length is None) == (rates is None):
            raise ValueError('rejection_sample_method "synthetic" takes one of synthetic_acceptance_length and '
                             "synthetic_acceptance_rates")
        elif length is not None and not 1 <= length <= k + 1:
            raise ValueError(f"synthetic_acceptance_length must be in [1, {k + 1}] (num_speculative_tokens + 1), "
                             f"got {length}")
        elif rates is not None and (len(rates) != k or not all(0 <= r <= 1 for r in rates)):
            raise ValueError(f"synthetic_acceptance_rates must be {k} rates in [0, 1] (one a draft position), "
                             f"got {rates}")

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From `LLM(speculative_config=...)` or `--speculative-config '<json>'`; a key
        llmbus does not know is a ValueError naming it."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json

            value = json.loads(value)
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"speculative_config does not take {', '.join(sorted(unknown))}")
        return cls(**value)


@dataclass(slots=True)
class WorkerConfig:
    """What a model runner is built with (ModelRunner(model_path, WorkerConfig)): the offline
    LLM and `llmbus worker` build one each, from the same flags."""

    cache_config: CacheConfig = field(default_factory=CacheConfig)
    dtype: str = "float32"  # --dtype: float32 (transformers' greedy output), bfloat16, float16, auto
    attention_backend: str | None = None  # None: triton on a GPU, torch on a CPU
    max_model_len: int | None = None  # None: the model's
    device: str | None = None  # None: "cuda" when there is one, else "cpu"
    quantization: str | None = None  # --quantization int8|int4; None: the checkpoint's own where served so
    speculative_config: SpeculativeConfig | None = None
    enforce_eager: bool = False  # no CUDA graphs
    max_cudagraph_capture_size: int = 256  # the largest decode batch captured as a graph
    load_format: str = "auto"  # "dummy": random weights of the config's shape
    lora_config: LoRAConfig | None = None  # --enable-lora: serve LoRA adapters
    seed: int | None = None  # vLLM's --seed: unseeded requests' draws repeat from run to run
    tokenizer: str | None = None  # vLLM's --tokenizer: where grammars read the vocabulary (default: the model)
    max_num_seqs: int = 128  # a hybrid model's recurrent state is allocated for this many requests
    kv_role: str = "kv_both"  # vLLM's kv_transfer_config role: kv_producer (prefill), kv_consumer (decode)
    tensor_parallel_size: int = 1  # the worker's ranks, each a slice of every layer (services/worker/parallel)
    enable_expert_parallel: bool = False  # the ranks split a sparse MLP's experts, each whole, instead of slicing each
    # vLLM's kv_transfer_config kv_ip, kv_port: where it serves its host tier's slots to other
    # hosts' workers ("": every interface, the host's address announced; 0: a free port)
    kv_ip: str = ""
    kv_port: int = 0
    # vLLM's limit_mm_per_prompt: {"image": 0} serves the language model alone (no image
    # encoder loaded: vision/encoder.py), as vLLM does; the gateway holds a prompt to N.
    limit_mm_per_prompt: dict = field(default_factory=dict)
