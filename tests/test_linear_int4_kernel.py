"""kernels/linear_int4.py under Triton's interpreter: the GPU's 4-bit product is x times the
weights its levels, steps and offsets stand for (as the CPU kernels are held to it), the
Int4Linear that runs it likewise, and on a GPU quantization leaves a sparse MoE's experts
to their grouped GEMMs."""

import pytest
import torch
import torch.nn.functional as F

from kernels.linear_int4 import GROUP, linear_int4, pack_levels
from services.worker.layers.moe import SparseMoE
from services.worker.layers.quantized_linear import Int4Linear, int4_grid, quantize
from services.worker.layers.mlp import MLP


def _grid(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 16, (n, k), generator=gen)
    step = (torch.rand(k // GROUP, n, generator=gen) * 0.05 + 0.001).half()
    low = (-8 * step.float() + torch.randn(k // GROUP, n, generator=gen) * 0.01).half()
    weight = (levels.view(n, k // GROUP, GROUP).double() * step.T.double()[..., None]
              + low.T.double()[..., None]).view(n, k)  # [N, K]: what the kernel stores, exactly
    return levels, step, low, weight, gen


def test_pack_levels_puts_input_8w_plus_j_in_nibble_j_of_word_w():
    levels = torch.arange(16 * 3).remainder(16).view(3, 16)  # [N=3, K=16]
    packed = pack_levels(levels)
    assert packed.shape == (2, 3) and packed.dtype == torch.int32
    for n in range(3):
        for k in range(16):
            assert (int(packed[k // 8, n]) >> (4 * (k % 8))) & 0xF == levels[n, k]
    with pytest.raises(ValueError, match="values in 0..15"):
        pack_levels(levels + 1)


@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("n, k, bias", [(48, 64, False), (100, 96, True), (8, 32, True)])
def test_the_product_is_x_times_the_weights_the_grid_stands_for(m, n, k, bias):
    """float32 activations: exact float32 dots, so within float32 rounding of the float64
    product; K of 96 takes 32-input tiles, 64 and 32 the others; partial N and M tiles."""
    levels, step, low, weight, gen = _grid(n, k, m * 100 + n)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    out = linear_int4(x, pack_levels(levels), step, low, b)
    exact = x.double() @ weight.T + (0 if b is None else b.double())
    magnitude = x.double().abs() @ weight.abs().T + (0 if b is None else b.double().abs())
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert bool(((out.double() - exact).abs() <= 2.0**-20 * magnitude + 1e-30).all())


def test_bfloat16_activations_round_the_float32_sums_once():
    levels, step, low, weight, gen = _grid(64, 128, 3)
    x = torch.randn(7, 128, generator=gen).bfloat16()
    out = linear_int4(x, pack_levels(levels), step, low)
    exact = x.double() @ weight.T
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) - 7)  # one bfloat16 step
    magnitude = x.double().abs() @ weight.abs().T
    assert out.dtype == torch.bfloat16 and bool(((out.double() - exact).abs() <= ulp + 2.0**-18 * magnitude).all())


def test_int4_linear_on_the_triton_kernel_is_the_product_with_the_grid_weights():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    levels, step, low = int4_grid(weight)
    on_grid = (levels.view(96, 2, 32) * step.half().float()[..., None] + low.half().float()[..., None]).view(96, 64)
    layer = Int4Linear(weight, bias, torch.bfloat16, kernel="triton")
    x = torch.randn(3, 5, 64)
    out = layer(x.bfloat16()).float()
    assert out.shape == (3, 5, 96) and layer.weight_bytes == 96 * 64 // 2 + 2 * 2 * 2 * 96
    torch.testing.assert_close(out, F.linear(x, on_grid, bias), rtol=0.02, atol=0.05)


def test_with_the_triton_kernel_a_sparse_moe_keeps_its_experts_for_the_grouped_gemms():
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(64, 32),
                                 "moe": SparseMoE(64, 32, 4, 2, renormalize=True, expert=MLP)})
    quantize(model, "int4", torch.bfloat16, "triton")
    assert isinstance(model["proj"], Int4Linear) and model["proj"].kernel == "triton"
    assert all(type(m) is torch.nn.Linear for e in model["moe"].experts for m in e.modules()
               if isinstance(m, (torch.nn.Linear, Int4Linear)))
    quantize(model, "int4", torch.bfloat16)  # (CPU: the experts too)
    assert all(isinstance(m, Int4Linear) for e in model["moe"].experts for m in e.children())
