"""Decode-only steps through one C call per layer (services/worker/models/fused_decode.py)
give the same bits as the module path that calls the same kernels one by one: the same
greedy tokens and the same log-probabilities, with and without qkv biases, at head_dim 64,
128 and 256, over block boundaries, for a batch whose requests finish at different steps, in
bfloat16, float32, int4 and int8 weights, and with a float8 KV cache; for Llama, Qwen2,
Qwen3, Gemma 1-3, Phi-3, SmolLM3, OLMo 2 and 3, GLM-4 and EXAONE 4."""

import pytest
import torch

import kernels.cpu as cpu_kernels
from llmbus import LLM, SamplingParams
from tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")

PROMPTS = [[5 + i % 300 for i in range(n)] for n in (1, 15, 16, 40)]


def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in (24, 9, 17, 24)]
    outputs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, [position[t].logprob for t, position in zip(o.outputs[0].token_ids,
                                                                                  o.outputs[0].logprobs)])
            for o in outputs]


LAYOUTS = [("bfloat16", None, "auto"), ("float32", None, "auto"), ("bfloat16", "int4", "auto"),
           ("bfloat16", "int8", "auto"), ("bfloat16", None, "fp8_e4m3"), ("float32", None, "fp8_e5m2")]
TWO_HEADS = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)


def longrope(rotating: int, partial: float = 1.0) -> dict:
    """Phi-3's longrope past 32 positions (these prompts cross it) over `rotating` dims of a head."""
    half = rotating // 2
    return dict(max_position_embeddings=256, original_max_position_embeddings=32, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
        "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [1.5 + 0.5 * i for i in range(half)]})



# Every layout on Llama and Qwen2 (biases); the other families' own parts (Qwen3's query/key
# norms, Gemma's GeGLU, Gemma 2's and 3's norms of each branch, soft cap, windows of 24 that
# these prompts pass, Gemma 3's rotary base per layer, Phi-3's longrope rows and a partial
# rotary) in both dtypes and one quantized.
CASES = [(arch, overrides, *layout) for arch, overrides in [
    ("llama", dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1, intermediate_size=256,
                   tie_word_embeddings=True)),
    ("qwen2", dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=320)),
] for layout in LAYOUTS] + [(arch, overrides, *layout) for arch, overrides in [
    ("qwen3", dict(TWO_HEADS, head_dim=64)),
    ("gemma", TWO_HEADS),
    ("gemma2", TWO_HEADS),
    ("gemma3", dict(TWO_HEADS, head_dim=256)),
    ("smollm3", TWO_HEADS),
    ("olmo2", TWO_HEADS),
    ("olmo3", TWO_HEADS),
    ("glm4", dict(TWO_HEADS, head_dim=64)),  # half-rotary (reordered at load), Gemma 2's four norms
    ("exaone4", dict(TWO_HEADS, head_dim=64)),  # output norms, per-head q/k norms, windows, a NoPE layer
    ("qwen3", dict(TWO_HEADS, head_dim=64, max_position_embeddings=128, rope_parameters={  # YaRN's scaled tables
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})),
    ("phi3", dict(TWO_HEADS, **longrope(64))),
    ("phi3", dict(TWO_HEADS, **longrope(32, partial=0.5))),
] for layout in LAYOUTS[:2] + [("bfloat16", "int8", "auto")]]


@pytest.mark.parametrize("arch, overrides, dtype, quantization, kv_cache_dtype", CASES)
def test_fused_decode_gives_the_module_paths_bits(tmp_path, arch, overrides, dtype, quantization, kv_cache_dtype):
    folder = build_tiny_model(tmp_path, arch, **overrides)
    fused = LLM(str(folder), dtype=dtype, block_size=16, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    path = fused.runner.model.fused_decode
    assert path is not None
    calls = []
    original = path.forward
    path.forward = lambda *args: calls.append(args[0].numel()) or original(*args)
    fused_out = run(fused)
    assert calls and max(calls) == len(PROMPTS) and min(calls) < len(PROMPTS)  # a shrinking batch

    modules = LLM(str(folder), dtype=dtype, block_size=16, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    modules.runner.model.fused_decode = None
    assert run(modules) == fused_out


def test_only_models_packed_for_the_kernels_take_it(tmp_path):
    folder = build_tiny_model(tmp_path, "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    assert LLM(str(folder), dtype="bfloat16").runner.model.fused_decode.dtype == torch.bfloat16
    assert LLM(str(folder), dtype="float32").runner.model.fused_decode.dtype == torch.float32
    # int4 and int8 on llmbus's kernels (the bits test above checks what the layer computes).
    assert LLM(str(folder), dtype="bfloat16", quantization="int4").runner.model.fused_decode is not None
    assert LLM(str(folder), dtype="bfloat16", quantization="int8").runner.model.fused_decode is not None
    # Asking for the Triton backend means Triton's attention, not the CPU kernel's.
    assert LLM(str(folder), dtype="bfloat16", attention_backend="triton").runner.model.fused_decode is None
