"""Lower precisions: bfloat16, and int8 weights with bfloat16 activations. float32 is
the one that matches transformers token for token; these must stay close to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.cpu as cpu_kernels
from llmbus import LLM, SamplingParams
from services.worker.layers.quantized_linear import INT8_KERNEL_MAX_ROWS, Int4Linear, Int8Linear, int4_grid
from services.worker.model_runner import ModelRunner
from test_engine_correctness import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


KERNELS = ["torch", pytest.param("llmbus", marks=pytest.mark.skipif(
    not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}"))]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, INT8_KERNEL_MAX_ROWS, INT8_KERNEL_MAX_ROWS + 1, 200])
def test_int8_linear_is_the_float_product_within_quantization_error(rows, kernel):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(rows, 64)
    layer = Int8Linear(weight, bias, kernel=kernel)
    assert layer.kernel == kernel
    scales = weight.abs().amax(1, keepdim=True) / 127
    dequantized = torch.round(weight / scales) * scales
    out = layer(x.bfloat16()).float()
    # Both kernels (small and large batches) compute the product with the rounded weights.
    torch.testing.assert_close(out, F.linear(x, dequantized, bias), rtol=0.02, atol=0.1)
    assert (out - F.linear(x, weight, bias)).abs().max() < 0.05 * F.linear(x, weight, bias).abs().max()


@pytest.fixture(scope="module")
def tiny_q4_llama(tmp_path_factory):
    """The tiny Llama with its layers' weights snapped to a 16-level grid per group of 32,
    as a GGUF Q4_1 checkpoint is after conversion (random weights in 4 bits would not
    keep the model's greedy choices, nor claim to)."""
    from safetensors.torch import load_file, save_file

    from tiny_models import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-q4"), "llama")
    path = folder / "model.safetensors"
    weights = load_file(path)
    for name, w in weights.items():
        if ".layers." in name and name.endswith("proj.weight"):
            levels, step, low = int4_grid(w)
            groups = w.shape[1] // 32
            weights[name] = (levels.view(-1, groups, 32) * step[..., None] + low[..., None]).view_as(w).contiguous()
    save_file(weights, path, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("engine", [dict(dtype="bfloat16"), dict(dtype="bfloat16", quantization="int8")],
                         ids=["bfloat16", "int8"])
def test_lower_precision_greedy_starts_like_float32(tiny_llama, engine):
    reference = [o.outputs[0].token_ids for o in LLM(str(tiny_llama)).generate(PROMPTS, GREEDY)]
    outputs = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), **engine).generate(PROMPTS, GREEDY)]
    # The tiny model's logits are far apart: the first tokens must agree everywhere.
    assert [o[:2] for o in outputs] == [r[:2] for r in reference]
    agree = sum(a == b for o, r in zip(outputs, reference) for a, b in zip(o, r))
    assert agree >= 0.75 * sum(map(len, reference))


def test_int4_greedy_stays_close_to_float32_on_a_q4_checkpoint(tiny_q4_llama):
    reference = [o.outputs[0].token_ids for o in LLM(str(tiny_q4_llama)).generate(PROMPTS, GREEDY)]
    llm = LLM(str(tiny_q4_llama), dtype="bfloat16", quantization="int4")
    outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    # Snapped weights leave near ties that bfloat16 activations swap now and then (plain
    # bfloat16 does no better on this model); a wrong kernel, step or offset agrees nowhere.
    first = sum(o[0] == r[0] for o, r in zip(outputs, reference))
    agree = sum(a == b for o, r in zip(outputs, reference) for a, b in zip(o, r))
    assert first >= len(PROMPTS) // 2
    assert agree >= 0.5 * sum(map(len, reference))


def test_an_int8_worker_behind_a_synchronous_scheduler_serves_what_the_offline_engine_computes(tiny_llama):
    """The flags reach the services: `worker --dtype bfloat16 --quantization int8` and
    `scheduler --no-async-scheduling` serve the same greedy tokens as the offline LLM."""
    import httpx

    from deployment import Deployment

    prompt = PROMPTS[4]
    expected = LLM(str(tiny_llama), dtype="bfloat16", quantization="int8").generate([prompt], GREEDY)
    d = Deployment(str(tiny_llama), worker_args=["--dtype", "bfloat16", "--quantization", "int8",
                                                 "--max-model-len", "512", "--num-kv-blocks", "64"],
                   scheduler_args=["--no-async-scheduling"])
    try:
        d.wait_healthy()
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                "logprobs": 0}
        reply = httpx.post(d.base_url + "/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == 8
        assert reply["choices"][0]["text"] == expected[0].outputs[0].text
    finally:
        d.close()


def test_int4_keeps_a_weight_that_is_already_on_a_16_level_grid_exactly():
    """As a GGUF Q4_1 checkpoint is after conversion: level * step + low per group of 32."""
    torch.manual_seed(0)
    levels = torch.randint(0, 16, (48, 64))
    step = torch.rand(48, 2) * 0.1 + 0.01
    low = torch.randn(48, 2)
    weight = (levels.view(48, 2, 32) * step[..., None] + low[..., None]).view(48, 64)
    got_levels, got_step, got_low = int4_grid(weight)
    rebuilt = (got_levels.view(48, 2, 32) * got_step[..., None] + got_low[..., None]).view(48, 64)
    torch.testing.assert_close(rebuilt, weight, rtol=0, atol=1e-6)
    # Off the grid: 16 levels between min and max, error at most half a step.
    noisy = torch.randn(48, 64)
    got_levels, got_step, got_low = int4_grid(noisy)
    rebuilt = (got_levels.view(48, 2, 32) * got_step[..., None] + got_low[..., None]).view(48, 64)
    assert ((rebuilt - noisy).abs().view(48, 2, 32) <= got_step[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 40])
def test_int4_linear_is_the_product_with_the_grid_weights(rows, kernel):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    levels, step, low = int4_grid(weight)
    on_grid = (levels.view(96, 2, 32) * step[..., None] + low[..., None]).view(96, 64)
    x = torch.randn(rows, 64)
    layer = Int4Linear(weight, bias, torch.bfloat16, kernel=kernel)
    assert layer.kernel == kernel
    out = layer(x.bfloat16()).float()
    torch.testing.assert_close(out, F.linear(x, on_grid, bias), rtol=0.02, atol=0.1)


def _random_int4(rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    groups = in_features // 32
    levels = torch.randint(0, 16, (out_features, in_features), generator=gen)
    step = torch.rand(out_features, groups, generator=gen) * 0.05 + 0.001
    low = -8 * step + torch.randn(out_features, groups, generator=gen) * 0.01
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    # The weights as the kernel stores them: step and low in float16.
    stored = (levels.view(out_features, groups, 32).float() * step.half().float()[..., None]
              + low.half().float()[..., None]).view(out_features, in_features)
    return levels, step, low, b, x, stored


SHAPES = [(64, 32, False), (100, 576, True), (960, 1536, False)]


@pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels unavailable")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 47])
@pytest.mark.parametrize("out_features, in_features, bias", SHAPES)
def test_llmbus_int4_kernel_rounds_the_exact_product(rows, out_features, in_features, bias):
    """Below the expansion threshold: against the float64 product with the weights it
    stores (levels, step and low as float16), within one bfloat16 rounding of the result,
    give or take the float32 rounding of its sums; 1-3 row tiles, partial 64-output blocks,
    a bias."""
    assert rows < cpu_kernels.int4_expand_rows()
    levels, step, low, b, x, stored = _random_int4(rows, out_features, in_features, bias)
    out = cpu_kernels.linear_int4(x, cpu_kernels.pack_int4(levels, step, low), out_features, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    exact = x.double() @ stored.double().T + (0 if b is None else b.double())
    magnitude = x.double().abs() @ stored.double().abs().T + (0 if b is None else b.double().abs())
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) - 7)  # one bfloat16 step
    assert bool(((out.double() - exact).abs() <= ulp + 2.0**-18 * magnitude).all())


@pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels unavailable")
@pytest.mark.parametrize("extra_rows", [0, 1, 82])
@pytest.mark.parametrize("out_features, in_features, bias", SHAPES)
def test_llmbus_int4_kernel_from_the_threshold_is_the_bfloat16_product(extra_rows, out_features, in_features, bias):
    """From `int4_expand_rows()` rows on, the weights are expanded to bfloat16 (rounded
    once) and multiplied by the bfloat16 kernel: the same bits as that kernel on those
    weights, which on a Q4 checkpoint are the bfloat16 model's own."""
    rows = cpu_kernels.int4_expand_rows() + extra_rows
    levels, step, low, b, x, stored = _random_int4(rows, out_features, in_features, bias)
    out = cpu_kernels.linear_int4(x, cpu_kernels.pack_int4(levels, step, low), out_features, b)
    reference = cpu_kernels.linear(x, cpu_kernels.pack_weight(stored.bfloat16()), out_features, b)
    assert torch.equal(out, reference)


def _random_int8(rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    levels = torch.randint(-127, 128, (out_features, in_features), generator=gen).to(torch.int8)
    scale = torch.rand(out_features, generator=gen) * 0.01 + 1e-4
    b = torch.randn(out_features, generator=gen) if bias else None
    return levels, scale, b, torch.randn(rows, in_features, generator=gen).bfloat16()


@pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels unavailable")
@pytest.mark.parametrize("extra_rows", [0, 50])
@pytest.mark.parametrize("out_features, in_features, bias", SHAPES)
def test_llmbus_int8_kernel_from_the_threshold_is_the_bfloat16_product(extra_rows, out_features, in_features, bias):
    """From `int8_expand_rows()` rows on: the bfloat16 kernel on level * scale rounded to
    bfloat16, bit for bit."""
    levels, scale, b, x = _random_int8(cpu_kernels.int8_expand_rows() + extra_rows, out_features, in_features, bias)
    out = cpu_kernels.linear_int8(x, cpu_kernels.pack_int8(levels, scale), out_features, b)
    weight = (levels.float() * scale[:, None]).bfloat16()
    assert torch.equal(out, cpu_kernels.linear(x, cpu_kernels.pack_weight(weight), out_features, b))


@pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels unavailable")
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 79])
@pytest.mark.parametrize("out_features, in_features, bias", SHAPES)
def test_llmbus_int8_kernel_rounds_the_exact_product(rows, out_features, in_features, bias):
    """int8 weights times their scales against the float64 product: within one bfloat16
    rounding of the result, give or take the float32 rounding of the sums; 1-6 row tiles
    and their tails, partial 64-output blocks, a bias."""
    assert rows < cpu_kernels.int8_expand_rows()
    levels, scale, b, x = _random_int8(rows, out_features, in_features, bias)
    out = cpu_kernels.linear_int8(x, cpu_kernels.pack_int8(levels, scale), out_features, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    weight = levels.double() * scale.double()[:, None]
    exact = x.double() @ weight.T + (0 if b is None else b.double())
    magnitude = x.double().abs() @ weight.abs().T + (0 if b is None else b.double().abs())
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) - 7)
    assert bool(((out.double() - exact).abs() <= ulp + 2.0**-20 * magnitude).all())
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_kernels.linear_int8(x.float(), cpu_kernels.pack_int8(levels, scale), out_features, b)


@pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels unavailable")
def test_llmbus_int4_kernel_refuses_what_it_cannot_read():
    levels, step = torch.randint(0, 16, (64, 64)), torch.rand(64, 2)
    packed = cpu_kernels.pack_int4(levels, step, step)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_kernels.linear_int4(torch.randn(2, 64), packed, 64)  # float32 activations
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.linear_int4(torch.randn(2, 32).bfloat16(), packed, 64)
    with pytest.raises(ValueError, match="0..15"):
        cpu_kernels.pack_int4(levels + 1, step, step)
    with pytest.raises(ValueError, match="in % 32"):
        cpu_kernels.pack_int4(levels[:, :48], step, step)


def test_quantization_needs_bfloat16_activations(tiny_llama):
    for method in ("int8", "int4"):
        with pytest.raises(ValueError, match="--dtype bfloat16"):
            ModelRunner(tiny_llama, dtype="float32", quantization=method)


def test_vllm_s_dtype_values_auto_half_and_float(tiny_llama, tmp_path):
    """--dtype auto is the checkpoint's own dtype (config.json's `dtype`, or transformers 4's
    `torch_dtype`; float16 as bfloat16 on a CPU, as vLLM's CPU backend); half and float are
    float16 and float32, by vLLM's spellings, on the command line too."""
    import json
    import shutil

    from llmbus.cli.main import build_parser
    from services.worker.loader import resolve_dtype

    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert [resolve_dtype(name, folder, cpu) for name in ("auto", "half", "float")] == ["float32", "float16",
                                                                                       "float32"]
    for key, written, on_cpu, on_gpu in (("dtype", "float16", "bfloat16", "float16"),
                                          ("torch_dtype", "bfloat16", "bfloat16", "bfloat16")):
        (folder / "config.json").write_text(json.dumps({**{k: v for k, v in config.items() if k != "dtype"},
                                                        key: written}))
        assert (resolve_dtype("auto", folder, cpu), resolve_dtype("auto", folder, gpu)) == (on_cpu, on_gpu)
    assert LLM(str(folder), dtype="auto").runner.dtype == torch.bfloat16
    assert build_parser().parse_args(["worker", "--dtype", "half"]).dtype == "half"
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        resolve_dtype("int3", folder, cpu)
