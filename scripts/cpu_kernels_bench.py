"""Time the CPU kernels (kernels/cpu) against the PyTorch ops they replace, on SmolLM2's
shapes: the kernel figures in docs/performance/history.md ("Third pass").

    python scripts/cpu_kernels_bench.py [--quick] [--dtype float32] [--attention-only --heads 4,1,256]

- products: every layer weight of a decode step in a row (30 layers + the tied head,
  270 MB in bfloat16, so nothing stays in cache), llmbus's packed product against
  oneDNN's (and in float32 MKL's plain `F.linear`, what transformers runs), at 1-32 rows
  (GB/s of weights); in bfloat16 also the layers' int4 and int8 products against
  bfloat16's at 1-128 rows; one 576 -> 3072 product at 128-2048 rows (GFLOP/s);
- decode attention: 128 decodes over 400 tokens with shuffled blocks, 8 layers' caches in
  turn (GB/s of K/V), against the PyTorch backend's gathered matmuls;
- prefill attention: one 512-token prompt (9 heads over 3), against PyTorch's SDPA.
`--heads Q,KV,D` times the attention with other heads (4,1,256: gemma-3-1b's); `--window W`
the decodes with a sliding window of W keys (over 2W), `--softcap C` with scores capped
(Gemma 2's 50): the kernel against the PyTorch backend's loop.
Best of a few repeats each, the two sides alternated; the machine's speed drifts, so
compare within one run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.cpu as cpu_kernels  # noqa: E402
from llmbus.bench.attention_batches import heads_first, make_batch  # noqa: E402
from services.worker.attention.torch_backend import TorchAttentionBackend  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def products(repeats: int, dtype: torch.dtype, layers: int) -> None:
    shapes = LAYER_SHAPES * layers + [(49152, 576)]
    weights = [(torch.randn(n, k) * 0.02).to(dtype) for n, k in shapes]
    ours = [cpu_kernels.pack_weight(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    others = {"oneDNN": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], "")}
    if dtype == torch.float32:
        others["MKL"] = lambda x, i: torch.nn.functional.linear(x, weights[i])
    print(f"products, a decode step's weights in a row ({nbytes / 1e6:.0f} MB):")
    for rows in (1, 4, 32):
        x = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
        t_ours = best(lambda: [cpu_kernels.linear(x[k], p, n) for (n, k), p in zip(shapes, ours)], repeats)
        line = f"  {rows:4d} rows: llmbus {t_ours * 1e3:6.2f} ms ({nbytes / t_ours / 1e9:4.1f} GB/s)"
        for name, other in others.items():
            t = best(lambda: [other(x[k], i) for i, (n, k) in enumerate(shapes)], repeats)
            line += f", {name} {t * 1e3:6.2f} ms ({nbytes / t / 1e9:4.1f} GB/s): {t / t_ours:.2f}x"
        print(line)
    if dtype == torch.bfloat16:
        quantized(repeats, layers)
    print("products, 576 -> 3072:")
    for rows in (128, 512, 2048):
        x = torch.randn(rows, 576).to(dtype)
        flops = 2 * rows * weights[2].numel()
        t_ours = best(lambda: cpu_kernels.linear(x, ours[2], 3072), repeats)
        line = f"  {rows:4d} rows: llmbus {flops / t_ours / 1e9:4.0f} GFLOP/s"
        for name, other in others.items():
            line += f", {name} {flops / best(lambda: other(x, 2), repeats) / 1e9:4.0f} GFLOP/s"
        print(line)


def quantized(repeats: int, layers: int) -> None:
    """The layers' products in int4 and int8 (linear_int4.cpp, linear_int8.cpp) against the
    same in bfloat16: the LM head is left out (int4 keeps it in bfloat16)."""
    from services.worker.layers.quantized_linear import int4_grid

    shapes = LAYER_SHAPES * layers
    weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
    bf16 = [cpu_kernels.pack_weight(w.bfloat16()) for w in weights]
    int4 = [cpu_kernels.pack_int4(*int4_grid(w)) for w in weights]
    scales = [w.abs().amax(1) / 127 for w in weights]
    int8 = [cpu_kernels.pack_int8(torch.round(w / s[:, None]).to(torch.int8), s) for w, s in zip(weights, scales)]
    mb = {name: sum(p.numel() * p.element_size() for p in packed) / 1e6
          for name, packed in (("int4", int4), ("int8", int8), ("bfloat16", bf16))}
    print("products of the layers' weights in a row, quantized (" + ", ".join(f"{k} {v:.0f} MB" for k, v in mb.items()) + "):")
    for rows in (1, 4, 16, 128):
        x = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
        t_bf16 = best(lambda: [cpu_kernels.linear(x[k], p, n) for (n, k), p in zip(shapes, bf16)], repeats)
        line = f"  {rows:4d} rows: bfloat16 {t_bf16 * 1e3:6.2f} ms"
        for name, fn, packed in (("int4", cpu_kernels.linear_int4, int4), ("int8", cpu_kernels.linear_int8, int8)):
            t = best(lambda: [fn(x[k], p, n) for (n, k), p in zip(shapes, packed)], repeats)
            line += f", {name} {t * 1e3:6.2f} ms ({mb[name] / 1e3 / t:4.1f} GB/s): {t_bf16 / t:.2f}x"
        print(line)


def paged_batch(query_lens, seq_lens, seed, dtype, heads=(9, 3, 64)):
    """A random step over SmolLM2's heads (9 over 3, head_dim 64; or `heads`) in a heads-first cache."""
    query, cache, md = make_batch(query_lens, seq_lens, *heads, 16, dtype, seed)
    return query, heads_first(cache), md


def attention(repeats: int, monkey_off, dtype: torch.dtype, heads=(9, 3, 64), window: int = 0,
              softcap: float | None = None) -> None:
    batch, length = 128, 2 * window if window else 400
    num_heads, num_kv_heads, head_dim = heads
    layers = [paged_batch([1] * batch, [length] * batch, seed, dtype, heads) for seed in range(8)]
    backend = TorchAttentionBackend()
    unused = torch.zeros(batch, num_kv_heads, head_dim).to(dtype)

    def run_all():
        for query, cache, md in layers:
            md.backend_state = None
            backend.forward(query, unused, unused, cache, md, head_dim**-0.5, window, softcap)

    t_kernel = best(run_all, repeats) / len(layers)
    with monkey_off():
        t_torch = best(run_all, repeats) / len(layers)
    nbytes = batch * (window or length) * num_kv_heads * head_dim * 2 * unused.element_size()
    print(f"decode attention, {batch} x {length} tokens{f', window {window}' if window else ''}"
          f"{f', softcap {softcap}' if softcap else ''}, a layer: llmbus {t_kernel * 1e3:.2f} ms "
          f"({nbytes / t_kernel / 1e9:.1f} GB/s of K/V), PyTorch backend {t_torch * 1e3:.2f} ms: {t_torch / t_kernel:.2f}x")

    query, cache, md = paged_batch([512], [512], 0, dtype, heads)
    unused = torch.zeros(512, num_kv_heads, head_dim).to(dtype)

    def prefill():
        md.backend_state = None
        backend.forward(query, unused, unused, cache, md, head_dim**-0.5, window, softcap)

    t_kernel = best(prefill, repeats)
    with monkey_off():
        t_torch = best(prefill, repeats)
    flops = num_heads * 512 * 513 / 2 * head_dim * 4
    print(f"prefill attention, one 512-token prompt, a layer: llmbus {t_kernel * 1e3:.2f} ms "
          f"({flops / t_kernel / 1e9:.0f} GFLOP/s), {'the loop' if window or softcap else 'SDPA'} "
          f"{t_torch * 1e3:.2f} ms ({flops / t_torch / 1e9:.0f} GFLOP/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="one repeat each, 2 layers' weights (a smoke run: its figures mean nothing)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--attention-only", action="store_true", help="the attention kernels alone")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim of the attention timed")
    parser.add_argument("--window", type=int, default=0, help="a sliding window for the decodes timed")
    parser.add_argument("--softcap", type=float, default=None, help="a soft cap on the decodes' scores")
    args = parser.parse_args()
    heads = tuple(int(x) for x in args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    if not cpu_kernels.available():
        sys.exit(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    repeats = 1 if args.quick else 3
    print(f"threads {torch.get_num_threads()}, {args.dtype}")
    if not args.attention_only:
        products(repeats, dtype, 2 if args.quick else 30)

    from contextlib import contextmanager

    @contextmanager
    def kernels_off():
        saved = cpu_kernels.attention_supported
        cpu_kernels.attention_supported = lambda *args: False
        try:
            yield
        finally:
            cpu_kernels.attention_supported = saved

    attention(repeats, kernels_off, dtype, heads, args.window, args.softcap)


if __name__ == "__main__":
    main()
