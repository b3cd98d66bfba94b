"""Checkpoints of integer weights with group scales, written by the library that defines
their format where one is at hand: compressed-tensors (vLLM's project, what llm-compressor
writes with) quantizes and packs its own, and converts AutoAWQ's into its own; AutoAWQ's
GEMM layout itself is written here (AutoAWQ no longer installs beside this torch), and the
reference reads it through compressed-tensors' converter, not through this packer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column of each eight that goes to nibble k (AutoAWQ's pack order)


def quantized_tensors(folder: Path):
    """The decoder layers' projection weights, the ones each format quantizes here (the
    embeddings, norms and head kept as they are, as the formats' recipes keep them)."""
    tensors = load_file(str(folder / "model.safetensors"))
    return tensors, [n for n, t in tensors.items() if ".layers." in n and n.endswith("_proj.weight") and t.dim() == 2]


def _with_config(source: Path, dest: Path, tensors: dict, quantization_config: dict) -> Path:
    dest = Path(dest)
    shutil.copytree(source, dest)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _scheme(bits: int, group_size: int | None, symmetric: bool, fmt: str = "pack-quantized", kind: str = "int",
            strategy: str | None = None, block: tuple[int, int] | None = None, dynamic_activations: bool = False):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = strategy or ("group" if group_size else "channel")
    args = QuantizationArgs(num_bits=bits, type=kind, symmetric=symmetric, strategy=strategy,
                            group_size=group_size if strategy == "group" else None,
                            block_structure=list(block) if block else None)
    acts = QuantizationArgs(num_bits=8, type=kind, strategy="token", dynamic=True) if dynamic_activations else None
    return QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts, format=fmt)


def _compressor(fmt: str):
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return PackedQuantizationCompressor if fmt == "pack-quantized" else NaiveQuantizationCompressor


def _value_ranges(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) over each set of weights one scale serves, shaped as compressed-tensors
    keeps that scale."""
    if args.strategy == "tensor":
        return weight.amin().reshape(1), weight.amax().reshape(1)
    if args.strategy == "channel":
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    if args.strategy == "group":
        groups = weight.unflatten(1, (-1, args.group_size))
        return groups.amin(-1), groups.amax(-1)
    rows, columns = args.block_structure  # block: the last row and column of blocks may be partial
    padded = torch.nn.functional.pad(weight, (0, -weight.shape[1] % columns, 0, -weight.shape[0] % rows),
                                     value=float(weight[0, 0]))
    tiles = padded.unflatten(0, (-1, rows)).unflatten(2, (-1, columns))
    return tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))


def ct_checkpoint(source: Path, dest: Path, bits: int = 4, group_size: int | None = 16, symmetric: bool = True,
                  scale_dtype: torch.dtype = torch.bfloat16, fmt: str = "pack-quantized", kind: str = "int",
                  strategy: str | None = None, block: tuple[int, int] | None = None,
                  dynamic_activations: bool = False) -> Path:
    """`source`'s model as a compressed-tensors checkpoint: pack-quantized W{bits}A16 (GPTQ's
    and AWQ's format from llm-compressor) by default, or int8/float8 weights stored as they
    are (`fmt` int-, float-quantized: W8A8, FP8-dynamic, FP8 block), with dynamic input
    activations where `dynamic_activations`; min/max scales per `strategy` (group,
    channel, tensor, block), quantized and packed by compressed-tensors' own compressor,
    the config its own."""
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _scheme(bits, group_size, symmetric, fmt, kind, strategy, block, dynamic_activations)
    tensors, names = quantized_tensors(Path(source))
    for name in names:
        weight = tensors.pop(name).float()
        scale, zero_point = calculate_qparams(*_value_ranges(weight, scheme.weights), scheme.weights)
        state = {"weight": weight.to(scale_dtype), "weight_scale": scale.to(scale_dtype), "weight_zero_point": zero_point}
        for part, tensor in _compressor(fmt).compress(state, scheme).items():
            tensors[name.removesuffix("weight") + part] = tensor
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                                ignore=["lm_head"])
    return _with_config(source, dest, tensors, {**config.model_dump(mode="json"), "quant_method": "compressed-tensors"})


def awq_checkpoint(source: Path, dest: Path, group_size: int = 16, zero_point: bool = True) -> Path:
    """`source`'s model in AutoAWQ's GEMM layout: min/max levels 0..15 with a zero point per
    group of `group_size` inputs (8 where zero_point is false), float16 scales."""
    tensors, names = quantized_tensors(Path(source))
    for name in names:
        weight = tensors.pop(name).float().T  # [in, out]: AWQ keeps the inputs first
        groups = weight.unflatten(0, (-1, group_size))  # [groups, size, out]
        low, high = groups.amin(1).clamp(max=0), groups.amax(1).clamp(min=0)
        if zero_point:
            scales = ((high - low) / 15).clamp(min=1e-6).half()
            zeros = torch.round(-low / scales.float()).clamp(0, 15).int()
        else:
            scales = (torch.maximum(-low, high) / 7).clamp(min=1e-6).half()
            zeros = torch.full_like(scales, 8, dtype=torch.int32)
        levels = torch.round(groups / scales.float()[:, None] + zeros[:, None]).clamp(0, 15).int().flatten(0, 1)
        module = name.removesuffix(".weight")
        tensors[f"{module}.qweight"] = _awq_pack(levels)
        tensors[f"{module}.scales"] = scales
        if zero_point:
            tensors[f"{module}.qzeros"] = _awq_pack(zeros)
    return _with_config(source, dest, tensors, {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                                "zero_point": zero_point, "version": "gemm"})


def _awq_pack(levels: torch.Tensor) -> torch.Tensor:
    """[rows, out] levels 0..15 -> [rows, out / 8] int32, nibble k holding column AWQ_ORDER[k]."""
    eight = levels.unflatten(1, (-1, 8))[..., list(AWQ_ORDER)].to(torch.int64)
    words = (eight << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def dense_reference(folder: Path, dest: Path) -> Path:
    """The reference's reading of an AWQ or pack-quantized folder, as an unquantized folder
    transformers loads: AWQ converted by compressed-tensors' AutoAWQConverter, then every
    layer decompressed by compressed-tensors' own compressor (in float32, as transformers
    decompresses a checkpoint it loads in float32: transformers' own loading of an
    asymmetric pack-quantized folder fails on the packed zero points' shape)."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    from compressed_tensors.quantization import QuantizationScheme

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    quant = config.pop("quantization_config")
    tensors = load_file(str(folder / "model.safetensors"))
    if quant["quant_method"] == "awq":
        tensors = AutoAWQConverter.from_autoawq_config(quant).process(tensors)
        scheme = _scheme(4, quant["group_size"], not quant["zero_point"])
    else:
        scheme = QuantizationScheme.model_validate(quant["config_groups"]["group_0"])
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        module = name.removesuffix(".weight_scale")
        state = {part: tensors.pop(f"{module}.{part}") for part in
                 ("weight_packed", "weight", "weight_scale", "weight_shape", "weight_zero_point")
                 if f"{module}.{part}" in tensors}
        state["weight_scale"] = state["weight_scale"].float()
        tensors[f"{module}.weight"] = _compressor(scheme.format).decompress(state, scheme)["weight"].float().contiguous()
    dest = Path(dest)
    shutil.copytree(folder, dest)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def gptq_checkpoint(ct_folder: Path, dest: Path, zeros_less_one: bool = True, reordered: bool = False) -> Path:
    """A pack-quantized folder (written by compressed-tensors) laid out as GPTQ's: its levels
    unpacked and packed again by compressed-tensors' own helpers along GPTQ's dimensions
    (qweight along the inputs, qzeros along the outputs, each zero point less one where
    `zeros_less_one`: checkpoint_format gptq), float16 scales [groups, out]. `reordered`
    (desc_act): each MLP's intermediate features in a random order, the gate and up rows
    and the down columns alike, so the model computes the same function while down_proj's
    groups are no longer runs of inputs (its g_idx says which group each input is in)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    ct_folder = Path(ct_folder)
    config = json.loads((ct_folder / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    bits, offset = weights["num_bits"], 1 << (weights["num_bits"] - 1)
    tensors = load_file(str(ct_folder / "model.safetensors"))
    layers = {}  # module -> (levels [out, in] unsigned, scales [groups, out], zeros [groups, out] unsigned)
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        shape = tensors.pop(f"{module}.weight_shape")
        scale = tensors.pop(f"{module}.weight_scale")
        levels = unpack_from_int32(tensors.pop(name), bits, shape).int() + offset
        zero_point = tensors.pop(f"{module}.weight_zero_point", None)
        zeros = (torch.full(scale.shape, offset, dtype=torch.int32) if zero_point is None else
                 unpack_from_int32(zero_point, bits, scale.shape, packed_dim=0).int() + offset)
        layers[module] = (levels, scale.half().T.contiguous(), zeros.T.contiguous())
    group_size = int(layers[next(iter(layers))][0].shape[1] // layers[next(iter(layers))][1].shape[0])
    if reordered:
        gen = torch.Generator().manual_seed(0)
        for mlp in sorted({m.rsplit(".", 1)[0] for m in layers if m.endswith(".down_proj")}):
            levels, scales, zeros = layers[f"{mlp}.down_proj"]
            order = torch.randperm(levels.shape[1], generator=gen)
            layers[f"{mlp}.down_proj"] = (levels[:, order], scales, zeros, order // group_size)
            for branch in ("gate_proj", "up_proj"):
                levels, scales, zeros = layers[f"{mlp}.{branch}"]
                layers[f"{mlp}.{branch}"] = (levels[order], scales[:, order], zeros[:, order])
    for module, (levels, scales, zeros, *g_idx) in layers.items():
        stored = zeros - int(zeros_less_one)
        assert int(stored.min()) >= 0, "a zero point of 0 has no v1 form"
        tensors[f"{module}.qweight"] = pack_to_int32((levels - offset).to(torch.int8), bits, packed_dim=1).T.contiguous()
        tensors[f"{module}.qzeros"] = pack_to_int32((stored - offset).to(torch.int8), bits, packed_dim=1)
        tensors[f"{module}.scales"] = scales
        tensors[f"{module}.g_idx"] = (g_idx[0] if g_idx else torch.arange(levels.shape[1]) // group_size).int()
    return _with_config(ct_folder, dest, tensors, {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": reordered,
        "sym": weights["symmetric"], "checkpoint_format": "gptq" if zeros_less_one else "gptq_v2"})
