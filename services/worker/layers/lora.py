"""The LoRA product of one linear map for a batch that mixes adapters.

Each adapted module keeps every slot's adapter stacked (`LoRAStack`: A as [slots, rank,
in], B as [slots, rank, out], a fused module's shards side by side along the rank, zeros
where an adapter lacks a piece) and adds `B(A x)` to the base product's output. A step's
`LoRAMapping` says which slot each token takes (-1: the base model's).

The slots in use are the first few (the manager fills them from 0), so a module does two
dense products for the whole step whatever its mix of adapters: x against every used
slot's A at once ([tokens, slots * rank]), a mask that keeps each token's own slot's
columns, then that against every slot's B. It computes every used slot's columns for
every token (4 slots of rank 16 on SmolLM2: ~27% of the base products' arithmetic) for
fixed shapes, no index arithmetic and two launches a module, what graphs and a
launch-bound GPU step want; on this CPU it runs as fast as a gather, two products and a
scatter per adapter did (docs/performance/history.md, "LoRA adapters"). A step on one adapter
alone skips the mask. A model with no adapter in its step does nothing more than look at
`active`, and its decode steps keep the fused C layer and CUDA graphs.
"""

from __future__ import annotations

import numpy as np
import torch

from services.worker.host_values import to_device


class LoRAMapping:
    """Which slot's adapter each of a step's tokens takes, set by the runner each step."""

    def __init__(self) -> None:
        self.slot_of_token: torch.Tensor | None = None  # [tokens] int64, -1 for the base model's
        self.num_slots = 0  # slots 0 .. num_slots-1 hold this step's adapters
        self.whole_step: int | None = None  # the slot every token takes, where one does
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    @property
    def active(self) -> bool:
        return self.num_slots > 0

    def set(self, slot_of_token: np.ndarray, device: torch.device) -> None:
        """`slot_of_token`: [tokens], each token's slot or -1. What the modules branch on is
        read from this host copy, never from the device's."""
        self.num_slots = int(slot_of_token.max()) + 1 if len(slot_of_token) else 0
        first = int(slot_of_token[0]) if self.num_slots else -1
        self.whole_step = first if first >= 0 and (slot_of_token == first).all() else None
        self.slot_of_token = to_device(slot_of_token, device)
        self._masks = {}

    def clear(self) -> None:
        self.slot_of_token, self.num_slots, self.whole_step, self._masks = None, 0, None, {}

    def mask(self, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, num_slots * rank]: 1 where a column is of the token's own slot (one per
        rank width and dtype in a step; the modules of every layer share it)."""
        key = (rank, dtype)
        mask = self._masks.get(key)
        if mask is None:
            column_slot = torch.arange(self.num_slots, device=self.slot_of_token.device).repeat_interleave(rank)
            mask = (self.slot_of_token[:, None] == column_slot[None, :]).to(dtype)
            self._masks[key] = mask
        return mask


class LoRAStack:
    def __init__(self, mapping: LoRAMapping, slots: int, in_size: int, out_size: int, rank: int,
                 dtype: torch.dtype, device: torch.device, input_split=None) -> None:
        self.mapping = mapping
        self.rank = rank
        # A tensor-parallel rank's row-parallel product (o_proj, down_proj): its input, and A's
        # columns, are this rank's slice, so the shrunk activations are partial sums, added
        # over the ranks before B (small: rank columns a token) — the base product's own sum
        # came before, so every rank then adds the whole of B's product.
        self.input_split = input_split
        self.a = torch.zeros(slots, rank, in_size, dtype=dtype, device=device)
        self.b = torch.zeros(slots, rank, out_size, dtype=dtype, device=device)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base product of x) plus each token's adapter's product, in place."""
        mapping = self.mapping
        if mapping.whole_step is not None:
            slot = mapping.whole_step
            return y.addmm_(self._summed(x @ self.a[slot].T), self.b[slot])
        n = mapping.num_slots
        shrunk = self._summed(x @ self.a[:n].reshape(n * self.rank, -1).T)
        shrunk.mul_(mapping.mask(self.rank, shrunk.dtype))
        return y.addmm_(shrunk, self.b[:n].reshape(n * self.rank, -1))

    def _summed(self, shrunk: torch.Tensor) -> torch.Tensor:
        return shrunk if self.input_split is None else self.input_split.all_reduce(shrunk)


def adapted(linear, lora: LoRAStack | None, x: torch.Tensor) -> torch.Tensor:
    """A linear map's output with its LoRA, where the model has adapters and the step any."""
    y = linear(x)
    if lora is not None and lora.mapping.active:
        lora.add(x, y)
    return y
