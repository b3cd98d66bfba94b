"""Checkpoints whose linear weights are stored quantized with scales, widened at load.

The formats vLLM users mostly meet, FP8 with block scales aside (fp8_weights.py):
- AutoAWQ's GEMM layout (`quant_method: awq`, Qwen's `-AWQ` releases and most AWQ repositories):
  per linear `qweight` int32 [in, out / 8], eight 4-bit levels a word in AWQ's interleaved
  order; `qzeros` int32 [in / group, out / 8], the zero points packed alike; `scales`
  [in / group, out]. A weight is (level - zero) * scale (zero 8 where `zero_point` is false).
- GPTQ's own (`quant_method: gptq`, AutoGPTQ's and GPTQModel's: Qwen's `-GPTQ-Int4/Int8`):
  per linear `qweight` int32 [in * bits / 32, out], packed along the inputs from the lowest
  bits up; `qzeros` int32 [groups, out * bits / 32]; `scales` [groups, out]; `g_idx` [in], each
  input's group (in order but where `desc_act` reordered them). A weight is (level - zero) *
  scale of its input's group; `checkpoint_format: gptq` (v1, the default) stores each zero
  point less one.
- compressed-tensors' (`quant_method: compressed-tensors`, what llm-compressor writes and
  vLLM's own recipes publish). pack-quantized (W4A16, W8A16: its GPTQ and AWQ recipes): per
  linear `weight_packed` int32 [out, in * bits / 32], levels offset by 2^(bits-1) packed from
  the lowest bits up; `weight_scale` [out, in / group] (a channel's one column);
  `weight_zero_point` int32 [out * bits / 32, in / group] where asymmetric; `weight_shape`.
  float-, int- and naive-quantized (FP8-dynamic, FP8 block, W8A8 INT8): `weight` itself
  float8_e4m3fn or int8, with `weight_scale` per tensor, channel, group or block. A weight is
  (level - zero) * scale, the levels and zero points signed.

Each weight is widened here in float32, where (level - zero) * scale is exact (a level
difference has at most 9 bits, a float16 or bfloat16 scale at most 11), and the loader casts
it to the model's dtype: one rounding, the same value as dequantizing in the scale's own
dtype as compressed-tensors and AutoAWQ do. In bfloat16 a 4-bit checkpoint is then served
at 4 bits (model_runner.py: its `--quantization int4`), whose int4_grid finds the
checkpoint's levels again in every group of 32 inputs (layers/quantized_linear.py).

A scheme that also quantizes activations as they come (W8A8's dynamic input_activations) is
read for its weights, and its activations computed unquantized, as the FP8 block
checkpoints' are: not the bits of vLLM's FP8 or INT8 GEMMs, a rounding less. Static
activation scales, output activations, AWQ's and GPTQ's other layouts and compressed-tensors'
reordered groups (`weight_g_idx`, which its own library no longer reads) are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from services.worker.models.checkpoints.fp8_weights import widen_fp8

QUANTIZED_WEIGHT_METHODS = ("awq", "compressed-tensors", "gptq")
# Where AWQ puts output column c of each eight in a packed word: at nibble AWQ_NIBBLE[c].
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)
# A quantized linear's tensors, by the suffix that follows its module's name.
AWQ_PARTS = ("qweight", "qzeros", "scales")
CT_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
CT_STORED_PARTS = ("weight", "weight_scale", "weight_zero_point")
STORED_DTYPES = (torch.int8, torch.float8_e4m3fn)  # a quantized layer's `weight` (a plain one's is a float's)


@dataclass(frozen=True)
class QuantizedWeights:
    method: str  # "awq" | "compressed-tensors" | "gptq"
    bits: int  # 4 (AWQ, W4A16, GPTQ's Int4) or 8 (W8A16, GPTQ's Int8)
    zero_points: bool  # a zero point a group stored beside each scale
    # GPTQ: groups reordered (desc_act: each input's group read from g_idx, no longer a run
    # of inputs); zero points stored less one (checkpoint_format gptq, v1)
    reordered: bool = False
    zeros_less_one: bool = False
    # compressed-tensors: levels packed in int32 words (pack-quantized), or one int8 or float8
    # a weight stored as `weight` (int-, float-, naive-quantized); the block of scales
    # ([rows, columns]) where the strategy is block, () otherwise
    packed: bool = True
    block: tuple[int, ...] = ()
    # Integer levels with one scale an output channel in every quantized layer (compressed-
    # tensors' channel strategy of int weights): the grid llmbus's int8 layers keep
    int_per_channel: bool = False

    @property
    def parts(self) -> tuple[str, ...]:
        return {"awq": AWQ_PARTS, "gptq": GPTQ_PARTS}.get(self.method, CT_PARTS if self.packed else CT_STORED_PARTS)

    @property
    def needed(self) -> frozenset[str]:
        """The parts a quantized linear has in full (its tensors may come in any order)."""
        if self.method == "awq":
            return frozenset({"qweight", "scales", *(("qzeros",) if self.zero_points else ())})
        if self.method == "gptq":  # (g_idx, where in order, is each input's index over the group size)
            return frozenset({"qweight", "qzeros", "scales", *(("g_idx",) if self.reordered else ())})
        return frozenset({"weight_packed" if self.packed else "weight", "weight_scale",
                          *(("weight_shape",) if self.packed else ()),
                          *(("weight_zero_point",) if self.zero_points else ())})


def quantized_weight_format(raw_config: dict) -> QuantizedWeights | None:
    """The format of an AWQ, GPTQ or compressed-tensors checkpoint (None: neither; FP8 with
    block scales and gpt-oss's mxfp4 have readers of their own); what of them cannot be
    read, and any other quantization, refused by name."""
    quant = raw_config.get("quantization_config") or {}
    method = quant.get("quant_method")
    if not quant or method == "fp8" or (method == "mxfp4" and "GptOssForCausalLM" in
                                        (raw_config.get("architectures") or [])):
        return None  # (fp8_weights.py, gpt_oss_weights.py)
    if method not in QUANTIZED_WEIGHT_METHODS:
        raise ValueError(f"unsupported quantization_config quant_method {method!r}: llmbus reads unquantized "
                         "checkpoints, FP8 ones with block scales (fp8), AWQ's (awq), GPTQ's (gptq), "
                         "compressed-tensors' (compressed-tensors) and gpt-oss's mxfp4 (for its own int8/int4: "
                         "--quantization)")
    if method == "awq":
        return _awq_format(quant)
    if method == "compressed-tensors":
        return _compressed_tensors_format(quant)
    return _gptq_format(quant)


def _gptq_format(quant: dict) -> QuantizedWeights:
    bits = quant.get("bits")
    if bits not in (4, 8):
        raise ValueError(f"unsupported GPTQ bits {bits}: 4 or 8")
    layout = quant.get("checkpoint_format") or quant.get("format") or "gptq"
    if layout not in ("gptq", "gptq_v2"):
        raise ValueError(f"unsupported GPTQ checkpoint_format {layout!r}: gptq or gptq_v2 (qweight packed along "
                         "the inputs)")
    if quant.get("dynamic"):
        raise ValueError("unsupported GPTQ dynamic (per-module bits and group sizes): one scheme for every layer")
    return QuantizedWeights("gptq", bits, True, reordered=bool(quant.get("desc_act")), zeros_less_one=layout == "gptq")


def _awq_format(quant: dict) -> QuantizedWeights:
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"unsupported AWQ version {version!r}: the GEMM layout only (qweight [in, out / 8])")
    bits = quant.get("bits", quant.get("w_bit", 4))
    if bits != 4:
        raise ValueError(f"unsupported AWQ bits {bits}: 4 only")
    return QuantizedWeights("awq", 4, bool(quant.get("zero_point", True)))


# compressed-tensors' formats read: the levels packed in int32 words, or the weight stored as
# they are, one int8 or float8 a weight (int-, float- and naive-quantized differ in name only)
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


def _compressed_tensors_format(quant: dict) -> QuantizedWeights:
    groups = list((quant.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("compressed-tensors checkpoint without config_groups: nothing says how its weights are stored")
    if quant.get("sparsity_config"):
        raise ValueError("unsupported compressed-tensors sparsity_config: dense weights only")
    if quant.get("transform_config"):
        raise ValueError("unsupported compressed-tensors transform_config (rotations): plain quantized weights only")
    if quant.get("kv_cache_scheme"):
        raise ValueError("unsupported compressed-tensors kv_cache_scheme: llmbus keeps its own cache dtype "
                         "(--kv-cache-dtype)")
    schemes, per_channel_int = set(), True
    for group in groups:
        fmt = group.get("format") or quant.get("format")
        if fmt not in CT_FORMATS:
            raise ValueError(f"unsupported compressed-tensors format {fmt!r}: {', '.join(CT_FORMATS)}")
        if group.get("output_activations"):
            raise ValueError("unsupported compressed-tensors output_activations quantization")
        acts = group.get("input_activations")
        if acts and not acts.get("dynamic"):
            raise ValueError("unsupported compressed-tensors static input_activations (input_scale): dynamic ones only, "
                             "computed unquantized")
        weights = group.get("weights") or {}
        kind, bits, strategy = weights.get("type", "int"), weights.get("num_bits"), weights.get("strategy")
        packed = fmt == "pack-quantized"
        if (kind, bits) not in ((("int", 4), ("int", 8)) if packed else (("int", 8), ("float", 8))):
            raise ValueError(f"unsupported compressed-tensors {fmt} weights {kind} {bits} bits: "
                             + ("int 4 or 8" if packed else "int 8 or float 8 (FP8 e4m3)"))
        if strategy not in (("group", "channel") if packed else ("group", "channel", "tensor", "block")):
            raise ValueError(f"unsupported compressed-tensors {fmt} weight strategy {strategy!r}")
        if weights.get("actorder") in ("group", "dynamic"):
            raise ValueError(f"unsupported compressed-tensors actorder {weights['actorder']!r} (weight_g_idx): "
                             "groups in order only (actorder weight/static or none)")
        block = tuple(weights.get("block_structure") or ()) if strategy == "block" else ()
        if strategy == "block" and (len(block) != 2 or min(block) < 1 or not weights.get("symmetric", True)):
            raise ValueError(f"unsupported compressed-tensors block_structure {block!r}: two sizes, symmetric")
        schemes.add((packed, bits, not weights.get("symmetric", True), block))
        per_channel_int = per_channel_int and kind == "int" and strategy == "channel"
    if len(schemes) > 1:
        raise ValueError(f"unsupported compressed-tensors checkpoint mixing weight schemes {sorted(schemes)}: one "
                         "format, number of bits, symmetry and block for every quantized layer")
    (packed, bits, zero_points, block), = schemes
    return QuantizedWeights("compressed-tensors", bits, zero_points, packed=packed, block=block,
                            int_per_channel=per_channel_int)


def _levels(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [rows, words] -> their unsigned levels [rows, words * 32 / bits], the lowest
    bits first (both formats pack from the lowest bits up; AWQ then reorders its eight)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, not {packed.dtype}")
    words = packed.contiguous()
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


def _scaled(levels: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None = None,
            group: torch.Tensor | None = None) -> torch.Tensor:
    """(levels [out, in] - zeros) * scale, float32 [out, in]: the zero points and scales
    [out or 1, groups] of each input's group, group[j] (None: the inputs in runs of in /
    groups)."""
    in_features, groups = levels.shape[1], scale.shape[1]
    if in_features % groups:
        raise ValueError(f"{groups} groups of scales do not split {in_features} inputs")
    if group is None:
        group = torch.arange(in_features) // (in_features // groups)
    elif group.shape != (in_features,) or int(group.min()) < 0 or int(group.max()) >= groups:
        raise ValueError(f"g_idx does not give each of {in_features} inputs one of {groups} groups")
    shifted = levels.float() if zeros is None else levels.float() - zeros.float()[:, group]
    return shifted * scale.float()[:, group]


def widen_awq(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None) -> torch.Tensor:
    """AutoAWQ GEMM's qweight [in, out / 8], scales [groups, out], qzeros [groups, out / 8]
    -> the weight [out, in], float32."""
    order = torch.tensor(AWQ_NIBBLE)

    def unpack(words: torch.Tensor) -> torch.Tensor:  # -> [rows, out], columns in order
        return _levels(words, 4).unflatten(-1, (-1, 8))[..., order].flatten(-2)

    levels = unpack(qweight)  # [in, out]
    zeros = unpack(qzeros) if qzeros is not None else torch.full_like(scales, 8, dtype=torch.int32)
    if scales.shape[1] != levels.shape[1] or zeros.shape != scales.shape:
        raise ValueError(f"AWQ scales {tuple(scales.shape)} and qzeros do not fit qweight {tuple(qweight.shape)}")
    return _scaled(levels.T, scales.T, zeros.T)


def widen_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               bits: int, zeros_less_one: bool) -> torch.Tensor:
    """GPTQ's qweight [in * bits / 32, out], qzeros [groups, out * bits / 32], scales
    [groups, out], g_idx [in] (None: the inputs' groups in order) -> the weight [out, in],
    float32."""
    levels = _levels(qweight.T, bits)  # [out, in]
    zeros = _levels(qzeros, bits)[:, : levels.shape[0]] + int(zeros_less_one)  # [groups, out]
    if scales.shape[1] != levels.shape[0] or zeros.shape != scales.shape:
        raise ValueError(f"GPTQ qzeros {tuple(qzeros.shape)} and scales {tuple(scales.shape)} do not fit qweight "
                         f"{tuple(qweight.shape)}")
    return _scaled(levels, scales.T, zeros.T, None if g_idx is None else g_idx.long())


def widen_pack_quantized(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, bits: int,
                         zero_point: torch.Tensor | None) -> torch.Tensor:
    """compressed-tensors' weight_packed [out, in * bits / 32], weight_scale [out, groups],
    weight_shape [out, in], weight_zero_point [out * bits / 32, groups] -> the weight
    [out, in], float32."""
    out_features, in_features = (int(v) for v in shape.tolist())
    offset = 1 << (bits - 1)
    levels = _levels(packed, bits)[:, :in_features] - offset  # [out, in], signed
    scale = scale.reshape(out_features, -1)
    if levels.shape[0] != out_features:
        raise ValueError(f"weight_packed {tuple(packed.shape)} does not hold a weight of {(out_features, in_features)}")
    zeros = None
    if zero_point is not None:
        zeros = _levels(zero_point.T, bits)[:, :out_features].T - offset  # packed along the outputs
        if zeros.shape != scale.shape:
            raise ValueError(f"weight_zero_point {tuple(zero_point.shape)} does not fit weight_scale "
                             f"{tuple(scale.shape)}")
    return _scaled(levels, scale, zeros)


def widen_stored(weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                 block: tuple[int, ...]) -> torch.Tensor:
    """compressed-tensors' int8 or float8 weight [out, in] with weight_scale (and
    weight_zero_point) by tensor ([1]), channel ([out, 1]), group ([out, groups]) or block
    ([ceil(out / rows), ceil(in / columns)]) -> the weight [out, in], float32."""
    if block:
        return widen_fp8(weight, scale, (block[0], block[1]))
    rows = weight.shape[0] if scale.numel() > 1 else 1  # (per tensor: one scale for every row)
    if scale.numel() > 1 and scale.shape[0] != rows:
        raise ValueError(f"weight_scale {tuple(scale.shape)} does not fit a weight of {tuple(weight.shape)}")
    scale = scale.reshape(rows, -1)
    return _scaled(weight, scale, None if zero_point is None else zero_point.reshape(scale.shape))


def quantized_widened(weights: Iterable[tuple[str, torch.Tensor]], fmt: QuantizedWeights) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized linear's parts (come in any order)
    widened into its `.weight`; the rest as they are."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}  # a module's name -> its parts read so far
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if part not in fmt.parts or (part == "weight" and tensor.dtype not in STORED_DTYPES):
            yield name, tensor
            continue
        if part == "g_idx" and not fmt.reordered:
            continue  # (each input's index over the group size: nothing to read)
        if part == "weight_g_idx":
            raise ValueError(f"{name}: activation reordering (weight_g_idx) is not supported")
        parts = waiting.setdefault(module, {})
        parts[part] = tensor
        if not fmt.needed <= parts.keys():
            continue
        del waiting[module]
        try:
            if fmt.method == "awq":
                weight = widen_awq(parts["qweight"], parts["scales"], parts.get("qzeros"))
            elif fmt.method == "gptq":
                weight = widen_gptq(parts["qweight"], parts["qzeros"], parts["scales"],
                                    parts.get("g_idx") if fmt.reordered else None, fmt.bits, fmt.zeros_less_one)
            elif fmt.packed:
                weight = widen_pack_quantized(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"],
                                              fmt.bits, parts.get("weight_zero_point"))
            else:
                weight = widen_stored(parts["weight"], parts["weight_scale"], parts.get("weight_zero_point"), fmt.block)
        except ValueError as exc:
            raise ValueError(f"{module}: {exc}") from None
        yield f"{module}.weight", weight
    if waiting:
        lone = sorted(f"{module} (has {', '.join(sorted(parts))})" for module, parts in waiting.items())
        raise ValueError(f"{fmt.method} checkpoint with quantized layers incomplete: {'; '.join(lone[:3])}; each "
                         f"needs {', '.join(sorted(fmt.needed))}")
