"""Our RMSNorm against transformers' own LlamaRMSNorm: bit for bit in float32 and through
PyTorch's ops; through the bfloat16 CPU kernel, the same bits but where its float32 sum
of squares, summed in another order, moves a rounding."""

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
        assert_same_or_last_bit(ours(x), theirs(x), path == "kernel" and dtype == torch.bfloat16)


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
        assert_same_or_last_bit(normed, theirs(expected_sum), path == "kernel" and dtype == torch.bfloat16)
