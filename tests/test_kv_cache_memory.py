"""A KV cache larger than the memory left after the model is refused before it is
allocated (services/worker/kv_cache.py), with the flag that sized it named: allocated, it
would be zeroed page by page until the OOM killer ended the worker with a bare SIGKILL."""

import subprocess
import sys

import pytest
import torch

from llmbus import LLM
from services.worker import kv_cache


def test_a_kv_cache_past_the_free_memory_is_refused_by_its_flag(tiny_llama):
    free = kv_cache.free_bytes(torch.device("cpu"))
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
    monkeypatch.setattr(kv_cache, "CGROUP", tmp_path)
    assert kv_cache.free_bytes(torch.device("cpu")) == min(5 << 30, kv_cache.psutil.virtual_memory().available)
    (tmp_path / "memory.max").write_text("max\n")
    assert kv_cache.free_bytes(torch.device("cpu")) > 0  # no limit: the host's


def test_vllm_s_gpu_memory_utilization_sizes_a_gpu_s_cache_and_not_a_cpu_s(monkeypatch, caplog):
    """On a GPU (its memory faked here): the share it allows, less what the loaded model
    holds and a step's reserve; a share the model alone fills is refused by name. A CPU's
    cache is the budget's (1 GiB, or vLLM's VLLM_CPU_KVCACHE_SPACE), the log says why;
    --kv-cache-memory-gb, where given, sizes either."""
    import logging
    from types import SimpleNamespace

    gib = 1 << 30
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # (tests/conftest.py sets it)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 16 * gib)
    assert kv_cache.kv_cache_budget(None, 0.5, gpu) == (24 * gib - kv_cache.STEP_RESERVE_BYTES,
                                                       "--gpu-memory-utilization 0.5")
    assert kv_cache.kv_cache_budget(2 * gib, 0.5, gpu) == (2 * gib, "--kv-cache-memory-gb 2")
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0.2 leaves no room .* holds 16.00 GiB of the "
                                         r"16.00 GiB it allows"):
        kv_cache.kv_cache_budget(None, 0.2, gpu)
    with caplog.at_level(logging.INFO, logger="llmbus.worker"):
        assert kv_cache.kv_cache_budget(None, 0.5, cpu) == (gib, "--kv-cache-memory-gb 1 (the default)")
    assert "sizes a GPU's KV cache" in caplog.text
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.25")
    assert kv_cache.kv_cache_budget(None, None, cpu) == (gib // 4, "--kv-cache-memory-gb 0.25 (the default)")


def test_the_cpu_cache_space_of_a_vllm_deployment_sizes_the_cache(tiny_llama, monkeypatch):
    block_bytes = LLM(str(tiny_llama), num_kv_blocks=1).runner.kv_caches[0][0, 0].nbytes * 2 * 2  # K and V, 2 layers
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.0625")  # 64 MiB
    assert LLM(str(tiny_llama), gpu_memory_utilization=0.9).runner.num_blocks == (64 << 20) // block_bytes
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        LLM(str(tiny_llama), gpu_memory_utilization=1.5)
