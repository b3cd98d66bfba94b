"""The PyTorch attention backend against attention written out per request in float64,
with decode groups forced small so a step has several of different padded lengths, and
with bfloat16 decodes taken by the CPU kernel where it loads."""

import pytest
import torch

import kernels.cpu as cpu_kernels
import services.worker.attention.torch_backend as torch_backend
from llmbus.bench.attention_batches import heads_first, make_batch


def naive_attention(query, kv_cache, md, scale):
    """softmax(q k^T * scale) v per request and head, causal within the new tokens."""
    out = torch.empty(query.shape, dtype=torch.float64)
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    for i, seq_len in enumerate(md.seq_lens_cpu.tolist()):
        start, end = int(md.query_start_loc_cpu[i]), int(md.query_start_loc_cpu[i + 1])
        slots = [int(md.block_table[i, p // block_size]) * block_size + p % block_size for p in range(seq_len)]
        k = kv_cache[0].flatten(0, 1)[slots].double()  # [seq_len, kv_heads, d]
        v = kv_cache[1].flatten(0, 1)[slots].double()
        for t in range(end - start):
            visible = seq_len - (end - start) + t + 1
            for h in range(query.shape[1]):
                scores = k[:visible, h // group] @ query[start + t, h].double() * scale
                out[start + t, h] = scores.softmax(0) @ v[:visible, h // group]
    return out


@pytest.mark.parametrize("dtype, tol, kernel", [
    (torch.float32, 1e-5, False), (torch.bfloat16, 2e-2, False), (torch.bfloat16, 1e-2, True),
])
def test_several_decode_groups_and_prefill_chunks_match_attention_written_out(monkeypatch, dtype, tol, kernel):
    if kernel and not cpu_kernels.available():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    if not kernel:
        monkeypatch.setattr(cpu_kernels, "attention_supported", lambda *args: False)
    monkeypatch.setattr(torch_backend, "DECODE_GROUP_SIZE", 3)
    query_lens = [1] * 7 + [4, 9]
    seq_lens = [3, 16, 17, 20, 33, 47, 60, 21, 9]  # sorted decodes, as the runner orders them
    query, kv_cache, md = make_batch(query_lens, seq_lens, 6, 2, 64, 16, dtype, seed=7)
    cache = heads_first(kv_cache)
    unused = torch.zeros(query.shape[0], 2, 64, dtype=dtype)
    out = torch_backend.TorchAttentionBackend().forward(query, unused, unused, cache, md, 0.125)
    assert md.backend_state.kernel_decodes == kernel
    assert len(md.backend_state.decode_groups) == (0 if kernel else 3)
    expected = naive_attention(query, kv_cache, md, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
