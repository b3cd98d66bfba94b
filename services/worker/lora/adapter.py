"""One LoRA adapter read from a PEFT folder, checked against the model it adapts.

A PEFT LoRA adds `scaling * B @ A` to a linear map's weight (A: [r, in], B: [out, r];
scaling `lora_alpha / r`, or `/ sqrt(r)` with rsLoRA). Our model fuses q/k/v and gate/up
into one product each (models/decoder.py), so an adapter's pieces are gathered per fused
module: each piece is the output rows it adds to (a shard: q, k or v) and its A and B,
with the scaling (and Granite's residual multiplier, which our o_proj and down_proj carry
folded in) already in B. Only what the file holds is adapted: a module or layer it lacks
adds nothing.

Anything that would change the function in ways this does not compute — DoRA, biases,
modules trained whole (`modules_to_save`), per-module ranks or alphas, adapters on the
embedding, the LM head or experts — is refused by name rather than served wrongly.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.layers.rotary import interleaved_as_halves
from services.worker.loader import open_weights
from services.worker.models.decoder_config import ModelConfig
from shared.lora_request import LoRARequest, check_options, read_adapter_config, weights_file

# PEFT's module name -> (our fused module, shard index); a fused name (Phi-3's checkpoints
# and adapters) is shard None: the whole output.
TARGETS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "qkv_proj": ("qkv_proj", None),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "gate_up_proj": ("gate_up_proj", None),
    "down_proj": ("down_proj", 0),
}
# How many shards each fused module has: a slot gives each shard a rank's worth of rows.
NUM_SHARDS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}

_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclass(slots=True)
class Piece:
    """What an adapter adds to one shard of one fused module: rows [start, start + size)
    of its output get `b @ (a @ x)`."""

    shard: int  # which of the module's shards, and so which rank rows of a slot
    start: int
    size: int
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [size, r], scaled


@dataclass(slots=True)
class LoRAAdapter:
    request: LoRARequest  # what names it
    rank: int
    pieces: dict[tuple[int, str], list[Piece]]  # (layer, fused module) -> pieces

    @classmethod
    def load(cls, lora: LoRARequest, config: ModelConfig, max_rank: int, shards=None) -> LoRAAdapter:
        """Read and check the adapter; a ValueError says what is wrong with it. `shards`: a
        tensor-parallel rank's cut (parallel/sharding.py; `config` is then its slice's), which
        the adapter is checked against the whole model's shapes and then cut to."""
        whole = config if shards is None else shards.full
        name, folder = lora.lora_name, Path(lora.lora_path)
        options = read_adapter_config(name, folder)
        rank, alpha = check_options(name, options, max_rank)
        scaling = alpha / (math.sqrt(rank) if options.get("use_rslora") else rank)
        weights = weights_file(name, folder)
        halves: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
        with open_weights(weights) as f:
            for key in f.keys():
                match = _KEY.fullmatch(key)
                if match is None or match[3] not in TARGETS:
                    raise ValueError(f"LoRA adapter {name!r} adapts {key!r}: llmbus adapts the q/k/v/o and "
                                     "gate/up/down projections of dense decoder layers only")
                layer, block, module, half = int(match[1]), match[2], match[3], match[4]
                halves.setdefault((layer, block, module), {})[half] = f.get_tensor(key).float()
        pieces: dict[tuple[int, str], list[Piece]] = {}
        for (layer, block, module), ab in sorted(halves.items()):
            if set(ab) != {"A", "B"}:
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{''.join(ab)} alone")
            fused, shard = TARGETS[module]
            if fused == "gate_up_proj" and not whole.gated_mlp:
                raise ValueError(f"LoRA adapter {name!r} adapts {module} of an MLP without a gate (Arcee's): "
                                 "llmbus adapts its attention and down_proj only")
            in_size, starts, sizes = module_shape(whole, layer, fused)
            a, b = ab["A"], ab["B"]
            start, size = (0, sum(sizes)) if shard is None else (starts[shard], sizes[shard])
            if a.shape != (rank, in_size) or b.shape != (size, rank):
                raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and "
                                 f"B {tuple(b.shape)}, the model needs A ({rank}, {in_size}) and B ({size}, {rank})")
            if whole.rotary_interleaved and fused == "qkv_proj" and shard != 2:
                # (GLM's queries and keys come out of the base weights reordered: so do B's rows)
                if shard is None:
                    raise ValueError(f"LoRA adapter {name!r}: a fused qkv_proj on a model with interleaved "
                                     "rotary (GLM's): adapt q_proj, k_proj and v_proj apart")
                b = interleaved_as_halves(b, whole.head_dim, whole.rotary_dim)
            if shards is not None:  # (this rank's: the rows its heads and MLP rows make, or its inputs)
                a, b = shards.cut_lora(fused, shard, a, b)
                _, starts, sizes = module_shape(config, layer, fused)
                start, size = (0, sum(sizes)) if shard is None else (starts[shard], sizes[shard])
            scale = scaling * (whole.residual_multiplier if fused in ("o_proj", "down_proj") else 1.0)
            pieces.setdefault((layer, fused), []).append(Piece(shard or 0, start, size, a, b * scale))
        if not pieces:
            raise ValueError(f"LoRA adapter {name!r} holds no weights")
        return cls(lora, rank, pieces)


def module_shape(config: ModelConfig, layer: int, fused: str) -> tuple[int, list[int], list[int]]:
    """(input size, shard starts, shard sizes) of one of our fused modules."""
    if layer >= config.num_hidden_layers:
        raise ValueError(f"the model has {config.num_hidden_layers} layers, not {layer + 1}")
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    if fused in ("gate_up_proj", "down_proj") and layer in config.moe_layers:
        raise ValueError(f"layer {layer}'s MLP is a mixture of experts: llmbus adapts dense MLPs only")
    in_size, sizes = {
        "qkv_proj": (hidden, [q, kv, kv]),
        "o_proj": (q, [hidden]),
        "gate_up_proj": (hidden, [inter, inter]),
        "down_proj": (inter, [hidden]),
    }[fused]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return in_size, starts, sizes
