"""The tokenizer core: prompt text and chat messages to token ids.

transformers' fast tokenizer for encoding and chat templates; its `tokenizers`
backend is what the gateway's incremental detokenizer steps through. A conversation with
tools goes through the model's template when that template renders tools (it reads a
`tools` variable), through `--tool-chat-template` when one is given, and otherwise as
Hermes-style messages through the model's own template (`tool_prompt.py`). vLLM's
`--chat-template` replaces the model's template (a base model's missing one, a fixed one).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from services.tokenizer.images import ImagePrompts
from services.tokenizer.tool_prompt import has_tool_turns, hermes_messages, with_arguments_as_objects
from shared.hf.image_models import image_model, no_images_why, read_image
from shared.messages.images import ImageFeature


def load_chat_template(value: str | Path) -> str:
    """A chat template as vLLM's --chat-template takes it: a file's path, or the Jinja
    template itself (on one line, its escapes such as \\n read as the characters)."""
    try:
        is_file = Path(value).is_file()
    except OSError:  # a template too long to be a file's name
        is_file = False
    if is_file:
        return Path(value).read_text()
    text = str(value)
    if "{{" in text or "{%" in text:
        # vLLM's reading of a one-line template; latin-1 with backslashreplace first keeps
        # every other character as it is (unicode_escape alone reads UTF-8 as latin-1).
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    raise ValueError(f"chat template {text!r} is neither a file nor a Jinja template")


class Tokenizer:
    def __init__(self, model_path: str | Path, tool_chat_template: str | Path | None = None,
                 chat_template: str | Path | None = None, content_format: str = "auto") -> None:
        """`content_format`: vLLM's --chat-template-content-format (render_chat)."""
        from transformers import AutoTokenizer  # heavy; only where a tokenizer is needed

        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_path))
        except (OSError, ValueError) as exc:
            hint = _tokenizer_hint(Path(model_path), exc)
            raise ValueError(f"cannot read the tokenizer of {model_path}: {hint}") from exc
        if chat_template is not None:
            self.hf.chat_template = load_chat_template(chat_template)
        elif not self.hf.chat_template:
            self.hf.chat_template = _processor_chat_template(Path(model_path))
        self.backend: BackendTokenizer = self.hf.backend_tokenizer
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.tool_template = load_chat_template(tool_chat_template) if tool_chat_template else None
        self.content_format = content_format
        self.template_renders_tools = self.tool_template is not None or _reads_tools(self.hf.chat_template)
        self.path = Path(model_path)
        # Whether the template walks a message's content parts itself (Gemma 3's puts its
        # image marker where an image part is); else parts are joined into one string.
        self.template_takes_parts = iterates_content(self.hf.chat_template)

    @functools.cached_property
    def image_prompts(self) -> ImagePrompts | None:
        """The checkpoint's image processor (images.py), read at the first image; None
        for a model that takes no images."""
        model = image_model(self.path)
        return None if model is None else ImagePrompts(self.path, model)

    def encode_with_images(self, text: str, files: list[bytes],
                           add_special_tokens: bool = True) -> tuple[list[int], list[ImageFeature]]:
        """A prompt whose text marks images, and their files: the token ids with each
        image's tokens in place, and the images (their files kept: ImageFeature.source)."""
        if self.image_prompts is None:
            raise ValueError(no_images_why(self.path))
        return self.image_prompts.encode(text, [read_image(f, i) for i, f in enumerate(files)], add_special_tokens,
                                         sources=files)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None, chat_template: str | None = None,
                    documents: list[dict] | None = None, content_format: str | None = None) -> str:
        """`chat_template_kwargs`: variables the template reads besides the messages (vLLM's
        field; Qwen3's `enable_thinking`), never the ones set here. `chat_template`: this
        call's own template text (LLM.chat's), over the tokenizer's and the tool template.
        `documents`: vLLM's, what a RAG template (Granite's, Command R's) shows the model.
        `content_format` (vLLM's; default the tokenizer's): "string" joins a message's parts
        into one string, an image's as the model's marker; "auto" gives a conversation with
        images to a template that walks the parts as parts."""
        template = chat_template
        if template is None and not self.hf.chat_template and self.tool_template is None:
            raise ValueError("this model has no chat template: give one (--chat-template)")
        check_chat_options(add_generation_prompt, continue_final_message, chat_template_kwargs)
        placeholder = self.image_prompts.placeholder if has_image_parts(messages) and self.image_prompts else None
        # (a conversation without images keeps its text parts joined, as served and as before)
        parts = placeholder is not None and (content_format or self.content_format) == "auto" and (
            self.template_takes_parts if template is None else iterates_content(template))
        messages = chat_messages(messages, placeholder, parts)
        if tools or has_tool_turns(messages):
            if _reads_tools(template) if template is not None else self.template_renders_tools:
                messages, template = with_arguments_as_objects(messages), template or self.tool_template
            else:
                messages, tools = hermes_messages(messages, tools), None
        try:
            return self.hf.apply_chat_template(
                messages, tools=tools, documents=documents, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
        except Exception as exc:  # jinja errors: bad roles, missing fields, ...
            raise ValueError(f"chat template failed: {exc}") from exc

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            chat_template: str | None = None, documents: list[dict] | None = None) -> list[int]:
        # The rendered template already holds the special tokens it wants.
        text = self.render_chat(messages, add_generation_prompt, tools, continue_final_message, chat_template_kwargs,
                                chat_template, documents)
        return self.encode(text, add_special_tokens=False)


class ChatOptionError(ValueError):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field  # what the gateway's 400 names


def check_chat_options(add_generation_prompt: bool, continue_final_message: bool,
                       chat_template_kwargs: dict[str, Any] | None) -> None:
    if add_generation_prompt and continue_final_message:
        raise ChatOptionError("continue_final_message goes on from the last message: add_generation_prompt must be "
                              "false with it", "continue_final_message")
    reserved = sorted(set(chat_template_kwargs or {}) & _RESERVED)
    if reserved:
        raise ChatOptionError(f"chat_template_kwargs cannot set {', '.join(reserved)}", "chat_template_kwargs")


def chat_messages(messages: list[dict], image_placeholder: str | None = None, parts: bool = False) -> list[dict]:
    """Chat messages as OpenAI defines them, as a template reads them: a content of text
    parts one string (joined by newlines, as vLLM joins them for such a template), an
    assistant's missing content '' (a template would print None). Image parts ({"type":
    "image"}, as the gateway leaves them once it has their files) are the model's
    `image_placeholder` in that string, or, for a template that walks the parts itself
    (`parts`), parts as it reads them. Raises ChatOptionError for what no template can
    render: a message without a role or content, a part that is not text (or an image,
    where the model takes them), tool calls without their function."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatOptionError(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatOptionError(f"messages[{i}] has no role", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text, and images where the model takes them
            kinds = [_part_kind(p, image_placeholder is not None) for p in content]
            if None in kinds:
                raise ChatOptionError(f"messages[{i}].content: only text parts are supported"
                                      + (" (and images)" if image_placeholder is not None else ""), "messages")
            if parts:
                content = [{"type": "text", "text": p["text"]} if k == "text" else {"type": "image"}
                           for p, k in zip(content, kinds)]
            else:
                content = "\n".join(p["text"] if k == "text" else image_placeholder for p, k in zip(content, kinds))
            message = {**message, "content": content}
        elif content is None and role == "assistant":
            message = {**message, "content": ""}
        elif not isinstance(content, str):
            raise ChatOptionError(f"messages[{i}] has no content", "messages")
        if "tool_calls" in message:
            _check_tool_calls(i, role, message["tool_calls"])
        out.append(message)
    return out


def _part_kind(part: Any, images: bool) -> str | None:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return "text"
    if images and isinstance(part, dict) and part.get("type") == "image":
        return "image"
    return None


def has_image_parts(messages: list[dict]) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"]) for m in messages)


def iterates_content(template: str | None) -> bool:
    """Whether a chat template loops over a message's content (vLLM's "openai" content
    format): then content parts go to it as parts."""
    if not isinstance(template, str):
        return False
    import jinja2
    import jinja2.nodes as nodes

    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return False
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        if (isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content") or (
                isinstance(it, nodes.Getattr) and it.attr == "content"):
            return True
    return False


def _check_tool_calls(i: int, role: str, calls: Any) -> None:
    """An assistant turn's calls, as OpenAI sends them back: arguments a JSON string."""
    if role != "assistant" or not isinstance(calls, list):
        raise ChatOptionError(f"messages[{i}].tool_calls must be a list on an assistant message", "messages")
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not isinstance(
                function.get("arguments", ""), str):
            raise ChatOptionError(f"messages[{i}].tool_calls: each call needs function.name and function.arguments "
                                  "(a JSON string)", "messages")


# What apply_chat_template takes itself, and what a template is given by it.
_RESERVED = frozenset({"messages", "conversation", "tools", "documents", "chat_template", "tokenize",
                       "add_generation_prompt", "continue_final_message", "return_tensors", "return_dict",
                       "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})


def _processor_chat_template(folder: Path) -> str | None:
    """A multimodal checkpoint's template where its tokenizer has none: its processor's,
    in chat_template.json (vLLM reads it there too)."""
    path = folder / "chat_template.json"
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text()).get("chat_template")
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"cannot read the chat template in {path}: {exc}") from exc
    return template if isinstance(template, str) else None


def _tokenizer_hint(folder: Path, exc: Exception) -> str:
    """What is wrong with a folder whose tokenizer transformers could not read, in words
    that name the file (its own message speaks of slow tokenizers and converters)."""
    if not (folder / "tokenizer.json").exists():
        if (folder / "tokenizer.model").exists():
            return ("it has only sentencepiece's tokenizer.model, which needs the sentencepiece package; add the "
                    "tokenizer.json that transformers writes (AutoTokenizer.from_pretrained(folder).save_pretrained("
                    "folder), where sentencepiece is installed)")
        if not any(folder.glob("vocab.*")) and not any(folder.glob("*.tiktoken")):
            return "it has no tokenizer.json (copy the checkpoint's tokenizer files beside its config.json)"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _reads_tools(template: str | dict | None) -> bool:
    """Whether a chat template renders tools itself (it reads the `tools` variable)."""
    if not isinstance(template, str):
        return False
    import jinja2
    import jinja2.meta

    return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
