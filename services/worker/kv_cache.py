"""A worker's KV cache sized before it is allocated: how much memory it may still take, and
how many blocks (and a hybrid's state rows) that buys.

A KV cache is allocated zeroed, so every byte is touched at start: one larger than the
machine's free memory has the kernel's OOM killer end the worker (or a neighbour) with a
bare SIGKILL, which `llmbus serve` can only report as a crash loop. Checked first, it is a
one-line error naming the flag to lower.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import psutil
import torch

log = logging.getLogger("llmbus.worker")

# What a step's own work (activations, logits, sampling) needs beside the cache.
STEP_RESERVE_BYTES = 512 << 20
# This process's cgroup (v2, as a container sees its own)
CGROUP = Path("/sys/fs/cgroup")


def free_bytes(device: torch.device) -> int:
    """Bytes this process can still allocate on `device`: the GPU's free memory with what
    PyTorch's allocator holds unused, or the host's available memory, capped by the
    cgroup's limit where one is set (a container's limit is not the host's)."""
    if device.type == "cuda":
        held_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + held_unused
    free = psutil.virtual_memory().available
    cgroup = CGROUP
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            # memory.current counts the page cache too (the checkpoint just read), which the
            # kernel gives back under the limit: what is in use is the rest.
            stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
            used = int((cgroup / "memory.current").read_text()) - int(stat.get("file", 0))
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass  # no cgroup v2 limit to read
    return free


def default_kv_cache_bytes(device: torch.device) -> int:
    """1 GiB, or on a CPU vLLM's CPU backend's variable where it is set
    (VLLM_CPU_KVCACHE_SPACE, in GiB), so a vLLM deployment's environment sizes it the same."""
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE") if device.type == "cpu" else None
    try:
        gib = float(space) if space else 1.0
    except ValueError:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {space!r}") from None
    if gib <= 0:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be positive, got {space!r}")
    return int(gib * (1 << 30))


def kv_cache_budget(kv_cache_memory_bytes: int | None, gpu_memory_utilization: float | None,
                    device: torch.device) -> tuple[int, str]:
    """(bytes for the KV cache, the flags that sized it): --kv-cache-memory-gb where given;
    on a GPU with --gpu-memory-utilization u (vLLM's), u of the GPU's memory less what this
    process holds already (the model, loaded) and a step's reserve; else the default. A
    CPU's cache is never sized by the GPU's flag (as vLLM's CPU backend): said in the log."""
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes, f"--kv-cache-memory-gb {kv_cache_memory_bytes / (1 << 30):g}"
    if gpu_memory_utilization is not None and device.type == "cuda":
        allowed = int(gpu_memory_utilization * torch.cuda.get_device_properties(device).total_memory)
        held = torch.cuda.memory_reserved(device)
        budget = allowed - held - STEP_RESERVE_BYTES
        asked = f"--gpu-memory-utilization {gpu_memory_utilization:g}"
        if budget <= 0:
            raise ValueError(f"{asked} leaves no room for a KV cache: the model holds {held / (1 << 30):.2f} GiB of "
                             f"the {allowed / (1 << 30):.2f} GiB it allows (with {STEP_RESERVE_BYTES >> 20} MiB kept "
                             "for a step's work): raise it")
        return budget, asked
    if gpu_memory_utilization is not None:
        log.info("--gpu-memory-utilization sizes a GPU's KV cache; this one is on the %s: "
                 "--kv-cache-memory-gb (or VLLM_CPU_KVCACHE_SPACE) sizes it", device.type)
    budget = default_kv_cache_bytes(device)
    return budget, f"--kv-cache-memory-gb {budget / (1 << 30):g} (the default)"


def check_kv_cache_fits(kv_bytes: int, device: torch.device, asked: str) -> None:
    """ValueError unless `kv_bytes` and a step's reserve fit in what `device` has free;
    `asked`: the flags that sized it, for the message."""
    free = free_bytes(device)
    if kv_bytes + STEP_RESERVE_BYTES > free:
        raise ValueError(
            f"the KV cache ({kv_bytes / (1 << 30):.2f} GiB, {asked}) does not fit in the "
            f"{free / (1 << 30):.2f} GiB {'the GPU' if device.type == 'cuda' else 'this machine'} has free after "
            f"loading the model (with {STEP_RESERVE_BYTES >> 20} MiB kept for a step's work): lower it")


def kv_bytes_per_block(cfg, block_size: int, kv_cache_dtype: torch.dtype, values_are_keys: bool = False) -> int:
    """A block's keys and values over every attention layer (latent attention's: one memory)."""
    return ((1 if values_are_keys else 2) * len(cfg.attention_layers) * block_size * cfg.num_key_value_heads
            * cfg.head_dim * kv_cache_dtype.itemsize)


def size_kv_cache(cfg, cache_config, block_size: int, kv_cache_dtype: torch.dtype, values_are_keys: bool,
                  device: torch.device, recurrent_rows: int, snapshot_rows: int,
                  state_bytes, draft_bytes_per_block: int = 0) -> tuple[int, int, int]:
    """(the scheduler's blocks, the recurrent state's request rows, its snapshot rows):
    --num-kv-blocks, or as many blocks as the budget holds (kv_cache_budget:
    --kv-cache-memory-gb, or --gpu-memory-utilization's share on a GPU), beside a hybrid's
    state (`state_bytes(rows)`: its bytes for that many rows), which comes out of the same
    budget (vLLM counts it so); refused (before any is allocated) where they and the pad
    block do not fit. `draft_bytes_per_block`: a draft model's cache's, under the same block
    ids (sample/draft_model.py)."""
    bytes_per_block = kv_bytes_per_block(cfg, block_size, kv_cache_dtype, values_are_keys) + draft_bytes_per_block
    if cache_config.num_kv_blocks is not None:
        num_blocks, asked = cache_config.num_kv_blocks, f"--num-kv-blocks {cache_config.num_kv_blocks}"
        state = state_bytes(recurrent_rows + snapshot_rows)
    else:
        budget, asked = kv_cache_budget(cache_config.kv_cache_memory_bytes, cache_config.gpu_memory_utilization,
                                        device)
        row_bytes = state_bytes(1) - state_bytes(0)
        if row_bytes and (recurrent_rows + 1) * row_bytes > budget // 2:
            # A hybrid's state a request is that of hundreds of tokens' KV (Qwen3.5-0.8B:
            # 19 MiB): --max-num-seqs of them would leave a default budget no blocks. Its
            # rows then take at most half of the budget, and so many requests run at once.
            rows = max(1, budget // 2 // row_bytes - 1)
            log.warning("the recurrent state of %d requests (%.2f GiB) would take over half the KV cache's "
                        "budget (%s): %d requests run at once (raise the budget for more)",
                        recurrent_rows, (recurrent_rows + 1) * row_bytes / (1 << 30), asked, rows)
            recurrent_rows = rows
        if snapshot_rows:
            # The prefix cache's snapshots: one a request where a quarter of the budget
            # holds them, else as many as it does (fewer than requests: the least
            # recently used goes first), so the cache never costs a running request.
            spare = budget * 3 // 4 - (recurrent_rows + 1) * row_bytes
            snapshot_rows = max(0, min(recurrent_rows, spare // row_bytes))
            if not snapshot_rows:
                log.warning("no room for the prefix cache's snapshots of a hybrid's state in the KV cache's "
                            "budget (%s): prefix caching off (raise the budget for it)", asked)
        state = state_bytes(recurrent_rows + snapshot_rows)
        num_blocks = (budget - state) // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"the KV cache's budget ({asked}) is too small for one block"
                             + (f" beside the recurrent state of {recurrent_rows} requests "
                                f"({state / (1 << 30):.2f} GiB)" if state else ""))
    check_kv_cache_fits((num_blocks + 1) * bytes_per_block + state, device, asked)
    # More blocks than the longest request could use at max_num_seqs are wasted memory,
    # but we cannot know max_num_seqs here; the budget is the user's to set.
    return int(num_blocks), recurrent_rows, snapshot_rows


def allocate_kv_caches(cfg, backend, num_blocks: int, block_size: int, kv_cache_dtype: torch.dtype,
                       values_are_keys: bool, device: torch.device, state_shapes) -> list:
    """A layer's cache each: an attention layer's paged K and V, a recurrent layer's state
    (`state_shapes(layer)`: its tensors' shapes and dtypes), None for a layer without a
    token mixer (Nemotron-H's MLP blocks)."""
    return [
        backend.new_kv_cache(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, kv_cache_dtype, device,
                             values_are_keys=values_are_keys)  # [2, num_blocks, block_size, kv_heads, head_dim]
        if i in cfg.attention_layers else
        tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in state_shapes(i))
        if i in cfg.recurrent_layers else None
        for i in range(cfg.num_hidden_layers)
    ]
