"""Which quantization a model runs with: the one asked for (--quantization), or, where none
was, the precision its checkpoint already holds where llmbus serves that as it is."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from services.worker.layers.quantized_linear import QUANTIZATIONS
from services.worker.models.checkpoints.quantized_weights import QuantizedWeights

log = logging.getLogger(__name__)


def int4_dtypes(device: torch.device) -> tuple[str, ...]:
    """The dtypes the int4 (and int8) layers run in there: int4 on a GPU is the Triton
    kernel, in 16-bit activations (kernels/linear_int4.py)."""
    return ("bfloat16",) if device.type == "cpu" else ("bfloat16", "float16")


def choose_quantization(quantization: str | None, held: QuantizedWeights | None, dtype: str, device: torch.device,
                        model_path: str | Path) -> str | None:
    """The quantization to run: `quantization` checked against the dtype and device, or
    (None asked) the checkpoint's own 4 or 8 bits where they are served as they are."""
    dtypes = int4_dtypes(device)
    if quantization is None and held is not None and held.bits == 4 and not held.reordered and dtype in dtypes:
        # A 4-bit checkpoint (AWQ, W4A16, GPTQ) stays at 4 bits, as vLLM serves it:
        # int4_grid finds its levels again in each group of 32 inputs (the offsets rounded
        # to float16, within a hundredth of a level). Elsewhere (float32, GPTQ's reordered
        # groups, which no run of 32 inputs keeps) it runs widened.
        quantization = "int4"
    elif quantization is None and held is not None and held.bits == 8 and held.int_per_channel \
            and not held.zero_points and dtype == "bfloat16" and device.type == "cpu":
        # A symmetric int8 checkpoint with a scale an output channel (W8A8 INT8, W8A16)
        # stays at 8 bits on a CPU, as vLLM's CPU backend serves W8A8: the int8 layers'
        # grid (int8_grid) finds its levels and scales again, exactly.
        quantization = "int8"
    elif quantization is None and held is not None and dtype == "float32":
        log.warning("quantized checkpoint widened to float32 (four bytes a weight): --dtype bfloat16 or auto "
                    "serves it at its own precision's size or near it", extra={"model": str(model_path)})
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"unknown quantization {quantization!r}: {', '.join(QUANTIZATIONS)}")
    if quantization == "int8" and device.type != "cpu":
        raise ValueError("--quantization int8 runs on CPU (its kernels are CPU ones)")
    if quantization is not None and dtype not in dtypes:
        # int8's kernel takes bfloat16 only; int4's float32 path is a slow reference
        # (measured: a decode step 127 ms, against 60 ms unquantized in float32).
        raise ValueError(f"--quantization {quantization} runs with --dtype {' or '.join(dtypes)}")
    return quantization
