"""The matrix products over weights packed once at load: bfloat16 and float32 (`linear`),
int4 and int8 weights with bfloat16 activations (kernels/cpu/linear*.cpp)."""

from __future__ import annotations

import torch

from kernels.cpu.library import DTYPE_SUFFIX, INT4_GROUP_SIZE, entry, lib


def _packed_numel(dtype: torch.dtype, out_features: int, in_features: int) -> int:
    return entry("packed_numel", dtype)(out_features, in_features)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bfloat16 (in even) or float32 weight -> the flat packed form `linear` reads."""
    out_features, in_features = weight.shape
    if weight.dtype not in DTYPE_SUFFIX or (weight.dtype == torch.bfloat16 and in_features % 2):
        raise ValueError(f"pack_weight takes a float32 or bfloat16 [out, in] weight (in even for bfloat16); "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    weight = weight.detach().contiguous()
    packed = torch.empty(_packed_numel(weight.dtype, out_features, in_features), dtype=weight.dtype)
    entry("pack", weight.dtype)(weight.data_ptr(), out_features, in_features, packed.data_ptr())
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W.T (+ bias, float32) -> [..., out], x and the packed W of one dtype."""
    in_features = x.shape[-1]
    # A wrong pointer here reads or writes out of bounds, so check what ctypes cannot.
    if (x.dtype not in DTYPE_SUFFIX or packed.dtype != x.dtype
            or packed.numel() != _packed_numel(x.dtype, out_features, in_features)):
        raise ValueError(f"linear: x {x.dtype} [..., {in_features}] does not fit a packed "
                         f"{packed.dtype} [{out_features}, ?] weight")
    return _product("linear", entry("linear", x.dtype), x, packed, out_features, bias)


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
    packed = torch.empty(lib().llmbus_int4_packed_bytes(out_features, in_features), dtype=torch.uint8)
    lib().llmbus_pack_int4(levels.data_ptr(), step.data_ptr(), low.data_ptr(), out_features, in_features,
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
    packed = torch.empty(lib().llmbus_int8_packed_bytes(out_features, in_features), dtype=torch.int8)
    lib().llmbus_pack_int8(weight.data_ptr(), scale.data_ptr(), out_features, in_features, packed.data_ptr())
    return packed


def linear_int8(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] bfloat16 @ (W * scale).T (+ bias, float32) -> [..., out] bfloat16, W packed
    by `pack_int8`."""
    in_features = x.shape[-1]
    if (x.dtype != torch.bfloat16 or packed.dtype != torch.int8 or in_features % 2
            or packed.numel() != lib().llmbus_int8_packed_bytes(out_features, in_features)):
        raise ValueError(f"linear_int8: x {x.dtype} [..., {in_features}] does not fit a packed int8 "
                         f"[{out_features}, ?] weight (x must be bfloat16)")
    return _product("linear_int8", lib().llmbus_linear_int8_bf16, x, packed, out_features, bias)


def int8_expand_rows() -> int:
    """Rows from which `linear_int8` expands each block of weights to bfloat16 (level *
    scale, rounded once) and runs `linear`'s bfloat16 product on it."""
    return lib().llmbus_int8_expand_rows()


def int4_expand_rows() -> int:
    """Rows from which `linear_int4` expands each block of weights to bfloat16 (level * step
    + low, rounded once) and runs `linear`'s bfloat16 product on it."""
    return lib().llmbus_int4_expand_rows()


def linear_int4(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] bfloat16 @ W.T (+ bias, float32) -> [..., out] bfloat16, W packed by
    `pack_int4`: per group sums on the 4-bit levels for few rows, the bfloat16 product on
    the expanded weights from `int4_expand_rows()` rows on."""
    in_features = x.shape[-1]
    if (x.dtype != torch.bfloat16 or packed.dtype != torch.uint8 or in_features % INT4_GROUP_SIZE
            or packed.numel() != lib().llmbus_int4_packed_bytes(out_features, in_features)):
        raise ValueError(f"linear_int4: x {x.dtype} [..., {in_features}] does not fit a packed int4 "
                         f"[{out_features}, ?] weight (x must be bfloat16)")
    return _product("linear_int4", lib().llmbus_linear_int4_bf16, x, packed, out_features, bias)


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
