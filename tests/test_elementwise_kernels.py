"""kernels/elementwise.py (Triton, run by the interpreter here) against the PyTorch ops it
replaces: bit for bit in bfloat16, where each PyTorch op rounds and the kernel rounds at
the same points; in float32 to a few ulps (the norm's sum and exp run in another order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.elementwise as ew
from services.worker.layers.rms_norm import RMSNorm
from services.worker.layers.rotary import RotaryEmbedding

DTYPES = [torch.bfloat16, torch.float32]


def same(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.dtype == torch.bfloat16:
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
    else:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (9, 96), (4, 576)])  # 576: SmolLM2's, not a power of 2
def test_add_rms_norm_is_the_torch_norm_of_the_rounded_sum(dtype, rows, hidden):
    torch.manual_seed(rows)
    x, residual = torch.randn(rows, hidden, dtype=dtype) * 3, torch.randn(rows, hidden, dtype=dtype)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = (torch.rand(hidden) + 0.5).to(dtype)
    expected_sum = x + residual
    written = residual.clone()
    out, summed = ew.add_rms_norm(x, written, norm.weight.data, 1e-5)
    assert summed is written  # the sum goes over the residual, as vLLM's fused add-norm
    torch.testing.assert_close(summed, expected_sum, atol=0, rtol=0)
    same(out, norm._norm(expected_sum))
    same(ew.add_rms_norm(x, None, norm.weight.data, 1e-5), norm._norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [80, 1536, 2500])  # over one block and not a multiple of it
def test_silu_mul_is_silu_of_gate_times_up(dtype, n):
    torch.manual_seed(n)
    gate_up = torch.randn(3, 2 * n, dtype=dtype) * 4
    same(ew.silu_mul(gate_up), F.silu(gate_up[:, :n]) * gate_up[:, n:])


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


@pytest.mark.parametrize("dtype, cache_dtype, scaling", [
    (torch.bfloat16, torch.bfloat16, {}), (torch.float32, torch.float32, {}),
    (torch.bfloat16, torch.bfloat16, LLAMA3), (torch.float32, torch.float32, LLAMA3),
    (torch.bfloat16, torch.float8_e4m3fn, {}), (torch.float32, torch.float8_e5m2, {})])
def test_rotary_and_cache_writes_the_bytes_rotary_then_reshape_and_cache_write(dtype, cache_dtype, scaling):
    from kernels.reshape_and_cache import reshape_and_cache

    torch.manual_seed(2)
    q_heads, kv_heads, head_dim, rows = 6, 2, 32, 5
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, scaling)
    positions = torch.tensor([0, 5, 9, 33, 63])
    slots = torch.tensor([3, -1, 17, 8, 30])  # -1: a padding row, nothing written
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)
    qk = qkv[:, : (q_heads + kv_heads) * head_dim].unflatten(-1, (q_heads + kv_heads, head_dim))
    v = qkv[:, (q_heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
    expected_cache = torch.zeros(2, 4, 16, kv_heads, head_dim, dtype=cache_dtype)
    rotated = rotary._rotate(positions, qk.clone())
    reshape_and_cache(rotated[:, q_heads:].contiguous(), v.contiguous(), expected_cache[0], expected_cache[1], slots)
    cache = torch.zeros_like(expected_cache)
    q = ew.rotary_and_cache(qk, v, positions, rotary.cos_cache, rotary.sin_signed_cache, cache[0], cache[1], slots,
                            q_heads)
    same(q, rotated[:, :q_heads])
    assert q.data_ptr() == qkv.data_ptr()  # the queries rotated in place
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))


def test_the_triton_backend_runs_the_models_element_wise_work_in_these_kernels(tiny_llama, monkeypatch):
    from llmbus import LLM, SamplingParams

    calls = {"add_rms_norm": 0, "rotary_and_cache": 0, "silu_mul": 0}
    for name in calls:
        inner = getattr(ew, name)
        monkeypatch.setattr(ew, name, lambda *a, _inner=inner, _name=name: (calls.__setitem__(_name, calls[_name] + 1),
                                                                             _inner(*a))[1])
    llm = LLM(str(tiny_llama), attention_backend="triton")
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    layers, steps = len(llm.runner.model.model.layers), 3
    # two norms a layer and the final one; one rotary (with the cache write) and one MLP a layer; each step
    assert calls == {"add_rms_norm": (2 * layers + 1) * steps, "rotary_and_cache": layers * steps,
                     "silu_mul": layers * steps}
    # Turned off (scripts/device_check.sh does when the kernels fail on a GPU): PyTorch ops.
    monkeypatch.setenv("LLMBUS_TRITON_ELEMENTWISE", "0")
    before = dict(calls)
    llm = LLM(str(tiny_llama), attention_backend="triton")
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert calls == before


def test_a_non_contiguous_input_is_refused_with_its_strides():
    x = torch.randn(8, 4).t()
    with pytest.raises(ValueError, match="contiguous"):
        ew.add_rms_norm(x, None, torch.ones(2), 1e-5)
