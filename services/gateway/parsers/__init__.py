"""Parsers of a model's answer text: tool calls (tool/), reasoning (reasoning.py), gpt-oss's harmony messages
(harmony.py), and what the streaming parsers share (streamed.py)."""
