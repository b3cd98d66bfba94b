"""The service subcommands: `llmbus gateway|tokenizer|scheduler|worker|serve`.

Every knob is a flag with an `LLMBUS_*` environment default (shared/flags.py), so
compose files and `llmbus serve` start the very same commands; `serve` hands each child
its flags as those variables instead of rendering them back into argv.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import uuid

from llmbus.cli.args import (or_exit, add_engine_args, as_env, gateway_config, lora_config, lora_modules,
                             runtime_lora_updating)
from llmbus.cli.service_args import (
    add_bus_args,
    add_bus_auth_args,
    add_chat_template_arg,
    add_gateway_args,
    add_served_model_name_arg,
    add_tokenizer_args,
    add_tracing_args,
    bus_auth,
)
from llmbus.model_fetch import (DEFAULT_MODEL, KNOWN_MODELS, is_hub_id, resolve_model, resolve_tokenizer,
                                 with_draft_resolved, with_hf_overrides)
from shared.engine_args import GROUPS, EngineArgs
from shared.event_loop import run
from shared.flags import env, env_flag
from shared.shards import shard_of
from shared.gc_heap import freeze_heap
from shared.kv_events import KVEventsConfig
from shared.hf.generation_config import default_sampling


def served_names(args: argparse.Namespace) -> list[str]:
    """The names clients may ask for, the deployment's own first: --served-model-name's, or
    the model's."""
    return [name for name in args.served_model_name or [] if name] or [_model_name(args)]


def served_name(args: argparse.Namespace) -> str:
    """The deployment's own name (its subjects, its answers' `model`)."""
    return served_names(args)[0]


def _model_name(args: argparse.Namespace) -> str:
    """The name a model is served under when none is given, as vLLM names it."""
    if args.model is None or args.model in KNOWN_MODELS:
        return args.model or DEFAULT_MODEL
    if is_hub_id(args.model) and not os.path.exists(args.model):
        return args.model  # as vLLM names it: clients send "org/name"
    return os.path.basename(os.path.normpath(args.model))


def _setup(args) -> tuple[str, str]:
    """The model's folder (fetched or downloaded once) and the deployment's name; the names
    are filled in where none was given, and --tokenizer made a folder too."""
    overrides = EngineArgs.from_cli_args(args).hf_overrides
    path = str(with_hf_overrides(resolve_model(args.model, args.revision, args.download_dir), overrides))
    args.served_model_name = served_names(args)
    if args.tokenizer:
        args.tokenizer = str(resolve_tokenizer(args.tokenizer, download_dir=args.download_dir))
    return path, args.served_model_name[0]


def tokenizer_folder(args, model_path: str) -> str:
    """Where the tokenizer is read: --tokenizer's folder (after _setup), else the model's."""
    return args.tokenizer or model_path


def _without_torch() -> None:
    """For the gateway and the tokenizers, which need transformers' tokenizer and chat
    templates and nothing of torch: transformers 5 imports torch whenever it is installed,
    ~190 MB and a second or more of CPU a process for nothing. `None` in sys.modules makes
    Python, and transformers' `is_torch_available`, take torch as absent in this process;
    a tokenizer's grammar-check child (spawned afresh) imports it as usual. After the
    model is resolved: converting a fetched checkpoint needs torch."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found" notice


class _FreezeWhenReady(asyncio.Event):
    """A service's `ready`: set once it serves, having first frozen the heap its start
    left (shared/gc_heap.py) — in the service's own process only, never a test's."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def set(self) -> None:
        freeze_heap(self.service)
        super().set()


def cmd_tokenizer(args) -> int:
    from services.tokenizer.shell.service import serve

    path, name = _setup(args)
    _without_torch()
    run(serve(tokenizer_folder(args, path), args.nats_url, name,
                      compile_timeout_s=args.structured_outputs_compile_timeout,
                      tool_chat_template=args.tool_chat_template, chat_template=args.chat_template,
                      auth=bus_auth(args), ready=_FreezeWhenReady("tokenizer"),
                      content_format=args.chat_template_content_format))
    return 0


def cmd_worker(args) -> int:
    from services.worker.shell.service import serve

    engine = or_exit(EngineArgs.from_cli_args, args)
    path, name = _setup(args)
    engine.speculative_config = or_exit(with_draft_resolved, engine.speculative_config, args.download_dir)
    args.worker_id = args.worker_id or uuid.uuid4().hex[:8]
    rank = shard_of(args.worker_id, engine.data_parallel_size, engine.data_parallel_rank)
    run(serve(path, args.nats_url, name, engine.worker_config(), args.worker_id, data_parallel_rank=rank, threads=args.threads,
                      auth=bus_auth(args), ready=_FreezeWhenReady("worker")))
    return 0


def cmd_scheduler(args) -> int:
    from services.scheduler.shell.service import serve

    engine = or_exit(EngineArgs.from_cli_args, args)
    run(serve(
        args.nats_url, served_name(args), engine.scheduler_config(),
        data_parallel_rank=engine.data_parallel_rank or 0,
        kv_events=KVEventsConfig.parse(engine.kv_events_config) is not None,
        step_timeout_s=args.step_timeout,
        heartbeat_timeout_s=args.heartbeat_timeout,
        gateway_timeout_s=args.gateway_timeout,
        no_worker_timeout_s=args.no_worker_timeout,
        max_waiting_requests=args.max_waiting_requests,
        async_scheduling=not args.no_async_scheduling,
        auth=bus_auth(args),
        ready=_FreezeWhenReady("scheduler"),
    ))
    return 0


def cmd_gateway(args) -> int:
    from services.gateway.shell.service import serve

    path, name = _setup(args)
    _without_torch()
    if args.disable_log_requests and not (args.enable_log_requests or args.enable_log_outputs):
        logging.getLogger("llmbus.requests").setLevel(logging.WARNING)
    serve(tokenizer_folder(args, path), args.nats_url, gateway_config(args, name, path), args.host, args.port,
          bus_auth(args), args.gateway_id, args.uvicorn_log_level, https(args), args.fd,
          access_log=not args.disable_uvicorn_access_log)
    return 0


def https(args: argparse.Namespace) -> dict:
    """uvicorn's TLS options from vLLM's flags ({} for plain HTTP); files it cannot read are
    a one-line error here, not a traceback from the server's start."""
    if args.ssl_keyfile and not args.ssl_certfile:
        raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate it belongs to)")
    if not args.ssl_certfile:
        return {}
    for flag, name in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)):
        if name and not os.access(name, os.R_OK):
            raise ValueError(f"{flag} {name}: no such readable file")
    return {"ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile}


# Flags of `serve` itself, not of any service it starts.
_SERVE_ONLY = {"command", "func", "verbose", "nats_url", "nats_cluster", "nats_tls", "nats_monitor", "tokenizers",
               "workers", "startup_timeout", "model_tag", "config", "api_server_count", "prefill_workers",
               "decode_workers"}


def cmd_serve(args) -> int:
    from llmbus.deploy.serve import run_serve

    if args.model_tag:  # `llmbus serve MODEL`, as `vllm serve MODEL` (over --model, as vLLM's)
        args.model = args.model_tag
    if args.lora_modules and not args.enable_lora:
        raise SystemExit("llmbus serve: --lora-modules needs --enable-lora (the workers serve the adapters)")
    lora_config(args)  # (bad limits or a wrong adapter fail here, before a fetch or a child)
    if args.api_server_count < 1:
        raise SystemExit("llmbus serve: --api-server-count must be at least 1")
    if args.data_parallel_size < 1:
        raise SystemExit("llmbus serve: --data-parallel-size must be at least 1")
    if args.prefill_workers or args.decode_workers:  # disaggregated: the two roles on this host
        if not (args.prefill_workers > 0 and args.decode_workers > 0) or args.kv_transfer_config:
            raise SystemExit("llmbus serve: --prefill-workers P --decode-workers D take P, D >= 1 (and set each "
                             "worker's --kv-transfer-config themselves)")
        if args.data_parallel_size > 1:
            raise SystemExit("llmbus serve: --prefill-workers/--decode-workers take --data-parallel-size 1")
        args.workers = args.prefill_workers + args.decode_workers
        if args.kv_offloading_size is None:  # (their KV moves through the host tier)
            args.kv_offloading_size = 1.0
    # vLLM's data parallelism is a model replica a shard: each shard gets a worker at least
    args.workers = max(args.workers, args.data_parallel_size)
    if args.api_server_count > 1 and runtime_lora_updating(warn=False):
        raise SystemExit("llmbus serve: runtime LoRA updating (VLLM_ALLOW_RUNTIME_LORA_UPDATING) loads an adapter "
                         "into the one gateway asked, not its siblings: it takes --api-server-count 1")
    https(args)  # (and TLS files the gateway could not read)
    lora_modules(args.lora_modules, args.max_lora_rank)
    args.model, _ = _setup(args)  # fetch once here, not in every child
    default_sampling(args.model, args.generation_config, args.override_generation_config)  # a bad one fails here
    # Workers on one machine share its cores: N workers with a thread per core each would
    # oversubscribe, and an OpenMP team stalls whenever one of its threads is descheduled.
    if args.threads is None and args.workers > 1:
        args.threads = max(1, (os.cpu_count() or 1) // args.workers)
    return run_serve(args, as_env(args, [name for name in vars(args) if name not in _SERVE_ONLY]))


def add_service_commands(sub) -> None:
    p = sub.add_parser("tokenizer", help="run a tokenizer replica")
    add_bus_args(p)
    add_engine_args(p, "model")
    add_tokenizer_args(p)
    p.set_defaults(func=cmd_tokenizer)

    p = sub.add_parser("worker", help="run a worker (model runner + KV cache)")
    add_bus_args(p)
    add_engine_args(p, "model", "worker", "prefix_caching", "speculative", "data_parallel")
    p.add_argument("--worker-id", default=env("--worker-id", None))
    # (the scheduler's flag: a hybrid model's worker allocates its recurrent state for that many
    # requests, and captures decode graphs up to twice that)
    EngineArgs.add_cli_args(p, only=("max_num_seqs",))
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("scheduler", help="run the scheduler")
    add_bus_args(p)
    add_engine_args(p, "model", "scheduler", "prefix_caching", "speculative", "data_parallel")
    p.add_argument("--step-timeout", type=float, default=float(env("--step-timeout", 120.0)),
                   help="seconds a worker may take for one step before it is declared dead")
    p.add_argument("--heartbeat-timeout", type=float, default=env("--heartbeat-timeout", 2.0),
                   help="seconds without a worker heartbeat before it is declared dead")
    p.add_argument("--gateway-timeout", type=float, default=env("--gateway-timeout", 10.0),
                   help="seconds without a gateway heartbeat before its requests are dropped (their clients "
                        "went with it); one that speaks again resumes them")
    p.add_argument("--no-worker-timeout", type=float, default=env("--no-worker-timeout", 30.0),
                   help="seconds a request may wait while no worker is up")
    p.add_argument("--max-waiting-requests", type=int, default=env("--max-waiting-requests", 0),
                   help="beyond this many waiting requests new ones get 429 (0 = no limit)")
    p.set_defaults(func=cmd_scheduler)

    p = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway")
    add_bus_args(p)
    add_engine_args(p, "model")
    add_gateway_args(p)
    add_chat_template_arg(p)
    p.add_argument("--gateway-id", default=env("--gateway-id", None),
                   help="this gateway's id, its bus identity and the first token of its outputs subject (default: "
                        "random; `llmbus serve` keeps one across restarts)")
    p.add_argument("--fd", type=int, default=None,
                   help="uvicorn's: serve on the listening socket of this inherited file descriptor, not --host and "
                        "--port (`llmbus serve` hands its port's to every gateway it starts)")
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("serve", help="run a whole deployment on this machine")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as `vllm serve MODEL` (or --model)")
    # (SUPPRESS: absent here, `llmbus -v serve`'s value stands; a subcommand's default would override it)
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="log at INFO, in every service too (as `llmbus -v serve`)")
    p.add_argument("--nats-url", default=env("--nats-url"), help="use this NATS instead of starting one")
    add_bus_auth_args(p)  # for a NATS of yours: handed to every service
    add_tracing_args(p)
    add_served_model_name_arg(p)
    # (a shard's rank is each scheduler's own: serve hands them out)
    add_engine_args(p, *(group for group in GROUPS if group != "data_parallel"))
    EngineArgs.add_cli_args(p, only=("data_parallel_size",))
    add_gateway_args(p)
    add_tokenizer_args(p)
    p.add_argument("--nats-cluster", type=int, default=env("--nats-cluster", 1),
                   help="start this many clustered nats-servers (3 survives the loss of one); every service "
                        "gets all their URLs")
    p.add_argument("--nats-tls", action="store_true", default=env_flag("--nats-tls"),
                   help="the NATS it starts speaks only TLS (clients and routes), with a CA and certificate "
                        "made for the deployment")
    p.add_argument("--nats-monitor", action="store_true", default=env_flag("--nats-monitor"),
                   help="serve NATS's monitoring endpoint on 127.0.0.1 (connections, subscriptions; no login)")
    p.add_argument("--tokenizers", type=int, default=env("--tokenizers", 1), help="tokenizer replicas")
    p.add_argument("--workers", type=int, default=env("--workers", 1), help="worker replicas")
    p.add_argument("--prefill-workers", type=int, default=env("--prefill-workers", 0),
                   help="disaggregated serving: this many prefill workers (kv_producer) and --decode-workers "
                        "decode workers (kv_consumer) in place of --workers; prompts are prefilled on the first, "
                        "their first token streamed from there, and decoded on the second, their KV moved "
                        "through the host tier (--kv-offloading-size, 1 GiB unless given)")
    p.add_argument("--decode-workers", type=int, default=env("--decode-workers", 0), help="see --prefill-workers")
    p.add_argument("--api-server-count", "-asc", type=int, default=env("--api-server-count", 1),
                   help="vLLM's: gateways serving the one port (one process tops out near 20k streamed tokens "
                        "a second); /metrics at any is all of theirs")
    p.add_argument("--max-waiting-requests", type=int, default=env("--max-waiting-requests", 0))
    p.add_argument("--step-timeout", type=float, default=env("--step-timeout", 120.0))
    p.add_argument("--startup-timeout", type=float, default=env("--startup-timeout", 300.0))
    p.set_defaults(func=cmd_serve)
