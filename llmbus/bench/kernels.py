"""`python -m llmbus.bench.kernels`: the GPU check of the attention kernels, one prepared script.

On a GPU: correctness at real sizes against the PyTorch reference, then decode timings
for batch x context in {1, 16, 64, 256} x {512, 4096, 16384} (head dim 128, 32 query /
8 KV heads, bf16, block 16) with every tile size and split count, the one the defaults
pick (TILE_KEYS, choose_num_splits), the achieved K/V bandwidth against
the H200's ~4.8 TB/s, torch SDPA on the same data gathered contiguous (and FlashInfer if
importable), a float8 cache (e4m3, e5m2) against bf16 at three shapes, and one mixed
prefill + decode step. Writes `kernels_bench.json` and
`kernels_bench.md` into --out (default $OUT or .).

`--smoke` runs the same code on tiny shapes (CPU: Triton's interpreter), to prove the
script works before device time is spent on it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import kernels  # noqa: F401 - interpreter when there is no GPU
import numpy as np
import torch
import torch.nn.functional as F

from kernels.paged_attention import TILE_KEYS, paged_attention
from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.attention.triton_backend import choose_num_splits

H200_PEAK_BYTES_S = 4.8e12


def make_step(batch, context, query_len, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    """`batch` requests with `context` tokens each, the last `query_len` of them new."""
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where used: GBs at real sizes
    blocks_per_req = -(-context // block_size)
    num_blocks = batch * blocks_per_req
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    value_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    block_table = torch.randperm(num_blocks, generator=gen, device=device).view(batch, blocks_per_req).to(torch.int32)
    qsl = np.arange(batch + 1, dtype=np.int64) * query_len
    seq_lens = np.full(batch, context, dtype=np.int64)
    query = torch.randn(batch * query_len, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    md = AttentionMetadata(
        num_decodes=batch if query_len == 1 else 0, num_actual_tokens=batch * query_len,
        max_query_len=query_len, max_seq_len=context,
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        slot_mapping=torch.full((batch * query_len,), -1, dtype=torch.int64, device=device),
        block_table=block_table, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    return query, key_cache, value_cache, md


def timed(fn, device) -> float:
    """Seconds per call: triton's do_bench on a GPU, one plain call on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100) / 1e3
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_kernel(query, key_cache, value_cache, md, num_splits, tile_keys=None):
    return paged_attention(query, key_cache, value_cache, md.block_table, md.query_start_loc, md.seq_lens,
                           md.max_query_len, query.shape[-1] ** -0.5, num_splits=num_splits, tile_keys=tile_keys)


def check(query, key_cache, value_cache, md, num_splits, tile_keys=None) -> float:
    ref = TorchAttentionBackend().forward(
        query.float(), torch.zeros(query.shape[0], *key_cache.shape[2:], device=query.device),
        torch.zeros(query.shape[0], *key_cache.shape[2:], device=query.device),
        torch.stack([key_cache, value_cache]).float(), md, query.shape[-1] ** -0.5,
    )
    out = run_kernel(query, key_cache, value_cache, md, num_splits, tile_keys).float()
    return float((out - ref).abs().max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script itself")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        heads, kv_heads, head_dim, dtype = 4, 2, 64, torch.float32
        batches, contexts, mixed = [1, 2], [32, 64], (16, 1, 2, 48)
        splits, tiles = [1, 2], [16, 32]
        fp8_shapes = [(2, 64)]
    else:
        heads, kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
        batches, contexts, mixed = [1, 16, 64, 256], [512, 4096, 16384], (2048, 1, 64, 4096)
        splits, tiles = [1, 2, 4, 8, 16], [16, 32, 64, 128]
        fp8_shapes = [(16, 16384), (64, 4096), (256, 16384)]
    block_size = 16
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                    "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(dtype),
                    "block_size": block_size, "correctness": [], "decode": [], "mixed": {}}

    # Correctness at the benchmark's sizes (a few shapes; the reference gathers contiguously).
    for batch, context, q_len in [(batches[1], contexts[1], 1), (batches[0], contexts[-1], 1), (2, max(contexts[0], 48), 37)]:  # 37 new tokens need a context that holds them
        step = make_step(batch, context, q_len, heads, kv_heads, head_dim, block_size, dtype, device)
        for s, t in [(1, tiles[0]), (splits[-1], tiles[0]), (1, tiles[-1]), (splits[-1], tiles[-1])]:
            err = check(*step, s, t)
            report["correctness"].append({"batch": batch, "context": context, "query_len": q_len,
                                          "num_splits": s, "tile_keys": t, "max_abs_err": err, "ok": err < 3e-2})
            print(f"check batch={batch} context={context} q={q_len} splits={s} tile={t}: max err {err:.2e}", flush=True)

    try:
        import flashinfer  # noqa: F401

        have_flashinfer = True
    except ImportError:
        have_flashinfer = False
    for batch in batches:
        for context in contexts:
            query, key_cache, value_cache, md = make_step(batch, context, 1, heads, kv_heads, head_dim,
                                                          block_size, dtype, device)
            kv_bytes = 2 * batch * context * kv_heads * head_dim * key_cache.element_size()
            times = {(t, s): timed(lambda s=s, t=t: run_kernel(query, key_cache, value_cache, md, s, t), device)
                     for t in tiles for s in splits}
            picked = (max(block_size, TILE_KEYS), choose_num_splits(batch, kv_heads, 1, context))
            if picked not in times:  # the defaults may lie outside a (smoke) sweep
                times[picked] = timed(lambda: run_kernel(query, key_cache, value_cache, md, picked[1], picked[0]), device)
            best = min(times, key=times.get)
            # SDPA on the same K/V laid out contiguous, [batch, kv_heads, context, head_dim].
            k = key_cache[md.block_table.long()].reshape(batch, -1, kv_heads, head_dim)[:, :context].transpose(1, 2).contiguous()
            v = value_cache[md.block_table.long()].reshape(batch, -1, kv_heads, head_dim)[:, :context].transpose(1, 2).contiguous()
            q = query.view(batch, heads, 1, head_dim)
            sdpa = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), device)
            del k, v
            row = {"batch": batch, "context": context, "kv_bytes": kv_bytes,
                   "ms_by_tile_splits": {f"t{t}s{s}": round(x * 1e3, 4) for (t, s), x in times.items()},
                   "best": f"t{best[0]}s{best[1]}", "best_ms": round(times[best] * 1e3, 4),
                   "picked": f"t{picked[0]}s{picked[1]}",
                   "kernel_ms": round(times[picked] * 1e3, 4),
                   "kernel_TBps": round(kv_bytes / times[picked] / 1e12, 3),
                   "peak_fraction": round(kv_bytes / times[picked] / H200_PEAK_BYTES_S, 3),
                   "sdpa_contiguous_ms": round(sdpa * 1e3, 4),
                   "sdpa_TBps": round(kv_bytes / sdpa / 1e12, 3)}
            report["decode"].append(row)
            print(json.dumps(row), flush=True)
            del query, key_cache, value_cache, md
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report["flashinfer"] = "importable but not wired" if have_flashinfer else "not importable"

    # A float8 KV cache (`--kv-cache-dtype`): half the bytes, widened as the tiles load.
    from services.worker.attention.kv_cache_dtype import to_cache_dtype

    report["fp8_decode"] = []
    for batch, context in fp8_shapes:
        query, key_cache, value_cache, md = make_step(batch, context, 1, heads, kv_heads, head_dim, block_size,
                                                      dtype, device)
        splits_picked = choose_num_splits(batch, kv_heads, 1, context)
        row = {"batch": batch, "context": context, "num_splits": splits_picked,
               "cache_ms": {"auto": round(timed(lambda: run_kernel(query, key_cache, value_cache, md, splits_picked),
                                                device) * 1e3, 4)}}
        for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
            k8, v8 = to_cache_dtype(key_cache, fmt), to_cache_dtype(value_cache, fmt)
            row["cache_ms"][str(fmt).removeprefix("torch.")] = round(
                timed(lambda: run_kernel(query, k8, v8, md, splits_picked), device) * 1e3, 4)
            del k8, v8
        report["fp8_decode"].append(row)
        print("fp8", json.dumps(row), flush=True)
        del query, key_cache, value_cache, md
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # A mixed step: one prefill chunk beside many decodes, in one launch.
    chunk, _, num_decodes, context = mixed
    pre = make_step(1, chunk, chunk, heads, kv_heads, head_dim, block_size, dtype, device, seed=1)
    dec = make_step(num_decodes, context, 1, heads, kv_heads, head_dim, block_size, dtype, device, seed=2)
    query = torch.cat([dec[0], pre[0]])
    key_cache = torch.cat([dec[1], pre[1]])
    value_cache = torch.cat([dec[2], pre[2]])
    offset = dec[1].shape[0]
    width = max(dec[3].block_table.shape[1], pre[3].block_table.shape[1])
    table = torch.zeros(num_decodes + 1, width, dtype=torch.int32, device=device)
    table[:num_decodes, : dec[3].block_table.shape[1]] = dec[3].block_table
    table[num_decodes, : pre[3].block_table.shape[1]] = pre[3].block_table + offset
    qsl = np.concatenate([np.arange(num_decodes + 1), [num_decodes + chunk]]).astype(np.int64)
    seq = np.concatenate([np.full(num_decodes, context), [chunk]]).astype(np.int64)
    md = AttentionMetadata(num_decodes, int(qsl[-1]), chunk, int(seq.max()),
                           torch.from_numpy(qsl.astype(np.int32)).to(device), torch.from_numpy(seq.astype(np.int32)).to(device),
                           torch.full((int(qsl[-1]),), -1, dtype=torch.int64, device=device), table, qsl, seq)
    err = check(query, key_cache, value_cache, md, 1)
    t = timed(lambda: run_kernel(query, key_cache, value_cache, md, 1), device)
    report["mixed"] = {"prefill_chunk": chunk, "decodes": num_decodes, "decode_context": context,
                       "ms": round(t * 1e3, 4), "max_abs_err": err}
    print("mixed", json.dumps(report["mixed"]), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_bench.json").write_text(json.dumps(report, indent=1))
    lines = ["| batch | context | best (tile, splits) | best ms | picked | picked ms | TB/s | of peak | SDPA contiguous ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["decode"]:
        lines.append(f"| {r['batch']} | {r['context']} | {r['best']} | {r['best_ms']} | {r['picked']} | "
                     f"{r['kernel_ms']} | {r['kernel_TBps']} | {r['peak_fraction']} | {r['sdpa_contiguous_ms']} |")
    (out / "kernels_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(c["ok"] for c in report["correctness"]) and report["mixed"]["max_abs_err"] < 3e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
