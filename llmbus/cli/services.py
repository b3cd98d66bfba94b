"""The service subcommands: `llmbus gateway|tokenizer|scheduler|worker|serve`.

Every knob is a flag with an `LLMBUS_*` environment default (llmbus/cli/args.py), so
compose files and `llmbus serve` start the very same commands; `serve` hands each child
its flags as those variables instead of rendering them back into argv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from llmbus.cli.args import (
    add_model_args,
    add_prefix_caching_args,
    add_scheduler_args,
    add_speculative_args,
    add_worker_args,
    as_env,
    cache_config,
    env,
    env_flag,
    gateway_config,
    hf_overrides,
    lora_config,
    lora_modules,
    runtime_lora_updating,
    scheduler_config,
)
from llmbus.model_fetch import (DEFAULT_MODEL, KNOWN_MODELS, is_hub_id, resolve_model, resolve_tokenizer,
                                 with_hf_overrides)
from shared.bus import BusAuth
from shared.config import STRUCTURED_CHECK_TIMEOUT_S
from shared.gc_heap import freeze_heap
from shared.hf.generation_config import default_sampling


def add_bus_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=env("--nats-url", "nats://127.0.0.1:4222"),
                        help="one NATS URL, or a cluster's, comma-separated")
    add_served_model_name_arg(parser)
    add_bus_auth_args(parser)
    add_tracing_args(parser)


def add_tracing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--otlp-traces-endpoint", default=env("--otlp-traces-endpoint", None),
                        help="vLLM's: send traces here over OTLP (http(s)://: OTLP/HTTP; grpc://host:4317 or "
                             "host:4317: OTLP/gRPC); or the OTEL_EXPORTER_OTLP_* variables")
    parser.add_argument("--collect-detailed-traces", default=env("--collect-detailed-traces", None),
                        choices=("model", "worker", "all", "model,worker", "worker,model"),
                        help="vLLM's; accepted as typed: a worker's step spans always carry its forward and "
                             "sampling times")


def add_served_model_name_arg(parser: argparse.ArgumentParser) -> None:
    # vLLM's: one name or several; the first is the deployment's (its subjects, its
    # responses' `model`), clients may ask for any (one line each in LLMBUS_SERVED_MODEL_NAME).
    parser.add_argument("--served-model-name", nargs="+", default=env("--served-model-name", "").split("\n"),
                        help="the name clients ask for (default: the model's); more names are aliases, as vLLM's")


def add_bus_auth_args(parser: argparse.ArgumentParser) -> None:
    """How a service authenticates to NATS; secrets are best given as LLMBUS_* variables
    (a flag shows in `ps`)."""
    parser.add_argument("--nats-user", default=env("--nats-user"))
    parser.add_argument("--nats-password", default=env("--nats-password"))
    parser.add_argument("--nats-token", default=env("--nats-token"))
    parser.add_argument("--nats-creds", default=env("--nats-creds"), help="a JWT/nkey .creds file")
    parser.add_argument("--nats-tls-ca", default=env("--nats-tls-ca"), help="CA that signed the NATS server's cert")
    parser.add_argument("--nats-tls-cert", default=env("--nats-tls-cert"), help="client certificate, if NATS asks")
    parser.add_argument("--nats-tls-key", default=env("--nats-tls-key"))
    parser.add_argument("--nats-inbox-prefix", default=env("--nats-inbox-prefix"),
                        help="where request replies come back (default _INBOX.<role>.<instance> for a user "
                             "<role>-<instance>, _INBOX.<user> for one without a dash, _INBOX without a user)")


def bus_auth(args) -> BusAuth:
    return BusAuth(user=args.nats_user, password=args.nats_password, token=args.nats_token,
                   creds_file=args.nats_creds, tls_ca=args.nats_tls_ca, tls_cert=args.nats_tls_cert,
                   tls_key=args.nats_tls_key, inbox=args.nats_inbox_prefix)


def add_chat_template_arg(parser: argparse.ArgumentParser) -> None:
    """The tokenizers render chats with it and the gateway shows it (/tokenizer_info)."""
    parser.add_argument("--chat-template", default=env("--chat-template", None),
                        help="vLLM's: the chat template, a file or the Jinja text itself, in place of the model's")
    parser.add_argument("--chat-template-content-format", default=env("--chat-template-content-format", "auto"),
                        choices=["auto", "string"],
                        help="vLLM's: a message's text parts reach the template as one string (joined by newlines)")


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=env("--host", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("--port", 8000)))
    # (VLLM_API_KEY, vLLM's variable, where LLMBUS_API_KEY is not set: a deployment's carries over)
    keys = env("--api-key", os.environ.get("VLLM_API_KEY", ""))
    parser.add_argument("--api-key", action="append", default=[k for k in keys.split("\n") if k],
                        help="require `Authorization: Bearer KEY` on /v1 (repeat for more keys; or LLMBUS_API_KEY, "
                             "VLLM_API_KEY)")
    parser.add_argument("--api-key-file", default=env("--api-key-file", None),
                        help="more API keys, one per line; read again on SIGHUP")
    parser.add_argument("--metrics-require-key", action="store_true", default=env_flag("--metrics-require-key"),
                        help="/metrics needs an API key too (/health stays open)")
    parser.add_argument("--lora-modules", nargs="+", action="extend",
                        default=[m for m in env("--lora-modules", "").split("\n") if m],
                        help='vLLM\'s: LoRA adapters clients name as their `model`, each name=path or '
                             '\'{"name": ..., "path": ...}\' (the workers need --enable-lora)')
    parser.add_argument("--max-body-bytes", type=int, default=int(env("--max-body-bytes", 4 << 20)))
    # vLLM's API server flags
    for flag, what in (
            ("--return-tokens-as-token-ids", "logprobs name every token as token_id:N (the request field's default)"),
            ("--enable-force-include-usage", "every stream ends with a usage chunk, as if it asked for include_usage"),
            ("--enable-server-load-tracking", "GET /load says how many requests this gateway is answering"),
            ("--disable-uvicorn-access-log", "no access log line per HTTP request, whatever --uvicorn-log-level")):
        parser.add_argument(flag, action="store_true", default=env_flag(flag), help=f"vLLM's: {what}")
    parser.add_argument("--root-path", default=env("--root-path", ""),
                        help="vLLM's: the path prefix a proxy in front serves the API under (for its docs' URLs)")
    parser.add_argument("--max-log-len", type=int, default=env("--max-log-len"),
                        help="vLLM's: the characters of a prompt or output and the token ids a request log line "
                             "holds (default: all)")
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        default=env_flag("--enable-tokenizer-info-endpoint"),
                        help="serve GET /tokenizer_info: the tokenizer's special tokens and chat template")
    parser.add_argument("--responses-store-mb", type=float, default=float(env("--responses-store-mb", 256)),
                        help="memory for the Responses API's stored responses (store, previous_response_id), the "
                             "least recently used dropped first; 0 stores none")
    # (set by llmbus serve --api-server-count for the gateways it runs on one port)
    parser.add_argument("--api-server-group", default=env("--api-server-group", ""), help=argparse.SUPPRESS)
    parser.add_argument("--scheduler-resume-timeout", type=float, default=env("--scheduler-resume-timeout", 30.0),
                        help="seconds requests in flight wait for a scheduler to come back and resume them")
    from services.gateway.parsers.tool import TOOL_CALL_PARSERS

    from services.gateway.parsers.reasoning import REASONING_PARSERS

    parser.add_argument("--reasoning-parser", default=env("--reasoning-parser", None), choices=REASONING_PARSERS,
                        help="a reasoning model's thinking goes to the chat message's `reasoning`, apart from its "
                             "content")
    parser.add_argument("--tool-call-parser", default=env("--tool-call-parser", "hermes"),
                        choices=sorted(TOOL_CALL_PARSERS),
                        help="how tool_choice auto reads the calls the model writes")
    parser.add_argument("--enable-auto-tool-choice", action="store_true", default=env_flag("--enable-auto-tool-choice"),
                        help="vLLM's; accepted as typed: tool_choice auto is always on, read by --tool-call-parser")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        default=env_flag("--enable-prompt-tokens-details"),
                        help="vLLM's; accepted as typed: usage always has prompt_tokens_details.cached_tokens")
    parser.add_argument("--disable-fastapi-docs", action="store_true", default=env_flag("--disable-fastapi-docs"),
                        help="vLLM's: no /docs, /redoc or /openapi.json (which describe the API to anyone)")
    # vLLM's CORS flags, each a JSON list as there
    for flag in ("--allowed-origins", "--allowed-methods", "--allowed-headers"):
        parser.add_argument(flag, type=json_strings, default=env(flag, '["*"]'),
                            help="CORS: a JSON list (default [\"*\"], vLLM's)")
    parser.add_argument("--enable-request-id-headers", action="store_true",
                        default=env_flag("--enable-request-id-headers"),
                        help="vLLM's: X-Request-Id on every response (the request's own, or a new one)")
    parser.add_argument("--allow-credentials", action="store_true", default=env_flag("--allow-credentials"),
                        help="CORS: let a browser send cookies and HTTP auth (vLLM's)")
    # vLLM's logging flags
    parser.add_argument("--disable-log-requests", action="store_true", default=env_flag("--disable-log-requests"),
                        help="no line per finished request (llmbus.requests; its one line at the default level)")
    parser.add_argument("--enable-log-requests", action="store_true", default=env_flag("--enable-log-requests"),
                        help="vLLM's: also a line as each request arrives, with its prompt and sampling parameters "
                             "(a line per finished request is the default)")
    parser.add_argument("--enable-log-outputs", action="store_true", default=env_flag("--enable-log-outputs"),
                        help="vLLM's: a finished request's line holds its choices' text and token ids")
    parser.add_argument("--disable-log-stats", action="store_true", default=env_flag("--disable-log-stats"),
                        help="vLLM's; accepted as typed: llmbus logs no periodic stats (GET /metrics has them)")
    parser.add_argument("--uvicorn-log-level", default=env("--uvicorn-log-level", "warning"),
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's own log level; info and below add its access log (a line per HTTP request)")
    # vLLM's HTTPS flags: the API over TLS, uvicorn's own
    parser.add_argument("--ssl-certfile", default=env("--ssl-certfile"),
                        help="serve HTTPS with this certificate (PEM; the chain after it, as uvicorn reads it)")
    parser.add_argument("--ssl-keyfile", default=env("--ssl-keyfile"),
                        help="the certificate's private key (PEM), where --ssl-certfile does not hold it")


# A spec's compile timeout the gateway can wait for: it waits STRUCTURED_CHECK_TIMEOUT_S
# for a check, the first one of a replica starting its compiling child too.
MAX_COMPILE_TIMEOUT_S = STRUCTURED_CHECK_TIMEOUT_S - 5


def json_strings(value: str) -> str:
    """A JSON list of strings (vLLM's form for the CORS flags), checked and kept as text: so
    `serve` hands it to the gateway as given (gateway_config reads it)."""
    try:
        items = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {value}")
    return value


def compile_timeout(value: str) -> float:
    seconds = float(value)
    if not 0 < seconds <= MAX_COMPILE_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most {MAX_COMPILE_TIMEOUT_S:g} seconds (the gateway "
                                         f"waits {STRUCTURED_CHECK_TIMEOUT_S:g} s for a check), got {value}")
    return seconds


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--structured-outputs-compile-timeout", type=compile_timeout,
                        default=env("--structured-outputs-compile-timeout", "5"),
                        help="seconds a structured-output spec may take to compile before the request is a 400 "
                             f"(at most {MAX_COMPILE_TIMEOUT_S:g})")
    add_chat_template_arg(parser)
    parser.add_argument("--tool-chat-template", default=env("--tool-chat-template", None),
                        help="a Jinja chat template for conversations with tools (default: the model's own when "
                             "it renders tools, else Hermes-style tool messages through the model's template)")


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
    path = str(with_hf_overrides(resolve_model(args.model, args.revision, args.download_dir), hf_overrides(args)))
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
    asyncio.run(serve(tokenizer_folder(args, path), args.nats_url, name,
                      compile_timeout_s=args.structured_outputs_compile_timeout,
                      tool_chat_template=args.tool_chat_template, chat_template=args.chat_template,
                      auth=bus_auth(args), ready=_FreezeWhenReady("tokenizer")))
    return 0


def cmd_worker(args) -> int:
    from services.worker.shell.service import serve

    path, name = _setup(args)
    asyncio.run(serve(path, args.nats_url, name, cache_config(args), args.dtype, args.attention_backend,
                      args.max_model_len, args.worker_id, threads=args.threads,
                      quantization=args.quantization, speculative_config=args.speculative_config,
                      enforce_eager=args.enforce_eager, max_cudagraph_capture_size=args.max_cudagraph_capture_size,
                      load_format=args.load_format, auth=bus_auth(args), lora_config=lora_config(args),
                      seed=args.seed, tokenizer=args.tokenizer, max_num_seqs=args.max_num_seqs,
                      ready=_FreezeWhenReady("worker")))
    return 0


def cmd_scheduler(args) -> int:
    from services.scheduler.shell.service import serve

    asyncio.run(serve(
        args.nats_url, served_name(args), scheduler_config(args),
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
               "workers", "startup_timeout", "model_tag", "config", "api_server_count"}


def cmd_serve(args) -> int:
    from llmbus.deploy.serve import run_serve

    if args.model_tag:  # `llmbus serve MODEL`, as `vllm serve MODEL` (over --model, as vLLM's)
        args.model = args.model_tag
    if args.lora_modules and not args.enable_lora:
        raise SystemExit("llmbus serve: --lora-modules needs --enable-lora (the workers serve the adapters)")
    lora_config(args)  # (bad limits or a wrong adapter fail here, before a fetch or a child)
    if args.api_server_count < 1:
        raise SystemExit("llmbus serve: --api-server-count must be at least 1")
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
    add_model_args(p)
    add_tokenizer_args(p)
    p.set_defaults(func=cmd_tokenizer)

    p = sub.add_parser("worker", help="run a worker (model runner + KV cache)")
    add_bus_args(p)
    add_model_args(p)
    add_worker_args(p)
    add_prefix_caching_args(p)
    add_speculative_args(p)
    p.add_argument("--worker-id", default=env("--worker-id", None))
    # (the scheduler's flag: a hybrid model's worker allocates its recurrent state for that many requests)
    p.add_argument("--max-num-seqs", type=int, default=env("--max-num-seqs", 128))
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("scheduler", help="run the scheduler")
    add_bus_args(p)
    add_model_args(p)
    add_scheduler_args(p)
    add_prefix_caching_args(p)
    add_speculative_args(p)
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
    add_model_args(p)
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
    add_model_args(p)
    add_worker_args(p)
    add_scheduler_args(p)
    add_prefix_caching_args(p)
    add_speculative_args(p)
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
    p.add_argument("--api-server-count", "-asc", type=int, default=env("--api-server-count", 1),
                   help="vLLM's: gateways serving the one port (one process tops out near 20k streamed tokens "
                        "a second); /metrics at any is all of theirs")
    p.add_argument("--max-waiting-requests", type=int, default=env("--max-waiting-requests", 0))
    p.add_argument("--step-timeout", type=float, default=env("--step-timeout", 120.0))
    p.add_argument("--startup-timeout", type=float, default=env("--startup-timeout", 300.0))
    p.set_defaults(func=cmd_serve)
