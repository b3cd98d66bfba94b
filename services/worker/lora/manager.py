"""The worker's LoRA adapters: read from disk, kept in slots, mapped onto each step.

With `--enable-lora` every dense layer's four products get a `LoRAStack` of `max_loras`
slots (layers/lora.py). An adapter is read the first time a request names it (`prepare`,
when the request reaches the worker: a bad adapter fails that request alone) and kept on
the host, up to `max_cpu_loras` of them, least recently used dropped first; a request
holds its own adapter, so a step never reads a disk (nor fails on one). Each step
puts the adapters its requests use into slots (least recently used slot given up first,
never one this step uses) and tells the model which tokens take which slot. The
scheduler never runs more than `max_loras` adapters at once (scheduler.py), so a step's
adapters always fit.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from services.worker.layers.lora import LoRAMapping, LoRAStack
from services.worker.lora.adapter import NUM_SHARDS, LoRAAdapter, module_shape
from services.worker.layers.mlp import MLP
from shared.config import LoRAConfig
from shared.lora_request import LoRARequest

log = logging.getLogger("llmbus.worker")


class LoRAManager:
    def __init__(self, model, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        if model.config.kv_lora_rank:  # (its projections are not the qkv_proj an adapter's targets map to)
            raise ValueError(f"--enable-lora is not supported for {model.config.architecture}: LoRA adapters "
                             "are not served on latent attention")
        if model.config.recurrent_layers:  # (nor on a Gated DeltaNet's projections)
            raise ValueError(f"--enable-lora is not supported for {model.config.architecture}: LoRA adapters "
                             "are not served on its recurrent layers")
        self.model = model
        self.config = config
        self.mapping = LoRAMapping()
        model.lora = self.mapping
        rank = config.max_lora_rank
        self.stacks: dict[tuple[int, str], LoRAStack] = {}
        for index, layer in enumerate(model.model.layers):
            owners = {"qkv_proj": layer.self_attn, "o_proj": layer.self_attn}
            if isinstance(layer.mlp, MLP):  # (sparse MLPs take no adapters; an ungated one's up rows neither)
                if layer.mlp.gated:
                    owners["gate_up_proj"] = layer.mlp
                owners["down_proj"] = layer.mlp
            for fused, owner in owners.items():
                in_size, _, sizes = module_shape(model.config, index, fused)
                stack = LoRAStack(self.mapping, config.max_loras, in_size, sum(sizes), rank * NUM_SHARDS[fused],
                                  dtype, device, getattr(getattr(owner, fused), "input_split", None))
                self.stacks[index, fused] = stack
                setattr(owner, fused.removesuffix("_proj") + "_lora", stack)
        self._read: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()  # on the host, most recent last
        self._slots: OrderedDict[LoRARequest, int] = OrderedDict()  # in slots, most recently used last

    @property
    def in_slots(self) -> list[LoRARequest]:
        """The adapters in the slots now, least recently used first."""
        return list(self._slots)

    def prepare(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter, read from disk the first time; a ValueError says why it cannot be."""
        adapter = self._read.get(lora)
        if adapter is not None:
            self._read.move_to_end(lora)
            return adapter
        adapter = LoRAAdapter.load(lora, self.model.config, self.config.max_lora_rank, self.model.shards)
        self._read[lora] = adapter
        while len(self._read) > self.config.max_cpu_loras:
            self._read.popitem(last=False)
        log.info("LoRA adapter read", extra={"lora_name": lora.lora_name, "rank": adapter.rank})
        return adapter

    def map_step(self, adapters: list[LoRAAdapter | None], token_starts: np.ndarray, token_ends: np.ndarray) -> None:
        """Map this step's tokens onto slots: request i (adapter `adapters[i]`) owns tokens
        [token_starts[i], token_ends[i]) of the flat batch."""
        of = {adapter.request: adapter for adapter in adapters if adapter is not None}
        used = list(of)
        if not used:
            self.mapping.clear()
            return
        if len(used) > self.config.max_loras:
            raise RuntimeError(f"a step with {len(used)} LoRA adapters, more than max_loras {self.config.max_loras}")
        slots = {lora: self._slot(of[lora], used) for lora in used}
        slot_of_token = np.full(int(token_ends[-1]), -1, dtype=np.int64)
        for adapter, start, end in zip(adapters, token_starts, token_ends):
            if adapter is not None:
                slot_of_token[start:end] = slots[adapter.request]
        self.mapping.set(slot_of_token, self.stacks[next(iter(self.stacks))].a.device)

    def _slot(self, adapter: LoRAAdapter, used: list[LoRARequest]) -> int:
        lora = adapter.request
        slot = self._slots.get(lora)
        if slot is not None:
            self._slots.move_to_end(lora)
            return slot
        if len(self._slots) < self.config.max_loras:
            slot = len(self._slots)
        else:  # the least recently used slot of an adapter this step does not use
            victim = next(other for other in self._slots if other not in used)
            slot = self._slots.pop(victim)
        self._write(slot, adapter)
        self._slots[lora] = slot
        return slot

    @torch.no_grad()
    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        rank = self.config.max_lora_rank
        for (layer, fused), stack in self.stacks.items():
            stack.a[slot].zero_()
            stack.b[slot].zero_()
            for piece in adapter.pieces.get((layer, fused), ()):
                lo, r = piece.shard * rank, adapter.rank
                stack.a[slot, lo:lo + r].copy_(piece.a)
                stack.b[slot, lo:lo + r, piece.start:piece.start + piece.size].copy_(piece.b.T)


def adapter_or_why(manager: LoRAManager | None, lora) -> LoRAAdapter | str:
    """A request's adapter, read, or why it cannot be (it fails alone)."""
    if manager is None:
        return lora.not_served()  # (the scheduler refuses it first; a twin for a stray placement)
    try:
        return manager.prepare(lora)
    except (ValueError, OSError) as exc:
        return str(exc)
