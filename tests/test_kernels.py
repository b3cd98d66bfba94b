"""The Triton kernels against the PyTorch reference, under Triton's interpreter on CPU.

Tolerances: float32 caches agree to 1e-4 (the kernel's online softmax reorders the sums);
bfloat16 caches are compared with a float32 reference over the same bf16 values and agree
to 2e-2 (bf16 output rounding; on a GPU the kernel also rounds the softmax weights to bf16
for the PV product, as flash-attention does). The interpreter computes bf16 `tl.dot` on
raw bits, so under it the kernel takes its float32-product path for bf16 too: loads,
conversions and stores of bf16 are tested here, the bf16 tensor-core dot on the GPU.
"""

import pytest
import torch

import kernels  # noqa: F401 - interpreter on CPU
from kernels.paged_attention import paged_attention
from kernels.reshape_and_cache import reshape_and_cache
from services.worker.attention.triton_backend import choose_num_splits
from llmbus.bench.attention_batches import heads_first, make_batch
from services.worker.attention.torch_backend import TorchAttentionBackend, write_kv_cache


def reference(query, kv_cache, metadata):
    """The PyTorch backend in float32 over the same values (no new K/V to write)."""
    q32, kv32 = query.float(), kv_cache.float()
    metadata.backend_state = None  # what a bfloat16 call derived does not hold for float32
    unused = torch.zeros(q32.shape[0], kv32.shape[3], kv32.shape[4])  # every slot is -1: not written
    return TorchAttentionBackend().forward(q32, unused, unused, kv32, metadata, query.shape[-1] ** -0.5)


# Decodes first (as the runner orders them), then chunks that start mid-sequence
# (prefix hits, later chunks) and a whole prompt; lengths on and off block boundaries.
CASES = {
    "decodes": ([1, 1, 1, 1], [1, 16, 17, 45]),
    "mixed": ([1, 1, 7, 16, 33], [9, 32, 7, 40, 33]),
    "mid-sequence": ([3, 17], [64, 50]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (8, 1)])  # GQA 1, 3, 8
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_matches_reference_float32(case, num_heads, num_kv_heads, block_size):
    query_lens, seq_lens = CASES[case]
    query, kv_cache, md = make_batch(query_lens, seq_lens, num_heads, num_kv_heads, 64, block_size, torch.float32)
    out = paged_attention(query, kv_cache[0], kv_cache[1], md.block_table, md.query_start_loc,
                          md.seq_lens, md.max_query_len, 64**-0.5)
    torch.testing.assert_close(out, reference(query, kv_cache, md), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_head_dims_and_split_kv_match_reference(head_dim, num_splits):
    query_lens, seq_lens = [1, 1, 1], [5, 70, 128]  # one sequence shorter than a split
    query, kv_cache, md = make_batch(query_lens, seq_lens, 6, 2, head_dim, 16, torch.float32, seed=1)
    out = paged_attention(query, kv_cache[0], kv_cache[1], md.block_table, md.query_start_loc,
                          md.seq_lens, md.max_query_len, head_dim**-0.5, num_splits=num_splits)
    torch.testing.assert_close(out, reference(query, kv_cache, md), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tile_keys", [16, 32, 128])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_tiles_of_several_blocks_match_reference(tile_keys, num_splits):
    # A tile gathers tile_keys / 16 blocks; lengths end mid-tile and mid-block, one
    # sequence is shorter than a tile, and prefill chunks start mid-sequence.
    query, kv_cache, md = make_batch([1, 1, 1, 7, 20], [3, 45, 140, 60, 20], 6, 2, 64, 16, torch.float32, seed=6)
    out = paged_attention(query, kv_cache[0], kv_cache[1], md.block_table, md.query_start_loc,
                          md.seq_lens, md.max_query_len, 64**-0.5, num_splits=num_splits, tile_keys=tile_keys)
    torch.testing.assert_close(out, reference(query, kv_cache, md), atol=1e-4, rtol=1e-4)


def test_split_kv_also_handles_prefill_chunks():
    query, kv_cache, md = make_batch([1, 9], [40, 37], 4, 2, 64, 16, torch.float32, seed=2)
    out = paged_attention(query, kv_cache[0], kv_cache[1], md.block_table, md.query_start_loc,
                          md.seq_lens, md.max_query_len, 64**-0.5, num_splits=2)
    torch.testing.assert_close(out, reference(query, kv_cache, md), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_bfloat16_cache_matches_float32_reference(num_splits):
    query, kv_cache, md = make_batch([1, 1, 6], [20, 47, 30], 6, 2, 64, 16, torch.bfloat16, seed=3)
    out = paged_attention(query, kv_cache[0], kv_cache[1], md.block_table, md.query_start_loc,
                          md.seq_lens, md.max_query_len, 64**-0.5, num_splits=num_splits)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(query, kv_cache, md), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_backends_read_a_heads_first_cache_as_a_token_major_one(dtype):
    query, kv_cache, md = make_batch([1, 1, 1, 5, 9], [9, 33, 47, 5, 30], 6, 2, 64, 16, dtype, seed=5)
    unused = torch.zeros(query.shape[0], 2, 64, dtype=dtype)
    torch_out = TorchAttentionBackend().forward(query, unused, unused, kv_cache, md, 0.125)
    md.backend_state = None
    assert torch.equal(TorchAttentionBackend().forward(query, unused, unused, heads_first(kv_cache), md, 0.125),
                       torch_out)
    cache = heads_first(kv_cache)
    out = paged_attention(query, cache[0], cache[1], md.block_table, md.query_start_loc,
                          md.seq_lens, md.max_query_len, 0.125)
    torch.testing.assert_close(out.float(), reference(query, kv_cache, md),
                               **({"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_puts_each_token_in_its_slot_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(4)
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 2, 64
    key = torch.randn(5, kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(5, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.tensor([3, 17, -1, 95, 40])  # a padded token in the middle
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    expected = cache.clone()
    reshape_and_cache(key, value, cache[0], cache[1], slots)
    write_kv_cache(key, value, expected, slots)
    assert torch.equal(cache, expected)
    in_heads_first = heads_first(torch.zeros_like(cache))
    write_kv_cache(key, value, in_heads_first, slots)
    assert torch.equal(in_heads_first, expected)
    assert cache[0].view(-1, kv_heads, head_dim)[95].equal(key[3])
    assert int((cache != 0).flatten(2).any(-1).sum()) == 2 * 4  # K and V, four real tokens


def windowed_reference(query, kv_cache, md, scale, window, softcap, sinks=None):
    """Gemma 2's attention written out per token in float32: every key of the request
    gathered through its block table, scores capped, then masked causally and to the window;
    gpt-oss's sinks a last column of each head's softmax, dropped after it."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.zeros(num_tokens, num_heads, head_dim)
    starts = md.query_start_loc.tolist()
    for i, seq_len in enumerate(md.seq_lens.tolist()):
        blocks = md.block_table[i, : -(-seq_len // block_size)].long()
        k, v = (kv_cache[j][blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float() for j in (0, 1))
        k, v = (x.repeat_interleave(num_heads // num_kv_heads, dim=1) for x in (k, v))  # [seq_len, heads, d]
        for t in range(starts[i], starts[i + 1]):
            pos = seq_len - (starts[i + 1] - t)
            scores = torch.einsum("hd,khd->hk", query[t].float(), k) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            keys = torch.arange(seq_len)
            hidden = (keys > pos) | ((keys <= pos - window) if window else False)
            scores = scores.masked_fill(hidden, float("-inf"))
            if sinks is None:
                probs = scores.softmax(-1)
            else:
                probs = torch.cat((scores, sinks.float()[:, None]), -1).softmax(-1)[:, :-1]
            out[t] = torch.einsum("hk,khd->hd", probs, v)
    return out


@pytest.mark.parametrize("window, softcap, sinks", [(5, None, False), (24, None, False), (0, 2.0, False),
                                                   (24, 2.0, False), (0, None, True), (24, None, True)])
@pytest.mark.parametrize("tile_keys, num_splits", [(16, 1), (64, 2)])
def test_sliding_window_soft_cap_and_sinks_match_the_written_out_attention(window, softcap, sinks, tile_keys,
                                                                           num_splits):
    """Both backends, on decodes with contexts far past the window, chunks starting
    mid-sequence and a whole prompt; windows inside a block and across blocks; gpt-oss's
    sinks, with and without split-KV (where the reduction takes them)."""
    query, kv_cache, md = make_batch([1, 1, 1, 7, 20], [3, 45, 140, 60, 20], 6, 2, 64, 16, torch.float32, seed=7)
    scale = 0.3  # scores wide enough for a cap of 2 to bend them
    head_sinks = torch.linspace(-2.0, 3.0, 6) if sinks else None  # (some above the scores, some below)
    expected = windowed_reference(query, kv_cache, md, scale, window, softcap, head_sinks)
    out = paged_attention(query, kv_cache[0], kv_cache[1], md.block_table, md.query_start_loc, md.seq_lens,
                          md.max_query_len, scale, num_splits=num_splits, tile_keys=tile_keys, window=window,
                          softcap=softcap, sinks=head_sinks)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    unused = torch.zeros(query.shape[0], 2, 64)
    for cache in (kv_cache, heads_first(kv_cache)):
        md.backend_state = None
        got = TorchAttentionBackend().forward(query, unused, unused, cache, md, scale, window, softcap, head_sinks)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    plain = windowed_reference(query, kv_cache, md, scale, 0, None)
    assert not torch.allclose(plain, expected, atol=1e-3)  # the window or cap changed the output


# (batch, context) -> the split count that was fastest (or within 3%) for the 64-key tile
# on an H200, 8 KV heads (docs/design/kernels.md, second GPU run).
MEASURED_BEST_SPLITS = {
    (1, 512): 1, (1, 4096): 16, (1, 16384): 16,
    (16, 512): 1, (16, 4096): 4, (16, 16384): 4,
    (64, 512): 1, (64, 4096): 1, (64, 16384): 1,
    (256, 512): 1, (256, 4096): 1, (256, 16384): 1,
}


def test_split_heuristic_picks_what_the_gpu_measured_best():
    for (batch, context), best in MEASURED_BEST_SPLITS.items():
        assert choose_num_splits(num_reqs=batch, num_kv_heads=8, max_query_len=1, max_seq_len=context) == best
    # Prefill chunks never split; short slices are not worth a reduction.
    assert choose_num_splits(num_reqs=1, num_kv_heads=8, max_query_len=5, max_seq_len=16384) == 1
    assert choose_num_splits(num_reqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=1024) == 4


def test_whole_model_on_the_triton_backend_gives_the_same_greedy_tokens(tiny_llama, tiny_qwen2):
    import random

    from llmbus import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 5, 17, 33)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for folder in (tiny_llama, tiny_qwen2):
        torch_ids = [o.outputs[0].token_ids for o in LLM(str(folder)).generate(prompts, params)]
        # A small budget forces chunked prefill, so chunks start mid-sequence too.
        triton_llm = LLM(str(folder), attention_backend="triton", max_num_batched_tokens=24)
        assert [o.outputs[0].token_ids for o in triton_llm.generate(prompts, params)] == torch_ids


def test_gpu_bench_script_runs_end_to_end_on_tiny_shapes(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "llmbus.bench.kernels", "--smoke", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    import json

    report = json.loads((tmp_path / "kernels_bench.json").read_text())
    assert report["correctness"] and all(c["ok"] for c in report["correctness"])
    assert len(report["decode"]) == 4 and (tmp_path / "kernels_bench.md").is_file()
