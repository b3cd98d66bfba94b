"""What the worker needs to know of a Hugging Face model folder, read from config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from services.worker.models.checkpoints.fp8_weights import fp8_weight_block
from services.worker.models.checkpoints.quantized_weights import (
    QuantizedWeights,
    quantized_weight_format,
)
from services.worker.models.config_fields.gemma import (
    gemma_fields,
    granite_fields,
    ropes_by_layer_type,
)
from services.worker.models.config_fields.hybrid import (
    lfm2,
    linear_attention_fields,
    mamba_fields,
    short_conv_fields,
)
from services.worker.models.config_fields.latent_attention import (
    latent_attention_fields,
    query_scale_fields,
)
from services.worker.models.config_fields.layer_normed import (
    layer_normed,
    layer_normed_fields,
)
from services.worker.models.config_fields.moe import moe_fields
from services.worker.models.config_fields.rewrites import CONFIG_REWRITES
from services.worker.models.config_reader import (
    filled,
    nope_layers,
    sliding_window_fields,
    text_config,
)
from services.worker.models.families.registry import (
    ATTENTION_GATED,
    BASE_MODELS,
    FAMILY_OF,
    FILLED_BY_TRANSFORMERS,
    GATED_ACTS,
    GEMMAS,
    HUNYUANS,
    LATENT_ATTENTION,
    LAYER_NORMED,
    O_PROJ_UNBIASED,
    POST_NORMED,
    QK_NORMED,
    QK_NORMS_OVER_HEADS,
    ROPES_BY_LAYER_TYPE,
    ROTARY_INTERLEAVED,
    SANDWICH_NORMED,
    SHORT_CONVS,
    SUPPORTED_ARCHITECTURES,
    TEXT_MODELS_OF,
    UNCLASSIFIED,
    UNGATED,
    WINDOWED,
)
from services.worker.models.rope_config import read_rope
from shared.hf.classification import SUFFIX, is_classifier, num_labels
from shared.hf.model_folder import read_config


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama with attention_bias
    o_bias: bool  # Llama with attention_bias only
    mlp_bias: bool = False  # Llama's mlp_bias, ERNIE's use_bias: gate/up and down biased
    gated_mlp: bool = True  # False (Arcee): the MLP is down(act(up x)), its gate_up_proj the up rows alone
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": ..., ...}; empty = default
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # A sliding window this family's loader does not implement (a Llama config's): the
    # context stops at the window. Mistral's, Qwen's and Gemma's are: `layer_windows`.
    sliding_window: int | None = None
    # Each layer's attention window (a query sees the keys of its last `window` positions,
    # itself included, as transformers' sliding-window mask; 0: every earlier key); empty
    # when no layer is windowed.
    layer_windows: tuple[int, ...] = ()
    # Gemma 3: the windowed layers rotate with this base (default rope), the others with
    # rope_theta and rope_scaling. None: every layer alike.
    local_rope_theta: float | None = None
    # Gemma 2's soft caps, cap * tanh(x / cap): on every attention score (after the scale)
    # and on the logits. None: no cap.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 2: a norm on the attention's output and on the MLP's output too, before each
    # joins the residual stream (post_attention_layernorm, post_feedforward_layernorm), the
    # MLP's input normed by pre_feedforward_layernorm.
    sandwich_norms: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head (q_norm, k_norm)
    # OLMo 2: the query and key norms span all heads of a token at once, not each head
    qk_norm_over_heads: bool = False
    # Hunyuan: the query and key norms after rotary, not before it
    qk_norm_after_rope: bool = False
    # False (OLMo 2): no norm before attention and the MLP, only the output norms of
    # sandwich_norms (post_attention_layernorm, post_feedforward_layernorm)
    pre_norms: bool = True
    rotary_dim: int = 0  # the leading dims of a head that rotate (partial_rotary_factor); 0 = all
    # longrope: a sequence longer than this (original_max_position_embeddings) rotates with
    # the long factors from its first token, as transformers' Phi-3 recomputes it there
    long_rope_threshold: int | None = None
    # Mixture of experts: `moe_layers` are sparse, each token going to `num_experts_per_tok`
    # of `num_experts` experts of `moe_intermediate_size`, weighed by the router's softmax
    # over the chosen ones (norm_topk_prob) or over all experts.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # With expert parallelism (--enable-expert-parallel), a rank's experts: (the first one's
    # index, how many), each whole; () where every expert is here (sliced, under TP)
    local_experts: tuple = ()
    norm_topk_prob: bool = False
    # GraniteMoe: the k chosen experts weighed by a softmax over their logits alone (the same
    # numbers as the renormalized softmax, by its own arithmetic, as transformers runs it)
    moe_topk_softmax: bool = False
    moe_layers: tuple[int, ...] = ()
    # Qwen2-MoE: a dense expert every token takes (0: none), weighed by sigmoid(gate . x)
    # (GLM-4.5's shared experts, one MLP of their summed size: unweighed, shared_expert_gated off)
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True
    # A router whose choice is by score + a learned correction bias ("": none): GLM-4.5's
    # (DeepSeek-V3's) "sigmoid" scores, chosen within the best `moe_topk_groups` of
    # `moe_num_groups` groups of experts (a group by its two best), the chosen scores
    # renormalized (norm_topk_prob) and scaled; ERNIE 4.5's "softmax", its renormalizing
    # sum floored at `moe_norm_min`
    moe_score_correction: str = ""
    moe_num_groups: int = 1
    moe_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    moe_norm_min: float = 0.0
    moe_norm_eps: float = 1e-20  # added to the renormalizing sum (DeepSeek-V3's 1e-20; LFM2-MoE's 1e-6)
    # AFMoE's: the attention's output times sigmoid(gate_proj(x)) of the layer's input x,
    # before o_proj
    attention_gate: bool = False
    # LFM3's: one gate a head (gate_proj [heads, hidden]), each head's output times its sigmoid
    attention_gate_per_head: bool = False
    moe_router_float32: bool = False  # Hunyuan MoE's, ERNIE's: the router's weights kept float32 (its product is)
    # DeepSeek-V2's router: the choice by its softmax scores alone (no correction bias:
    # moe_score_correction names the scoring), groups ranked by their best expert
    moe_correction_bias: bool = True
    moe_group_by_max: bool = False
    # Layers a checkpoint holds past num_hidden_layers (GLM-4.5's multi-token prediction),
    # skipped at load
    skipped_layers: int = 0
    # Multi-head latent attention where kv_lora_rank > 0 (DeepSeek-V3's:
    # layers/latent_attention.py): keys and values from a kv_lora_rank latent a token,
    # queries through a q_lora_rank one (0: one projection), each query head's
    # qk_nope_head_dim unrotated dims and qk_rope_head_dim rotating ones, values of
    # v_head_dim. head_dim and num_key_value_heads then describe the cache's one latent
    # head (kv_lora_rank + qk_rope_head_dim wide), attention_scale the softmax's.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Ministral 3's and Mistral 4's queries times 1 + beta * log(1 + floor(position / original))
    # (the rope config's llama_4_scaling_beta; 0: none): layers/query_scale.py
    query_scale_beta: float = 0.0
    query_scale_original: int = 0
    # A checkpoint in FP8 with block scales: its block (rows, columns), the weights widened
    # at load (models/checkpoints/fp8_weights.py); () for any other
    fp8_weight_block: tuple[int, ...] = ()
    # A checkpoint of AWQ's or compressed-tensors' integer weights with group scales, widened
    # at load (models/checkpoints/quantized_weights.py); None for any other
    quantized_weights: QuantizedWeights | None = None
    # Granite's scalars; a Llama's are the identity (attention_scale None: 1/sqrt(head_dim)).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None
    logits_scaling: float = 1.0
    # Gemma's embedding scale is rounded to the activations' dtype before it multiplies
    # (transformers casts it so), Granite's multiplies as the float it is.
    embedding_multiplier_in_dtype: bool = False
    hidden_act: str = "silu"  # one of HIDDEN_ACTS
    norm_weight_offset: float = 0.0  # Gemma: its norms weigh by (offset + weight), offset 1
    nope_layers: tuple[int, ...] = ()  # SmolLM3: layers whose queries and keys do not rotate
    # GLM: rotary turns interleaved pairs of dims; the loader reorders the query and key rows
    # to the rotate-half layout (rotary.interleaved_as_halves)
    rotary_interleaved: bool = False
    # A sequence classifier's classes (shared/hf/classification.py): its score head's rows, in
    # place of an LM head; 0: not a classifier
    num_labels: int = 0
    # The LayerNorm decoders (LAYER_NORMED): LayerNorm (mean and variance, a bias where
    # norm_bias) in place of RMSNorm, with rms_norm_eps as its eps
    layer_norm: bool = False
    norm_bias: bool = False
    # GPT-NeoX, Phi: attention and MLP read the same residual and both outputs join it at
    # once; Phi's MLP reads the attention's normed input (shared_norm), NeoX's its own norm
    parallel_residual: bool = False
    shared_norm: bool = False
    # GPT-2, OPT: a learned table of absolute positions (this many rows, a position's row
    # `position_offset` further on) added to the embeddings; their layers do not rotate
    position_embeddings: int = 0
    position_offset: int = 0
    lm_head_bias: bool = False  # Phi
    # OPT: queries scaled by 1/sqrt(head_dim) after their projection, the scores then
    # unscaled (transformers' order of roundings)
    scale_queries: bool = False
    # StableLM's and Cohere's parallel sum, residual + attention + MLP in that order (NeoX's
    # and Phi's: MLP and attention, then the residual): the same numbers, other roundings
    residual_first: bool = False
    # gpt-oss: a learned logit per query head (`sinks`) that joins each row's softmax as one
    # more column, and is dropped after it: a share of attention that goes to no value
    attention_sinks: bool = False
    # gpt-oss's experts and router are biased; its experts gate with a clamped SwiGLU:
    # gate at most limit, up within +-limit, (up + 1) * gate * sigmoid(alpha * gate)
    moe_bias: bool = False
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # Hybrids: the layers whose token mixer keeps a recurrent state a request in place of a
    # KV cache, and which mixer: "gated_delta_net" (Qwen3.5's linear attention:
    # layers/gated_delta_net.py; its key and value heads and the width of its causal
    # convolution below), "short_conv" (LFM2's: layers/short_conv.py) or "mamba2"
    # (Granite 4.0-H's: layers/mamba2.py)
    recurrent_layers: tuple[int, ...] = ()
    recurrent_mixer: str = ""
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # OLMo Hybrid's: beta times 2 (linear_allow_neg_eigval: the state's eigenvalues down to
    # -1), its output norm's own eps (0: rms_norm_eps)
    linear_beta_scale: float = 1.0
    linear_norm_eps: float = 0.0
    # Layers normed as OLMo 2's (each branch's output, not its input) in a model whose other
    # layers are normed as a Llama's: OLMo Hybrid's attention layers
    post_normed_layers: tuple[int, ...] = ()
    short_conv_kernel: int = 0
    short_conv_bias: bool = False
    short_conv_channels: int = 0  # (a tensor-parallel rank's share of them; 0: hidden_size, all)
    # Mamba2's: heads of head_dim over a state of state_size, B and C shared by groups of
    # heads, its convolution's width, biases, and the limits its time steps are clamped to
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_num_groups: int = 1
    mamba_conv_kernel: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_dt_limit: tuple[float, float] = (0.0, math.inf)

    # Nemotron-H's blocks of one branch: its MLP alone (no token mixer, no cache) or its
    # token mixer alone (no MLP)
    mixerless_layers: tuple[int, ...] = ()
    mlpless_layers: tuple[int, ...] = ()

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend over a KV cache (all but a hybrid's recurrent ones and
        the layers without a token mixer)."""
        other = {*self.recurrent_layers, *self.mixerless_layers}
        return tuple(i for i in range(self.num_hidden_layers) if i not in other)

    @property
    def rotary_head_dim(self) -> int:
        """The width a rotary table is built for: a head's (its leading rotary_dim rotating),
        or latent attention's rotating dims alone."""
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def max_model_len(self) -> int:
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        return cls.from_dict(read_config(folder))

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        """From a config.json's contents (a copy the caller no longer needs: it may be changed)."""
        # (a quantization neither reads refused here, by its method)
        quantized_weights, fp8_block = quantized_weight_format(raw), fp8_weight_block(raw)
        multimodal = next((a for a in raw.get("architectures") or [] if a in TEXT_MODELS_OF), None)
        if multimodal is not None:
            raw = text_config(raw, TEXT_MODELS_OF[multimodal])
        # A sequence classifier: the decoder of its family, a score head in place of the LM head
        archs = [BASE_MODELS.get(a, a.removesuffix(SUFFIX) + "ForCausalLM" if a.endswith(SUFFIX) else a)
                 for a in raw.get("architectures") or []]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(sorted([*SUPPORTED_ARCHITECTURES, *BASE_MODELS]))} (and each family's "
                f"{SUFFIX})"
            )
        if arch in UNCLASSIFIED and is_classifier(raw):
            raise ValueError(f"unsupported architecture {raw['architectures'][0]!r}: the {arch} family generates; "
                             f"its {SUFFIX} is not served")
        if arch in FILLED_BY_TRANSFORMERS:
            raw = filled(raw, FILLED_BY_TRANSFORMERS[arch])
        if arch in LAYER_NORMED:
            raw = layer_normed(arch, raw)
        if arch in SHORT_CONVS:
            raw = lfm2(raw)
        family = FAMILY_OF[arch]
        for rewrite in family.config_rewrites:
            raw = CONFIG_REWRITES[rewrite](raw)
        local_rope_theta = None
        if arch in ROPES_BY_LAYER_TYPE:
            raw, local_rope_theta = ropes_by_layer_type(raw)
        # Gemma 2's config names it hidden_activation (Gemma's carries both, hidden_act first)
        hidden_act = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"
        if arch in GEMMAS and hidden_act == "gelu":
            # Gemma's first releases say "gelu" and mean the tanh approximation (transformers
            # and vLLM read it so)
            hidden_act = "gelu_pytorch_tanh"
        if hidden_act not in UNGATED.get(arch, GATED_ACTS):
            raise ValueError(f"unsupported hidden_act {hidden_act!r} for {arch}: "
                             f"{', '.join(UNGATED.get(arch, GATED_ACTS))}")
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        theta, rope, rotary_dim, long_rope_threshold, beta = read_rope(arch, raw, head_dim)
        latent = latent_attention_fields(arch, raw, rope)
        if latent:  # the cache's one latent head; the rotary over the rotating dims alone
            head_dim, rotary_dim = latent["kv_lora_rank"] + latent["qk_rope_head_dim"], 0
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):  # several EOS ids: the first is the one we stop on
            eos = eos[0] if eos else None
        fields = dict(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=1 if latent else raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            # transformers' default where config.json leaves it out: Gemma's config ties
            tie_word_embeddings=raw.get("tie_word_embeddings", arch in GEMMAS),
            qkv_bias=bool(raw.get("attention_bias", False) or raw.get("use_bias", False)),
            o_bias=arch not in O_PROJ_UNBIASED and bool(raw.get("attention_bias", False) or raw.get("use_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False) or raw.get("use_bias", False)),
            gated_mlp=arch not in UNGATED,
            rope_scaling=rope,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
            sliding_window=(raw.get("sliding_window") if raw.get("use_sliding_window", True)
                            and arch not in WINDOWED else None),
            local_rope_theta=local_rope_theta,
            qk_norm=arch in QK_NORMED,
            qk_norm_after_rope=arch in HUNYUANS,
            qk_norm_over_heads=arch in QK_NORMS_OVER_HEADS,
            pre_norms=arch not in POST_NORMED,
            rotary_dim=rotary_dim if rotary_dim < head_dim else 0,
            long_rope_threshold=long_rope_threshold,
            **moe_fields(arch, raw),
            hidden_act=hidden_act,
            **granite_fields(arch, raw),
            **gemma_fields(arch, raw),
            **({"sandwich_norms": True} if arch in SANDWICH_NORMED else {}),
            attention_gate=arch in ATTENTION_GATED,
            rotary_interleaved=arch in ROTARY_INTERLEAVED
            or (arch in LATENT_ATTENTION and bool(raw.get("rope_interleave", True))),
            **sliding_window_fields(arch, raw),
            nope_layers=nope_layers(arch, raw),
            num_labels=num_labels(raw) if is_classifier(raw) else 0,
            **layer_normed_fields(arch, raw),
            **latent,
            fp8_weight_block=fp8_block or (),
            quantized_weights=quantized_weights,
            **query_scale_fields(arch, beta, rope),
            **linear_attention_fields(arch, raw),
            **short_conv_fields(arch, raw),
            **mamba_fields(arch, raw),
        )
        if family.fields is not None:
            fields.update(family.fields(raw))
        return cls(**fields)



