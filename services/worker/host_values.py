"""Host values (lists, numpy arrays) as device tensors without waiting for the device.

`torch.tensor(values, device="cuda")` and `.to("cuda")` copy synchronously: PyTorch
follows the copy with a stream synchronize, so the host waits for every kernel queued
before it. In a step launched while the one before it still runs (launched_step.py),
that wait would undo the overlap, and once a step per token. A non-blocking copy from
pageable memory is staged by the driver at once and needs no synchronize: the host values
may be freed as soon as it returns.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        host = values
    elif isinstance(values, np.ndarray):
        host = torch.from_numpy(values)
    else:
        host = torch.tensor(values, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    return host.to(device, non_blocking=True)
