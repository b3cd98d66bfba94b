"""Our RMSNorm against transformers' own LlamaRMSNorm: bit for bit through PyTorch's ops;
through the CPU kernel, whose float32 sum of squares runs in another order, the same bits
in bfloat16 but where that moves a rounding, and within a few float32 roundings in float32."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import kernels.cpu as cpu_kernels
from services.worker.layers.rms_norm import RMSNorm


def norms(hidden_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.rand(hidden_size, generator=gen) + 0.5).to(dtype)
    ours, theirs = RMSNorm(hidden_size, 1e-5).to(dtype), LlamaRMSNorm(hidden_size, 1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    return ours, theirs, gen


def assert_same_or_last_bit(ours: torch.Tensor, theirs: torch.Tensor, kernel: bool) -> None:
    if not kernel:
        assert torch.equal(ours, theirs)
        return
    if ours.dtype == torch.float32:  # every element can move, each by a few roundings at most
        torch.testing.assert_close(ours, theirs, rtol=2.0**-21, atol=1e-30)  # a couple of float32 ulps
        return
    differ = ours != theirs
    assert int(differ.sum()) <= max(2, differ.numel() // 10_000)  # a rare rounding, not a pattern
    relative = (ours.float() - theirs.float()).abs() / theirs.float().abs().clamp_min(1e-30)
    assert float(torch.where(differ, relative, 0.0).max()) <= 2.0**-6  # one bfloat16 step


@pytest.fixture(params=["torch", "kernel"])
def path(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "supports", lambda x: False)
    elif not cpu_kernels.available():
        pytest.skip(f"CPU kernels: {cpu_kernels.unavailable_reason()}")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden_size", [64, 576, 960, 2048])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rms_norm_matches_transformers(path, dtype, hidden_size, num_tokens):
    ours, theirs, gen = norms(hidden_size, dtype, hidden_size + num_tokens)
    x = (torch.randn(num_tokens, hidden_size, generator=gen) * 4).to(dtype)
    x[0, :3] = torch.tensor([60.0, -45.0, 0.0]).to(dtype)  # outlier channels, as SmolLM2 has
    with torch.no_grad():
        assert_same_or_last_bit(ours(x), theirs(x), path == "kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 40])
def test_the_residual_form_is_the_add_then_the_norm(path, dtype, num_tokens):
    """norm(x, residual) -> (norm(residual + x), residual + x) as transformers' layer adds
    them; the sum itself is exact to the bit (one rounding of one addition)."""
    ours, theirs, gen = norms(576, dtype, num_tokens)
    x = torch.randn(num_tokens, 576, generator=gen).to(dtype)
    residual = (torch.randn(num_tokens, 576, generator=gen) * 3).to(dtype)
    expected_sum = residual + x
    with torch.no_grad():
        normed, new_residual = ours(x, residual.clone())
        assert torch.equal(new_residual, expected_sum)
        assert_same_or_last_bit(normed, theirs(expected_sum), path == "kernel")
