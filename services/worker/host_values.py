"""Host values (lists, numpy arrays) as device tensors without waiting for the device.

`torch.tensor(values, device="cuda")` and `.to("cuda")` copy synchronously: PyTorch
follows the copy with a stream synchronize, so the host waits for every kernel queued
before it. In a step launched while the one before it still runs (launched_step.py),
that wait would undo the overlap, and once a step per token. Even a non-blocking copy
from pageable memory may wait so: CUDA stages pageable memory through its own pinned
buffer and documents that it "may synchronize with the stream" to do it (torch's sync
debug mode cannot see that wait: it is the driver's). So the values are put in pinned
memory first (PyTorch's caching host allocator: a block is reused only once the copy out
of it is done) and copied from there, which CUDA queues without waiting.

Lists go through numpy: `torch.tensor(list)` reads a list of 128 Python numbers in 9-19
us, `np.asarray` in 3-5 (a random-sampling step makes about six of them).
"""

from __future__ import annotations

import numpy as np
import torch


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64,
                 torch.int32: np.int32, torch.bool: np.bool_}


def from_list(values, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` on the host, the same dtype and values, faster."""
    if dtype is None or dtype in _NUMPY_DTYPES:
        array = np.asarray(values, dtype=_NUMPY_DTYPES.get(dtype))
        if dtype is None and array.dtype == np.float64:
            array = array.astype(np.float32)  # torch.tensor's default for Python floats
        if array.dtype != object:
            return torch.from_numpy(array)
    return torch.tensor(values, dtype=dtype)


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values (a list, a numpy array, a CPU tensor) on `device`, in `dtype` if given:
    queued behind the device's work on CUDA, never waiting for it."""
    if isinstance(values, torch.Tensor):
        host = values
    elif isinstance(values, np.ndarray):
        host = torch.from_numpy(values)
    else:
        host = from_list(values, dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)  # (the host's own tensor on a CPU)
    return host.pin_memory().to(device, non_blocking=True)


def put_scalar(tensor: torch.Tensor, indices: tuple[torch.Tensor, ...], value) -> None:
    """`tensor[indices] = value` for index tensors on the tensor's device, without waiting
    for it: PyTorch makes a Python scalar a CPU tensor and copies it over synchronously
    when the indices are tensors (a CUDA step's EOS ban for min_tokens waited so, seen by
    scripts/gpu_check.py's host_syncs case on an H200). A filled device scalar needs no copy."""
    tensor.index_put_(indices, torch.full((), value, dtype=tensor.dtype, device=tensor.device))
