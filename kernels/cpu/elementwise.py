"""The elementwise steps between the products (kernels/cpu/elementwise.cpp) and the one-call
decode layer (kernels/cpu/decoder_layer.cpp)."""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu.library import DTYPE_SUFFIX, LayerSpec, StepSpec, available, entry


def supports(x: torch.Tensor) -> bool:
    """Whether the elementwise kernels take this activation tensor (bfloat16 or float32 on the CPU)."""
    return x.dtype in DTYPE_SUFFIX and x.device.type == "cpu" and available()


def _rows(x: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    if x.dtype not in DTYPE_SUFFIX or (dtype is not None and x.dtype != dtype) or not x.is_contiguous():
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
    check_norm_args(x, residual, weight, DTYPE_SUFFIX)
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    entry("add_rms_norm", x.dtype)(
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
    check_rotary_args(x, positions, cos_table, sin_table, DTYPE_SUFFIX, partial=True)
    rows, heads, head_dim = x.shape
    entry("rotary", x.dtype)(x.data_ptr(), rows, heads, head_dim, cos_table.shape[-1], x.stride(0),
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
    entry("act_and_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // max(2 * n, 1), n,
                                         ACTIVATIONS[activation], torch.get_num_threads())
    return out


def decoder_layer(layer: LayerSpec, step: StepSpec, hidden: torch.Tensor, residual: torch.Tensor, first: bool) -> None:
    """One decoder layer of a decode-only step, in place: `hidden` [rows, hidden_size] becomes
    the layer's output and `residual` the stream before it (set from `hidden` when `first`).
    The specs hold raw pointers: the caller keeps every tensor they point into alive and
    checks shapes and dtypes once when building them (services/worker/models/fused_decode.py)."""
    status = entry("decoder_layer", hidden.dtype)(ctypes.byref(layer), ctypes.byref(step), hidden.data_ptr(),
                                                   residual.data_ptr(), int(first))
    if status != 0:
        raise ValueError(f"decoder_layer: the attention kernel refused the layer's shape (status {status})")
