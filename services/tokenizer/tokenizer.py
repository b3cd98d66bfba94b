"""The tokenizer core: prompt text and chat messages to token ids.

transformers' fast tokenizer for encoding and chat templates; its `tokenizers`
backend is what the gateway's incremental detokenizer steps through.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer


class Tokenizer:
    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy; only where a tokenizer is needed

        self.hf = AutoTokenizer.from_pretrained(str(model_path))
        self.backend: BackendTokenizer = self.hf.backend_tokenizer
        self.eos_token_id: int | None = self.hf.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template")
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja errors: bad roles, missing fields, ...
            raise ValueError(f"chat template failed: {exc}") from exc

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The rendered template already holds the special tokens it wants.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)
