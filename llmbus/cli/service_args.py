"""The flags each service takes beside the engine's (args.py): the bus and its
credentials, tracing, the served model's names, the gateway's and the tokenizer's own.
Each flag has an `LLMBUS_*` environment default, so compose files and `llmbus serve` start
the very same commands."""

from __future__ import annotations

import argparse
import json
import os

from shared.flags import env, env_flag
from shared.bus import BusAuth
from shared.config import STRUCTURED_CHECK_TIMEOUT_S


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
                        help="vLLM's: string, a message's parts reach the template as one string (joined by newlines, "
                             "an image as the model's marker); auto, the same unless the conversation holds images "
                             "and the template walks a message's parts")


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
    # vLLM's media flags: where a chat's image_url parts may be read from (--limit-mm-per-prompt: the engine's)
    parser.add_argument("--allowed-media-domains", nargs="+", action="extend",
                        default=[d for d in env("--allowed-media-domains", "").split("\n") if d],
                        help="http(s) image URLs are fetched from these hosts only (default: any host)")
    parser.add_argument("--allowed-local-media-path", default=env("--allowed-local-media-path", None),
                        help="file:// image URLs are read from under this folder only (default: none are)")
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
