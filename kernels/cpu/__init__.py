"""CPU kernels for the model step: where eager PyTorch left the most time on the table.

- `linear`: a bfloat16 or float32 matrix product over weights packed once at load
  (`pack_weight`), streaming the weights at close to memory speed for decode-sized batches
  (kernels/cpu/linear.cpp).
- `linear_int4`, `linear_int8`: the same for 4-bit weights (a step and a low per group of
  32 inputs, `pack_int4`) or int8 weights (a scale per output, `pack_int8`) and bfloat16
  activations (kernels/cpu/linear_int4.cpp, linear_int8.cpp).
- `paged_decode_attention`: attention of one query token per sequence, reading keys and
  values in place from the paged cache (kernels/cpu/paged_decode_attention.cpp).
- `write_kv`: new keys and values into their cache slots; with an 8-bit float cache
  (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`) converted as PyTorch converts (kernels/cpu/fp8.h).
  Both attention kernels read such a cache too, for queries of either dtype.
- `paged_prefill_attention`: causal attention of one request's new tokens over its paged
  cache, flash-attention style (kernels/cpu/paged_prefill_attention.cpp).
- `add_rms_norm`, `rotary`, `act_and_mul`: the elementwise steps between the products, one
  pass each, with the roundings of the PyTorch ops they replace (kernels/cpu/elementwise.cpp).
- `decoder_layer`: all of the above for one Llama-family layer (Qwen3's and Gemma's
  additions included) of a decode-only step in one call (kernels/cpu/decoder_layer.cpp),
  described by `LayerSpec` and `StepSpec`.

Each takes bfloat16 or float32 (one C++ template, an entry point per dtype). They need
x86-64 with AVX-512 BF16 and a C++ compiler at run time; `available()` says whether they
loaded, `unavailable_reason()` why not, and every caller keeps a PyTorch path. They sum in
another order than PyTorch's kernels, so float32 results move in their last bits; float32
greedy output stays token-identical to transformers (the oracle tests and `llmbus bench
agreement`'s prompts).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from kernels.cpu.build import build_library

log = logging.getLogger("llmbus.kernels")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class LayerSpec(ctypes.Structure):
    """Mirror of LlmbusLayer in decoder_layer.cpp (every field 8 bytes: no padding)."""

    _fields_ = [(name, _I) for name in (
        "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "block_size")] + [
        ("eps", ctypes.c_double), ("scale", ctypes.c_double)] + [(name, _P) for name in (
        "input_norm", "post_norm", "qkv", "o", "gate_up", "down", "qkv_bias", "o_bias", "k_cache", "v_cache")] + [
        (name, _I) for name in ("block_stride", "slot_stride", "head_stride")] + [
        ("cos_table", _P), ("sin_table", _P), ("weight_format", _I), ("kv_format", _I), ("window", _I)] + [
        (name, _P) for name in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")] + [
        ("activation", _I), ("softcap", ctypes.c_double), ("rotary_dim", _I), ("qk_norm_over_heads", _I)]


class StepSpec(ctypes.Structure):
    """Mirror of LlmbusStep in decoder_layer.cpp."""

    _fields_ = [(name, _I) for name in ("rows", "table_stride", "threads")] + [(name, _P) for name in (
        "positions", "slots", "block_table", "seq_lens", "normed", "qkv", "attn", "gate_up", "act")]


# The dtypes the kernels take, by the suffix of their C entry points.
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# 8-bit float KV caches, by the format code the kernels take (kernels/cpu/fp8.h); 0 is a
# cache of the activations' own dtype.
FP8_KV_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def kv_format(activation_dtype: torch.dtype, cache_dtype: torch.dtype) -> int | None:
    """The kernels' code for a cache of `cache_dtype` beside activations of `activation_dtype`,
    or None where they take no such pair."""
    if activation_dtype not in _SUFFIX:
        return None
    return 0 if cache_dtype == activation_dtype else FP8_KV_FORMATS.get(cache_dtype)

_C = ctypes.c_int
_SIGNATURES = {  # each entry point exists as llmbus_<name>_bf16 and llmbus_<name>_f32
    "packed_numel": ([_I, _I], _I),
    "pack": ([_P, _I, _I, _P], None),
    "linear": ([_P, _I, _I, _I, _P, _I, _P, _P, _I, _C], None),
    "paged_decode_attention": ([_P, _I, _I, _P, _P, _I, _I, _I, _P, _I, _P, _I, _I, _I, _I, _I, _F, _P, _I, _I, _C, _I,
                                _I, _F], _C),
    "paged_prefill_attention": ([_P, _I, _I, _P, _P, _I, _I, _I, _P, _I, _I, _I, _I, _I, _I, _F, _P, _I, _I, _C, _I,
                                 _I, _F], _C),
    "write_kv": ([_P, _P, _I, _P, _I, _I, _I, _P, _P, _I, _I, _I, _I, _I], _C),
    "add_rms_norm": ([_P, _P, _P, _F, _P, _I, _I, _C], None),
    "rotary": ([_P, _I, _I, _I, _I, _I, _P, _P, _P, _C], None),
    "act_and_mul": ([_P, _P, _I, _I, _I, _C], None),
    "decoder_layer": ([ctypes.POINTER(LayerSpec), ctypes.POINTER(StepSpec), _P, _P, _I], _C),
}
_INT_SIGNATURES = {  # one of each: int4 and int8 weights take bfloat16 activations only
    "int8_packed_bytes": ([_I, _I], _I),
    "int8_expand_rows": ([], _I),
    "pack_int8": ([_P, _P, _I, _I, _P], None),
    "linear_int8_bf16": ([_P, _I, _I, _I, _P, _I, _P, _P, _I, _C], None),
    "int4_packed_bytes": ([_I, _I], _I),
    "int4_expand_rows": ([], _I),
    "pack_int4": ([_P, _P, _P, _I, _I, _P], None),
    "linear_int4_bf16": ([_P, _I, _I, _I, _P, _I, _P, _P, _I, _C], None),
}
INT4_GROUP_SIZE = 32  # inputs per step and low, fixed by the kernel


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    lib, reason = build_library()
    if lib is None:
        log.warning("CPU kernels unavailable, using PyTorch ops", extra={"reason": reason})
        return None, reason
    for suffix in _SUFFIX.values():
        for name, (argtypes, restype) in _SIGNATURES.items():
            entry = getattr(lib, f"llmbus_{name}_{suffix}")
            entry.argtypes, entry.restype = argtypes, restype
    for name, (argtypes, restype) in _INT_SIGNATURES.items():
        entry = getattr(lib, f"llmbus_{name}")
        entry.argtypes, entry.restype = argtypes, restype
    return lib, ""


def available() -> bool:
    return _library()[0] is not None


def unavailable_reason() -> str:
    return _library()[1]


def _lib() -> ctypes.CDLL:
    lib, reason = _library()
    if lib is None:
        raise RuntimeError(f"CPU kernels unavailable: {reason}")
    return lib


def _entry(name: str, dtype: torch.dtype):
    """The C entry point `llmbus_<name>_<bf16|f32>` for tensors of `dtype`."""
    return getattr(_lib(), f"llmbus_{name}_{_SUFFIX[dtype]}")


def _packed_numel(dtype: torch.dtype, out_features: int, in_features: int) -> int:
    return _entry("packed_numel", dtype)(out_features, in_features)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bfloat16 (in even) or float32 weight -> the flat packed form `linear` reads."""
    out_features, in_features = weight.shape
    if weight.dtype not in _SUFFIX or (weight.dtype == torch.bfloat16 and in_features % 2):
        raise ValueError(f"pack_weight takes a float32 or bfloat16 [out, in] weight (in even for bfloat16); "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    weight = weight.detach().contiguous()
    packed = torch.empty(_packed_numel(weight.dtype, out_features, in_features), dtype=weight.dtype)
    _entry("pack", weight.dtype)(weight.data_ptr(), out_features, in_features, packed.data_ptr())
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W.T (+ bias, float32) -> [..., out], x and the packed W of one dtype."""
    in_features = x.shape[-1]
    # A wrong pointer here reads or writes out of bounds, so check what ctypes cannot.
    if (x.dtype not in _SUFFIX or packed.dtype != x.dtype
            or packed.numel() != _packed_numel(x.dtype, out_features, in_features)):
        raise ValueError(f"linear: x {x.dtype} [..., {in_features}] does not fit a packed "
                         f"{packed.dtype} [{out_features}, ?] weight")
    return _product("linear", _entry("linear", x.dtype), x, packed, out_features, bias)


def pack_int4(levels: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """levels [out, in] (0..15), step and low [out, in / 32] -> the flat uint8 form
    `linear_int4` reads (weight = levels * step + low; step and low kept as float16)."""
    out_features, in_features = levels.shape
    groups = in_features // INT4_GROUP_SIZE
    if in_features % INT4_GROUP_SIZE or step.shape != (out_features, groups) or low.shape != step.shape:
        raise ValueError(f"pack_int4: levels [{out_features}, {in_features}] need in % {INT4_GROUP_SIZE} == 0 "
                         f"and step, low [{out_features}, {groups}]; got {tuple(step.shape)}, {tuple(low.shape)}")
    if levels.min() < 0 or levels.max() > 15:
        raise ValueError("pack_int4: levels must lie in 0..15")
    levels = levels.to(torch.uint8).contiguous()
    step, low = step.float().contiguous(), low.float().contiguous()
    packed = torch.empty(_lib().llmbus_int4_packed_bytes(out_features, in_features), dtype=torch.uint8)
    _lib().llmbus_pack_int4(levels.data_ptr(), step.data_ptr(), low.data_ptr(), out_features, in_features,
                            packed.data_ptr())
    return packed


def pack_int8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight [out, in] int8 (in even), scale [out] -> the flat int8 form `linear_int8` reads
    (weight * scale per output; the scales ride at the end of the buffer as float32)."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.int8 or in_features % 2 or scale.shape != (out_features,):
        raise ValueError(f"pack_int8 takes an int8 [out, in] weight (in even) and [out] scales; "
                         f"got {weight.dtype} {tuple(weight.shape)}, {tuple(scale.shape)}")
    weight, scale = weight.contiguous(), scale.float().contiguous()
    packed = torch.empty(_lib().llmbus_int8_packed_bytes(out_features, in_features), dtype=torch.int8)
    _lib().llmbus_pack_int8(weight.data_ptr(), scale.data_ptr(), out_features, in_features, packed.data_ptr())
    return packed


def linear_int8(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] bfloat16 @ (W * scale).T (+ bias, float32) -> [..., out] bfloat16, W packed
    by `pack_int8`."""
    in_features = x.shape[-1]
    if (x.dtype != torch.bfloat16 or packed.dtype != torch.int8 or in_features % 2
            or packed.numel() != _lib().llmbus_int8_packed_bytes(out_features, in_features)):
        raise ValueError(f"linear_int8: x {x.dtype} [..., {in_features}] does not fit a packed int8 "
                         f"[{out_features}, ?] weight (x must be bfloat16)")
    return _product("linear_int8", _lib().llmbus_linear_int8_bf16, x, packed, out_features, bias)


def int8_expand_rows() -> int:
    """Rows from which `linear_int8` expands each block of weights to bfloat16 (level *
    scale, rounded once) and runs `linear`'s bfloat16 product on it."""
    return _lib().llmbus_int8_expand_rows()


def int4_expand_rows() -> int:
    """Rows from which `linear_int4` expands each block of weights to bfloat16 (level * step
    + low, rounded once) and runs `linear`'s bfloat16 product on it."""
    return _lib().llmbus_int4_expand_rows()


def linear_int4(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] bfloat16 @ W.T (+ bias, float32) -> [..., out] bfloat16, W packed by
    `pack_int4`: per group sums on the 4-bit levels for few rows, the bfloat16 product on
    the expanded weights from `int4_expand_rows()` rows on."""
    in_features = x.shape[-1]
    if (x.dtype != torch.bfloat16 or packed.dtype != torch.uint8 or in_features % INT4_GROUP_SIZE
            or packed.numel() != _lib().llmbus_int4_packed_bytes(out_features, in_features)):
        raise ValueError(f"linear_int4: x {x.dtype} [..., {in_features}] does not fit a packed int4 "
                         f"[{out_features}, ?] weight (x must be bfloat16)")
    return _product("linear_int4", _lib().llmbus_linear_int4_bf16, x, packed, out_features, bias)


def _product(name: str, entry, x: torch.Tensor, packed: torch.Tensor, out_features: int,
             bias: torch.Tensor | None) -> torch.Tensor:
    """The call the products share (`linear`, `linear_int4`, `linear_int8`), once the caller
    has checked that x fits its packed weight: y [..., out] of x's dtype."""
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != out_features or not bias.is_contiguous()):
        raise ValueError(f"{name}: bias must be contiguous float32 [out_features]")
    in_features = x.shape[-1]
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty(rows, out_features, dtype=x.dtype)
    entry(
        x2.data_ptr(), rows, in_features, x2.stride(0), packed.data_ptr(), out_features,
        None if bias is None else bias.data_ptr(), y.data_ptr(), out_features, torch.get_num_threads(),
    )
    return y.view(*x.shape[:-1], out_features)


def attention_supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether both attention kernels (decode and prefill) take this query and cache."""
    head_dim = query.shape[-1]
    return (
        kv_format(query.dtype, kv_cache.dtype) is not None and query.device.type == "cpu"
        and head_dim in (64, 128, 256) and kv_cache.stride(-1) == 1 and query.stride(-1) == 1
        and query.shape[1] % kv_cache.shape[3] == 0 and query.shape[1] // kv_cache.shape[3] <= 64 and available()
    )


def _attention_entry(kernel: str, query: torch.Tensor, kv_cache: torch.Tensor):
    """The C entry point for this query and cache and the cache's format code, after the
    checks ctypes cannot make."""
    code = kv_format(query.dtype, kv_cache.dtype)
    if code is None:
        raise ValueError(f"{kernel} takes a bfloat16 or float32 query and a cache of the same dtype or of "
                         f"float8 (e4m3fn, e5m2), got {query.dtype} and {kv_cache.dtype}")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError(f"{kernel} needs head_dim contiguous in query and cache")
    return _entry(kernel, query.dtype), code


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim] bfloat16 or float32, one token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], any layout, head_dim contiguous
    block_table: torch.Tensor,  # [>= num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= num_seqs] int32: tokens to attend over, the new one included
    scale: float,
    window: int = 0,  # > 0: only the last `window` of them (a sliding window)
    softcap: float | None = None,  # scores become softcap * tanh(score / softcap) (Gemma 2)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    entry, code = _attention_entry("paged_decode_attention", query, kv_cache)
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_table and seq_lens must be int32")
    block_table, seq_lens = block_table.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(query)
    k, v = kv_cache[0], kv_cache[1]
    status = entry(
        query.data_ptr(), query.stride(0), query.stride(1), k.data_ptr(), v.data_ptr(),
        k.stride(0), k.stride(1), k.stride(2), block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, out.data_ptr(), out.stride(0), out.stride(1),
        torch.get_num_threads(), code, window, softcap or 0.0,
    )
    if status == -1:
        raise ValueError(f"paged_decode_attention: head_dim {head_dim} has no compiled variant")
    if status != 0:
        raise ValueError(f"paged_decode_attention: {num_heads} query heads over {num_kv_heads} KV heads")
    return out


def paged_prefill_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim] bfloat16 or float32: one request's new tokens
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    blocks: torch.Tensor,  # [>= ceil(seq_len / block_size)] int32: the request's block table row
    seq_len: int,  # cached + new tokens; the new ones are the last query_len
    scale: float,
    window: int = 0,  # > 0: each token sees its last `window` positions only
    softcap: float | None = None,  # scores become softcap * tanh(score / softcap) (Gemma 2)
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    query_len, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    entry, code = _attention_entry("paged_prefill_attention", query, kv_cache)
    if blocks.dtype != torch.int32 or not blocks.is_contiguous() or blocks.numel() * block_size < seq_len:
        raise ValueError(f"paged_prefill_attention needs a contiguous int32 block row covering {seq_len} tokens")
    out = torch.empty_like(query)
    k, v = kv_cache[0], kv_cache[1]
    status = entry(
        query.data_ptr(), query.stride(0), query.stride(1), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
        k.stride(2), blocks.data_ptr(), query_len, seq_len, num_heads, num_kv_heads, head_dim, block_size, scale,
        out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads(), code, window, softcap or 0.0,
    )
    if status == -1:
        raise ValueError(f"paged_prefill_attention: head_dim {head_dim} has no compiled variant")
    if status != 0:
        raise ValueError(f"paged_prefill_attention: {query_len} new of {seq_len} tokens, "
                         f"{num_heads} heads over {num_kv_heads}")
    return out


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], bfloat16 or float32
    value: torch.Tensor,  # as key
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks a padded token
) -> None:
    """key and value into their slots, converted to the cache's dtype (float8: rounded to
    nearest even, saturating at the format's largest finite value)."""
    code = kv_format(key.dtype, kv_cache.dtype)
    if code is None or value.dtype != key.dtype or key.shape != value.shape:
        raise ValueError(f"write_kv: key and value of one dtype and shape into a cache of it or of float8; "
                         f"got {key.dtype} {tuple(key.shape)}, {value.dtype}, cache {kv_cache.dtype}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if kv_cache.shape[3:] != (num_kv_heads, head_dim) or kv_cache.stride(-1) != 1:
        raise ValueError(f"write_kv: cache {tuple(kv_cache.shape)} does not hold [{num_kv_heads}, {head_dim}] "
                         f"heads with head_dim contiguous")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError("write_kv: slot_mapping must be int64, one slot per token")
    if num_tokens and int(slot_mapping.max()) >= kv_cache.shape[1] * kv_cache.shape[2]:
        raise ValueError("write_kv: a slot lies past the cache")
    # The kernel takes heads adjacent within a row and one row stride for both.
    if key.stride()[1:] != (head_dim, 1) or value.stride() != key.stride():
        key, value = key.contiguous(), value.contiguous()
    slots = slot_mapping.contiguous()
    k, v = kv_cache[0], kv_cache[1]
    _entry("write_kv", key.dtype)(
        key.data_ptr(), value.data_ptr(), key.stride(0), slots.data_ptr(), num_tokens, num_kv_heads, head_dim,
        k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2), kv_cache.shape[2], code,
    )


def supports(x: torch.Tensor) -> bool:
    """Whether the elementwise kernels take this activation tensor (bfloat16 or float32 on the CPU)."""
    return x.dtype in _SUFFIX and x.device.type == "cpu" and available()


def _rows(x: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    if x.dtype not in _SUFFIX or (dtype is not None and x.dtype != dtype) or not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous bfloat16 or float32 (as the activations), "
                         f"got {x.dtype} with strides {x.stride()}")
    return x


def check_norm_args(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, dtypes=None) -> None:
    """What an add-RMSNorm kernel (this one, kernels/elementwise.py's) takes: contiguous
    rows, the weight and residual in x's dtype; a ValueError naming what is wrong otherwise."""
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is None:
            continue
        if (dtypes is not None and t.dtype not in dtypes) or t.dtype != x.dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {'bfloat16 or float32 ' if dtypes else ''}(as the "
                             f"activations), got {t.dtype} with strides {t.stride()}")
    if weight.numel() != x.shape[-1]:
        raise ValueError(f"RMSNorm weight has {weight.numel()} elements for rows of {x.shape[-1]}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")


def add_rms_norm(
    x: torch.Tensor,  # [rows, hidden]
    residual: torch.Tensor | None,  # [rows, hidden], updated in place to residual + x
    weight: torch.Tensor,  # [hidden], x's dtype
    eps: float,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x), or with a residual (x + residual -> residual): (RMSNorm(residual), residual)."""
    check_norm_args(x, residual, weight, _SUFFIX)
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    _entry("add_rms_norm", x.dtype)(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), eps, out.data_ptr(),
        x.numel() // max(hidden, 1), hidden, torch.get_num_threads(),
    )
    return out if residual is None else (out, residual)


def check_rotary_args(x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                      sin_table: torch.Tensor, dtypes=None, partial: bool = False) -> None:
    """What a rotary kernel (this one, kernels/elementwise.py's) takes; a ValueError naming
    what is wrong otherwise. With `partial`, tables narrower than a head (an even width):
    its leading dims rotate."""
    rows, heads, head_dim = x.shape
    if (dtypes is not None and x.dtype not in dtypes) or x.stride(2) != 1 or x.stride(1) != head_dim or head_dim % 2:
        raise ValueError(f"rotary takes {'' if dtypes is None else 'bfloat16 or float32 '}[rows, heads, head_dim] "
                         f"with contiguous heads, got {x.dtype} {x.stride()}")
    if positions.dtype != torch.int64 or not positions.is_contiguous() or positions.numel() != rows:
        raise ValueError("rotary: positions must be contiguous int64, one per row")
    width = cos_table.shape[-1]
    for table in (cos_table, sin_table):
        if (table.dtype != torch.float32 or not table.is_contiguous() or table.shape[-1] != width
                or not (width == head_dim or (partial and 0 < width < head_dim and width % 2 == 0))):
            raise ValueError(f"rotary: cos/sin tables must be contiguous float32 [max_position, "
                             f"{'an even width up to ' if partial else ''}head_dim]")


def rotary(
    x: torch.Tensor,  # [rows, heads, head_dim], head_dim contiguous, heads adjacent; rotated in place
    positions: torch.Tensor,  # [rows] int64, each < the tables' length (the caller checks once per step)
    cos_table: torch.Tensor,  # [max_position, rotary_dim] float32: rotary_dim <= head_dim (partial rotary)
    sin_table: torch.Tensor,  # [max_position, rotary_dim] float32, first half negated
) -> torch.Tensor:
    """Each head's leading rotary_dim dims rotated by its row's position; the rest kept."""
    check_rotary_args(x, positions, cos_table, sin_table, _SUFFIX, partial=True)
    rows, heads, head_dim = x.shape
    _entry("rotary", x.dtype)(x.data_ptr(), rows, heads, head_dim, cos_table.shape[-1], x.stride(0),
                              positions.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr(),
                              torch.get_num_threads())
    return x


# The gate activations `act_and_mul` applies (kernels/cpu/elementwise.cpp), by transformers' names.
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


def act_and_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """gate_up [rows, 2n] (gate, then up) -> act(gate) * up [rows, n]: SwiGLU, or GeGLU with
    "gelu_pytorch_tanh"."""
    _rows(gate_up, "gate_up")
    n = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype)
    _entry("act_and_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // max(2 * n, 1), n,
                                         ACTIVATIONS[activation], torch.get_num_threads())
    return out


def decoder_layer(layer: LayerSpec, step: StepSpec, hidden: torch.Tensor, residual: torch.Tensor, first: bool) -> None:
    """One decoder layer of a decode-only step, in place: `hidden` [rows, hidden_size] becomes
    the layer's output and `residual` the stream before it (set from `hidden` when `first`).
    The specs hold raw pointers: the caller keeps every tensor they point into alive and
    checks shapes and dtypes once when building them (services/worker/models/fused_decode.py)."""
    status = _entry("decoder_layer", hidden.dtype)(ctypes.byref(layer), ctypes.byref(step), hidden.data_ptr(),
                                                   residual.data_ptr(), int(first))
    if status != 0:
        raise ValueError(f"decoder_layer: the attention kernel refused the layer's shape (status {status})")
