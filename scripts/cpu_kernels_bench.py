"""Time the CPU kernels (kernels/cpu) against the PyTorch ops they replace, on SmolLM2's
shapes: the kernel figures in docs/performance.md ("Third pass").

    python scripts/cpu_kernels_bench.py [--quick]

- products: every layer weight of a decode step in a row (30 layers + the tied head,
  270 MB, so nothing stays in cache), llmbus's packed bfloat16 product against oneDNN's,
  at 1-32 rows (GB/s of weights), and one 576 -> 3072 product at 128-2048 rows (GFLOP/s);
- decode attention: 128 decodes over 400 tokens with shuffled blocks, 8 layers' caches in
  turn (GB/s of K/V), against the PyTorch backend's gathered matmuls;
- prefill attention: one 512-token prompt (9 heads over 3), against PyTorch's SDPA.
Best of a few repeats each, the two sides alternated; the machine's speed drifts, so
compare within one run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.cpu as cpu_kernels  # noqa: E402
from services.worker.attention.metadata import AttentionMetadata  # noqa: E402
from services.worker.attention.torch_backend import TorchAttentionBackend, new_kv_cache  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def products(repeats: int) -> None:
    shapes = LAYER_SHAPES * 30 + [(49152, 576)]
    weights = [torch.randn(n, k).bfloat16() * 0.02 for n, k in shapes]
    ours = [cpu_kernels.pack_bf16(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    nbytes = sum(w.numel() * 2 for w in weights)
    print(f"products, a decode step's weights in a row ({nbytes / 1e6:.0f} MB):")
    for rows in (1, 4, 32):
        x = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
        t_ours = best(lambda: [cpu_kernels.linear_bf16(x[k], p, n) for (n, k), p in zip(shapes, ours)], repeats)
        t_dnn = best(lambda: [torch.ops.mkldnn._linear_pointwise(x[k], p, None, "none", [], "")
                              for (n, k), p in zip(shapes, onednn)], repeats)
        print(f"  {rows:4d} rows: llmbus {t_ours * 1e3:6.2f} ms ({nbytes / t_ours / 1e9:4.1f} GB/s), "
              f"oneDNN {t_dnn * 1e3:6.2f} ms ({nbytes / t_dnn / 1e9:4.1f} GB/s): {t_dnn / t_ours:.2f}x")
    w = weights[2]
    ours_w, dnn_w = ours[2], onednn[2]
    print("products, 576 -> 3072:")
    for rows in (128, 512, 2048):
        x = torch.randn(rows, 576).bfloat16()
        t_ours = best(lambda: cpu_kernels.linear_bf16(x, ours_w, 3072), repeats)
        t_dnn = best(lambda: torch.ops.mkldnn._linear_pointwise(x, dnn_w, None, "none", [], ""), repeats)
        flops = 2 * rows * w.numel()
        print(f"  {rows:4d} rows: llmbus {flops / t_ours / 1e9:4.0f} GFLOP/s, oneDNN {flops / t_dnn / 1e9:4.0f} GFLOP/s")


def paged_batch(seq_lens, query_lens, heads, kv_heads, head_dim, block_size, seed):
    """Random K/V in a heads-first cache with shuffled blocks, and the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_req)
    cache = new_kv_cache(num_blocks, block_size, kv_heads, head_dim, torch.bfloat16, "cpu")
    cache.copy_(torch.randn(cache.shape, generator=gen).bfloat16())
    perm = torch.randperm(num_blocks, generator=gen).int()
    table = torch.zeros(len(seq_lens), max(per_req), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_req):
        table[i, :n] = perm[used:used + n]
        used += n
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    query = torch.randn(int(qsl[-1]), heads, head_dim, generator=gen).bfloat16()
    md = AttentionMetadata(
        num_decodes=sum(q == 1 for q in query_lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), slot_mapping=torch.full((int(qsl[-1]),), -1),
        block_table=table, query_start_loc_cpu=qsl, seq_lens_cpu=np.asarray(seq_lens))
    return query, cache, md


def attention(repeats: int, monkey_off) -> None:
    batch, length = 128, 400
    layers = [paged_batch([length] * batch, [1] * batch, 9, 3, 64, 16, seed) for seed in range(8)]
    backend = TorchAttentionBackend()
    unused = torch.zeros(batch, 3, 64).bfloat16()

    def run_all():
        for query, cache, md in layers:
            md.backend_state = None
            backend.forward(query, unused, unused, cache, md, 0.125)

    t_kernel = best(run_all, repeats) / len(layers)
    with monkey_off():
        t_torch = best(run_all, repeats) / len(layers)
    nbytes = batch * length * 3 * 64 * 2 * 2
    print(f"decode attention, {batch} x {length} tokens, a layer: llmbus {t_kernel * 1e3:.2f} ms "
          f"({nbytes / t_kernel / 1e9:.1f} GB/s of K/V), PyTorch backend {t_torch * 1e3:.2f} ms: {t_torch / t_kernel:.2f}x")

    query, cache, md = paged_batch([512], [512], 9, 3, 64, 16, 0)
    unused = torch.zeros(512, 3, 64).bfloat16()

    def prefill():
        md.backend_state = None
        backend.forward(query, unused, unused, cache, md, 0.125)

    t_kernel = best(prefill, repeats)
    with monkey_off():
        t_torch = best(prefill, repeats)
    flops = 9 * 512 * 513 / 2 * 64 * 4
    print(f"prefill attention, one 512-token prompt, a layer: llmbus {t_kernel * 1e3:.2f} ms "
          f"({flops / t_kernel / 1e9:.0f} GFLOP/s), SDPA {t_torch * 1e3:.2f} ms ({flops / t_torch / 1e9:.0f} GFLOP/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one repeat each (a smoke run)")
    args = parser.parse_args()
    if not cpu_kernels.available():
        sys.exit(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    repeats = 1 if args.quick else 3
    print(f"threads {torch.get_num_threads()}")
    products(repeats)

    from contextlib import contextmanager

    @contextmanager
    def kernels_off():
        saved = cpu_kernels.attention_supported
        cpu_kernels.attention_supported = lambda *args: False
        try:
            yield
        finally:
            cpu_kernels.attention_supported = saved

    attention(repeats, kernels_off)


if __name__ == "__main__":
    main()
