"""The one decoder every family runs on (models/families/registry.py lists them), over a
paged KV cache: attention (or a hybrid's recurrent mixer, or latent attention) and an MLP
(dense or sparse) a layer, with the norms, scalars and positions each family's config
asks for (models/decoder_config.py), so one test file holds every family to transformers.

The module tree mirrors Hugging Face's so checkpoints load by name, except that q/k/v
and gate/up are fused into one matmul each (models/weight_names.py maps the names). The
forward takes one step's flattened tokens, with no batch dimension and no padding.
"""
from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.backend import AttentionBackend
from services.worker.attention.metadata import AttentionMetadata
from services.worker.layers.attention import Attention, triton_elementwise
from services.worker.layers.gated_delta_net import (
    GatedDeltaNet,
)
from services.worker.layers.latent_attention import LatentAttention
from services.worker.layers.layer_norm import LayerNorm
from services.worker.layers.lora import LoRAMapping
from services.worker.layers.mamba2 import Mamba2Mixer
from services.worker.layers.mlp import MLP, ClampedSwiGLUExpert
from services.worker.layers.moe import CorrectedRouter, SparseMoE
from services.worker.layers.query_scale import QueryScale
from services.worker.layers.rms_norm import ResidualAdd, RMSNorm
from services.worker.layers.rotary import RotaryEmbedding
from services.worker.layers.short_conv import ShortConv
from services.worker.models.checkpoints.decoder_weights import load_decoder_weights
from services.worker.models.decoder_config import ModelConfig

# A hybrid's token mixers with a state a request in place of attention (ModelConfig.recurrent_mixer)
RECURRENT_MIXERS = {"gated_delta_net": GatedDeltaNet, "short_conv": ShortConv, "mamba2": Mamba2Mixer}


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, index: int,
                 local_rotary: RotaryEmbedding | None = None, no_rotary: RotaryEmbedding | None = None,
                 position_scale: QueryScale | None = None):
        super().__init__()
        triton = triton_elementwise(backend)
        # (OLMo 2 norms no branch's input: the residual add alone, and each branch's output;
        # OLMo Hybrid its attention layers so, its others as a Llama)
        post_normed = not config.pre_norms or index in config.post_normed_layers
        self.input_layernorm = ResidualAdd() if post_normed else _norm(config, triton)
        window = config.layer_windows[index] if config.layer_windows else 0
        if window and local_rotary is not None:  # Gemma 3: the windowed layers' own base
            rotary = local_rotary
        if index in config.nope_layers:  # SmolLM3: no rotation at all
            rotary = no_rotary
        if index in config.mixerless_layers:  # (Nemotron-H's MLP blocks: no token mixer)
            self.self_attn = None
        elif index in config.recurrent_layers:  # a hybrid's token mixer with a state in place of a KV cache
            self.self_attn = RECURRENT_MIXERS[config.recurrent_mixer](config)
        else:
            self.self_attn = LatentAttention(config, rotary, backend, triton) if config.kv_lora_rank \
                else Attention(config, rotary, backend, triton, window)
            self.self_attn.position_scale = position_scale
        # GPT-NeoX, Phi: attention and MLP side by side; Phi's MLP reads the attention's input
        self.parallel = config.parallel_residual
        self.residual_first = config.residual_first  # (StableLM's and Cohere's order of the sum)
        # (Nemotron-H's blocks of one branch have no second norm: a mixer block no MLP, an
        # MLP block's input norm the MLP's)
        one_branch = index in config.mlpless_layers or index in config.mixerless_layers
        self.post_attention_layernorm = None if config.shared_norm or one_branch else _norm(config, triton)
        if config.sandwich_norms or index in config.post_normed_layers:
            # Gemma 2: post_attention_layernorm norms the attention's output alone
            self.pre_feedforward_layernorm = ResidualAdd() if post_normed else \
                RMSNorm(config.hidden_size, config.rms_norm_eps, triton)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, triton)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if index in config.mlpless_layers:  # (Nemotron-H's mixer blocks: no MLP)
            self.mlp = None
        elif index in config.moe_layers:
            expert = MLP if not config.swiglu_limit else partial(
                ClampedSwiGLUExpert, alpha=config.swiglu_alpha, limit=config.swiglu_limit)
            router = CorrectedRouter(config.num_experts, config.hidden_size, config.moe_score_correction,
                                     config.moe_num_groups, config.moe_topk_groups, config.routed_scaling_factor,
                                     config.moe_norm_min, config.moe_router_float32, config.moe_correction_bias,
                                     config.moe_group_by_max, config.moe_norm_eps) if config.moe_score_correction else None
            self.mlp = SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                 config.num_experts_per_tok, config.norm_topk_prob, expert, fused=backend.name == "triton",
                                 topk_softmax=config.moe_topk_softmax,
                                 shared_intermediate_size=config.shared_expert_intermediate_size,
                                 router_bias=config.moe_bias, shared_gated=config.shared_expert_gated, router=router,
                                 router_float32=config.moe_router_float32, local_experts=config.local_experts)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, triton, config.hidden_act, config.mlp_bias,
                           config.gated_mlp)

    def forward(self, positions, hidden, residual, kv_cache, metadata):
        """(this layer's MLP output, the residual stream before adding it): each residual
        add is done by the norm that follows it, so it can fuse with it (vLLM's layout)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.parallel:  # x + attention(norm(x)) + mlp(norm'(x)), both off the same x (`residual`)
            attended = self.self_attn(positions, hidden, kv_cache, metadata)
            mlp_input = hidden if self.post_attention_layernorm is None else self.post_attention_layernorm(residual)
            if self.residual_first:  # (x + attention) + mlp, the next norm's add doing the second
                return self.mlp(mlp_input), residual + attended
            return attended + self.mlp(mlp_input), residual
        if self.self_attn is None:  # (Nemotron-H's blocks of one branch: its MLP alone, its mixer alone)
            return self.mlp(hidden), residual
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        if self.mlp is None:
            return hidden, residual
        if self.pre_feedforward_layernorm is None:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        # Gemma 2 norms each branch's output before the residual add (which the next norm
        # does, as above): attention -> norm -> add -> norm -> MLP -> norm.
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


def _norm(config: ModelConfig, triton: bool) -> nn.Module:
    if config.layer_norm:
        return LayerNorm(config.hidden_size, config.rms_norm_eps, config.norm_bias)
    return RMSNorm(config.hidden_size, config.rms_norm_eps, triton)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_position: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # One table shared by every layer (a plain attribute, not a submodule per layer).
        rotary = RotaryEmbedding(config.rotary_head_dim, max_position, config.rope_theta, config.rope_scaling,
                                 config.rotary_dim)
        self.rotary = rotary
        self.local_rotary = None if config.local_rope_theta is None else RotaryEmbedding(
            config.rotary_head_dim, max_position, config.local_rope_theta, {"rope_type": "default"}, config.rotary_dim)
        self.no_rotary = RotaryEmbedding.identity(config.rotary_head_dim, max_position) if config.nope_layers else None
        # Ministral 3's and Mistral 4's queries scaled by position (layers/query_scale.py)
        position_scale = QueryScale(config.query_scale_beta, config.query_scale_original) if config.query_scale_beta \
            else None
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary, backend, i, self.local_rotary, self.no_rotary, position_scale)
            for i in range(config.num_hidden_layers)
        )
        self.norm = _norm(config, triton_elementwise(backend))
        # GPT-2, OPT: learned absolute positions (their layers do not rotate)
        self.embed_positions = nn.Embedding(config.position_embeddings, config.hidden_size) \
            if config.position_embeddings else None


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_position: int):
        super().__init__()
        self.config = config
        self.attention_backend = backend  # every layer's
        self.model = LlamaModel(config, backend, max_position)
        # Decode-only steps in one C call per layer (on CPU, with the kernels), set by the loader.
        self.fused_decode = None
        # False for a checkpoint without an LM head (an embedding model's decoder alone):
        # it embeds, and the scheduler refuses it anything to generate.
        self.generates = True
        # Which tokens of a step take which LoRA adapter, where the worker serves adapters.
        self.lora: LoRAMapping | None = None
        # A tensor-parallel rank's cutter of checkpoint tensors and its rows of the
        # vocabulary (parallel/sharding.py), set by the loader; None: the whole model.
        self.shards = None
        self.vocab_slices = None
        # EAGLE-3's drafts read the residual stream entering these layers (`aux_hidden`, each step's, joined)
        self.aux_layers: tuple[int, ...] = ()
        # A sequence classifier (config.num_labels): a score head, whose logits the worker
        # pools at the prompt's last token as it pools embeddings; it generates nothing.
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False) if config.num_labels else None
        if config.tie_word_embeddings or config.num_labels:
            self.lm_head = None
            self.generates = not config.num_labels
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)

    @property
    def eager_only(self) -> bool:
        """This step must run the modules themselves: the fast paths (captured CUDA graphs,
        the fused C decode layer) were built without adapters, so a step with any skips them,
        and they keep no layer's input for EAGLE-3's drafts."""
        return self.lora is not None and self.lora.active or bool(self.aux_layers)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        metadata: AttentionMetadata,
        images=None,  # a step's image embeddings (vision/step_images.py): rows of `hidden` they replace
    ) -> torch.Tensor:  # [num_tokens, hidden_size], after the final norm
        if (images is None and self.fused_decode is not None and not self.eager_only
                and self.fused_decode.takes(input_ids, metadata, kv_caches)):
            return self.fused_decode.forward(input_ids, positions, kv_caches, metadata)
        hidden, residual = self.embed(input_ids, positions), None
        if images is not None:  # (after the embedding's multiplier: transformers scatters them so)
            hidden = images.apply(hidden, metadata)
        aux = {}
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            if i in self.aux_layers:
                aux[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
            if images is not None and images.deepstack > i:  # (Qwen3-VL's image features into its first layers)
                # (the layer's output summed here, as transformers adds them to it: the same rounding)
                hidden, residual = images.add_deepstack(i, hidden + residual), None
        if aux:
            self.aux_hidden = torch.cat([aux[i] for i in self.aux_layers], dim=-1)
        if residual is None:  # no layers
            return self.model.norm(hidden)
        return self.model.norm(hidden, residual)[0]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        if self.model.embed_positions is not None:  # GPT-2's, OPT's (tokens' rows + positions' rows)
            return hidden + self.model.embed_positions(positions + self.config.position_offset)
        # Granite's and Gemma's multiplier on the looked-up rows, not folded into the table:
        # a tied LM head reads the same table.
        multiplier = self.config.embedding_multiplier
        if multiplier == 1.0:
            return hidden
        if self.config.embedding_multiplier_in_dtype:
            key = (multiplier, hidden.dtype)
            if key not in _EMBEDDING_SCALES:
                _EMBEDDING_SCALES[key] = torch.tensor(multiplier, dtype=hidden.dtype).item()
            multiplier = _EMBEDDING_SCALES[key]
        return hidden * multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden_size] -> [num_rows, vocab_size] float32
        if not self.generates:
            raise RuntimeError("this model has no LM head: it computes no logits")
        logits = F.linear(hidden, self.model.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)
        if self.vocab_slices is not None:  # a tensor-parallel rank's rows of the vocabulary: every rank's, in order
            logits = self.vocab_slices.gather(logits)
        logits = logits.float()
        if self.config.final_logit_softcapping is not None:  # Gemma 2 (in float32; transformers: the model's dtype)
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits if self.config.logits_scaling == 1.0 else logits / self.config.logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by Hugging Face name; every parameter must be set
        (checkpoints/decoder_weights.py)."""
        load_decoder_weights(self, weights)

    @torch.no_grad()
    def fold_residual_multiplier(self) -> None:
        """Granite scales each attention and MLP output before it joins the residual
        stream. Both end in a linear map, so the scalar goes into those weights once, here,
        before any quantization or packing: every path (modules, the CPU kernels' one-call
        layer, Triton, graphs) then runs it at no cost, where a multiply would be two more
        passes a layer and a case the C layer lacks."""
        multiplier = self.config.residual_multiplier
        if multiplier == 1.0:
            return
        for layer in self.model.layers:
            # (a sparse MLP's output is its experts' weighed sum: each expert's down_proj takes it)
            downs = [e.down_proj for e in (*layer.mlp.experts, *filter(None, [layer.mlp.shared_expert]))] \
                if isinstance(layer.mlp, SparseMoE) else [layer.mlp.down_proj]
            # (a hybrid's recurrent mixers end in out_proj)
            output = layer.self_attn.o_proj if hasattr(layer.self_attn, "o_proj") else layer.self_attn.out_proj
            for linear in (output, *downs):
                linear.weight.mul_(multiplier)
                if linear.bias is not None:
                    linear.bias.mul_(multiplier)


# (multiplier, dtype) -> the multiplier rounded to that dtype, as a Python float: found once,
# not in every step (nor in a captured one).
_EMBEDDING_SCALES: dict[tuple[float, torch.dtype], float] = {}
