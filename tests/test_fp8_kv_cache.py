"""The 8-bit float KV cache (`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`).

Writes round as PyTorch's float8 conversions do (the CPU kernel and the PyTorch path give
the same bytes: every finite value, the midpoints between neighbours, subnormals, values
past the largest one), and every read is the exact widening of those bytes: the attention
kernels and the PyTorch path give the same bits on a float8 cache as on its widened copy.
How far greedy output moves is a precision question, measured by `llmbus bench agreement`
(docs/performance/history.md), not asserted here.
"""

import pytest
import torch

import kernels.cpu as cpu_kernels
from llmbus import LLM, SamplingParams
from llmbus.bench.attention_batches import heads_first, make_batch
from services.worker.attention.kv_cache_dtype import FP8_MAX, to_cache_dtype
from services.worker.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from shared.config import CacheConfig

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


def awkward_values(fmt: torch.dtype, head_dim: int = 64) -> torch.Tensor:
    """[rows, 1, head_dim] float32: each finite value of the format and its negation, the
    midpoints between neighbours (ties), random values over 2^-14..2^8 and beyond the
    largest finite one."""
    finite = torch.arange(256, dtype=torch.uint8).view(fmt).float()
    finite = finite[torch.isfinite(finite)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(2048, generator=gen) * torch.logspace(-14, 8, 2048, base=2)
    beyond = torch.tensor([FP8_MAX[fmt] * 1.03, -FP8_MAX[fmt] * 1.5, 1e30, -0.0, 1e-30])
    x = torch.cat([finite, -finite, mids, -mids, spread, beyond])
    x = torch.cat([x, torch.zeros(-x.numel() % head_dim)])
    return x.view(-1, 1, head_dim)


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_writes_the_bytes_pytorch_converts_to(monkeypatch, fmt, dtype):
    values = awkward_values(fmt).to(dtype)
    rows = values.shape[0]
    slots = torch.randperm(rows + 7)[:rows]  # scattered slots, some left unwritten
    slots[3] = -1  # a padded token
    caches = []
    for kernels_on in (True, False):
        monkeypatch.setattr(cpu_kernels, "available", lambda on=kernels_on: on)
        cache = torch.zeros(2, rows + 7, 1, 1, 64, dtype=fmt)
        write_kv_cache(values, -values, cache, slots)
        caches.append(cache.view(torch.uint8))
    assert torch.equal(caches[0], caches[1])
    written = caches[0][0].view(-1, 64)[slots[slots >= 0]]
    expected = to_cache_dtype(values[slots >= 0].view(-1, 64), fmt).view(torch.uint8)
    assert torch.equal(written, expected)
    assert not torch.isinf(caches[0].view(fmt).float()).any()  # saturated, not infinite


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_kernels_read_float8_as_its_widened_copy(fmt, dtype, head_dim):
    query, kv_cache, md = make_batch([1, 1, 1, 1], [5, 37, 160, 300], 6, 2, head_dim, 16, dtype, seed=1)
    cache8 = to_cache_dtype(heads_first(kv_cache), fmt)
    wide = cache8.to(dtype)
    assert torch.equal(cpu_kernels.paged_decode_attention(query, cache8, md.block_table, md.seq_lens, 0.125),
                       cpu_kernels.paged_decode_attention(query, wide, md.block_table, md.seq_lens, 0.125))
    query, kv_cache, md = make_batch([23], [60], 6, 2, head_dim, 16, dtype, seed=2)  # a chunk after a prefix
    cache8 = to_cache_dtype(kv_cache, fmt)
    blocks = md.block_table[0].contiguous()
    assert torch.equal(cpu_kernels.paged_prefill_attention(query, cache8, blocks, 60, 0.125),
                       cpu_kernels.paged_prefill_attention(query, cache8.to(dtype), blocks, 60, 0.125))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_pytorch_path_reads_float8_as_its_widened_copy(monkeypatch, fmt):
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    query, kv_cache, md = make_batch([1, 1, 1, 9], [9, 33, 47, 30], 6, 2, 64, 16, torch.bfloat16, seed=5)
    unused = torch.zeros(query.shape[0], 2, 64, dtype=torch.bfloat16)
    md.slot_mapping = torch.full_like(md.slot_mapping, -1)  # read only
    cache8 = to_cache_dtype(kv_cache, fmt)
    out8 = TorchAttentionBackend().forward(query, unused, unused, cache8, md, 0.125)
    md.backend_state = None
    assert torch.equal(out8, TorchAttentionBackend().forward(query, unused, unused, cache8.to(torch.bfloat16), md, 0.125))


def test_engine_holds_twice_the_tokens_and_runs_every_path(tiny_llama):
    prompts = [[5 + i % 300 for i in range(n)] for n in (3, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    auto = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory_bytes=1 << 22)
    fp8 = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory_bytes=1 << 22, kv_cache_dtype="fp8",
              max_num_batched_tokens=32)  # chunked prefill: later chunks read the float8 prefix
    assert fp8.runner.num_blocks == 2 * auto.runner.num_blocks
    assert fp8.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    outputs = fp8.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 12, 12]
    # A prefix hit reads blocks written in an earlier step: the same tokens again.
    again = fp8.generate(prompts[1:2], params)
    assert again[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    assert fp8.stats().prefix_cache_hits >= 32


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernels_write_and_read_float8_as_the_cpu_path_does(fmt, dtype):
    # Under Triton's interpreter on CPU; on a GPU scripts/gpu_check.py runs the same engine.
    from kernels.paged_attention import paged_attention
    from kernels.reshape_and_cache import reshape_and_cache

    values = awkward_values(fmt).to(dtype)
    rows = values.shape[0]
    slots = torch.randperm(rows)
    cache = torch.zeros(2, rows, 1, 1, 64, dtype=fmt)
    reshape_and_cache(values, -values, cache[0], cache[1], slots)
    expected = torch.zeros_like(cache)
    write_kv_cache(values, -values, expected, slots)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))

    query, kv_cache, md = make_batch([1, 1, 7], [9, 40, 30], 6, 2, 64, 16, dtype, seed=3)
    cache8 = to_cache_dtype(kv_cache, fmt)
    args = (md.block_table, md.query_start_loc, md.seq_lens, md.max_query_len, 0.125)
    assert torch.equal(paged_attention(query, cache8[0], cache8[1], *args),
                       paged_attention(query, cache8[0].to(dtype), cache8[1].to(dtype), *args))


def test_the_engine_on_the_triton_backend_takes_a_float8_cache(tiny_llama):
    prompts = [[5 + i % 300 for i in range(n)] for n in (3, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    triton_llm = LLM(str(tiny_llama), kv_cache_dtype="fp8_e5m2", attention_backend="triton", max_num_batched_tokens=24)
    assert triton_llm.runner.kv_caches[0].dtype == torch.float8_e5m2
    torch_llm = LLM(str(tiny_llama), kv_cache_dtype="fp8_e5m2", max_num_batched_tokens=24)
    # float32 model: both backends read the same float8 values and sum in float32.
    assert [o.outputs[0].token_ids for o in triton_llm.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in torch_llm.generate(prompts, params)]


def test_unknown_cache_dtypes_are_refused():
    with pytest.raises(ValueError, match="kv cache dtype must be one of auto, fp8"):
        CacheConfig(cache_dtype="int8")
