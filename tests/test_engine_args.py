"""EngineArgs says each engine argument once: the offline LLM's keyword, the command's flag
and its default are one field, so they cannot drift apart."""

from __future__ import annotations

import dataclasses

import pytest

from llmbus.cli.main import build_parser
from shared.config import SpeculativeConfig
from shared.engine_args import EngineArgs


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("LLMBUS_"):
            monkeypatch.delenv(name)


def _parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_the_command_line_defaults_are_the_offline_defaults():
    from_cli = EngineArgs.from_cli_args(_parse())
    assert from_cli == EngineArgs(device=from_cli.device)


def test_every_field_but_the_offline_ones_is_a_flag():
    commands = build_parser()._subparsers._group_actions[0].choices
    options = {o for command in ("serve", "worker", "scheduler") for a in commands[command]._actions
               for o in a.option_strings}
    for f in dataclasses.fields(EngineArgs):
        if f.metadata["group"] is None:
            continue
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        if f.metadata["on"]:
            flag = "--no-" + f.name.removeprefix("enable_").replace("_", "-")
        assert flag in options, f.name


def test_flags_become_the_fields_they_name():
    args = EngineArgs.from_cli_args(_parse(
        "--no-chunked-prefill", "--enable-prefix-caching", "--no-async-scheduling", "--kv-cache-memory-gb", "0.5",
        "--max-num-batched-tokens", "4k", "--hf-overrides", '{"a": 1}',
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'))
    assert (args.enable_chunked_prefill, args.enable_prefix_caching, args.async_scheduling) == (False, True, False)
    assert args.kv_cache_memory_bytes == 1 << 29 and args.max_num_batched_tokens == 4000
    assert args.hf_overrides == {"a": 1} and args.speculative_config.num_speculative_tokens == 2
    assert EngineArgs.from_cli_args(_parse("--no-enable-prefix-caching")).enable_prefix_caching is False


def test_a_variable_sets_a_switch_as_its_flag_does(monkeypatch):
    monkeypatch.setenv("LLMBUS_NO_PREFIX_CACHING", "1")
    monkeypatch.setenv("LLMBUS_MAX_NUM_SEQS", "7")
    args = EngineArgs.from_cli_args(_parse())
    assert args.enable_prefix_caching is False and args.max_num_seqs == 7


def test_the_configs_of_both_halves_come_from_one_set_of_args():
    args = EngineArgs(max_num_seqs=300, enable_chunked_prefill=False, max_num_batched_tokens=512,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert isinstance(args.speculative_config, SpeculativeConfig)
    worker, scheduler = args.worker_config(), args.scheduler_config(model_max_len=8192)
    assert worker.max_cudagraph_capture_size == 512 and worker.max_num_seqs == 300
    assert worker.cache_config.enable_prefix_caching and scheduler.enable_prefix_caching
    # without chunked prefill a prompt must fit one step, so the context nobody asked for is capped
    assert scheduler.max_model_len == 512 and scheduler.num_speculative_tokens == 3


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineArgs(max_num_seq=4)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        EngineArgs(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineArgs(tensor_parallel_size=0)
    assert EngineArgs(tensor_parallel_size=2).worker_config().tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tokenizer_mode"):
        EngineArgs(tokenizer_mode="slow")
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2).lora_config()
