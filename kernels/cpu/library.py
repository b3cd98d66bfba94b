"""Loading the CPU kernels' library (kernels/cpu/build.py compiles it) and the C entry points
the other modules call: their ctypes signatures, one per dtype, and the structs they share."""

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
DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# 8-bit float KV caches, by the format code the kernels take (kernels/cpu/fp8.h); 0 is a
# cache of the activations' own dtype.
FP8_KV_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def kv_format(activation_dtype: torch.dtype, cache_dtype: torch.dtype) -> int | None:
    """The kernels' code for a cache of `cache_dtype` beside activations of `activation_dtype`,
    or None where they take no such pair."""
    if activation_dtype not in DTYPE_SUFFIX:
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
def load() -> tuple[ctypes.CDLL | None, str]:
    lib, reason = build_library()
    if lib is None:
        log.warning("CPU kernels unavailable, using PyTorch ops", extra={"reason": reason})
        return None, reason
    for suffix in DTYPE_SUFFIX.values():
        for name, (argtypes, restype) in _SIGNATURES.items():
            entry = getattr(lib, f"llmbus_{name}_{suffix}")
            entry.argtypes, entry.restype = argtypes, restype
    for name, (argtypes, restype) in _INT_SIGNATURES.items():
        entry = getattr(lib, f"llmbus_{name}")
        entry.argtypes, entry.restype = argtypes, restype
    return lib, ""


def available() -> bool:
    return load()[0] is not None


def unavailable_reason() -> str:
    return load()[1]


def lib() -> ctypes.CDLL:
    lib, reason = load()
    if lib is None:
        raise RuntimeError(f"CPU kernels unavailable: {reason}")
    return lib


def entry(name: str, dtype: torch.dtype):
    """The C entry point `llmbus_<name>_<bf16|f32>` for tensors of `dtype`."""
    return getattr(lib(), f"llmbus_{name}_{DTYPE_SUFFIX[dtype]}")
