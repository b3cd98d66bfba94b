"""The LoRA product of one linear map for a batch that mixes adapters.

Each adapted module keeps every slot's adapter stacked (`LoRAStack`: A as [slots, rank,
in], B as [slots, out, rank], a fused module's shards side by side along the rank, zeros
where an adapter lacks a piece) and adds `B @ (A @ x)` to the base product's output, for
each adapter of the step over its own tokens. A step's `LoRAMapping` says which tokens
are whose: segments of (slot, token rows), one per adapter in the step, none for the
base model's tokens. A model with no adapter in its step does nothing more than look at
an empty list, and its decode steps keep the fused C layer and CUDA graphs.
"""

from __future__ import annotations

import torch


class LoRAMapping:
    """Which slot's adapter each of a step's tokens takes, set by the runner each step."""

    def __init__(self) -> None:
        # (slot, the rows of its tokens in the step's flat batch, or None for all of them)
        self.segments: list[tuple[int, torch.Tensor | None]] = []

    @property
    def active(self) -> bool:
        return bool(self.segments)


class LoRAStack:
    def __init__(self, mapping: LoRAMapping, slots: int, in_size: int, out_size: int, rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.mapping = mapping
        self.a = torch.zeros(slots, rank, in_size, dtype=dtype, device=device)
        self.b = torch.zeros(slots, out_size, rank, dtype=dtype, device=device)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base product of x) plus each adapter's product on its tokens, in place."""
        for slot, rows in self.mapping.segments:
            if rows is None:
                y.add_((x @ self.a[slot].T) @ self.b[slot].T)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ self.a[slot].T) @ self.b[slot].T)
        return y


def adapted(linear, lora: LoRAStack | None, x: torch.Tensor) -> torch.Tensor:
    """A linear map's output with its LoRA, where the model has adapters and the step any."""
    y = linear(x)
    if lora is not None and lora.mapping.segments:
        lora.add(x, y)
    return y
