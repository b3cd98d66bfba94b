"""The model's sampling defaults from its generation_config.json, as vLLM's
`--generation-config auto` applies them: to what a request leaves out, offline and served."""

from __future__ import annotations

import json

import openai
import pytest

from deployment import llmbus_serve
from llmbus import LLM, SamplingParams
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.engine_params import to_sampling_params
from shared.hf.generation_config import default_sampling, stop_at_model_eos
from tiny_models import build_tiny_model, hf_greedy, random_prompts

pytestmark = pytest.mark.timeout(300)

QWEN_LIKE = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
             "bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 64}


def write_config(folder, fields: dict):
    (folder / "generation_config.json").write_text(json.dumps(fields))
    return folder


def test_the_sampling_fields_are_read_by_their_sampling_params_names(tmp_path):
    folder = write_config(tmp_path, QWEN_LIKE)
    assert default_sampling(folder) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                                        "max_tokens": 64}
    assert default_sampling(folder, "vllm") == {}
    (tmp_path / "elsewhere").mkdir()
    other = write_config(tmp_path / "elsewhere", {"min_p": 0.1})
    assert default_sampling(folder, str(other)) == {"min_p": 0.1}
    assert default_sampling(folder, "vllm", '{"temperature": 0.2, "max_new_tokens": 9}') == {"temperature": 0.2,
                                                                                              "max_tokens": 9}
    assert default_sampling(folder, overrides={"top_k": 5})["top_k"] == 5  # on top of the file
    assert default_sampling(tmp_path / "missing") == {}  # auto: a model without the file has none


@pytest.mark.parametrize("source, overrides, message", [
    ("nowhere", None, "no generation_config.json there"),
    ("auto", {"do_sample": True}, "unknown field 'do_sample'"),
    ("auto", {"top_p": 0.0}, "top_p must be in"),
    ("auto", "{not json", "Expecting property name"),
])
def test_a_bad_source_or_override_is_refused_by_name(tmp_path, source, overrides, message):
    with pytest.raises(ValueError, match=message):
        default_sampling(tmp_path, str(tmp_path / source) if source != "auto" else source, overrides)


def test_a_request_keeps_what_it_gives_and_takes_the_model_s_defaults_for_the_rest():
    defaults = {"temperature": 0.7, "top_k": 20, "max_tokens": 64}
    chat = to_sampling_params(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                                    temperature=0.0), defaults=defaults)
    assert (chat.temperature, chat.top_k, chat.max_tokens) == (0.0, 20, 64)
    given = to_sampling_params(ChatCompletionRequest(model="m", messages=[], max_completion_tokens=3), defaults=defaults)
    assert (given.temperature, given.max_tokens) == (0.7, 3)
    completion = to_sampling_params(CompletionRequest(model="m", prompt="hi"), defaults=defaults)
    assert (completion.temperature, completion.max_tokens) == (0.7, 16)  # OpenAI's default length stands
    assert to_sampling_params(CompletionRequest(model="m", prompt="hi")).temperature == 1.0  # none: neutral


PROMPTS = random_prompts([5, 17], seed=3)


def test_offline_generate_without_params_uses_the_model_s_defaults(tmp_path):
    folder = write_config(build_tiny_model(tmp_path / "m", "llama"), {"temperature": 0.0, "max_new_tokens": 5})
    llm = LLM(str(folder))
    assert llm.get_default_sampling_params().max_tokens == 5
    outputs = llm.generate(PROMPTS)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(folder, PROMPTS, 5)  # greedy, 5 tokens
    ignored = LLM(str(folder), generation_config="vllm").get_default_sampling_params()
    assert (ignored.temperature, ignored.max_tokens) == (SamplingParams().temperature, SamplingParams().max_tokens)


def ends_the_turn(folder, prompt) -> int:
    """A token greedy output reaches at its third step (the first two are other tokens):
    for a model whose generation config names it an EOS, as Gemma's names <end_of_turn>."""
    tokens = hf_greedy(folder, [prompt], 6)[0]
    assert tokens[2] not in tokens[:2]
    return tokens[2]


def test_the_file_s_eos_ids_end_a_request_as_stop_token_ids_unless_it_ignores_eos(tmp_path):
    """As vLLM's update_from_generation_config: the ids beyond the tokenizer's EOS join a
    request's stop_token_ids (finish_reason stop, the token last), not with ignore_eos,
    nor with --generation-config vllm."""
    folder = build_tiny_model(tmp_path / "m", "llama")
    llm = LLM(str(folder))
    turn_end = ends_the_turn(folder, PROMPTS[0])
    write_config(folder, {"eos_token_id": [llm.eos_token_id, turn_end]})
    greedy = SamplingParams(temperature=0, max_tokens=6)
    [out] = LLM(str(folder)).generate([PROMPTS[0]], greedy)
    assert (out.outputs[0].token_ids[-1], len(out.outputs[0].token_ids), out.outputs[0].finish_reason) == (
        turn_end, 3, "stop")
    [ignoring] = LLM(str(folder)).generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    [without] = LLM(str(folder), generation_config="vllm").generate([PROMPTS[0]], greedy)
    assert len(ignoring.outputs[0].token_ids) == len(without.outputs[0].token_ids) == 6
    params = SamplingParams(stop_token_ids=[7])
    assert stop_at_model_eos(params, (llm.eos_token_id, turn_end, 7), llm.eos_token_id).stop_token_ids == [7, turn_end]
    write_config(folder, {"eos_token_id": "2"})
    with pytest.raises(ValueError, match="eos_token_id"):
        LLM(str(folder))


def test_llmbus_serve_applies_the_file_and_the_override_to_what_a_chat_leaves_out_and_ends_at_its_eos(tmp_path):
    folder = build_tiny_model(tmp_path / "m", "llama")
    turn_end = ends_the_turn(folder, PROMPTS[0])
    write_config(folder, {"temperature": 0.0, "max_new_tokens": 64, "eos_token_id": [2, turn_end]})
    proc, url = llmbus_serve(["--model", str(folder), "--served-model-name", "tiny", "--num-kv-blocks", "64",
                              "--override-generation-config", '{"max_new_tokens": 4}'], tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "hello there"}]
        left_out = client.chat.completions.create(model="tiny", messages=messages, extra_body={"ignore_eos": True})
        explicit = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=4,
                                                  extra_body={"ignore_eos": True})
        assert left_out.usage.completion_tokens == 4  # the override's, over the file's 64
        assert left_out.choices[0].message.content == explicit.choices[0].message.content  # the file's greedy
        ended = client.completions.create(model="tiny", prompt=PROMPTS[0], temperature=0, max_tokens=6)
        assert (ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("stop", 3)  # the file's EOS
    finally:
        proc.terminate()
        proc.wait(60)
