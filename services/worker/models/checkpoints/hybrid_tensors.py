"""Hybrid families' checkpoint tensors as the decoder holds them: Nemotron-H's and Granite
4.0-H's names, Qwen3.5's gated queries split from q_proj, OLMo Hybrid's fused DeltaNet
products."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from services.worker.models.decoder_config import ModelConfig


def nemotron_h_tensors(weights: Iterable[tuple[str, torch.Tensor]],
                       config: ModelConfig) -> Iterable[tuple[str, torch.Tensor]]:
    """Nemotron-H's names (as released, `backbone.*`, or as transformers 5 saves them,
    `model.*`): a block's norm is its input norm, its `mixer` its token mixer or, in an MLP
    block, its MLP; the embeddings and the final norm as ours."""
    mixerless = set(config.mixerless_layers)
    for name, tensor in weights:
        name = re.sub(r"^backbone\.", "model.", name)
        name = {"model.embeddings.weight": "model.embed_tokens.weight", "model.norm_f.weight": "model.norm.weight"}.get(
            name, name)
        match = re.match(r"model\.layers\.(\d+)\.(norm\.|mixer\.)(.*)", name)
        if match:
            layer, part, rest = match.groups()
            if part == "norm.":
                part = "input_layernorm."
            else:
                part = "mlp." if int(layer) in mixerless else "self_attn."
                rest = "norm_weight" if rest == "norm.weight" else rest  # (Mamba2's gated norm)
            name = f"model.layers.{layer}.{part}{rest}"
        yield name, tensor


def granite_hybrid_tensors(weights: Iterable[tuple[str, torch.Tensor]],
                           moe: bool) -> Iterable[tuple[str, torch.Tensor]]:
    """Granite 4.0-H's shared MLP (`shared_mlp.input_linear`, gate and up rows fused as
    ours are; `output_linear`): its experts' shared expert, or, without experts (H-Micro),
    the layer's MLP itself."""
    prefix = ".mlp.shared_expert." if moe else ".mlp."
    for name, tensor in weights:
        name = name.replace(".shared_mlp.input_linear.", prefix + "gate_up_proj.")
        yield name.replace(".shared_mlp.output_linear.", prefix + "down_proj."), tensor


def gated_query_tensors(weights: Iterable[tuple[str, torch.Tensor]], heads: int,
                        head_dim: int) -> Iterable[tuple[str, torch.Tensor]]:
    """Qwen3.5's q_proj holds, head by head, a head's query rows then its gate's (the
    heads' outputs times sigmoid(gate)): the query rows as q_proj's, the gate rows as
    `output_gate`'s, AFMoE's gate."""
    for name, tensor in weights:
        if name.endswith(".self_attn.q_proj.weight"):
            halves = tensor.unflatten(0, (heads, 2, head_dim))
            yield name, halves[:, 0].flatten(0, 1)
            yield name.replace(".q_proj.", ".output_gate."), halves[:, 1].flatten(0, 1)
        else:
            yield name, tensor


# OLMo Hybrid's q, k and v products, and their convolutions, apart in its checkpoints: fused
# here in that order, as transformers concatenates them (the convolutions' split sizes as
# saved, whatever they are)
OLMO_HYBRID_FUSED = {".linear_attn.in_proj_qkv.weight": (".linear_attn.q_proj.weight", ".linear_attn.k_proj.weight",
                                                         ".linear_attn.v_proj.weight"),
                     ".linear_attn.conv1d.weight": (".linear_attn.q_conv1d.weight", ".linear_attn.k_conv1d.weight",
                                                    ".linear_attn.v_conv1d.weight")}


def olmo_hybrid_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    waiting: dict[str, dict[str, torch.Tensor]] = {}  # fused name -> its parts read so far
    for name, tensor in weights:
        fused = next(((target, part) for target, parts in OLMO_HYBRID_FUSED.items() for part in parts
                      if name.endswith(part)), None)
        if fused is None:
            yield name, tensor
            continue
        target, part = fused
        full_name = name[: -len(part)] + target
        parts = waiting.setdefault(full_name, {})
        parts[part] = tensor
        if len(parts) == len(OLMO_HYBRID_FUSED[target]):
            del waiting[full_name]
            yield full_name, torch.cat([parts[p] for p in OLMO_HYBRID_FUSED[target]])
    if waiting:
        raise ValueError(f"OLMo Hybrid checkpoint with {', '.join(sorted(waiting)[:3])} incomplete: q, k and v each")
