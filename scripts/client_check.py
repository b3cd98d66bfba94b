"""The clients people point at an OpenAI-compatible server, against a running llmbus:
LangChain's ChatOpenAI (with_structured_output by json_schema, function_calling and
json_mode; bind_tools with a named tool and with "any"; a tool round trip), instructor
(JSON_SCHEMA and TOOLS modes), the OpenAI Agents SDK over the Responses API (an agent's
answer, streamed too; an agent that calls a function tool and answers with its result; a
run that goes on from the last one's stored response), LiteLLM (`hosted_vllm/`: chat,
streamed, a Pydantic response_format, a required tool, text_completion), pydantic-ai
(native, prompted and tool output) and Outlines (`from_openai` with a JSON schema,
`from_vllm` with a regex, a Lark grammar and a JSON schema) and lm-evaluation-harness
(`local-completions` with the server's own tokenizer, `tokenizer_backend="remote"`: the
loglikelihoods of a few continuations, compared with transformers' where the caller gives
them). Each line says what came back or why it failed.

They pin an openai client of their own, so they live in their own environment:

    python -m venv /tmp/clients && /tmp/clients/bin/pip install -r scripts/client_check.requirements.txt
    /tmp/clients/bin/pip install --no-deps -r scripts/client_check.no-deps.requirements.txt
    llmbus serve &                          # the default model, SmolLM2-135M-Instruct
    /tmp/clients/bin/python scripts/client_check.py http://127.0.0.1:8000/v1 smollm2 [EXPECTED_JSON]

EXPECTED_JSON: {"pairs": [[context, continuation], ...], "expected": [[loglikelihood,
is_greedy], ...]} (tests/test_smollm2.py computes it with transformers); without it the
lm-evaluation-harness check scores two pairs of its own and checks only that it can.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (else it fetches a price list at import)

import instructor  # noqa: E402
import litellm  # noqa: E402
import openai  # noqa: E402
import outlines  # noqa: E402
import pydantic_ai  # noqa: E402
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled  # noqa: E402
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402


class Person(BaseModel):
    name: str
    age: int


@tool
def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return "sunny"


def check(what: str, run) -> bool:
    try:
        print(f"ok      {what}: {run()}")
        return True
    except Exception as exc:  # noqa: BLE001 - each failure is reported, the rest still run
        print(f"FAILED  {what}: {type(exc).__name__}: {str(exc)[:300]}")
        return False


def main(url: str, model: str, expected: str | None = None) -> int:
    llm = ChatOpenAI(base_url=url, api_key="none", model=model, temperature=0, max_tokens=80, max_retries=0)
    ask = "Describe a person named Ada who is 36 years old."
    results = []
    for method in ("json_schema", "function_calling", "json_mode"):
        # json_mode sends no schema (LangChain: say the format in the prompt); asked only for
        # "JSON", the 135M model's greedy answer nests keys past max_tokens, constrained or not.
        prompt = ask + (" Answer in JSON with the keys name and age." if method == "json_mode" else "")
        results.append(check(f"langchain with_structured_output {method}",
                             lambda: llm.with_structured_output(Person, method=method).invoke(prompt)))
    weather = "What is the weather in Paris?"
    for choice in ("get_weather", "any"):
        results.append(check(f"langchain bind_tools tool_choice={choice}",
                             lambda: llm.bind_tools([get_weather], tool_choice=choice).invoke(weather).tool_calls))

    def round_trip():
        call = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(weather)
        history = [HumanMessage(weather), call, ToolMessage("sunny", tool_call_id=call.tool_calls[0]["id"])]
        return llm.bind_tools([get_weather]).invoke(history).content[:80]

    results.append(check("langchain tool round trip", round_trip))
    for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
        client = instructor.from_openai(openai.OpenAI(base_url=url, api_key="none"), mode=mode)
        results.append(check(f"instructor {mode.name}", lambda: client.chat.completions.create(
            model=model, response_model=Person, max_retries=0, temperature=0, max_tokens=80,
            messages=[{"role": "user", "content": ask}])))
    results += agents_checks(url, model)
    results += litellm_checks(url, model, ask) + pydantic_ai_checks(url, model, ask) + outlines_checks(url, model, ask)
    results += lm_eval_checks(url, model, json.loads(expected) if expected else None)
    print(f"{sum(results)} of {len(results)} passed")
    return 0 if all(results) else 1


def agents_checks(url: str, model: str) -> list[bool]:
    set_tracing_disabled(True)  # (its traces would go to OpenAI's servers)
    responses = OpenAIResponsesModel(model=model, openai_client=openai.AsyncOpenAI(base_url=url, api_key="none"))
    settings = ModelSettings(temperature=0, max_tokens=60)
    agent = Agent(name="plain", instructions="Be brief.", model=responses, model_settings=settings)
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the weather in a city."""
        called.append(city)
        return "sunny"

    # tool_choice required, then reset by the SDK after the call: the agent's next turn answers
    tool_agent = Agent(name="tools", instructions="Use the tools.", model=responses, tools=[get_weather],
                       model_settings=ModelSettings(temperature=0, max_tokens=80, tool_choice="required"))

    def tool_run():
        result = Runner.run_sync(tool_agent, "What is the weather in Paris?", max_turns=3)
        assert called, "the tool was not called"
        return f"called with {called[0]!r}; {result.final_output[:60]!r}"

    def chained():
        first = Runner.run_sync(agent, "My name is Ada.")
        return Runner.run_sync(agent, "What is my name?", previous_response_id=first.last_response_id).final_output

    def streamed():
        async def run():
            result = Runner.run_streamed(agent, "Count to three.")
            async for _ in result.stream_events():
                pass
            return result.final_output
        return asyncio.run(run())

    return [check("agents run", lambda: Runner.run_sync(agent, "Say hello.").final_output[:60]),
            check("agents streamed run", lambda: streamed()[:60]),
            check("agents function tool", tool_run),
            check("agents previous_response_id", lambda: chained()[:60])]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def litellm_checks(url: str, model: str, ask: str) -> list[bool]:
    options = dict(model=f"hosted_vllm/{model}", api_base=url, api_key="none", temperature=0, max_tokens=80)
    messages = [{"role": "user", "content": ask}]

    def tool_call():
        call = litellm.completion(messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                  tools=[WEATHER_TOOL], tool_choice="required", **options)
        return call.choices[0].message.tool_calls[0].function

    return [check("litellm completion", lambda: litellm.completion(messages=messages, **options)
                  .choices[0].message.content[:60]),
            check("litellm stream", lambda: "".join(c.choices[0].delta.content or "" for c in litellm.completion(
                messages=messages, stream=True, **options))[:60]),
            check("litellm response_format", lambda: Person.model_validate_json(litellm.completion(
                messages=messages, response_format=Person, **options).choices[0].message.content)),
            check("litellm tools", tool_call),
            check("litellm text_completion", lambda: litellm.text_completion(
                prompt="The capital of France is", **options).choices[0].text[:40])]


def pydantic_ai_checks(url: str, model: str, ask: str) -> list[bool]:
    chat = OpenAIChatModel(model, provider=OpenAIProvider(base_url=url, api_key="none"))
    settings = pydantic_ai.ModelSettings(temperature=0, max_tokens=80)
    return [check(f"pydantic-ai {kind.__name__}", lambda: pydantic_ai.Agent(
        chat, output_type=kind(Person), model_settings=settings).run_sync(ask).output)
        for kind in (pydantic_ai.NativeOutput, pydantic_ai.PromptedOutput, pydantic_ai.ToolOutput)]


def outlines_checks(url: str, model: str, ask: str) -> list[bool]:
    client = openai.OpenAI(base_url=url, api_key="none")
    hosted, served = outlines.from_openai(client, model), outlines.from_vllm(client, model)
    lark = 'start: answer " " DIGIT\nanswer: "yes" | "no"\nDIGIT: /[0-9]/\n'

    def matching(pattern: str, text: str) -> str:
        assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern}"
        return text

    return [check("outlines from_openai json", lambda: Person.model_validate_json(
                hosted(ask, Person, max_tokens=80, temperature=0))),
            check("outlines from_vllm regex", lambda: matching("[0-9]{3}-[0-9]{4}", served(
                "A phone number:", outlines.types.Regex("[0-9]{3}-[0-9]{4}"), max_tokens=20, temperature=0))),
            check("outlines from_vllm lark", lambda: matching("(yes|no) [0-9]", served(
                "Is the sky blue? Answer and rate 0-9:", outlines.types.CFG(lark), max_tokens=20, temperature=0))),
            check("outlines from_vllm json", lambda: Person.model_validate_json(
                served(ask, Person, max_tokens=80, temperature=0)))]


def lm_eval_checks(url: str, model: str, expected: dict | None) -> list[bool]:
    """lm-evaluation-harness's `local-completions` model as `lm_eval --model local-completions
    --model_args base_url=.../v1/completions,tokenizer_backend=remote` builds it: prompts as
    token ids from the server's /tokenize, each continuation scored from echoed prompt
    logprobs (installed without its dependencies: its tasks' datasets are not needed here)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    pairs = [tuple(p) for p in expected["pairs"]] if expected else \
        [("The capital of France is", " Paris"), ("2 + 2 =", " 4")]

    def loglikelihoods():
        lm = LocalCompletionsAPI(base_url=url.rstrip("/") + "/completions", model=model, tokenizer_backend="remote",
                                 max_retries=1)
        got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                               disable_tqdm=True)
        if expected:
            for (ll, greedy), (want, want_greedy) in zip(got, expected["expected"], strict=True):
                assert abs(ll - want) < 1e-3 and greedy == want_greedy, f"{got} against transformers' {expected}"
        return [(round(ll, 4), greedy) for ll, greedy in got]

    return [check("lm-evaluation-harness local-completions loglikelihood", loglikelihoods)]


if __name__ == "__main__":
    sys.exit(main(*(sys.argv[1:4] if len(sys.argv) >= 3 else ("http://127.0.0.1:8000/v1", "smollm2"))))
