"""What this machine can do at best, measured in the same run as the engine it bounds.

- Compute: matmul FLOP/s for a dtype, on the model's own layer shapes (the MLP's
  up-projection at a full token budget) and on a square GEMM; the higher is the peak.
  A token costs about 2 x parameters FLOPs, so the peak / (2 x parameters) is the most
  tokens per second any engine could reach.
- Memory: copy bandwidth (bytes read + bytes written per second, as STREAM's copy counts
  them) over a buffer far larger than the caches. A decode step must read every weight
  once, so weight bytes / bandwidth is the least time a step can take.

Both are measured on the device the model runs on (a GPU's figures on a GPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class Roofline:
    dtype: torch.dtype
    matmul_flops: float  # FLOP/s
    copy_bytes_per_s: float
    num_params: int
    weight_bytes: int  # read by one decode step

    @property
    def max_tokens_per_s(self) -> float:
        return self.matmul_flops / (2 * self.num_params)

    @property
    def min_decode_step_s(self) -> float:
        return self.weight_bytes / self.copy_bytes_per_s

    def describe(self) -> str:
        return (
            f"roofline ({str(self.dtype).removeprefix('torch.')}): matmul {self.matmul_flops / 1e9:.1f} GFLOP/s, "
            f"copy {self.copy_bytes_per_s / 1e9:.1f} GB/s; {self.num_params / 1e6:.1f} M params -> "
            f"compute bound {self.max_tokens_per_s:.0f} tok/s; {self.weight_bytes / 1e6:.0f} MB of weights "
            f"per decode step -> bandwidth bound {self.min_decode_step_s * 1e3:.1f} ms/token"
        )


def _best_time(fn, repeats: int, min_seconds: float = 0.3, device: torch.device | None = None) -> float:
    """Best per-call time over a few timed batches of calls (best: the machine is shared).
    On a GPU the calls are asynchronous: each batch waits for its kernels to finish."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    fn()  # warm up: allocation, kernel selection
    sync()
    best = float("inf")
    deadline = time.perf_counter() + min_seconds
    while True:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / repeats)
        if time.perf_counter() > deadline:
            return best


def matmul_flops(dtype: torch.dtype, shapes: list[tuple[int, int, int]], device: torch.device | None = None) -> float:
    """The best FLOP/s of `x @ w.T` over the (tokens, in, out) shapes, through F.linear and,
    where the model packs its weights, through the packed product it runs: the bound is
    the best this machine does, not what an unpacked call does."""
    from services.worker.layers.packed_linear import PackedLinear, can_pack

    best = 0.0
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device).to(dtype)
        w = torch.randn(n, k, device=device).to(dtype)
        products = [lambda: F.linear(x, w)]
        if can_pack(dtype, x.device):
            packed = PackedLinear(w, None)
            products.append(lambda: packed(x))
        for product in products:
            best = max(best, 2 * m * k * n / _best_time(product, repeats=5, device=x.device))
    return best


def copy_bandwidth(num_bytes: int = 512 << 20, device: torch.device | None = None) -> float:
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), repeats=2, min_seconds=1.0, device=src.device)
    return 2 * num_bytes / seconds


def model_weights(model: torch.nn.Module, tied: bool) -> tuple[int, int]:
    """(parameters, bytes one decode step reads). Every matmul weight is read whole once;
    the input embedding only one row per token, unless it doubles as the LM head (tied,
    with no LM head module of its own). Tied weights count once as parameters."""
    seen, num_params, num_bytes = set(), 0, 0
    for name, param in model.named_parameters():
        if param.data_ptr() in seen:
            continue
        seen.add(param.data_ptr())
        num_params += param.numel()
        if "embed_tokens" not in name or getattr(model, "lm_head", None) is None:
            num_bytes += param.numel() * param.element_size()
    for name, module in model.named_modules():
        if hasattr(module, "weight_bytes"):  # packed or quantized: weights held in buffers
            if not (tied and name == "lm_head"):  # a packed or quantized copy of the embedding
                num_params += module.num_weights
            num_bytes += module.weight_bytes
    return num_params, num_bytes


def measure(model: torch.nn.Module, hidden: int, intermediate: int, tied: bool, dtype: torch.dtype,
            num_tokens: int = 512, device: torch.device | None = None) -> Roofline:
    num_params, weight_bytes = model_weights(model, tied)
    # A GPU's peak needs a bigger square than a CPU's to show (1024^3 is ~3 us on an H200).
    square = 8192 if device is not None and device.type == "cuda" else 1024
    flops = matmul_flops(dtype, [(num_tokens, hidden, intermediate), (square, square, square)], device)
    return Roofline(dtype, flops, copy_bandwidth(device=device), num_params, weight_bytes)


def measure_runner(runner, num_tokens: int = 512) -> Roofline:
    cfg = runner.model_config
    return measure(runner.model, cfg.hidden_size, cfg.intermediate_size, cfg.tie_word_embeddings,
                   runner.dtype, num_tokens, runner.device)
