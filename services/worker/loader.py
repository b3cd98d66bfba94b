"""Build the native model from a Hugging Face folder: config.json + safetensors (or, where a
repository has none, PyTorch's pytorch_model.bin)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from services.worker.attention.backend import AttentionBackend
from services.worker.layers.moe import SparseMoE
from services.worker.layers.packed_linear import (
    PackedLinear,
    can_pack,
    kernel_choices,
    move_to_huge_pages,
    pack_linears,
)
from services.worker.layers.quantized_linear import quantize, quantized_linear
from services.worker.models.checkpoints.fp8_weights import fp8_widened
from services.worker.models.checkpoints.quantized_weights import quantized_widened
from services.worker.models.decoder import LlamaForCausalLM
from services.worker.models.decoder_config import ModelConfig
from services.worker.models.fused_decode import FusedDecode
from services.worker.models.weight_names import MULTIMODAL_PARTS
from services.worker.parallel.sharding import Shards, slice_vocabulary, split_sums
from shared.config import DTYPE_ALIASES, DTYPE_CHOICES
from shared.hf.model_folder import checkpoint_dtype

LOAD_FORMATS = ("auto", "dummy")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: {', '.join(DTYPE_CHOICES)}")
    return DTYPES[name]


def resolve_dtype(name: str, folder: str | Path, device: torch.device) -> str:
    """The dtype a --dtype value means, by its name in DTYPES. "auto" (vLLM's): the
    checkpoint's own (config.json's `dtype`, or `torch_dtype` as transformers 4 wrote it;
    float32 where it names none). float16 on a CPU runs as bfloat16, as vLLM's CPU backend
    takes it: the same range of exponents is not, but llmbus's CPU kernels and oneDNN's
    packed products take bfloat16 and not float16, which PyTorch runs several times slower."""
    name = DTYPE_ALIASES.get(name, name)
    if name == "auto":
        name = checkpoint_dtype(folder) or "float32"
        name = name if name in DTYPES else "float32"
        if name == "float16" and device.type == "cpu":
            name = "bfloat16"
    parse_dtype(name)  # (an unknown one refused by name)
    return name


def _indexed_shards(index: Path) -> list[Path]:
    """A sharded checkpoint's files, by its index's weight map."""
    return [index.parent / shard for shard in sorted(set(json.loads(index.read_text())["weight_map"].values()))]


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return _indexed_shards(index)
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if not found and not pytorch_files(folder):
        raise ValueError(f"{folder} has no safetensors weights (nor PyTorch's pytorch_model.bin)")
    return found


def pytorch_files(folder: Path) -> list[Path]:
    """PyTorch's pickled checkpoint (pytorch_model.bin, or its shards by their index): what
    older repositories hold alone (facebook/opt-125m, vLLM's quickstart model)."""
    index = folder / "pytorch_model.bin.index.json"
    if index.is_file():
        return _indexed_shards(index)
    return sorted(folder.glob("pytorch_model*.bin"))


def language_model_part(name: str) -> bool:
    """What the decoder reads: a vision tower is left on disk, unread."""
    return not name.startswith(MULTIMODAL_PARTS)


def iter_weights(folder: Path,
                 reads: Callable[[str], bool] = language_model_part) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by name, those `reads` keeps (the others are not read from
    disk): its safetensors, or where it has none (vLLM's load_format auto) its
    pytorch_model.bin, unpickled with `weights_only` (tensors and plain containers alone:
    a pickle that would run code is refused, not run)."""
    files = safetensors_files(folder)
    for path in files:
        with open_weights(path) as f:
            for name in f.keys():
                if reads(name):
                    yield name, f.get_tensor(name)
    if files:
        return
    for path in pytorch_files(folder):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # (a partial download, or a pickle weights_only refuses)
            raise ValueError(f"cannot read the weights in {path}: {str(exc).splitlines()[0]}") from exc
        for name, tensor in state.items():
            if reads(name):
                yield name, tensor


def tensor_names(folder: Path) -> set[str]:
    """The names of the checkpoint's tensors (a pytorch_model.bin's read whole to find them)."""
    files = safetensors_files(folder)
    if not files:
        return {name for name, _ in iter_weights(folder, lambda _: True)}
    names = set()
    for path in files:
        with open_weights(path) as f:
            names.update(f.keys())
    return names


def open_weights(path: Path):
    """safe_open, with a file that is missing or cut short (a partial download, a shard the
    index names but the folder lacks) a ValueError naming it rather than a traceback."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"cannot read the weights in {path}: {exc} (a partial download?)") from exc


def load_model(
    folder: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    backend: AttentionBackend,
    max_position: int,
    quantization: str | None = None,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    tensor_parallel=None,
) -> LlamaForCausalLM:
    """`load_format` "auto" reads the folder's safetensors; "dummy" (vLLM's name) gives
    random weights of the config's shape, for timing a shape no checkpoint is at hand for.
    `tensor_parallel`: (this rank's group, the whole model's config) where `config` is one
    rank's slice (parallel/sharding.py)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}: {', '.join(LOAD_FORMATS)}")
    folder = Path(folder)
    if load_format == "dummy":
        # Built where it runs: an 8B-shaped model's initialization takes a GPU milliseconds.
        with torch.device(device):
            model = LlamaForCausalLM(config, backend, max_position)
        dummy_weights(model)
    else:
        with torch.device("cpu"):
            model = LlamaForCausalLM(config, backend, max_position)
        if tensor_parallel is not None:
            group, full = tensor_parallel
            model.shards = Shards(full, group.rank, group.world_size, config.local_experts)
            slice_vocabulary(model, model.shards, group)
        model.load_weights(read_weights(folder, config))
    if tensor_parallel is not None:
        split_sums(model, tensor_parallel[0])  # (before packing: the packed copies take the zeroed biases)
    model = ready_to_run(model, dtype, quantization, device, tensor_parallel)
    # (the one-call C decode layer runs a whole layer: no sum between its products)
    model.fused_decode = FusedDecode.build(model) if tensor_parallel is None else None
    return model


def read_weights(folder: Path, config: ModelConfig, reads: Callable[[str], bool] = language_model_part):
    """The checkpoint's tensors `reads` keeps, widened from FP8 or a quantized format as read."""
    weights = iter_weights(folder, reads)
    if config.fp8_weight_block:  # (DeepSeek-V3's, Qwen3-FP8's: widened as read)
        weights = fp8_widened(weights, config.fp8_weight_block)
    if config.quantized_weights is not None:  # (AWQ's, GPTQ's, compressed-tensors': widened as read, in float32)
        weights = quantized_widened(weights, config.quantized_weights)
    return weights


def ready_to_run(model: LlamaForCausalLM, dtype: torch.dtype, quantization: str | None, device,
                 tensor_parallel=None) -> LlamaForCausalLM:
    """A model whose weights are read, as it runs: quantized, cast, on its device, its
    experts stacked and its products packed for the device's kernels."""
    if quantization is not None:
        # From the checkpoint's own precision, every matmul weight of the decoder layers.
        # The LM head (a fifth of SmolLM2's weights) in int8 either way, whose per-channel
        # scales keep greedy output about as close to float32's as bfloat16 does; never in
        # int4: it decides the token directly, and 4 bits moved it on most prompts. This is
        # how SmolLM2's GGUF comes (Q4_1 layers, which int4 keeps exactly, an 8-bit head).
        # Measured with int4 layers: an int8 head took W0 from 4.9 to 3.7 ms a token, and
        # greedy agreement with float32 went 2/16, 462/1417 -> 3/16, 365/1417 tokens.
        # On a GPU int4 runs on the Triton kernel (kernels/linear_int4.py) and the head stays
        # unquantized (int8 has no GPU kernel here).
        on_gpu = torch.device(device).type == "cuda"
        try:
            quantize(model.model, quantization, dtype, "triton" if on_gpu else None)
        except ValueError as exc:
            if tensor_parallel is None:
                raise
            raise ValueError(f"--tensor-parallel-size {tensor_parallel[0].world_size} with {quantization}: "
                             f"a rank's slice of a product cannot be quantized: {exc}") from None
        if model.generates and not on_gpu:
            head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
            bias = None if model.lm_head is None else model.lm_head.bias  # (Phi's)
            model.lm_head = quantized_linear("int8", head, bias, dtype)
    # Parameters only: the RoPE tables stay float32, as transformers keeps them, and so
    # does a parameter marked `keep_float32` (ERNIE 4.5's router: its class keeps it so).
    for param in model.parameters():
        if not getattr(param, "keep_float32", False):
            param.data = param.data.to(dtype)
    model = model.to(device)
    for module in model.modules():
        if isinstance(module, SparseMoE) and module.fused:
            module.stack_experts()  # for the Triton grouped GEMMs
    if can_pack(dtype, torch.device(device)):
        choices = kernel_choices()
        pack_linears(model, choices)  # what quantization left unquantized (int4: the LM head)
        if model.lm_head is None and model.generates:
            # A packed copy of the tied embedding as the LM head (SmolLM2: 57 MB more in
            # bfloat16, 113 MB in float32): the embedding is read a row per token, the head
            # whole on every step.
            head = model.model.embed_tokens.weight
            model.lm_head = PackedLinear(head, None, rows_from=choices.rows_from(head))
        choices.finish()
        move_to_huge_pages(model)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Weights as transformers initializes a Llama: products and embeddings from
    N(0, 0.02), norms 1, biases 0; the same every time for a seed."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=generator)
        else:
            param.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)  # (a LayerNorm's bias: 0)
