"""A KV cache larger than the memory left after the model is refused before it is
allocated (services/worker/memory.py), with the flag that sized it named: allocated, it
would be zeroed page by page until the OOM killer ended the worker with a bare SIGKILL."""

import subprocess
import sys

import pytest
import torch

from llmbus import LLM
from services.worker import memory


def test_a_kv_cache_past_the_free_memory_is_refused_by_its_flag(tiny_llama):
    free = memory.free_bytes(torch.device("cpu"))
    assert free > 0
    with pytest.raises(ValueError, match=r"KV cache \(.* GiB, --kv-cache-memory-gb .*\) does not fit .* lower it"):
        LLM(str(tiny_llama), kv_cache_memory_bytes=2 * free)
    with pytest.raises(ValueError, match=r"--num-kv-blocks 1000000000\) does not fit"):
        LLM(str(tiny_llama), num_kv_blocks=10**9)
    assert LLM(str(tiny_llama), kv_cache_memory_bytes=16 << 20).runner.num_blocks > 0  # one that fits


def test_a_worker_asked_for_too_much_says_so_and_exits(tiny_llama):
    """The command a user types: one line naming the flag, no traceback (before any bus)."""
    result = subprocess.run([sys.executable, "-m", "llmbus", "worker", "--model", str(tiny_llama),
                             "--nats-url", "nats://127.0.0.1:1", "--kv-cache-memory-gb", "100000"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "llmbus: error: the KV cache" in result.stderr and "--kv-cache-memory-gb 100000" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_containers_limit_caps_the_free_memory_its_page_cache_not_counted(tmp_path, monkeypatch):
    """cgroup v2: limit minus what is in use, the page cache (a checkpoint just read, which
    the kernel gives back under the limit) not counted as in use."""
    (tmp_path / "memory.max").write_text(f"{8 << 30}\n")
    (tmp_path / "memory.current").write_text(f"{7 << 30}\n")
    (tmp_path / "memory.stat").write_text(f"anon {3 << 30}\nfile {4 << 30}\nkernel 0\n")
    monkeypatch.setattr(memory, "CGROUP", tmp_path)
    assert memory.free_bytes(torch.device("cpu")) == min(5 << 30, memory.psutil.virtual_memory().available)
    (tmp_path / "memory.max").write_text("max\n")
    assert memory.free_bytes(torch.device("cpu")) > 0  # no limit: the host's
