"""A decoder's checkpoint tensors copied into its parameters by Hugging Face name: fused
q/k/v and gate/up, stacked or per-expert experts, a tensor-parallel rank's slices, each
family's renames and fixups; every parameter must be set."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from services.worker.layers.latent_attention import rope_rows_as_halves
from services.worker.layers.rotary import interleaved_as_halves
from services.worker.models.checkpoints.layer_normed_names import renamed_tensors
from services.worker.models.checkpoints.tensor_fixups import TENSOR_FIXUPS
from services.worker.models.families.registry import FAMILY_OF
from services.worker.models.weight_names import (
    ALIASES,
    LANGUAGE_MODEL_PREFIXES,
    PACKED_WEIGHTS,
    STACKED_EXPERTS,
    TRANSPOSED_FIRST,
)

log = logging.getLogger("llmbus.worker")


@torch.no_grad()
def load_decoder_weights(model, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into `model` (a LlamaForCausalLM) by Hugging Face name."""
    params = dict(model.named_parameters())
    # (GLM-4.5's routers' correction biases are float32 buffers, read as weights are)
    params.update((n, b) for n, b in model.named_buffers() if n.endswith(".e_score_correction_bias"))
    loaded: set[str] = set()
    family = FAMILY_OF[model.config.architecture]
    num_layers = model.config.num_hidden_layers
    skipped = tuple(f"model.layers.{i}." for i in range(num_layers, num_layers + model.config.skipped_layers))
    if family.unread:
        weights = ((n, t) for n, t in weights if not n.startswith(family.unread))
    weights = renamed_tensors(family, weights)  # (GPT-2's, OPT's, GPT-NeoX's, Phi's layouts)
    for fixup in family.tensor_fixups:  # (stacked experts, fused products, a layout of its own)
        # (on the checkpoint's whole tensors: a tensor-parallel rank's config counts its heads only)
        weights = TENSOR_FIXUPS[fixup](weights, model.config if model.shards is None else model.shards.full)
    names = family.weight_names
    for name, tensor in weights:
        for theirs, ours in LANGUAGE_MODEL_PREFIXES.items():
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
        if not name.startswith(("model.", "lm_head.", "score.")):
            name = "model." + name  # a decoder saved alone (LlamaModel, MistralModel, ...)
        if skipped and name.startswith(skipped):
            continue  # (GLM-4.5's multi-token-prediction layers: transformers skips them too)
        if ".experts." in name or ".block_sparse_moe." in name or model.config.recurrent_mixer == "short_conv":
            for theirs, ours in ALIASES.items():
                name = name.replace(theirs, ours)
        if "rotary_emb.inv_freq" in name:
            continue  # old checkpoints stored the table; we compute it
        if model.shards is not None and model.shards.local_experts:
            name = model.shards.expert_name(name)  # (expert parallelism: another rank's expert is not read)
            if name is None:
                continue
        theirs = next((n for n in names if n in name), None)
        name = name if theirs is None else name.replace(theirs, names[theirs])
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the embedding serves
        if name.endswith(".e_score_correction_bias") and tensor.dim() == 2 and len(tensor) == 1:
            tensor = tensor[0]  # (ERNIE's [1, experts]: one group of statistics)
        if model.config.kv_lora_rank and model.config.rotary_interleaved:  # (DeepSeek's interleaved rotating rows)
            tensor = rope_rows_as_halves(name, tensor, model.config)
        stacked = next((s for s in STACKED_EXPERTS if name.endswith(s)), None)
        if stacked is not None:
            prefix = name[: -len(stacked)] + ".mlp.experts"
            for e, rows in enumerate(tensor.unbind(0)):
                if model.shards is not None and (e := model.shards.local_expert(e)) is None:
                    continue  # (another rank's expert)
                target = f"{prefix}.{e}.{STACKED_EXPERTS[stacked]}.weight"
                if target not in params:
                    raise ValueError(f"checkpoint has unexpected weight {name!r} (expert {e})")
                shape = params[target].shape if model.shards is None else model.shards.whole_shape(
                    target, params[target].shape)
                if stacked in TRANSPOSED_FIRST and not family.stacked_experts_out_in and rows.T.shape == shape:
                    rows = rows.T
                _copy(params[target].data, rows if model.shards is None else model.shards.cut(target, rows), name)
                loaded.add(target)
            continue
        for part, (fused, shard) in PACKED_WEIGHTS.items():
            # (latent attention's q_proj is its own, not a third of a fused one)
            if f".{part}." in name and not (part == "q_proj" and model.config.kv_lora_rank):
                if part == "up_proj" and not model.config.gated_mlp:
                    shard = 0  # (the up rows are all an ungated MLP's gate_up_proj holds)
                target = name.replace(part, fused)
                if target not in params:  # (a bias the config does not announce, a layer too many)
                    raise ValueError(f"checkpoint has unexpected weight {name!r}")
                module = model.get_submodule(target.rsplit(".", 2)[0])
                sizes = module.shard_sizes
                offset = sum(sizes[:shard])
                param = params[target]
                if model.config.rotary_interleaved and part in ("q_proj", "k_proj"):
                    tensor = interleaved_as_halves(tensor, model.config.head_dim, model.config.rotary_dim)
                if model.shards is not None:
                    tensor = model.shards.cut(name, tensor)
                _copy(param.data.narrow(0, offset, sizes[shard]), tensor, name)
                loaded.add(f"{target}#{shard}")
                break
        else:
            if name not in params:
                raise ValueError(f"checkpoint has unexpected weight {name!r}")
            if model.config.rotary_interleaved and ".qkv_proj." in name:
                raise ValueError(f"checkpoint has {name!r} fused: interleaved rotary (GLM's) is reordered "
                                 "from q_proj and k_proj apart")
            if model.shards is not None:
                tensor = model.shards.cut(name, tensor)
            _copy(params[name].data, tensor, name)
            loaded.add(name)
    if model.lm_head is not None and "lm_head.weight" not in loaded:
        log.warning("the checkpoint has no LM head: this model serves embeddings, not generation")
        model.lm_head, model.generates = None, False
        del params["lm_head.weight"]
    missing = []
    for name, param in params.items():
        if name in loaded:  # a fused weight the checkpoint holds fused too (Phi-3's qkv_proj, gate_up_proj)
            continue
        leaf = name.rsplit(".", 2)
        module_name = leaf[-2] if len(leaf) > 1 else ""
        if module_name in ("qkv_proj", "gate_up_proj"):
            num_shards = 3 if module_name == "qkv_proj" else 2 if model.config.gated_mlp else 1
            missing += [f"{name}#{s}" for s in range(num_shards) if f"{name}#{s}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint lacks weights: {', '.join(missing[:5])}")
    model.fold_residual_multiplier()
    if model.config.norm_weight_offset:
        # Gemma's norms weigh by 1 + w, computed in float32 as transformers does (the
        # parameters are float32 until the loader casts them): then they are plain norms.
        for name, param in params.items():
            if name.endswith("norm.weight"):
                param.add_(model.config.norm_weight_offset)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
