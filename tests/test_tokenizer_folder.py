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
