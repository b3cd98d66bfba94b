"""Which packed product serves each of a model's weight shapes on this CPU, by measurement.

llmbus's bfloat16 and float32 products (kernels/cpu/linear.cpp, `vdpbf16ps`) stream the
weights at close to memory speed for the few rows of a decode step, and on the AMD Zen
they were tuned on they match oneDNN up to thousands of rows. On an Intel Xeon with AMX,
oneDNN's product (the one `F.linear` and oneDNN-packed weights take) runs on AMX tiles at
2.5x our throughput from a few dozen rows on, while ours still wins single streams. So
neither is right everywhere: at load, each weight shape is timed on its own weight with
both packings at a few row counts, and where oneDNN's is clearly faster (by `MARGIN`) from
some row count on, the layer keeps both packings and switches there (PackedLinear's
`rows_from`; the one-call decode layer steps aside from there too). The choice is kept
under $LLMBUS_HOME/kernels/choices.json, keyed by the CPU, its flags, torch's version, the
threads and the shape, so a machine measures a shape once.

`LLMBUS_CPU_KERNELS` forces a choice: `auto` (the default) measures; `1` or `avx512`
takes llmbus's product at every row count (the choice before this file); `amx` takes
oneDNN's at every row count, and is an error on a CPU without AMX; `0` turns llmbus's
kernels off altogether (kernels/cpu/build.py), PyTorch's oneDNN then serving.

Shapes under MIN_WEIGHTS weights (the tests' tiny models) are not measured: a call that
small times the call, not the product, and a choice that flipped run to run would change
the bits a model computes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch

import kernels.cpu as cpu_kernels
from kernels.cpu.build import cache_dir, cpu_flags

log = logging.getLogger("llmbus.worker")

MODES = ("auto", "1", "avx512", "amx", "0")
ROWS = (1, 8, 32, 128, 512)  # the row counts timed: a decode step's few to a prefill chunk's many
MARGIN = 0.15  # oneDNN's product takes a row count only this much faster (noise never flips it)
MIN_WEIGHTS = 1 << 18
CALL_CAP_S = 0.05  # no row count whose one call would take longer than this (a 70B head at 512 rows)
REPEATS = 3

# (llmbus's seconds, oneDNN's seconds) for one call, by row count
Timings = dict[int, tuple[float, float]]


def mode() -> str:
    """LLMBUS_CPU_KERNELS, checked: a forced choice this CPU cannot run is a ValueError."""
    value = os.environ.get("LLMBUS_CPU_KERNELS", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"LLMBUS_CPU_KERNELS={value!r}: one of {', '.join(MODES)}")
    if value == "amx" and "amx_bf16" not in cpu_flags():
        raise ValueError("LLMBUS_CPU_KERNELS=amx: this CPU has no AMX (no amx_bf16 among /proc/cpuinfo's flags)")
    return value


def decide(timings: Timings, margin: float = MARGIN) -> int | None:
    """The row count from which oneDNN's product serves: the least measured count from which
    it is faster by `margin` at every larger one, two counts at least (one alone may be a
    moment's noise) where more than one was measured; None where llmbus's is not beaten so."""
    counts = sorted(timings, reverse=True)
    beaten = 0
    for rows in counts:
        ours, theirs = timings[rows]
        if theirs * (1 + margin) >= ours:
            break
        beaten += 1
    if beaten == 0 or beaten == 1 and len(counts) > 1:
        return None
    return counts[beaten - 1]


def measure(products: tuple[Callable[[torch.Tensor], torch.Tensor], ...], in_features: int, dtype: torch.dtype,
            rows_counts: tuple[int, ...] = ROWS) -> Timings:
    """Two products of one weight (llmbus's, oneDNN's) timed at each row count (best of
    REPEATS, alternated), up to the count whose one call would pass CALL_CAP_S."""
    timings: Timings = {}
    last = None
    for rows in rows_counts:
        if last is not None and max(timings[last]) * rows / last > CALL_CAP_S:
            break
        x = torch.randn(rows, in_features, dtype=dtype)
        best = [float("inf"), float("inf")]
        for product in products:
            product(x)  # (warm: first-touch of the packed copy, oneDNN's primitive)
        for _ in range(REPEATS):
            for i, product in enumerate(products):
                start = time.perf_counter()
                product(x)
                best[i] = min(best[i], time.perf_counter() - start)
        timings[rows] = (best[0], best[1])
        last = rows
    return timings


class KernelChoices:
    """Each weight shape's row count for oneDNN's product (PackedLinear's `rows_from`)."""

    def __init__(self, timer: Callable[[torch.Tensor], Timings], forced: str | None = None,
                 path: Path | None = None) -> None:
        """`timer`: a weight's two products timed (packed_linear.time_products)."""
        self.mode = forced or mode()
        self.path = path or cache_dir() / "choices.json"
        self.timer = timer
        self.made: dict[str, int | None] = {}  # this load's, by key
        self.measured: list[str] = []
        self._stored: dict | None = None
        self._machine: str | None = None  # (the key's machine part: read once a load)

    def rows_from(self, weight: torch.Tensor) -> int | None:
        if self.mode in ("1", "avx512", "0") or not cpu_kernels.available():
            return None  # (without llmbus's kernels every product is oneDNN's already)
        if self.mode == "amx":
            return 1
        if weight.numel() < MIN_WEIGHTS:
            return None
        key = self._key(weight)
        if key not in self.made:
            stored = self._store()
            if key in stored:
                self.made[key] = stored[key]
            else:
                self.made[key] = decide(self.timer(weight.detach()))
                self.measured.append(key)
        return self.made[key]

    def finish(self) -> None:
        """Keep what was measured, and say in one line what serves which shapes."""
        if self.measured:
            stored = {**self._read(), **{key: self.made[key] for key in self.measured}}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(f".{os.getpid()}.tmp")  # (workers of a host may write at once)
            partial.write_text(json.dumps(stored, indent=1, sort_keys=True))
            partial.replace(self.path)
        if self.mode == "auto" and self.made:
            shapes = {key.rsplit("|", 1)[1]: rows for key, rows in self.made.items()}
            log.info("cpu products chosen", extra={
                "cpu_kernels": {shape: "llmbus" if rows is None else f"llmbus below {rows} rows, onednn from {rows}"
                                if rows > 1 else "onednn" for shape, rows in shapes.items()},
                "measured_shapes": len(self.measured)})

    def _key(self, weight: torch.Tensor) -> str:
        if self._machine is None:
            flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
            self._machine = f"{_cpu_model()}|{flags}|torch {torch.__version__}|{torch.get_num_threads()} threads"
        return f"{self._machine}|{str(weight.dtype).removeprefix('torch.')} {weight.shape[0]}x{weight.shape[1]}"

    def _store(self) -> dict:
        if self._stored is None:
            self._stored = self._read()
        return self._stored

    def _read(self) -> dict:
        try:
            stored = json.loads(self.path.read_text())
            return stored if isinstance(stored, dict) else {}
        except (OSError, ValueError):
            return {}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"
