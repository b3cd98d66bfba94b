"""Triton kernels of the GPU path: paged attention, the KV-cache write, the fused
element-wise ops, the MoE experts, the sampling draws (the attention backend itself is
services/worker/attention/triton_backend.py). This package imports nothing from services/.

Without a GPU, Triton's interpreter runs them on CPU tensors (slow, but exact enough to
test). The interpreter must be chosen before anything imports triton — transformers and
torch do so lazily — which is why the worker package imports this module first.
"""

import os


def use_interpreter_without_gpu() -> None:
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


use_interpreter_without_gpu()
