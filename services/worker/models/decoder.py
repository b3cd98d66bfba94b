"""Llama-family decoder (Llama, Mistral-style configs, Qwen2, Qwen3, Phi-3, Granite, Gemma 1-3;
Mixtral and Qwen3-MoE with sparse MLPs) over a paged KV cache.

The module tree mirrors Hugging Face's so checkpoints load by name, except that q/k/v
and gate/up are fused into one matmul each (`PACKED_WEIGHTS` maps the names). The
forward takes one step's flattened tokens, with no batch dimension and no padding.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterable, Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import kernels.cpu as cpu_kernels
import kernels.elementwise as triton_kernels
from services.worker.attention.backend import AttentionBackend
from services.worker.attention.metadata import AttentionMetadata
from services.worker.layers.layer_norm import LayerNorm
from services.worker.layers.lora import LoRAMapping, LoRAStack, adapted
from services.worker.layers.moe import CorrectedRouter, SparseMoE
from services.worker.layers.query_scale import QueryScale
from services.worker.layers.rms_norm import ResidualAdd, RMSNorm
from services.worker.layers.rotary import RotaryEmbedding, interleaved_as_halves
from services.worker.layers.gated_delta_net import GatedDeltaNet, key_head_grouped_tensors
from services.worker.models.gpt_oss_weights import gpt_oss_tensors
from services.worker.layers.mamba2 import Mamba2Mixer
from services.worker.layers.short_conv import ShortConv
from services.worker.layers.latent_attention import LatentAttention, rope_rows_as_halves
from services.worker.models.layer_normed_names import checkpoint_tensor
from services.worker.models.decoder_config import ModelConfig
from services.worker.models.families.registry import (DEEPSEEK_V3_MOES, GRANITE_HYBRID, HUNYUANS, LINEAR_ATTENTION,
                                                      OLMO_HYBRID, SHORT_CONVS)

log = logging.getLogger("llmbus.worker")

# checkpoint name part -> (our fused module, shard index)
PACKED_WEIGHTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# A multimodal checkpoint's language model (Gemma 3's), as the Hub's checkpoints and
# transformers 5's in-memory layout name it, and the parts the loader leaves unread.
LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                           "model.language_model.": "model."}
MULTIMODAL_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                    "visual.", "model.visual.")  # (the last two Qwen-VL's)
# Mixtral's (and GraniteMoe's router's) names for the parts that Qwen3-MoE and our modules call otherwise.
ALIASES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj.",
           ".mlp.router.layer.": ".mlp.gate."}
# GLM-4-0414's names for Gemma 2's four norms: its post_attention_layernorm is the MLP's
# input norm, the attention's output norm is post_self_attn_layernorm.
GLM4_NORMS = {".post_attention_layernorm.": ".pre_feedforward_layernorm.",
              ".post_self_attn_layernorm.": ".post_attention_layernorm.",
              ".post_mlp_layernorm.": ".post_feedforward_layernorm."}
# Each family's own names for our modules, by architecture: a weight's name takes the first
# that it holds, once (GLM-4-0414's overlap: one of its names is another's rename).
NAMES_OF = {
    "Glm4ForCausalLM": GLM4_NORMS,
    "ApertusForCausalLM": {".attention_layernorm.": ".input_layernorm.",
                           ".feedforward_layernorm.": ".post_attention_layernorm."},
    **dict.fromkeys(HUNYUANS, {".query_layernorm.": ".q_norm.", ".key_layernorm.": ".k_norm.",
                               ".mlp.gate.wg.": ".mlp.gate.", ".mlp.shared_mlp.": ".mlp.shared_expert."}),
    **dict.fromkeys((*DEEPSEEK_V3_MOES, "DeepseekV2ForCausalLM", "Mistral4ForCausalLM"),
                    {".mlp.shared_experts.": ".mlp.shared_expert."}),
    "Ernie4_5_MoeForCausalLM": {".mlp.shared_experts.": ".mlp.shared_expert.", ".mlp.moe_statics.": ".mlp.gate."},
    # (its bias beside the router, in the block Mixtral's names call block_sparse_moe)
    "MiniMaxM2ForCausalLM": {".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"},
    "VaultGemmaForCausalLM": {".pre_feedforward_layernorm.": ".post_attention_layernorm."},
    "AfmoeForCausalLM": {".pre_mlp_layernorm.": ".pre_feedforward_layernorm.",
                         ".post_mlp_layernorm.": ".post_feedforward_layernorm.", ".mlp.router.gate.": ".mlp.gate.",
                         ".mlp.expert_bias": ".mlp.gate.e_score_correction_bias",
                         ".mlp.shared_experts.": ".mlp.shared_expert.", ".self_attn.gate_proj.": ".self_attn.output_gate."},
    "ExaoneMoeForCausalLM": {".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias",
                             ".mlp.shared_experts.": ".mlp.shared_expert."},
    # (a hybrid's token mixer is `self_attn` whatever it is; its gated norm weighs by w alone)
    **dict.fromkeys(LINEAR_ATTENTION, {".linear_attn.norm.weight": ".self_attn.norm_weight",
                                       ".linear_attn.": ".self_attn."}),
    # (its final norm is called embedding_norm; its short convolutions are `self_attn` here)
    # (its MLPs' w1/w3/w2 read as Mixtral's experts' are, ALIASES)
    **dict.fromkeys(SHORT_CONVS, {
        "model.embedding_norm.": "model.norm.", ".operator_norm.": ".input_layernorm.",
        ".ffn_norm.": ".post_attention_layernorm.", ".feed_forward.expert_bias": ".mlp.gate.e_score_correction_bias",
        ".feed_forward.": ".mlp.", ".self_attn.out_proj.": ".self_attn.o_proj.",
        ".self_attn.q_layernorm.": ".self_attn.q_norm.", ".self_attn.k_layernorm.": ".self_attn.k_norm.",
        ".conv.": ".self_attn."}),
    # (its q/k/v products and their convolutions fused by olmo_hybrid_tensors; its norms'
    # names those transformers renames)
    OLMO_HYBRID: {".attention_layer_norm.": ".input_layernorm.", ".feedforward_layer_norm.": ".post_attention_layernorm.",
                  ".linear_attn.o_norm.weight": ".self_attn.norm_weight", ".linear_attn.g_proj.": ".self_attn.in_proj_z.",
                  ".linear_attn.a_proj.": ".self_attn.in_proj_a.", ".linear_attn.b_proj.": ".self_attn.in_proj_b.",
                  ".linear_attn.o_proj.": ".self_attn.out_proj.", ".linear_attn.": ".self_attn."},
    # (its attention's names Qwen3's, but its gate's: a head a gate, AFMoE's name)
    "Lfm3ForCausalLM": {".self_attn.gate_proj.": ".self_attn.output_gate.",
        "model.embedding_norm.": "model.norm.", ".operator_norm.": ".input_layernorm.",
        ".post_operator_norm.": ".post_attention_layernorm.", ".ffn_norm.": ".pre_feedforward_layernorm.",
        ".post_ffn_norm.": ".post_feedforward_layernorm.", ".feed_forward.": ".mlp.", ".conv.": ".self_attn."},
    # (Granite 4.0-H's shared MLP: granite_hybrid_tensors)
    GRANITE_HYBRID: {".mamba.norm.weight": ".self_attn.norm_weight", ".mamba.": ".self_attn."},
    "BambaForCausalLM": {".mamba.norm.weight": ".self_attn.norm_weight", ".mamba.": ".self_attn.",
                         ".feed_forward.": ".mlp.", ".pre_ff_layernorm.": ".post_attention_layernorm.",
                         "model.final_layernorm.": "model.norm."},
}
# Experts stacked in one tensor each: one expert's row each. GraniteMoe's are [experts, out,
# in]; Qwen3-VL-MoE's [experts, in, out] as the Hub ships them, [experts, out, in] as
# transformers 5 saves them: read by shape, and where the shape cannot tell (in == out) as
# the Hub's.
STACKED_EXPERTS = {".mlp.input_linear.weight": "gate_up_proj", ".mlp.output_linear.weight": "down_proj",
                   ".mlp.experts.gate_up_proj": "gate_up_proj", ".mlp.experts.down_proj": "down_proj"}
TRANSPOSED_FIRST = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
# Families whose checkpoints stack their experts in their transformers class's own layout,
# [experts, out, in], whatever the shapes (transformers converts none on load: Mistral 4's)
STACKED_OUT_IN = ("Mistral4ForCausalLM",)
# Checkpoint tensors a family holds beside its model that transformers leaves unread
# (EXAONE MoE's multi-token-prediction module)
UNREAD_PREFIXES = {"ExaoneMoeForCausalLM": ("mtp.",), **dict.fromkeys(LINEAR_ATTENTION, ("mtp.",))}


# A hybrid's token mixers with a state a request in place of attention (ModelConfig.recurrent_mixer)
RECURRENT_MIXERS = {"gated_delta_net": GatedDeltaNet, "short_conv": ShortConv, "mamba2": Mamba2Mixer}


def triton_elementwise(backend: AttentionBackend) -> bool:
    """Whether the element-wise work runs in Triton kernels (kernels/elementwise.py): with
    the GPU's attention backend, unless LLMBUS_TRITON_ELEMENTWISE=0 (PyTorch ops instead;
    scripts/device_check.sh sets it when the kernels fail its first check)."""
    return backend.name == "triton" and os.environ.get("LLMBUS_TRITON_ELEMENTWISE", "1") != "0"


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, triton: bool = False,
                 window: int = 0):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale if config.attention_scale is not None else self.head_dim**-0.5
        # OPT scales the queries as they leave their projection, and the scores not at all
        self.query_scale = None
        if config.scale_queries:
            self.query_scale, self.scale = self.scale, 1.0
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        # AFMoE's: the heads' output gated by sigmoid(gate_proj(x)), x the attention's input
        # (its checkpoint's self_attn.gate_proj, renamed: `gate_proj` is an MLP's half here),
        # an output element a gate; LFM3's a head a gate
        self.gate_per_head = config.attention_gate_per_head
        gates = self.num_heads if self.gate_per_head else self.q_size
        self.output_gate = nn.Linear(config.hidden_size, gates, bias=False) if config.attention_gate else None
        self.shard_sizes = (self.q_size, self.kv_size, self.kv_size)
        # LoRA adapters' products on top of qkv_proj's and o_proj's (layers/lora.py), where
        # the worker serves adapters (manager.py attaches them)
        self.qkv_lora: LoRAStack | None = None
        self.o_lora: LoRAStack | None = None
        self.rotary = rotary
        self.backend = backend
        self.position_scale = None  # Llama 4's temperature by position, where the model has one (set by its layer)
        # This layer's sliding window (0: none) and Gemma 2's soft cap on the scores
        self.window = window
        self.softcap = config.attn_logit_softcapping
        # gpt-oss: a logit per query head that each row's softmax also spreads over
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None
        # With the Triton kernels on (`triton_elementwise`), one kernel rotates queries and
        # keys and writes keys and values into the cache (kernels/elementwise.py), then the
        # backend attends over the cache. A partial rotary rotates in PyTorch.
        self.qk_norm_after_rope = config.qk_norm_after_rope  # (then the rotary cannot write the cache)
        self.rotary_writes_cache = triton and rotary.head_dim == self.head_dim and not self.qk_norm_after_rope
        self.qk_norm_over_heads = config.qk_norm_over_heads
        if config.qk_norm:  # Qwen3: over each head's head_dim (OLMo 2: over all of them), a weight for q and for k
            over = (self.num_heads, self.num_kv_heads) if config.qk_norm_over_heads else (1, 1)
            self.q_norm = RMSNorm(over[0] * self.head_dim, config.rms_norm_eps, triton=triton)
            self.k_norm = RMSNorm(over[1] * self.head_dim, config.rms_norm_eps, triton=triton)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = adapted(self.qkv_proj, self.qkv_lora, hidden)
        if self.query_scale is not None:
            qkv[:, : self.q_size] *= self.query_scale
        # Query and key heads are adjacent: rotate them in one pass, then split the result.
        qk = qkv[:, : self.q_size + self.kv_size].unflatten(-1, (self.num_heads + self.num_kv_heads, self.head_dim))
        if self.q_norm is not None and self.qk_norm_over_heads:  # OLMo 2: each token's queries, and keys, as one row
            qk = torch.cat((self.q_norm(qkv[:, : self.q_size].contiguous()),
                            self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].contiguous())),
                           dim=1).unflatten(-1, (self.num_heads + self.num_kv_heads, self.head_dim))
        elif self.q_norm is not None and not self.qk_norm_after_rope:
            qk = self._head_norms(qk, num_tokens)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.rotary_writes_cache:
            q = triton_kernels.rotary_and_cache(qk, v, positions, self.rotary.cos_cache, self.rotary.sin_signed_cache,
                                                kv_cache[0], kv_cache[1], metadata.slot_mapping, self.num_heads)
            if self.position_scale is not None:
                q = q * self.position_scale(positions, q.dtype)
            out = self.backend.forward(q, None, None, kv_cache, metadata, self.scale, self.window, self.softcap,
                                       self.sinks)
        else:
            qk = self.rotary(positions, qk)
            if self.qk_norm_after_rope:
                qk = self._head_norms(qk, num_tokens)
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            if self.position_scale is not None:
                q = q * self.position_scale(positions, q.dtype)
            out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale, self.window, self.softcap, self.sinks)
        out = out.reshape(num_tokens, self.q_size)
        if self.output_gate is not None and self.gate_per_head:
            out = (out.view(num_tokens, self.num_heads, self.head_dim)
                   * torch.sigmoid(self.output_gate(hidden)).unsqueeze(-1)).view(num_tokens, self.q_size)
        elif self.output_gate is not None:
            out = out * torch.sigmoid(self.output_gate(hidden))
        return adapted(self.o_proj, self.o_lora, out)

    def _head_norms(self, qk: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Each query and key head normed over its head_dim (Qwen3's, Hunyuan's)."""
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        # Norms as contiguous rows of head_dim (what their kernels take: with one KV head
        # the key's reshape is a strided view), then side by side again.
        q, k = (x.reshape(-1, self.head_dim).contiguous() for x in (q, k))
        return torch.cat((self.q_norm(q).view(num_tokens, self.num_heads, self.head_dim),
                          self.k_norm(k).view(num_tokens, self.num_kv_heads, self.head_dim)), dim=1)


# The gate's activation for the MLPs that are not SwiGLU (Gemma's GeGLU), as transformers'
# ACT2FN names them, where the kernels do not take it (off the CPU, or GELU's exact form).
GATE_ACTS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
             "relu2": lambda x: F.relu(x).square(),  # (relu2: of an MLP without a gate, Arcee's)
             # GPT-2's and Phi's tanh form, as transformers computes it (not PyTorch's fused one:
             # the same function, other roundings)
             "gelu_new": lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                                               * (x + 0.044715 * torch.pow(x, 3.0)))),
             "relu": F.relu}


class XIELU(nn.Module):
    """Apertus' xIELU activation (transformers' Python form): per layer, learned `alpha_p`
    and `alpha_n` (through softplus) and fixed `beta` and `eps`, all four read from the
    checkpoint as transformers saves them."""

    def __init__(self) -> None:
        super().__init__()
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            setattr(self, name, nn.Parameter(torch.zeros(1 if name.startswith("alpha") else ()), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + self.beta * x)


class MLP(nn.Module):
    """The dense gated MLP (SwiGLU, or GeGLU by `hidden_act`), and each expert of a sparse one."""

    def __init__(self, hidden_size: int, intermediate_size: int, triton: bool = False, hidden_act: str = "silu",
                 bias: bool = False, gated: bool = True):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.gated = gated  # False (Arcee): gate_up_proj holds the up rows alone, down(act(up x))
        self.triton = triton and hidden_act == "silu"  # SiLU-and-mul in one Triton kernel (kernels/elementwise.py)
        self.gate_up_proj = nn.Linear(hidden_size, (2 if gated else 1) * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.shard_sizes = (intermediate_size, intermediate_size) if gated else (intermediate_size,)
        self.act_fn = XIELU() if hidden_act == "xielu" else GATE_ACTS[hidden_act]  # (a module: its parameters load)
        self.gate_up_lora: LoRAStack | None = None  # as Attention's
        self.down_lora: LoRAStack | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden_size]
        gate_up = adapted(self.gate_up_proj, self.gate_up_lora, x)
        if not self.gated:
            return adapted(self.down_proj, self.down_lora, self.act_fn(gate_up))
        if self.triton and gate_up.is_contiguous():
            act = triton_kernels.silu_mul(gate_up)
        elif (self.hidden_act in cpu_kernels.ACTIVATIONS and cpu_kernels.supports(gate_up)
              and gate_up.is_contiguous()):
            act = cpu_kernels.act_and_mul(gate_up, self.hidden_act)  # one pass, the same roundings
        else:
            gate, up = gate_up.split(self.shard_sizes, dim=-1)
            act = GATE_ACTS[self.hidden_act](gate) * up
        return adapted(self.down_proj, self.down_lora, act)


class ClampedSwiGLUExpert(nn.Module):
    """gpt-oss's expert: biased products, and between them a SwiGLU with clamps, its gate
    at most `limit` and its up within +-`limit`, (up + 1) * gate * sigmoid(alpha * gate),
    as transformers computes it. `gate_up_proj` holds the gate rows, then the up rows (the
    checkpoint interleaves them: models/gpt_oss_weights.py reorders them at load)."""

    def __init__(self, hidden_size: int, intermediate_size: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=True)
        self.shard_sizes = (intermediate_size, intermediate_size)
        self.gate_up_lora: LoRAStack | None = None  # (adapters are refused for it: attribute for the loader's walk)
        self.down_lora: LoRAStack | None = None

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.shard_sizes, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activate(self.gate_up_proj(x)))


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
                                 router_float32=config.moe_router_float32)
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
        the fused C decode layer) were built without adapters, so a step with any skips them."""
        return self.lora is not None and self.lora.active

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], after the final norm
        if (self.fused_decode is not None and not self.eager_only
                and self.fused_decode.takes(input_ids, metadata, kv_caches)):
            return self.fused_decode.forward(input_ids, positions, kv_caches, metadata)
        hidden, residual = self.embed(input_ids, positions), None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
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
        if self.lm_head is None:  # tied
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        if self.config.final_logit_softcapping is not None:  # Gemma 2 (in float32; transformers: the model's dtype)
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits if self.config.logits_scaling == 1.0 else logits / self.config.logits_scaling

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by Hugging Face name; every parameter must be set."""
        params = dict(self.named_parameters())
        # (GLM-4.5's routers' correction biases are float32 buffers, read as weights are)
        params.update((n, b) for n, b in self.named_buffers() if n.endswith(".e_score_correction_bias"))
        loaded: set[str] = set()
        arch, heads = self.config.architecture, self.config.num_attention_heads
        num_layers = self.config.num_hidden_layers
        skipped = tuple(f"model.layers.{i}." for i in range(num_layers, num_layers + self.config.skipped_layers))
        if arch == "GptOssForCausalLM":  # its stacked, interleaved, MXFP4 experts, one by one
            weights = gpt_oss_tensors(weights)
        if arch in LINEAR_ATTENTION:
            weights = gated_query_tensors(weights, heads, self.config.head_dim)
        if arch == "Qwen3NextForCausalLM":
            weights = key_head_grouped_tensors(weights, self.config)
        if arch == GRANITE_HYBRID:
            weights = granite_hybrid_tensors(weights, bool(self.config.moe_layers))
        if arch == "NemotronHForCausalLM":
            weights = nemotron_h_tensors(weights, self.config)
        if arch == OLMO_HYBRID:
            weights = olmo_hybrid_tensors(weights)
        unread = UNREAD_PREFIXES.get(arch, ())
        for name, tensor in weights:
            if unread and name.startswith(unread):
                continue
            renamed = checkpoint_tensor(arch, name, tensor, heads)  # (GPT-2's, OPT's, GPT-NeoX's, Phi's names)
            if renamed is None:
                continue
            name, tensor = renamed
            for theirs, ours in LANGUAGE_MODEL_PREFIXES.items():
                if name.startswith(theirs):
                    name = ours + name[len(theirs):]
            if not name.startswith(("model.", "lm_head.", "score.")):
                name = "model." + name  # a decoder saved alone (LlamaModel, MistralModel, ...)
            if skipped and name.startswith(skipped):
                continue  # (GLM-4.5's multi-token-prediction layers: transformers skips them too)
            if ".experts." in name or ".block_sparse_moe." in name or arch in SHORT_CONVS:
                for theirs, ours in ALIASES.items():
                    name = name.replace(theirs, ours)
            if "rotary_emb.inv_freq" in name:
                continue  # old checkpoints stored the table; we compute it
            names = NAMES_OF.get(self.config.architecture, {})
            theirs = next((n for n in names if n in name), None)
            name = name if theirs is None else name.replace(theirs, names[theirs])
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves
            if name.endswith(".e_score_correction_bias") and tensor.dim() == 2 and len(tensor) == 1:
                tensor = tensor[0]  # (ERNIE's [1, experts]: one group of statistics)
            if self.config.kv_lora_rank and self.config.rotary_interleaved:  # (DeepSeek's interleaved rotating rows)
                tensor = rope_rows_as_halves(name, tensor, self.config)
            stacked = next((s for s in STACKED_EXPERTS if name.endswith(s)), None)
            if stacked is not None:
                prefix = name[: -len(stacked)] + ".mlp.experts"
                for e, rows in enumerate(tensor.unbind(0)):
                    target = f"{prefix}.{e}.{STACKED_EXPERTS[stacked]}.weight"
                    if target not in params:
                        raise ValueError(f"checkpoint has unexpected weight {name!r} (expert {e})")
                    if stacked in TRANSPOSED_FIRST and arch not in STACKED_OUT_IN and rows.T.shape == params[target].shape:
                        rows = rows.T
                    _copy(params[target].data, rows, name)
                    loaded.add(target)
                continue
            for part, (fused, shard) in PACKED_WEIGHTS.items():
                # (latent attention's q_proj is its own, not a third of a fused one)
                if f".{part}." in name and not (part == "q_proj" and self.config.kv_lora_rank):
                    if part == "up_proj" and not self.config.gated_mlp:
                        shard = 0  # (the up rows are all an ungated MLP's gate_up_proj holds)
                    target = name.replace(part, fused)
                    if target not in params:  # (a bias the config does not announce, a layer too many)
                        raise ValueError(f"checkpoint has unexpected weight {name!r}")
                    module = self.get_submodule(target.rsplit(".", 2)[0])
                    sizes = module.shard_sizes
                    offset = sum(sizes[:shard])
                    param = params[target]
                    if self.config.rotary_interleaved and part in ("q_proj", "k_proj"):
                        tensor = interleaved_as_halves(tensor, self.config.head_dim, self.config.rotary_dim)
                    _copy(param.data.narrow(0, offset, sizes[shard]), tensor, name)
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint has unexpected weight {name!r}")
                if self.config.rotary_interleaved and ".qkv_proj." in name:
                    raise ValueError(f"checkpoint has {name!r} fused: interleaved rotary (GLM's) is reordered "
                                     "from q_proj and k_proj apart")
                _copy(params[name].data, tensor, name)
                loaded.add(name)
        if self.lm_head is not None and "lm_head.weight" not in loaded:
            log.warning("the checkpoint has no LM head: this model serves embeddings, not generation")
            self.lm_head, self.generates = None, False
            del params["lm_head.weight"]
        missing = []
        for name, param in params.items():
            if name in loaded:  # a fused weight the checkpoint holds fused too (Phi-3's qkv_proj, gate_up_proj)
                continue
            leaf = name.rsplit(".", 2)
            module_name = leaf[-2] if len(leaf) > 1 else ""
            if module_name in ("qkv_proj", "gate_up_proj"):
                num_shards = 3 if module_name == "qkv_proj" else 2 if self.config.gated_mlp else 1
                missing += [f"{name}#{s}" for s in range(num_shards) if f"{name}#{s}" not in loaded]
            elif name not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint lacks weights: {', '.join(missing[:5])}")
        self.fold_residual_multiplier()
        if self.config.norm_weight_offset:
            # Gemma's norms weigh by 1 + w, computed in float32 as transformers does (the
            # parameters are float32 until the loader casts them): then they are plain norms.
            for name, param in params.items():
                if name.endswith("norm.weight"):
                    param.add_(self.config.norm_weight_offset)

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


# (multiplier, dtype) -> the multiplier rounded to that dtype, as a Python float: found once,
# not in every step (nor in a captured one).
_EMBEDDING_SCALES: dict[tuple[float, torch.dtype], float] = {}


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


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
