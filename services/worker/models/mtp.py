"""Multi-token prediction layers as DeepSeek-V3, GLM-4.5 and GLM-4.7-Flash ship them
(`num_nextn_predict_layers`), for speculative decoding (`{"method": "mtp"}`).

The checkpoint holds each past the model's last decoder layer, as `model.layers.{N}.*`:
`enorm` and `hnorm` (RMS norms), `eh_proj` (2H -> H), one decoder layer of the model's
kind (its latent attention and experts), `shared_head.norm`, and copies of the embedding
and the LM head. At position p it reads the token at p + 1 (normed by `enorm`) beside the
main model's final hidden state at p (normed by `hnorm`) and predicts the token at p + 2:
    h = eh_proj([enorm(embed(t[p+1])); hnorm(hidden[p])]);  out = layer(h)
    logits = head(shared_head.norm(out))
The embedding and the head are the main model's (DeepSeek-V3's paper shares them; the
checkpoint's copies are not read). A further draft feeds `out` back in place of the main
model's hidden state, as vLLM's and SGLang's MTP drafters do. Only the first such layer
is read (DeepSeek-V3 and GLM ship one).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from services.worker.attention.backend import AttentionBackend
from services.worker.layers.attention import triton_elementwise
from services.worker.layers.rms_norm import RMSNorm
from services.worker.loader import dummy_weights, read_weights, ready_to_run
from services.worker.models.decoder import LlamaForCausalLM
from services.worker.models.decoder_config import ModelConfig
from services.worker.parallel.sharding import Shards, split_sums

# The tensors of an MTP layer that join its input to the decoder layer it holds
FUSION = ("enorm.", "hnorm.", "eh_proj.")
# The copies of the main model's embedding and head it also holds: the main model's serve
SHARED = ("embed_tokens.", "shared_head.head.")


def one_layer(config: ModelConfig) -> ModelConfig:
    """The main model's config for its MTP layer alone, as layer 0: of the kind its last
    layer is (sparse where the model has experts), no vocabulary of its own."""
    sparse = bool(config.moe_layers)
    return dataclasses.replace(
        config, num_hidden_layers=1, moe_layers=(0,) if sparse else (), skipped_layers=0, vocab_size=1,
        tie_word_embeddings=True, layer_windows=(), nope_layers=(), recurrent_layers=(), post_normed_layers=(),
        mixerless_layers=(), mlpless_layers=(), num_labels=0)


class MultiTokenPredictor(LlamaForCausalLM):
    """One MTP layer: a one-layer decoder (its final norm `shared_head.norm`) with the
    fusion of its inputs beside it in `model` (so quantization and packing take `eh_proj`
    as they take the layer's products). No embedding or head: the main model's serve."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_position: int) -> None:
        super().__init__(one_layer(config), backend, max_position)
        self.model.embed_tokens = None
        self.generates = False  # (its logits are the main model's head's: `predict` gives its input)
        triton = triton_elementwise(backend)
        hidden = config.hidden_size
        self.model.enorm = RMSNorm(hidden, config.rms_norm_eps, triton)
        self.model.hnorm = RMSNorm(hidden, config.rms_norm_eps, triton)
        self.model.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)

    values_are_keys = property(lambda self: bool(self.config.kv_lora_rank))  # (latent attention: one memory)

    def kept(self, target: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """What it reads of a step of the main model: its final hidden states."""
        return hidden

    def predict(self, input_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor, kv_cache, metadata,
                target: LlamaForCausalLM) -> tuple[torch.Tensor, torch.Tensor]:
        """(the head's input, the layer's output) at each row: `input_ids` the next tokens,
        `previous` the hidden states they follow (the main model's, or this layer's own
        output for a further draft)."""
        model = self.model
        embedded = target.embed(input_ids, positions)
        joined = torch.cat([model.enorm(embedded), model.hnorm(previous.to(embedded.dtype))], dim=-1)
        hidden, residual = model.layers[0](positions, model.eh_proj(joined), None, kv_cache, metadata)
        return model.norm(hidden, residual)

    def draft_logits(self, normed: torch.Tensor, target: LlamaForCausalLM) -> torch.Tensor:
        return target.compute_logits(normed)  # (the main model's head)

    def draft_ids(self, normed: torch.Tensor, target: LlamaForCausalLM) -> torch.Tensor:
        return self.draft_logits(normed, target).argmax(dim=-1)


def load_mtp(folder: str | Path, config: ModelConfig, dtype: torch.dtype, backend: AttentionBackend,
             max_position: int, quantization: str | None, device, load_format: str = "auto",
             tensor_parallel=None) -> MultiTokenPredictor:
    """The first MTP layer of the checkpoint in `folder` (`config` its main model's), read
    alone: no other tensor of the checkpoint is read again ("dummy": random weights).
    `tensor_parallel`: (a rank's group, the whole main model's config) where `config` is a
    rank's slice: its layer cut as the main model's layers are (by name: the fusion,
    `eh_proj` and the norms, whole on every rank), its products summed over the ranks."""
    if not config.skipped_layers:
        raise ValueError(f"speculative_config method mtp: {config.architecture} here has no multi-token-prediction "
                         "layers (its config counts none: num_nextn_predict_layers)")
    prefix = f"model.layers.{config.num_hidden_layers}."
    shared = tuple(prefix + name for name in SHARED)
    with torch.device("cpu"):
        module = MultiTokenPredictor(config, backend, max_position)
    if tensor_parallel is not None:
        group, full = tensor_parallel
        module.shards = Shards(full, group.rank, group.world_size, config.local_experts)

    def renamed():
        found = False
        for name, tensor in read_weights(Path(folder), config, lambda n: n.startswith(prefix) and
                                         not n.startswith(shared)):
            found, rest = True, name[len(prefix):]
            if rest.startswith(FUSION):
                yield "model." + rest, tensor
            elif rest.startswith("shared_head.norm."):
                yield "model.norm." + rest[len("shared_head.norm."):], tensor
            else:
                yield "model.layers.0." + rest, tensor
        if not found:
            raise ValueError(f"speculative_config method mtp: the checkpoint in {folder} holds no "
                             f"multi-token-prediction layer ({prefix}*)")

    if load_format == "dummy":
        dummy_weights(module)
    else:
        module.load_weights(renamed())
    if tensor_parallel is not None:
        split_sums(module, tensor_parallel[0])
    return ready_to_run(module, dtype, quantization, device, tensor_parallel)
