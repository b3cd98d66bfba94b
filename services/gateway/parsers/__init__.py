"""Parsers of a model's answer text: tool calls (tool_parsers.py), reasoning (reasoning_parsers.py) and gpt-oss's harmony messages (harmony.py)."""
