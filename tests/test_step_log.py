"""LLMBUS_STEP_LOG: one JSON line per step, and the script that compares two runs' logs."""

import json
import subprocess
import sys
from pathlib import Path

from llmbus import LLM, SamplingParams

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "compare_step_logs.py"


def test_every_step_is_logged_and_two_equal_runs_compare_equal(tiny_llama, tmp_path, monkeypatch):
    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("LLMBUS_STEP_LOG", str(log))
    llm = LLM(str(tiny_llama), max_num_batched_tokens=16)  # 16: the 20-token prompt takes two steps
    prompts = [list(range(3, 23)), list(range(5, 10))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    sent = []  # every step the engine hands the runner with tokens to compute
    execute = llm.executor.execute

    async def counting(step, headers=None):
        if step.total_num_scheduled_tokens:
            sent.append(step.step_id)
        return await execute(step, headers)

    llm.executor.execute = counting
    llm.add_requests(prompts, [params] * 2)
    while llm.scheduler.has_unfinished_requests():
        llm.step()
    num_steps = len(sent)
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(steps) == num_steps
    # Every prompt token and every output token but the last goes through a forward once.
    assert sum(s["tokens"] for s in steps) == 20 + 5 + 2 * 3
    assert sum(s["sampled"] for s in steps) == 2 * 4
    assert all(s["forward_ms"] > 0 and s["decodes"] <= s["reqs"] for s in steps)

    # The same lines under a second pid: the script must find the schedules equal.
    twin = [dict(s, pid=s["pid"] + 1) for s in steps]
    log.write_text("".join(json.dumps(s) + "\n" for s in steps + twin))
    out = subprocess.run([sys.executable, str(SCRIPT), str(log)], capture_output=True, text=True, check=True).stdout
    assert out.count(f"{num_steps} steps, 31 tokens, 8 sampled") == 2
    assert f"0 of {num_steps} steps differ" in out
    twin[-1]["tokens"] += 1
    log.write_text("".join(json.dumps(s) + "\n" for s in steps + twin))
    out = subprocess.run([sys.executable, str(SCRIPT), str(log)], capture_output=True, text=True, check=True).stdout
    assert f"1 of {num_steps} steps differ" in out
