"""The fused element-wise kernels (kernels/elementwise.py) on the GPU: the same bits as the
PyTorch ops they replace, and what they save a decoder layer.

    python scripts/elementwise_check.py --out $OUT [--cpu]

For a SmolLM2-shaped and a Llama-3-8B-shaped layer in bfloat16, at batch 1 and 128: one
layer's element-wise work (two residual adds with RMSNorm, rotary over the query and key
heads with the keys and values written to the cache, SiLU-and-mul) as PyTorch ops (and
the Triton cache write they are followed by) and as four launches of the Triton kernels, each captured in a
CUDA graph (so launches cost what they cost in the engine's decode graphs) and replayed;
microseconds a layer, and the share of bits equal. Writes $OUT/elementwise.json. Exits 1
if a kernel failed to run: scripts/device_check.sh then runs the rest with
LLMBUS_TRITON_ELEMENTWISE=0 (PyTorch ops), so one bad kernel costs one figure, not the run.
`--cpu`: tiny shapes, eager, under Triton's interpreter (tests this script).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (hidden, heads, kv heads, head_dim, intermediate)
SHAPES = {"smollm2": (576, 9, 3, 64, 1536), "llama3_8b": (4096, 32, 8, 128, 14336)}
TINY = {"tiny": (64, 4, 2, 16, 128)}
EPS = 1e-5


def layer_inputs(shape, batch: int, device: str) -> dict:
    hidden, heads, kv_heads, head_dim, inter = shape
    gen = torch.Generator(device=device).manual_seed(batch)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen, device=device) * scale).to(torch.bfloat16)

    num_blocks = batch  # (block size 16: room for every row's slot)
    return {
        "x": randn(batch, hidden, scale=3.0), "residual": randn(batch, hidden),
        "weight": (torch.rand(hidden, generator=gen, device=device) + 0.5).to(torch.bfloat16),
        "qk": randn(batch, heads + kv_heads, head_dim), "v": randn(batch, kv_heads, head_dim),
        "gate_up": randn(batch, 2 * inter, scale=4.0), "heads": heads,
        "positions": torch.randint(0, 4096, (batch,), generator=gen, device=device),
        "slots": torch.randperm(num_blocks * 16, generator=gen, device=device)[:batch],
        "cache": torch.zeros(2, num_blocks, 16, kv_heads, head_dim, dtype=torch.bfloat16, device=device),
    }


def run_layer(fused: bool, inputs: dict, rotary, norm) -> list[torch.Tensor]:
    """One layer's element-wise work on fresh copies of the inputs; its outputs. (The
    PyTorch path's cos/sin rows are gathered once a step, not a layer: cached in `rotary`.)"""
    import kernels.elementwise as ew

    from kernels.reshape_and_cache import reshape_and_cache

    x, residual, weight = inputs["x"], inputs["residual"].clone(), inputs["weight"]
    qk, gate_up, positions = inputs["qk"].clone(), inputs["gate_up"], inputs["positions"]
    v, slots, cache, heads = inputs["v"], inputs["slots"], inputs["cache"], inputs["heads"]
    n = gate_up.shape[-1] // 2
    if fused:
        normed, residual = ew.add_rms_norm(x, residual, weight, EPS)
        q = ew.rotary_and_cache(qk, v, positions, rotary.cos_cache, rotary.sin_signed_cache, cache[0], cache[1],
                                slots, heads)
        mlp_in, residual = ew.add_rms_norm(normed, residual, weight, EPS)
        act = ew.silu_mul(gate_up)
    else:  # the PyTorch ops, and the Triton cache write they were followed by
        normed, residual = norm(x, residual)
        rotated = rotary._rotate(positions, qk)
        q = rotated[:, :heads]
        reshape_and_cache(rotated[:, heads:], v, cache[0], cache[1], slots)
        mlp_in, residual = norm(normed, residual)
        act = F.silu(gate_up[:, :n]) * gate_up[:, n:]
    return [normed, q, mlp_in, residual, act]


def time_us(fn, device: str, reps: int) -> float:
    """Microseconds a call: replays of a CUDA graph of `reps` calls on a GPU, eager on CPU."""
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()

    from services.worker.layers.rms_norm import RMSNorm
    from services.worker.layers.rotary import RotaryEmbedding

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no GPU (--cpu tests the script)")
        return 0
    report, failed = {}, False
    for name, shape in (TINY if args.cpu else SHAPES).items():
        rotary = RotaryEmbedding(shape[3], 4096, 500000.0, {}).to(device)
        for batch in ((1, 4) if args.cpu else (1, 128)):
            inputs = layer_inputs(shape, batch, device)
            norm = RMSNorm(shape[0], EPS).to(device)
            norm.weight.data = inputs["weight"]
            key = f"{name}_b{batch}"
            try:
                with torch.inference_mode():
                    fused = run_layer(True, inputs, rotary, norm) + [inputs["cache"].clone()]
                    inputs["cache"].zero_()
                    plain = run_layer(False, inputs, rotary, norm) + [inputs["cache"].clone()]
                    equal = sum(int((a == b).sum()) for a, b in zip(fused, plain))
                    report[f"elementwise_bits_equal_{key}"] = round(equal / sum(a.numel() for a in fused), 6)
                    reps = 2 if args.cpu else 20
                    fused_us = time_us(lambda: run_layer(True, inputs, rotary, norm), device, reps)
                    torch_us = time_us(lambda: run_layer(False, inputs, rotary, norm), device, reps)
                report[f"elementwise_us_layer_{key}"] = round(fused_us, 2)
                report[f"elementwise_us_layer_{key}_torch"] = round(torch_us, 2)
                report[f"elementwise_speedup_{key}"] = round(torch_us / fused_us, 3)
            except Exception:  # noqa: BLE001 - the run goes on without the kernels; say why
                traceback.print_exc()
                report[f"elementwise_error_{key}"] = traceback.format_exc(limit=2)[-500:]
                failed = True
            print(json.dumps({k: v for k, v in report.items() if key in k}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "elementwise.json").write_text(json.dumps(report, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
