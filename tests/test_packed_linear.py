"""bfloat16 weights prepacked for oneDNN: the same numbers as F.linear, and every matmul
of a bfloat16 model on CPU goes through them."""

import pytest
import torch
import torch.nn.functional as F

from services.worker.layers.packed_linear import PackedLinear, can_pack
from services.worker.model_runner import ModelRunner
from tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_is_bit_identical_to_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    out = PackedLinear(weight, b)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    assert torch.equal(out, F.linear(x, weight, b))


@pytest.mark.parametrize("tied", [True, False])
def test_a_bfloat16_model_packs_every_matmul_and_a_float32_one_none(tmp_path, tied):
    folder = build_tiny_model(tmp_path, "llama", tie_word_embeddings=tied)
    bf16 = ModelRunner(folder, dtype="bfloat16").model
    assert not any(type(m) is torch.nn.Linear for m in bf16.modules())
    assert isinstance(bf16.lm_head, PackedLinear)  # tied: a packed copy of the embedding
    f32 = ModelRunner(folder, dtype="float32").model
    assert not any(isinstance(m, PackedLinear) for m in f32.modules())
    hidden = torch.randn(5, bf16.config.hidden_size).bfloat16()
    head = f32.model.embed_tokens.weight if tied else f32.lm_head.weight
    assert torch.equal(bf16.compute_logits(hidden), F.linear(hidden, head.bfloat16()).float())
