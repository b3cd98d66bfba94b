"""A model folder whose tokenizer cannot be read is refused in words that name the file,
not transformers' talk of slow tokenizers and converters."""

import shutil

import pytest

from services.tokenizer.tokenizer import Tokenizer


@pytest.mark.parametrize("files, said", [
    ({}, "has no tokenizer.json"),
    ({"tokenizer.model": b"\0" * 16}, "has only sentencepiece's tokenizer.model"),
])
def test_a_folder_without_a_readable_tokenizer_says_which_file_is_missing(tiny_llama, tmp_path, files, said):
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, tmp_path / name)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=f"cannot read the tokenizer of {tmp_path}: it {said}"):
        Tokenizer(tmp_path)
    shutil.copy(tiny_llama / "tokenizer.json", tmp_path / "tokenizer.json")
    assert Tokenizer(tmp_path).encode("hello")  # with its tokenizer.json, it reads


def test_vllm_s_tokenizer_option_reads_another_folder_s(tiny_llama, tmp_path):
    """A checkpoint without tokenizer files (a bare fine-tune's) runs with --tokenizer /
    LLM(tokenizer=...): the same tokens as with its own, grammars included (the worker's
    vocabulary comes from there too); without it, the missing file is named."""
    import shutil

    from llmbus import LLM, SamplingParams
    from shared.sampling_params import StructuredOutputsParams

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (tiny_llama / name).exists():
            shutil.copy(tiny_llama / name, bare / name)
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(bare))
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-c]{4}"))]
    prompts = ["The quick brown fox", "letters:"]
    own = [o.outputs[0] for o in LLM(str(tiny_llama)).generate(prompts, params)]
    other = [o.outputs[0] for o in LLM(str(bare), tokenizer=str(tiny_llama)).generate(prompts, params)]
    assert [(o.token_ids, o.text) for o in other] == [(o.token_ids, o.text) for o in own]
    assert len(other[1].text) == 4 and set(other[1].text) <= set("abc")


def test_a_template_only_in_chat_template_json_is_read(tiny_llama, tmp_path):
    """Multimodal checkpoints may keep the chat template with their processor
    (chat_template.json) and none with the tokenizer: chats render from it, as vLLM's."""
    import json

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, tmp_path / name)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tmp_path).render_chat(messages)
    template = (tiny_llama / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert Tokenizer(tmp_path).render_chat(messages) == Tokenizer(tiny_llama).render_chat(messages)
