"""Tool calls read out of generated text as it streams: what the model wrote as content,
and what it wrote as calls, each call's id and name first, then its arguments in fragments.

One parser per choice, fed the choice's text deltas. The non-streamed answer feeds its
whole text at once and assembles the same deltas, so both answers agree by construction.

- `HermesToolParser` (`--tool-call-parser hermes`, for `tool_choice: auto`): the model
  chose; calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  (the format `services/tokenizer/tool_prompt.py` teaches), content is the text before
  the first. A block that is not a call is content.
- `RequiredToolParser` (`required`): a grammar made the text a JSON array of
  `{"name": ..., "arguments": {...}}` objects, separators fixed, name first; arguments
  stream as the model writes them.
- `NamedToolParser` (a named function): a grammar made the whole text its arguments.
- `Llama3JsonToolParser` (`llama3_json`) and `PythonicToolParser` (`pythonic`), for
  `auto` with Llama's own formats: the answer is text, or calls from its first character.
- `MistralToolParser` (`mistral`): content, then the calls after `[TOOL_CALLS]`;
  `GraniteToolParser` (`granite`) the same after Granite 3's `<|tool_call|>`.
- `Qwen3CoderToolParser` (`qwen3_coder`): hermes' blocks around Qwen3-Coder's XML-like
  calls, their values typed by the tools' schemas; `SeedOssToolParser` (`seed_oss`) the
  same calls in Seed-OSS's `<seed:tool_call>` blocks.
- `Glm45ToolParser` (`glm45`, `glm47`): hermes' blocks around GLM-4.5's calls, the name and
  then `<arg_key>`/`<arg_value>` pairs (GLM-4.7 writes no newline after the name).
- `MiniMaxM2ToolParser` (`minimax_m2`): `<minimax:tool_call>` blocks of one or more
  `<invoke name="...">` calls, their `<parameter name="...">` values typed as qwen3_coder's.
- `DeepSeekV3ToolParser` (`deepseek_v3`, and `deepseek_v31`: `DeepSeekV31ToolParser`): one
  `<｜tool▁calls▁begin｜>` block of calls after the content, each name then its arguments
  (in a json fence for V3 and R1, bare for V3.1); `KimiK2ToolParser` (`kimi_k2`): Kimi K2's
  block, its calls keeping the model's own ids.
- `HarmonyToolParser` (`openai`): gpt-oss's calls, messages to `functions.NAME` (parsers/harmony.py).
"""

from services.gateway.parsers.tool.base import ParsedDelta, ToolCall, ToolCallDelta, ToolCallParser, parse_whole
from services.gateway.parsers.tool.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser, KimiK2ToolParser
from services.gateway.parsers.tool.forced import NamedToolParser, RequiredToolParser
from services.gateway.parsers.tool.harmony import HarmonyToolParser
from services.gateway.parsers.tool.hermes import (
    Glm45ToolParser,
    HermesToolParser,
    MiniMaxM2ToolParser,
    Qwen3CoderToolParser,
    SeedOssToolParser,
)
from services.gateway.parsers.tool.leading_calls import Llama3JsonToolParser, PythonicToolParser
from services.gateway.parsers.tool.mistral import GraniteToolParser, MistralToolParser

# `--tool-call-parser`: how `tool_choice: auto` reads what the model wrote (vLLM's names).
TOOL_CALL_PARSERS: dict[str, type] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                                      "pythonic": PythonicToolParser, "mistral": MistralToolParser,
                                      "qwen3_coder": Qwen3CoderToolParser, "granite": GraniteToolParser,
                                      "seed_oss": SeedOssToolParser, "glm45": Glm45ToolParser,
                                      "glm47": Glm45ToolParser, "minimax_m2": MiniMaxM2ToolParser,
                                      "deepseek_v3": DeepSeekV3ToolParser, "deepseek_v31": DeepSeekV31ToolParser,
                                      "kimi_k2": KimiK2ToolParser}
TOOL_CALL_PARSERS["openai"] = HarmonyToolParser

__all__ = ["TOOL_CALL_PARSERS", "ParsedDelta", "ToolCall", "ToolCallDelta", "ToolCallParser", "parse_whole",
           "NamedToolParser", "RequiredToolParser", *(parser.__name__ for parser in set(TOOL_CALL_PARSERS.values()))]
