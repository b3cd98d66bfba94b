"""EAGLE-3 heads (vLLM's `{"method": "eagle3", "model": HEAD}`), as published for Llama
3.1/3.3 and Qwen3 (`LlamaForCausalLMEagle3`: `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`).

A head is one Llama decoder layer trained to draft from the target's hidden states. The
target's residual stream entering three of its layers (`eagle_aux_hidden_state_layer_ids`,
by default 2, N/2 and N-3 of N, as vLLM picks them) is joined and brought to the head's
width by `fc`; at position p the layer reads that (normed by `hidden_norm`, and as its
residual) beside the embedding of the token at p + 1 (normed by `input_layernorm`): its
attention's q/k/v read both, 2H wide. Its head scores a draft vocabulary (`draft_vocab_size`
tokens, the target's most frequent), mapped to the target's ids by `d2t` (draft id i is
target id i + d2t[i]). A further draft reads the layer's own output in place of `fc`'s.
The embedding is the head's own where it ships one, else the target's.

Under --tensor-parallel-size every rank holds the whole head (one layer, a draft
vocabulary's head: a small share of the target's weights) and drafts alike from the
target's hidden states, which are whole on every rank; only the target's embedding, where
the head reads it, is cut (and summed) as the target's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from services.worker.attention.backend import AttentionBackend
from services.worker.layers.attention import triton_elementwise
from services.worker.layers.rms_norm import RMSNorm
from services.worker.loader import dummy_weights, iter_weights, ready_to_run, tensor_names
from services.worker.models.decoder import LlamaForCausalLM
from services.worker.models.decoder_config import ModelConfig
from shared.hf.model_folder import read_config

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class Eagle3Head(LlamaForCausalLM):
    """The head as a one-layer decoder whose layer's q/k/v read 2H, beside `fc` and `d2t`."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_position: int, draft_vocab_size: int,
                 fc_inputs: int, own_embedding: bool, norm_before_residual: bool) -> None:
        super().__init__(config, backend, max_position)
        hidden = config.hidden_size
        layer = self.model.layers[0]
        attention = layer.self_attn
        attention.qkv_proj = nn.Linear(2 * hidden, attention.q_size + 2 * attention.kv_size, bias=config.qkv_bias)
        layer.hidden_norm = RMSNorm(hidden, config.rms_norm_eps, triton_elementwise(backend))
        self.model.fc = nn.Linear(fc_inputs, hidden, bias=False)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        if not own_embedding:
            self.model.embed_tokens = None  # (the target's serves)
        self.norm_before_residual = norm_before_residual
        self.values_are_keys = False

    def kept(self, target: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """What it reads of a step of the target: the residual stream entering its chosen layers, joined."""
        return target.aux_hidden

    def predict(self, input_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor, kv_cache, metadata,
                target: LlamaForCausalLM) -> tuple[torch.Tensor, torch.Tensor]:
        """(the head's input, the layer's output) at each row: `previous` the target's
        joined hidden states (brought to the head's width by `fc`) or the layer's own output."""
        model, layer = self.model, self.model.layers[0]
        embedded = (target if model.embed_tokens is None else self).embed(input_ids, positions)
        previous = previous.to(embedded.dtype)
        if previous.shape[-1] != self.config.hidden_size:
            previous = model.fc(previous)
        normed = layer.hidden_norm(previous)
        residual = normed if self.norm_before_residual else previous
        joined = torch.cat([layer.input_layernorm(embedded), normed], dim=-1)
        attended = layer.self_attn(positions, joined, kv_cache, metadata)
        hidden, residual = layer.post_attention_layernorm(attended, residual)
        return model.norm(layer.mlp(hidden), residual)

    def draft_ids(self, normed: torch.Tensor, target: LlamaForCausalLM) -> torch.Tensor:
        best = self.lm_head(normed).argmax(dim=-1)  # (in the draft vocabulary)
        return best + self.d2t[best]

    def draft_logits(self, normed: torch.Tensor, target: LlamaForCausalLM) -> torch.Tensor:
        """Over the target's vocabulary (a token outside the draft vocabulary: -inf), as
        the target's sampler reads logits (probabilistic drafts)."""
        logits = self.lm_head(normed).float()
        full = logits.new_full((len(logits), target.config.vocab_size), float("-inf"))
        full[:, torch.arange(len(self.d2t), device=logits.device) + self.d2t] = logits
        return full


def load_eagle3(folder: str | Path, target: LlamaForCausalLM, dtype: torch.dtype, backend: AttentionBackend,
                max_position: int, device, load_format: str = "auto") -> Eagle3Head:
    """The head in `folder`, checked against the target it drafts for (its vocabulary, its
    width, the layers it reads); the target set to keep those layers' inputs ("dummy":
    random weights of the shape its config.json gives, its draft ids the target's)."""
    folder, goal = Path(folder), target.config
    raw = read_config(folder)
    name = f"speculative_config model {str(folder)!r}"
    if not set(raw.get("architectures") or []) & set(ARCHITECTURES):
        raise ValueError(f"{name} is not an EAGLE-3 head ({', '.join(ARCHITECTURES)}): its architectures are "
                         f"{raw.get('architectures')}")
    if raw["vocab_size"] != goal.vocab_size:
        raise ValueError(f"{name} drafts for a vocabulary of {raw['vocab_size']} tokens, the target's has "
                         f"{goal.vocab_size}: a head for another model")
    target_hidden = raw.get("target_hidden_size") or raw["hidden_size"]
    if target_hidden != goal.hidden_size:
        raise ValueError(f"{name} reads hidden states {target_hidden} wide, the target's are {goal.hidden_size}: "
                         "a head for another model")
    layers = goal.num_hidden_layers
    aux = tuple(raw.get("eagle_aux_hidden_state_layer_ids") or (2, layers // 2, layers - 3))
    if len(aux) != 3 or not all(0 <= i < layers for i in aux):
        raise ValueError(f"{name} reads the target's layers {list(aux)}: three of its {layers} "
                         "(eagle_aux_hidden_state_layer_ids)")
    own_embedding = load_format != "dummy" and "embed_tokens.weight" in tensor_names(folder)
    if not own_embedding and raw["hidden_size"] != goal.hidden_size:
        raise ValueError(f"{name} is {raw['hidden_size']} wide and has no embedding of its own: the target's is "
                         f"{goal.hidden_size} wide")
    # (built with no head and, where the target's serves, a one-row embedding: a
    # vocabulary-sized table made only to be replaced is gigabytes at Llama 3's size)
    config = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                                    "tie_word_embeddings": True,
                                    "vocab_size": raw["vocab_size"] if own_embedding else 1})
    with torch.device("cpu"):
        head = Eagle3Head(config, backend, max_position, raw.get("draft_vocab_size") or raw["vocab_size"],
                          3 * target_hidden, own_embedding, bool(raw.get("norm_before_residual")))
    d2t = []

    def renamed():
        for tensor_name, tensor in iter_weights(folder, lambda n: n != "t2d"):  # (t2d: for training)
            if tensor_name == "d2t":
                d2t.append(tensor)
                continue
            yield tensor_name.replace("midlayer.", "layers.0."), tensor

    if load_format == "dummy":
        dummy_weights(head)
    else:
        head.load_weights(renamed())
    if d2t:  # (a head of the target's whole vocabulary has none: draft ids are target ids)
        head.d2t.copy_(d2t[0])
    head = ready_to_run(head, dtype, None, device)
    target.aux_layers = aux
    return head
