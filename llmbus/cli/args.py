"""The engine's flags on the `llmbus` command (each said once, in shared/engine_args.py)
and the gateway's config from its flags. Each flag's default can come from the
environment (shared/flags.py), so `llmbus serve` hands its children their flags as
LLMBUS_* variables (`as_env`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os

from llmbus.model_fetch import DEFAULT_MODEL, KNOWN_MODELS
from shared.config import GatewayConfig, LoRAConfig
from shared.engine_args import GROUPS, EngineArgs
from shared.flags import env_name
from shared.hf.classification import classifier_of
from shared.hf.generation_config import default_sampling, model_eos_ids
from shared.hf.model_folder import architectures
from shared.hf.pooling_config import unsupported_pooling
from shared.hf.image_models import image_model, no_images_why
from shared.lora_request import LoRARequest, parse_lora_modules

log = logging.getLogger("llmbus.gateway")


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


def add_engine_args(parser: argparse.ArgumentParser, *groups: str) -> None:
    """The engine flags of `groups` (shared/engine_args.py); none named: every one, as the
    in-process engine takes them (`generate`, `bench throughput`)."""
    EngineArgs.add_cli_args(parser, *(groups or GROUPS), help={
        "model": f"a local HF folder or a known model ({', '.join(KNOWN_MODELS)}); default {DEFAULT_MODEL}"})


def or_exit(check, *args):
    """A start-up check's ValueError stops the command with its reason, no traceback."""
    try:
        return check(*args)
    except ValueError as exc:
        raise SystemExit(f"llmbus: {exc}") from None


def lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    """None without --enable-lora; limits that cannot hold stop the command, saying why."""
    return or_exit(lambda: EngineArgs.from_cli_args(args).lora_config())


def lora_modules(values: list[str], max_rank: int | None = None) -> dict[str, LoRARequest]:
    """--lora-modules, each adapter's folder checked: a wrong one stops the gateway at start."""
    return or_exit(parse_lora_modules, values, max_rank)


def gateway_config(args: argparse.Namespace, model_name: str, model_path: str) -> GatewayConfig:
    defaults = default_sampling(model_path, args.generation_config, args.override_generation_config)
    if defaults:
        log.info("default sampling parameters from the model's generation config: %s "
                 "(--generation-config vllm to ignore them)", defaults)
    aliases = tuple(name for name in args.served_model_name or [] if name and name != model_name)
    reasoning_parser, tool_call_parser = args.reasoning_parser, args.tool_call_parser
    if "GptOssForCausalLM" in architectures(model_path):
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
                         max_log_len=args.max_log_len, allowed_media_domains=tuple(args.allowed_media_domains),
                         allowed_local_media_path=args.allowed_local_media_path,
                         limit_mm_per_prompt=json.loads(args.limit_mm_per_prompt or "{}"),
                         no_images_why=None if image_model(model_path) else no_images_why(model_path))


def runtime_lora_updating(warn: bool = True) -> bool:
    """vLLM's switch, under vLLM's name, so a deployment's environment carries over."""
    on = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")
    if on and warn:
        log.warning("runtime LoRA updating is on: anyone with an API key may load adapters from this "
                    "machine's disk (VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    return on


def engine_kwargs(args: argparse.Namespace) -> dict:
    """`LLM(...)`'s keyword arguments from the engine flags."""
    return EngineArgs.from_cli_args(args).kwargs()
