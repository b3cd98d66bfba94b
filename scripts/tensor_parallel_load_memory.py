"""What one tensor-parallel rank's loading holds: rank 0's anonymous memory (its own
pages, not the page cache's mapped checkpoint) at its peak while the model loads, and
after, at 1 and N ranks. Checkpoint tensors come from safetensors mapped (safetensors
0.8's get_tensor copies nothing) and each rank copies out only its slice, so the peak
should fall with N as the weights held do.

    python scripts/tensor_parallel_load_memory.py --model smollm2 --tensor-parallel-size 3

Each count loads in a process of its own (rank 0 of a stand-in group: loading talks to no
other rank). Float32, PyTorch's own products (LLMBUS_CPU_KERNELS=0), one run each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def anon_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("RssAnon"))


def load(model: str, world_size: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from llmbus.model_fetch import resolve_model
    from services.worker.attention.backend import get_attention_backend
    from services.worker.loader import load_model
    from services.worker.models.decoder_config import ModelConfig
    from services.worker.parallel.sharding import local_config

    class Rank0:  # (what loading reads of a group)
        rank, world_size = 0, 0

    Rank0.world_size = world_size
    folder = resolve_model(model)
    full = ModelConfig.from_folder(folder)
    config = full if world_size == 1 else local_config(full, world_size)
    start, peak, done = anon_mib(), [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anon_mib())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    model = load_model(folder, config, torch.float32, get_attention_backend("torch"), 512,
                       tensor_parallel=None if world_size == 1 else (Rank0, full))
    done.set()
    watcher.join()
    held = anon_mib() - start
    del model
    return {"tensor_parallel_size": world_size, "peak_mib": peak[0] - start, "held_mib": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tensor-parallel-size", type=int, default=3)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # (a child: load at this size)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(load(args.model, args.one)))
        return
    env = {**os.environ, "LLMBUS_CPU_KERNELS": "0"}
    rows = [json.loads(subprocess.run([sys.executable, __file__, "--model", args.model, "--one", str(n)], env=env,
                                      check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            for n in (1, args.tensor_parallel_size)]
    rows.append({"peak_ratio": round(rows[1]["peak_mib"] / rows[0]["peak_mib"], 2),
                 "held_ratio": round(rows[1]["held_mib"] / rows[0]["held_mib"], 2)})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
