"""A reasoning model's thinking read out of its chat answer (vLLM's `--reasoning-parser`):
the text between `<think>` and `</think>` goes to the message's `reasoning`, the rest to
its `content` (and from there to a tool-call parser).

One parser per choice, fed the choice's text deltas; the non-streamed answer feeds its
whole text at once, so both agree by construction (as parsers/tool/). A tag split
across deltas is held back until it is whole or cannot be one.

- `deepseek_r1`: the template opens the thinking in the prompt, so the answer is reasoning
  from its first character (a leading `<think>` dropped) until `</think>`; `minimax_m2`
  the same (MiniMax-M2 writes no opening tag).
- `qwen3`: reasoning where the answer begins with `<think>`, or where the prompt ends
  inside an open `<think>` (Qwen3.5's and the thinking-2507 templates put it there);
  otherwise (`enable_thinking: false` closes it in the prompt) all content.
- `glm45`: as `qwen3` (GLM-4.5's template closes an empty `<think></think>` in the prompt
  when thinking is off); `deepseek_v3` the same (DeepSeek-V3.1's template ends the prompt
  with `<think>` when `thinking` is on and `</think>` when off, where vLLM's parser reads
  chat_template_kwargs to choose between R1's parser and none).
- `seed_oss`: as `qwen3`, between Seed-OSS's `<seed:think>` and `</seed:think>` (its
  thinking-budget notes, `<seed:cot_budget_reflect>`, stay in the reasoning).
- `openai_gptoss`: gpt-oss's harmony analysis channel (harmony.py).
Reasoning that never closes (max_tokens ran out) stays reasoning.
"""

from __future__ import annotations

from services.gateway.parsers.harmony import HarmonyReasoningParser
from services.gateway.parsers.streamed import StreamedReasoning, partial_suffix

# name -> the tags around its thinking
TAGS = {"deepseek_r1": ("<think>", "</think>"), "qwen3": ("<think>", "</think>"), "glm45": ("<think>", "</think>"),
        "minimax_m2": ("<think>", "</think>"), "seed_oss": ("<seed:think>", "</seed:think>"),
        "deepseek_v3": ("<think>", "</think>")}
# The answer is reasoning from its first character, whatever the prompt says
STARTS_IN_REASONING = ("deepseek_r1", "minimax_m2")


class ReasoningParser(StreamedReasoning):
    # "open?": the answer may still begin with <think>; "reasoning"; "content"
    def __init__(self, starts_in_reasoning: bool, tags: tuple[str, str] = TAGS["qwen3"]) -> None:
        self.open, self.close = tags
        self._state = "open?" if not starts_in_reasoning else "reasoning"
        self._leading_open = True  # a <think> at the very start is dropped in any mode
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) this text adds."""
        text, self._held = self._held + text, ""
        reasoning = content = ""
        if self._leading_open:
            if self.open.startswith(text):  # all of it may still be the tag
                self._held = text
                return "", ""
            self._leading_open = False
            if text.startswith(self.open):
                text, self._state = text[len(self.open):], "reasoning"
            elif self._state == "open?":
                self._state = "content"
        if self._state == "reasoning":
            end = text.find(self.close)
            if end < 0:
                keep = partial_suffix(text, self.close)
                reasoning, self._held = text[: len(text) - keep], text[len(text) - keep:]
                return reasoning, ""
            reasoning, text, self._state = text[:end], text[end + len(self.close):], "content"
        content = text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the answer's end: an unfinished tag is text after all."""
        held, self._held = self._held, ""
        if self._leading_open and self._state == "open?":
            return "", held
        return (held, "") if self._state == "reasoning" else ("", held)


def prompt_opens_thinking(prompt_tail: str, tags: tuple[str, str] = TAGS["qwen3"]) -> bool:
    """Whether a prompt's text ends inside an open thinking tag (the template began the thinking)."""
    return prompt_tail.rfind(tags[0]) > prompt_tail.rfind(tags[1])


def new_parser(name: str, prompt_tail: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: {', '.join(REASONING_PARSERS)}")
    if name == "openai_gptoss":
        return HarmonyReasoningParser()
    tags = TAGS[name]
    return ReasoningParser(name in STARTS_IN_REASONING or prompt_opens_thinking(prompt_tail, tags), tags)


# `openai_gptoss`: gpt-oss's harmony channels (harmony.py), read from its special tokens,
# which the answer's text then keeps
KEEPS_SPECIAL_TOKENS = ("openai_gptoss",)
REASONING_PARSERS = (*TAGS, *KEEPS_SPECIAL_TOKENS)
