"""DeepSeek-V3's (and V3.1's, Kimi K2's) block of calls after the content."""

from __future__ import annotations

import re

from services.gateway.parsers.tool.hermes import HermesToolParser


class DeepSeekV3ToolParser(HermesToolParser):
    """vLLM's `deepseek_v3` (DeepSeek-V3, R1): after the content, one
    `<｜tool▁calls▁begin｜>` block of calls, each `<｜tool▁call▁begin｜>function<｜tool▁sep｜>`
    then the name and its JSON arguments in a json code fence, `<｜tool▁call▁end｜>`. The
    markers are special tokens: these requests keep them in their text."""

    keeps_special_tokens = True
    OPEN, CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL = re.compile(r"<｜tool▁call▁begin｜>[^<]*?<｜tool▁sep｜>([^\n<]+)\n```(?:json)?\n(.*?)\n```\s*"
                      r"(?:<｜tool▁call▁end｜>|$)", re.S)

    def _calls(self, body: str) -> list[tuple[str, ...]]:
        return [(name.strip(), arguments.strip() or "{}") for name, arguments in self.CALL.findall(body)]


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """vLLM's `deepseek_v31` (DeepSeek-V3.1): the same block, each call the name, then
    `<｜tool▁sep｜>` and its JSON arguments as written, no fence."""

    CALL = re.compile(r"<｜tool▁call▁begin｜>([^<]+?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|$)", re.S)


class KimiK2ToolParser(DeepSeekV3ToolParser):
    """vLLM's `kimi_k2`: a `<|tool_calls_section_begin|>` block of calls, each
    `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>`.
    The call keeps the model's id (`functions.NAME:INDEX`), as vLLM's does: Kimi's template
    renders a tool's result under that id, the form its model was trained to read."""

    OPEN, CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL = re.compile(r"<\|tool_call_begin\|>\s*([^<\s]+:\d+)\s*<\|tool_call_argument_begin\|>(.*?)"
                      r"(?:<\|tool_call_end\|>|$)", re.S)

    def _calls(self, body: str) -> list[tuple[str, ...]]:
        return [(call_id.rpartition(":")[0].removeprefix("functions."), arguments.strip() or "{}", call_id)
                for call_id, arguments in self.CALL.findall(body)]
