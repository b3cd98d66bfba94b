"""The supervisor behind `llmbus serve`, with fake processes and a clock passed in:
restarts with doubling backoff, the backoff forgotten after a healthy run, a crash loop
reported, and stopping in order."""

from __future__ import annotations

import signal

import pytest

from llmbus.deploy.supervisor import CrashLoop, Supervisor


class FakeProcess:
    def __init__(self, log: list, name: str) -> None:
        self.code = None
        self.log = log
        self.name = name

    def poll(self):
        return self.code

    def send_signal(self, sig) -> None:
        self.log.append((self.name, sig))
        self.code = -sig

    def wait(self, timeout=None):
        return self.code


def make(log: list, name: str):
    started = []

    def start():
        started.append(FakeProcess(log, name))
        return started[-1]

    return start, started


def test_an_exited_replica_restarts_after_a_doubling_backoff():
    sup = Supervisor(backoff_s=0.5, max_backoff_s=2.0, healthy_after_s=30, max_restarts=10, window_s=60)
    start, started = make([], "worker-1")
    replica = sup.add("worker-1", start, now=0.0)
    starts_at = []
    now = 0.0
    for _ in range(4):
        replica.proc.code = -signal.SIGKILL
        sup.poll(now)  # noticed: due again after the backoff
        due = replica.restart_at
        sup.poll(due - 0.01)
        assert len(started) == len(starts_at) + 1  # not before it is due
        sup.poll(due)
        starts_at.append(due - now)
        now = due
    assert starts_at == [0.5, 1.0, 2.0, 2.0]
    assert replica.num_restarts == 4 and replica.running


def test_a_replica_that_ran_a_while_starts_again_at_the_first_backoff():
    sup = Supervisor(backoff_s=0.5, healthy_after_s=30)
    start, _ = make([], "scheduler")
    replica = sup.add("scheduler", start, now=0.0)
    replica.proc.code = 1
    sup.poll(1.0)
    sup.poll(1.5)
    replica.proc.code = 1
    sup.poll(2.0)
    assert replica.backoff_s == 1.0  # it exited soon after starting: doubled
    sup.poll(3.0)
    replica.proc.code = 1
    sup.poll(100.0)  # up for 97 s this time
    assert replica.backoff_s == 0.5


def test_too_many_exits_in_the_window_is_a_crash_loop():
    sup = Supervisor(backoff_s=0.1, max_restarts=3, window_s=60)
    start, _ = make([], "tokenizer-1")
    replica = sup.add("tokenizer-1", start, now=0.0)
    now = 0.0
    with pytest.raises(CrashLoop, match=r"tokenizer-1 exited 3 times in 60 s \(last: code 2\)"):
        for _ in range(5):
            replica.proc.code = 2
            sup.poll(now)
            now = replica.restart_at
            sup.poll(now)


def test_exits_spread_wider_than_the_window_are_no_crash_loop():
    sup = Supervisor(backoff_s=0.1, max_restarts=3, window_s=60, healthy_after_s=1000)
    start, _ = make([], "worker-2")
    replica = sup.add("worker-2", start, now=0.0)
    for i in range(6):
        replica.proc.code = 1
        sup.poll(100.0 * (i + 1))
        sup.poll(100.0 * (i + 1) + 20)
    assert replica.num_restarts == 6


def test_stop_goes_group_by_group():
    log = []
    sup = Supervisor()
    for name in ("scheduler", "tokenizer-1", "worker-1", "worker-2", "gateway"):
        sup.add(name, make(log, name)[0], now=0.0)
    sup.stop([("gateway",), ("worker", "tokenizer"), ("scheduler",)], timeout_s=1)
    assert [name for name, _ in log] == ["gateway", "tokenizer-1", "worker-1", "worker-2", "scheduler"]
    assert {sig for _, sig in log} == {signal.SIGTERM}


def test_serve_hands_its_children_repeated_and_json_flags_as_they_parse_back(monkeypatch):
    """`llmbus serve` passes flags as LLMBUS_* variables: a repeated one (--api-key) and a
    JSON one (--speculative-config) must come back the same in the child's parser."""
    from llmbus.cli.args import as_env
    from llmbus.cli.main import build_parser

    argv = ["serve", "--api-key", "k1", "--api-key", "k2", "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2}', "--seed", "5"]
    args = build_parser().parse_args(argv)
    env = as_env(args, ["api_key", "speculative_config", "metrics_require_key", "seed"])
    assert "LLMBUS_METRICS_REQUIRE_KEY" not in env
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    child = build_parser().parse_args(["gateway"])
    assert child.api_key == ["k1", "k2"]
    assert build_parser().parse_args(["worker"]).seed == 5  # (an int again, as typed)
    scheduler = build_parser().parse_args(["scheduler"])
    assert scheduler.speculative_config == args.speculative_config
    assert scheduler.speculative_config.num_speculative_tokens == 2


def test_vllm_command_lines_run_as_typed(monkeypatch, capsys):
    """`vllm serve MODEL ...`'s flags: the model as a positional, vLLM's spellings of the
    prefix caching and chunked prefill switches (reaching the scheduler as ours do), flags
    that change nothing here accepted, a parallelism llmbus lacks refused by name."""
    from llmbus.cli.args import as_env, gateway_config
    from llmbus.cli.main import build_parser

    argv = ["serve", "some/model", "--enable-prefix-caching", "--no-enable-chunked-prefill", "--trust-remote-code",
            "-tp", "1", "--pipeline-parallel-size", "1", "--enable-auto-tool-choice", "--enable-prompt-tokens-details", "--chat-template", "{{ x }}",
            "--allowed-origins", '["https://ui.example"]', "--served-model-name", "mine", "gpt-4o-mini",
            # vLLM's sizes, spellings and API-server flags
            "--max-model-len", "32k", "--max-num-batched-tokens", "8K", "--tokenizer-mode", "auto", "-dp", "1",
            "--swap-space", "4", "--async-scheduling", "--chat-template-content-format", "string", "--max-log-len", "100",
            "--disable-uvicorn-access-log", "--enable-force-include-usage", "--return-tokens-as-token-ids",
            "--enable-server-load-tracking", "--root-path", "/api", "--enable-log-requests"]
    args = build_parser().parse_args(argv)
    assert (args.model_tag, args.no_prefix_caching, args.no_chunked_prefill) == ("some/model", False, True)
    assert (args.max_model_len, args.max_num_batched_tokens, args.no_async_scheduling) == (32000, 8192, False)
    assert args.disable_log_requests is False and args.enable_log_requests is True
    for flag in ("--max-model-len", "--max-num-batched-tokens", "--enable-force-include-usage",
                 "--return-tokens-as-token-ids", "--enable-server-load-tracking", "--root-path"):
        dest = flag.lstrip("-").replace("-", "_")
        for name, value in as_env(args, [dest]).items():
            monkeypatch.setenv(name, value)
    for name, value in as_env(args, ["no_prefix_caching", "no_chunked_prefill", "chat_template",
                                     "allowed_origins", "served_model_name"]).items():
        monkeypatch.setenv(name, value)
    scheduler = build_parser().parse_args(["scheduler"])
    assert (scheduler.no_prefix_caching, scheduler.no_chunked_prefill) == (False, True)
    assert build_parser().parse_args(["tokenizer"]).chat_template == "{{ x }}"
    gateway = build_parser().parse_args(["gateway"])
    assert gateway.chat_template == "{{ x }}"
    config = gateway_config(gateway, "mine", ".")
    assert (config.allowed_origins, config.model_aliases) == (("https://ui.example",), ("gpt-4o-mini",))
    assert (config.force_include_usage, config.return_tokens_as_token_ids, config.server_load_tracking,
            config.root_path) == (True, True, True, "/api")
    assert build_parser().parse_args(["worker"]).max_model_len == 32000  # (a service reads serve's sizes back)
    for refused in (["--tokenizer-mode", "slow"], ["-pp", "2"], ["--max-model-len", "1.5"],
                    ["--chat-template-content-format", "openai"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *refused])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "https://ui.example"])  # not a JSON list
    assert build_parser().parse_args(["serve", "--no-enable-prefix-caching"]).no_prefix_caching is True
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["serve", "--pipeline-parallel-size", "2"])
    assert refused.value.code == 2
    assert "no pipeline parallelism" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "-tp", "2"]).tensor_parallel_size == 2
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")  # vLLM's variable, where ours is not set
    assert build_parser().parse_args(["gateway"]).api_key == ["from-vllm"]
    monkeypatch.setenv("LLMBUS_API_KEY", "ours")
    assert build_parser().parse_args(["gateway"]).api_key == ["ours"]


def test_vllm_s_config_file_gives_a_command_s_flags_and_the_command_line_wins(tmp_path, capsys):
    """`llmbus serve --config FILE.yaml`, as vLLM's: keys are flags' long names (dashes or
    underscores), switches true or false (their --no- form), lists one flag's values or a
    repeated flag, mappings JSON; the command line after it wins; a key that is no flag of
    the command is refused by name."""
    import yaml

    from llmbus.cli.main import build_parser
    from llmbus.cli.config_file import expand_config

    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "model": "Qwen/Qwen3-0.6B", "port": 9000, "max_model_len": 4096, "enable-prefix-caching": False,
        "served-model-name": ["qwen", "gpt-4o-mini"], "api-key": ["k1", "k2"], "trust-remote-code": True,
        "speculative-config": {"method": "ngram", "num_speculative_tokens": 3}, "seed": None}))
    parser = build_parser()
    args = parser.parse_args(expand_config(parser, ["serve", "--config", str(config), "--port", "9001"]))
    assert (args.model, args.port, args.max_model_len, args.no_prefix_caching) == ("Qwen/Qwen3-0.6B", 9001, 4096, True)
    assert args.served_model_name == ["qwen", "gpt-4o-mini"] and args.api_key == ["k1", "k2"]
    assert args.trust_remote_code and args.speculative_config.num_speculative_tokens == 3 and args.seed is None
    (tmp_path / "worker.yaml").write_text("dtype: bfloat16\n")
    worker = parser.parse_args(expand_config(parser, ["worker", f"--config={tmp_path / 'worker.yaml'}"]))
    assert worker.dtype == "bfloat16"
    config.write_text("port: 9000\nmax-num-whatever: 3\n")
    with pytest.raises(SystemExit):
        expand_config(parser, ["serve", "--config", str(config)])
    assert "'max-num-whatever' is not a flag of llmbus serve" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        expand_config(parser, ["serve", "--config", str(tmp_path / "missing.yaml")])
    assert "No such file" in capsys.readouterr().err


def test_api_server_count_takes_siblings_but_not_runtime_lora_loading(monkeypatch, capsys):
    """--api-server-count N runs N gateways; an adapter loaded at runtime would reach only
    the one gateway asked, so the two are refused together by name, before anything starts."""
    from llmbus.cli.main import main

    with pytest.raises(SystemExit) as refused:
        main(["serve", "--api-server-count", "0"])
    assert "at least 1" in str(refused.value)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    with pytest.raises(SystemExit) as refused:
        main(["serve", "--api-server-count", "2"])
    assert "--api-server-count 1" in str(refused.value)
