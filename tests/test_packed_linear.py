"""Packed products: oneDNN's bfloat16 the same numbers as F.linear, llmbus's own within a
last-bit rounding of the exact product in bfloat16 and a few float32 roundings of it in
float32; every matmul of a bfloat16 or float32 model on CPU is packed."""

import pytest
import torch
import torch.nn.functional as F

import kernels.cpu as cpu_kernels
from services.worker.loader import iter_weights
from services.worker.layers.packed_linear import PackedLinear, _onednn_packing_works, can_pack, default_kernel
from services.worker.model_runner import ModelRunner
from tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")), reason="no packed bfloat16 product")

needs_onednn = pytest.mark.skipif(not _onednn_packing_works(), reason="no oneDNN bfloat16")
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers around |x| (8 significant bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.exp2(exponent - 7)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_product_is_bit_identical_to_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    out = PackedLinear(weight, b, kernel="onednn")(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    assert torch.equal(out, F.linear(x, weight, b))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 17, 300])
def test_onednn_float32_product_is_within_float32_rounding(rows):
    """oneDNN's float32 sums run in another order than MKL's: not the same bits, as close."""
    gen = torch.Generator().manual_seed(rows)
    weight, b, x = torch.randn(96, 576, generator=gen), torch.randn(96, generator=gen), torch.randn(rows, 576, generator=gen)
    out = PackedLinear(weight, b, kernel="onednn")(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 96)
    exact = x.double() @ weight.double().T + b.double()
    assert bool(((out.double() - exact).abs() <= 2.0**-20 * (x.double().abs() @ weight.double().abs().T)).all())


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 13, 130])
@pytest.mark.parametrize("out_features, bias", [(64, False), (200, True), (960, False)])
def test_llmbus_product_rounds_the_exact_product(rows, out_features, bias):
    """Within one bfloat16 step of the float64 product, give or take the float32 rounding
    of the sums where they cancel, and no further from it than F.linear: whole and partial
    64-feature blocks, 1-4 row tiles and their tails, a bias."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, 576, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    out = PackedLinear(weight, b, kernel="llmbus")(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())
    error = (out.double() - exact).abs()
    magnitude = x.double().abs() @ weight.double().abs().T  # what float32 rounding scales with
    assert bool((error <= bf16_ulp(exact) + 2.0**-20 * magnitude).all())
    reference_error = (F.linear(x, weight, b).double() - exact).abs()
    assert float(error.max()) <= float(reference_error.max()) * 1.01 + 1e-12


@needs_kernels
@pytest.mark.parametrize("rows", [1, 4, 6, 11, 130])
@pytest.mark.parametrize("out_features, in_features, bias", [(64, 576, False), (200, 577, True), (960, 1536, False)])
def test_llmbus_float32_product_is_within_float32_rounding(rows, out_features, in_features, bias):
    """One float32 chain over the inputs per output: within a few float32 roundings of the
    float64 product, scaled by what the sum's terms add up to (odd input counts too)."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    out = PackedLinear(weight, b, kernel="llmbus")(x)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    exact = x.double() @ weight.double().T + (0 if b is None else b.double())
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if b is None else b.double().abs())
    assert bool(((out.double() - exact).abs() <= 2.0**-20 * magnitude).all())


@needs_kernels
def test_llmbus_product_takes_strided_rows_and_leading_dimensions():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 64, generator=gen).bfloat16()
    wide = torch.randn(2, 5, 96, generator=gen).bfloat16()
    x = wide[..., :64]  # rows 96 apart
    out = PackedLinear(weight, None, kernel="llmbus")(x)
    assert out.shape == (2, 5, 128)
    torch.testing.assert_close(out, F.linear(x.contiguous(), weight), atol=0, rtol=2**-7)


@pytest.mark.parametrize("tied", [True, False])
def test_a_model_packs_every_matmul(tmp_path, tied):
    folder = build_tiny_model(tmp_path, "llama", tie_word_embeddings=tied)
    bf16 = ModelRunner(folder, dtype="bfloat16").model
    f32 = ModelRunner(folder, dtype="float32").model
    for model, dtype in ((bf16, torch.bfloat16), (f32, torch.float32)):
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        assert isinstance(model.lm_head, PackedLinear)  # tied: a packed copy of the embedding
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert {m.kernel for m in packed} == {default_kernel(dtype)} and {m.dtype for m in packed} == {dtype}
    weights = dict(iter_weights(folder))
    head = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]
    hidden = torch.randn(5, bf16.config.hidden_size).bfloat16()
    logits = bf16.compute_logits(hidden)
    reference = F.linear(hidden, head.bfloat16()).float()
    if default_kernel() == "onednn":
        assert torch.equal(logits, reference)
    else:
        torch.testing.assert_close(logits, reference, atol=0, rtol=2**-7)
