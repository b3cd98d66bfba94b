"""Lower precisions: bfloat16, and int8 weights with bfloat16 activations. float32 is
the one that matches transformers token for token; these must stay close to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmbus import LLM, SamplingParams
from services.worker.layers.int8_linear import INT8_KERNEL_MAX_ROWS, Int8Linear
from services.worker.model_runner import ModelRunner
from test_engine_correctness import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("rows", [1, INT8_KERNEL_MAX_ROWS, INT8_KERNEL_MAX_ROWS + 1, 200])
def test_int8_linear_is_the_float_product_within_quantization_error(rows):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(rows, 64)
    layer = Int8Linear(weight, bias)
    scales = weight.abs().amax(1, keepdim=True) / 127
    dequantized = torch.round(weight / scales) * scales
    out = layer(x.bfloat16()).float()
    # Both kernels (small and large batches) compute the product with the rounded weights.
    torch.testing.assert_close(out, F.linear(x, dequantized, bias), rtol=0.02, atol=0.1)
    assert (out - F.linear(x, weight, bias)).abs().max() < 0.05 * F.linear(x, weight, bias).abs().max()


@pytest.mark.parametrize("engine", [dict(dtype="bfloat16"), dict(dtype="bfloat16", quantization="int8")],
                         ids=["bfloat16", "int8"])
def test_lower_precision_greedy_starts_like_float32(tiny_llama, engine):
    reference = [o.outputs[0].token_ids for o in LLM(str(tiny_llama)).generate(PROMPTS, GREEDY)]
    outputs = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), **engine).generate(PROMPTS, GREEDY)]
    # The tiny model's logits are far apart: the first tokens must agree everywhere.
    assert [o[:2] for o in outputs] == [r[:2] for r in reference]
    agree = sum(a == b for o, r in zip(outputs, reference) for a, b in zip(o, r))
    assert agree >= 0.75 * sum(map(len, reference))


def test_int8_with_float32_activations_is_refused_with_a_clear_error(tiny_llama):
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        ModelRunner(tiny_llama, dtype="float32", quantization="int8")


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
