"""`--model org/name` as vLLM takes it: the repository's snapshot in the Hugging Face cache
(downloaded there first where the Hub can be reached; this machine cannot, so the cache
is laid out here as huggingface_hub lays it out, and HF_HUB_OFFLINE=1 only looks)."""

import os
import shutil
import subprocess
import sys

import pytest

from llmbus.cli.main import build_parser
from llmbus.model_fetch import is_hub_id
from llmbus.cli.services import served_name


COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the snapshot's (a full hash: what an offline look-up takes)


def hub_cache(tmp_path, tiny_llama):
    """HF_HUB_CACHE with `org/tiny` at one commit, as a download leaves it (blobs linked from
    the snapshot, refs/main naming the commit)."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in tiny_llama.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return tmp_path / "hub"


def run_generate(model: str, cache, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if cache is not None:
        env["HF_HUB_CACHE"] = str(cache)
    return subprocess.run([sys.executable, "-m", "llmbus", "generate", "--model", model, "--max-tokens", "3", *flags,
                           "hi"], capture_output=True, text=True, timeout=120, env=env)


def test_a_hub_id_serves_from_the_hugging_face_cache(tmp_path, tiny_llama):
    cache = hub_cache(tmp_path, tiny_llama)
    found = run_generate("org/tiny", cache)
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.strip()
    missing = run_generate("org/absent", cache)
    assert missing.returncode == 2
    assert "llmbus: error: model 'org/absent' is not in the Hugging Face cache" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_revision_and_download_dir_pick_the_snapshot_as_vllms_flags_do(tmp_path, tiny_llama):
    cache = hub_cache(tmp_path, tiny_llama)
    pinned = run_generate("org/tiny", None, "--download-dir", str(cache), "--revision", COMMIT)
    assert pinned.returncode == 0, pinned.stderr[-2000:]
    other = run_generate("org/tiny", None, "--download-dir", str(cache), "--revision", "f" * 40)
    assert other.returncode == 2
    assert f"model 'org/tiny' at {'f' * 40} is not in the Hugging Face cache" in other.stderr


def test_a_hub_id_is_the_served_name_as_vllm_gives_it(tmp_path):
    assert (is_hub_id("org/name"), is_hub_id("./org/name"), is_hub_id("/abs/path"), is_hub_id("name")) == (
        True, False, False, False)
    assert served_name(build_parser().parse_args(["serve", "--model", "Qwen/Qwen3-0.6B"])) == "Qwen/Qwen3-0.6B"
    local = tmp_path / "some" / "folder"
    local.mkdir(parents=True)
    args = build_parser().parse_args(["serve", "--model", str(local)])
    assert served_name(args) == "folder"  # a local folder: its name, as before


@pytest.mark.parametrize("model", ["org/name/extra", "a b/c"])
def test_what_is_not_a_folder_nor_a_hub_id_is_refused_by_name(model):
    from llmbus.model_fetch import resolve_model

    with pytest.raises(ValueError, match="nor a Hugging Face repository id"):
        resolve_model(model)


def test_a_hub_tokenizer_serves_a_weights_only_folder(tmp_path, tiny_llama):
    """vLLM's --tokenizer org/name: the repository's tokenizer from the cache, for a local
    checkpoint without one."""
    cache = hub_cache(tmp_path, tiny_llama)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama / name, bare / name)
    found = run_generate(str(bare), cache, "--tokenizer", "org/tiny", "--temperature", "0")
    own = run_generate(str(tiny_llama), cache, "--temperature", "0")
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout == own.stdout and found.stdout.strip()


def test_a_repository_without_safetensors_serves_its_pytorch_model_bin(tmp_path):
    """facebook/opt-125m (vLLM's quickstart model) ships pytorch_model.bin alone: read with
    torch.load's weights_only, equal to transformers; one that pickles code is refused."""
    import pickle

    import torch
    from transformers import AutoModelForCausalLM

    from llmbus import LLM, SamplingParams
    from tiny_models import build_tiny_model, hf_greedy, random_prompts

    built = build_tiny_model(tmp_path / "built", "opt", seed=2)
    folder = tmp_path / "opt"
    folder.mkdir()
    for f in built.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    torch.save(AutoModelForCausalLM.from_pretrained(built).state_dict(), folder / "pytorch_model.bin")
    prompts = random_prompts([3, 17])
    want = hf_greedy(built, prompts, 8)
    cache = hub_cache(tmp_path, folder)
    found = run_generate("org/tiny", cache)
    assert found.returncode == 0, found.stderr[-2000:]
    got = LLM(str(folder)).generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                    use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want

    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": Payload()}, f)
    with pytest.raises(ValueError, match="cannot read the weights in .*pytorch_model.bin"):
        LLM(str(folder))
