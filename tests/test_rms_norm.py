"""Our RMSNorm against transformers' own LlamaRMSNorm, bit for bit."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from services.worker.layers.rms_norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden_size", [64, 576, 960, 2048])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rms_norm_is_bit_identical_to_transformers(dtype, hidden_size, num_tokens):
    gen = torch.Generator().manual_seed(hidden_size + num_tokens)
    weight = (torch.rand(hidden_size, generator=gen) + 0.5).to(dtype)
    x = (torch.randn(num_tokens, hidden_size, generator=gen) * 4).to(dtype)
    x[0, :3] = torch.tensor([60.0, -45.0, 0.0]).to(dtype)  # outlier channels, as SmolLM2 has
    ours, theirs = RMSNorm(hidden_size, 1e-5).to(dtype), LlamaRMSNorm(hidden_size, 1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        assert torch.equal(ours(x), theirs(x))
