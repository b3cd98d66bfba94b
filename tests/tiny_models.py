"""Tiny random Hugging Face models with a real (small, trained-here) BPE tokenizer.

They are saved exactly as a hub checkpoint would be (config.json + safetensors +
tokenizer files), so the engine loads them through its ordinary path.
"""

from __future__ import annotations

import copy
import json
import math
import random
import shutil
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Continuous batching schedules requests under one token budget.",
    "Prefix caching lets requests share the blocks of a common prompt.",
    "héllo wörld — naïve café, 東京, emoji 🙂 and more unicode text.",
    "def main():\n    return 42\n",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# Gemma 3's image tokens, as its tokenizer names them (transformers' Gemma3Processor reads them)
GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                       "image_token": "<image_soft_token>"}
# Qwen2.5-VL's
QWEN_VL_IMAGE_TOKENS = {"vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>",
                        "image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}


def build_tokenizer(folder: Path, vocab_size: int = 384, extra_special_tokens: dict | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=extra_special_tokens,  # (added last: ids past the trained vocabulary)
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


def build_config_of_tiny_gemma3(common: dict, overrides: dict):
    from transformers import Gemma3TextConfig

    head_dim = common.get("head_dim") or common["hidden_size"] // common["num_attention_heads"]
    gemma3 = {"num_hidden_layers": 3, "head_dim": head_dim, "hidden_activation": "gelu_pytorch_tanh",
              "sliding_window": 24, "query_pre_attn_scalar": 24,
              "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
              "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    return Gemma3TextConfig(**{**common, **gemma3, **overrides})


# Llama 4's temperature on the queries past a pretrained context of 16 (beta 0.5, so prompts
# of 17 tokens and more meet it), under YaRN as Ministral 3's and Mistral 4's checkpoints ship it
MINISTRAL3_ROPE = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                       "original_max_position_embeddings": 16, "llama_4_scaling_beta": 0.5}}


def build_tiny_model(
    folder: Path, arch: str = "llama", seed: int = 0, max_shard_size: str | None = None, **overrides
) -> Path:
    """A 2-layer GQA model; weights drawn wide enough that greedy picks are not near-ties."""
    from transformers import (
        Gemma3Config,
        Gemma3ForCausalLM,
        Gemma3ForConditionalGeneration,
        SiglipVisionConfig,
        Gemma2Config,
        Gemma2ForCausalLM,
        GemmaConfig,
        GemmaForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
        Olmo2Config,
        Olmo2ForCausalLM,
        Olmo3Config,
        Olmo3ForCausalLM,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        PixtralVisionConfig,
        GraniteMoeConfig,
        GraniteMoeForCausalLM,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder, extra_special_tokens={"gemma3_multimodal": GEMMA3_IMAGE_TOKENS,
                                                              "qwen2_vl": QWEN_VL_IMAGE_TOKENS,
                                                              "qwen2_5_vl": QWEN_VL_IMAGE_TOKENS,
                                                              "qwen3_vl": QWEN_VL_IMAGE_TOKENS,
                                                              "qwen3_vl_moe": QWEN_VL_IMAGE_TOKENS}.get(arch))
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
        _biases_made_to_count(model)  # (where attention_bias or mlp_bias asks for them)
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # the qkv biases start at zero; make them count
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 16, **common}))
        with torch.no_grad():  # the q/k norm weights start at one; make them count
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    elif arch == "phi3":  # q/k/v and gate/up fused in the checkpoint, as Phi-3's are
        model = Phi3ForCausalLM(Phi3Config(**common))
    elif arch == "mixtral":  # 8 experts, top 2, every layer sparse
        model = MixtralForCausalLM(MixtralConfig(**{"num_local_experts": 8, "num_experts_per_tok": 2, **common}))
    elif arch == "qwen3_moe":  # 8 experts, top 2; the last layer dense (mlp_only_layers)
        moe = {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "mlp_only_layers": [common["num_hidden_layers"] - 1], "norm_topk_prob": True}
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**moe, **common}))
    elif arch == "qwen2_moe":  # 8 experts of 32, top 2, a shared expert of 64; the last layer dense
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 64, "mlp_only_layers": [common["num_hidden_layers"] - 1]}
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**moe, **common}))
        _biases_made_to_count(model)
    elif arch == "glm4_moe":
        # Layer 0 dense, layer 1 sparse: 8 experts of 32 in 4 groups, the best 2 groups kept,
        # top 2, two shared experts; scaled by 2.5; q/k/v biased, half of each head rotating.
        # The router's correction bias drawn wide enough to change what a token picks.
        from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

        moe = {"head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "n_shared_experts": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
               "first_k_dense_replace": 1, "attention_bias": True}
        model = Glm4MoeForCausalLM(Glm4MoeConfig(**{**common, **moe, **overrides}))
        _biases_made_to_count(model)
        _router_bias_and_qk_norms_made_to_count(model, 0.5)
    elif arch == "deepseek_v3":
        # Multi-head latent attention: queries through a rank-32 latent (q_lora_rank; None:
        # one projection, as DeepSeek-V2-Lite's), keys and values from one rank-32 latent per
        # token and an 8-dim rotating key shared by every head, interleaved pairs; YaRN with
        # DeepSeek's mscale pair, so its softmax scale moves too. Layer 0 dense, layer 1
        # sparse: GLM-4.5's experts (DeepSeek-V3's router), the correction bias drawn to count.
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        mla = {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
               "v_head_dim": 16, "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
               "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
               "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.9,
                                   "mscale_all_dim": 0.7, "original_max_position_embeddings": 256}}
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**common, **mla, **overrides}))
        _router_bias_and_qk_norms_made_to_count(model, 0.5)
    elif arch in ("ministral3", "mistral4"):
        # MINISTRAL3_ROPE's temperature on the queries. Mistral 4: DeepSeek-V3's latent attention; layer 0 dense, layer 1 sparse: 8 experts
        # by softmax score within the best 2 of 4 groups (a group by its two best), top 2,
        # renormalized, scaled by 1.5, a shared expert
        from transformers import Ministral3Config, Ministral3ForCausalLM, Mistral4Config, Mistral4ForCausalLM

        rope = copy.deepcopy(MINISTRAL3_ROPE)  # (transformers' config writes into it)
        if arch == "ministral3":
            model = Ministral3ForCausalLM(Ministral3Config(**{"head_dim": 16, **common, **rope, **overrides}))
        else:  # (its head_dim is its query heads' nope + rope dims: no other may be given)
            common.pop("head_dim", None), overrides.pop("head_dim", None)
            mla = {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                   "v_head_dim": 16, "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
                   "routed_scaling_factor": 1.5, "first_k_dense_replace": 1}
            model = Mistral4ForCausalLM(Mistral4Config(**{**common, **mla, **rope, **overrides}))
            _router_bias_and_qk_norms_made_to_count(model, 0.5)  # (its latent norms)
    elif arch == "internlm3":
        # transformers runs it as a Llama (its auto classes map internlm3 there), its biases
        # under qkv_bias/bias, drawn to count; the checkpoint names InternLM3ForCausalLM (its
        # own remote code's class: written below), dynamic NTK rope as internlm3-8b-instruct's
        from transformers import InternLM3Config

        model = LlamaForCausalLM(InternLM3Config(**{"head_dim": 16, **common, "qkv_bias": True, "bias": True,
                                                    "rope_parameters": {"rope_type": "dynamic", "factor": 6.0,
                                                                        "rope_theta": 50000.0}, **overrides}))
        _biases_made_to_count(model)
    elif arch == "helium":
        # interleaved rotary pairs; q/k/v biased (drawn to count), o_proj never
        from transformers import HeliumConfig, HeliumForCausalLM

        model = HeliumForCausalLM(HeliumConfig(**{"head_dim": 16, **common, "attention_bias": True, **overrides}))
        _biases_made_to_count(model)
    elif arch == "flex_olmo":
        # OLMo 2's layer (its q/k norms over all heads drawn to count) with OLMoE's experts in
        # every layer: 7 experts of 64, top 5, weighed by the softmax over all (unnormalized)
        from transformers import FlexOlmoConfig, FlexOlmoForCausalLM

        model = FlexOlmoForCausalLM(FlexOlmoConfig(**{**common, "intermediate_size": 64, **overrides}))
        _router_bias_and_qk_norms_made_to_count(model, 0.5)
    elif arch == "solar_open":
        # a Llama's attention, q/k/v biased (drawn to count: o_proj never); every layer sparse:
        # 8 experts of 32 in 4 groups, the best 2 kept, top 2, scaled by 2.5, a shared expert,
        # the correction bias drawn to count
        from transformers import SolarOpenConfig, SolarOpenForCausalLM

        moe = {"head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
               "attention_bias": True}
        model = SolarOpenForCausalLM(SolarOpenConfig(**{**common, **moe, **overrides}))
        _biases_made_to_count(model)
        _router_bias_and_qk_norms_made_to_count(model, 0.5)
    elif arch == "youtu":
        # Youtu-LLM: DeepSeek-V3's latent attention in a dense Llama, tied
        from transformers import YoutuConfig, YoutuForCausalLM

        mla = {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
               "v_head_dim": 16, "num_key_value_heads": 4, "tie_word_embeddings": True}
        model = YoutuForCausalLM(YoutuConfig(**{**common, **mla, **overrides}))
        _router_bias_and_qk_norms_made_to_count(model, 0.5)  # (its latent norms)
    elif arch == "glm4_moe_lite":
        # GLM-4.7-Flash: DeepSeek-V3's latent attention and experts, its layers' kinds by
        # mlp_layer_types (layer 0 sparse, layer 1 dense: the reverse of first_k_dense_replace's)
        from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

        mla = {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
               "v_head_dim": 24, "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
               "routed_scaling_factor": 1.8, "mlp_layer_types": ["sparse", "dense"]}
        model = Glm4MoeLiteForCausalLM(Glm4MoeLiteConfig(**{**common, **mla, **overrides}))
        _router_bias_and_qk_norms_made_to_count(model, 0.5)
    elif arch == "deepseek_v2":
        # DeepSeek-V3's latent attention (one q_proj, as V2-Lite's); layer 0 dense, layer 1
        # sparse: 8 experts by softmax score within the best 2 of 4 groups (a group by its
        # best), top 2, unnormalized, scaled by 1.5, two shared experts
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        mla = {"q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
               "v_head_dim": 16, "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "n_shared_experts": 2, "n_group": 4, "topk_group": 2,
               "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.5, "first_k_dense_replace": 1}
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**{**common, **mla, **overrides}))
        _router_bias_and_qk_norms_made_to_count(model, 0.5)  # (its latent norms)
    elif arch == "dots1":
        # Qwen3's attention, a window of 24 on layer 1 (max_window_layers); layer 0 dense,
        # layer 1 sparse: 8 experts of 32 in 4 groups, the best 2 kept, top 2, unnormalized,
        # scaled by 1.5, one shared expert; the correction bias drawn to count
        from transformers import Dots1Config, Dots1ForCausalLM

        moe = {"head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5,
               "first_k_dense_replace": 1, "sliding_window": 24, "max_window_layers": 1}
        model = Dots1ForCausalLM(Dots1Config(**{**common, **moe, **overrides}))
        _router_bias_and_qk_norms_made_to_count(model, 0.5)
    elif arch == "ernie4_5_moe":
        # ERNIE's interleaved rotary, tied; layer 0 dense, layer 1 sparse: 8 experts of 32,
        # top 2 by probability + the correction bias (drawn to count), a shared expert
        from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

        moe = {"head_dim": 16, "moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 32,
               "moe_num_shared_experts": 1, "moe_layer_start_index": 1}
        model = Ernie4_5_MoeForCausalLM(Ernie4_5_MoeConfig(**{**common, **moe, **overrides}))
        _router_bias_and_qk_norms_made_to_count(model, 0.1)  # (on probabilities: smaller)
    elif arch == "minimax_m2":
        # q/k norms over all heads (made to count), half of each head rotating; every layer
        # sparse: 8 experts of 64, top 2 by sigmoid score + the correction bias (drawn to count)
        from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

        moe = {"head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64,
               "rotary_dim": 8}
        model = MiniMaxM2ForCausalLM(MiniMaxM2Config(**{**common, **moe, **overrides}))
        _router_bias_and_qk_norms_made_to_count(model, 0.5)
    elif arch == "granite":  # each of its four scalars away from the identity
        # Attention softer than 1/sqrt(head_dim), as Granite's muP-style 1/head_dim is
        # (sharper, int4 parts from float32 at the first token on these random weights).
        head_dim = common.get("head_dim") or common["hidden_size"] // common["num_attention_heads"]
        scalars = {"embedding_multiplier": 3.0, "residual_multiplier": 0.6, "attention_multiplier": 0.8 / head_dim**0.5,
                   "logits_scaling": 2.5}
        model = GraniteForCausalLM(GraniteConfig(**{**scalars, **common}))
    elif arch == "granite_moe":  # Granite's scalars, 8 experts of 32, top 2, every layer sparse
        head_dim = common.get("head_dim") or common["hidden_size"] // common["num_attention_heads"]
        scalars = {"embedding_multiplier": 3.0, "residual_multiplier": 0.6, "attention_multiplier": 0.8 / head_dim**0.5,
                   "logits_scaling": 2.5}
        model = GraniteMoeForCausalLM(GraniteMoeConfig(**{**scalars, "num_local_experts": 8, "num_experts_per_tok": 2,
                                                          **common, "intermediate_size": 32, **overrides}))
    elif arch == "gemma":  # tied, as Gemma's checkpoints are, with its config's "gelu" (meaning tanh)
        head_dim = common.get("head_dim") or common["hidden_size"] // common["num_attention_heads"]
        model = GemmaForCausalLM(GemmaConfig(**{**common, "head_dim": head_dim, "tie_word_embeddings": True,
                                                "hidden_act": "gelu"}))
        _norms_made_to_count(model, 0.0)  # (they weigh by 1 + w)
    elif arch == "gemma2":
        # Windows of 24 (not a block's multiple) on layers 0 and 2 of 3, so every prompt's
        # outputs slide; caps low enough to bend these weights' scores and logits (without
        # the window 6 of 7 test prompts' outputs change, without the cap 7). Untied: tied,
        # the last token's own row (times 8) wins every step here and outputs repeat one
        # token (Gemma's case tests the tied head).
        head_dim = common.get("head_dim") or common["hidden_size"] // common["num_attention_heads"]
        gemma2 = {"num_hidden_layers": 3, "head_dim": head_dim, "hidden_activation": "gelu_pytorch_tanh",
                  "sliding_window": 24, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
                  "final_logit_softcapping": 10.0}
        model = Gemma2ForCausalLM(Gemma2Config(**{**common, **gemma2, **overrides}))
        _norms_made_to_count(model, 0.0)  # (they weigh by 1 + w)
    elif arch == "gemma3_multimodal":
        # Gemma 3's language model inside the multimodal checkpoint (gemma-3-4b-it's shape
        # of files: text_config, language_model.* weights, a vision tower and projector).
        text = build_config_of_tiny_gemma3(common, overrides)
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14)
        vocab = common["vocab_size"]
        model = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
            image_token_index=vocab - 1, boi_token_index=vocab - 3, eoi_token_index=vocab - 2,
            tie_word_embeddings=common["tie_word_embeddings"]))  # the outer config's says
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight") and "language_model" in name:
                    param.normal_(0.0, 0.3)
            # (the projector starts at zero: every image would embed to zeros)
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
            model.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_(0.0, 0.3)
    elif arch == "gemma3":
        # Gemma 2's shape without caps, query/key norms, and the windowed layers (0 and 2)
        # rotating with a base of their own, apart from the full layer's (with linear
        # scaling): bases far apart, so a layer on the other's table changes the outputs.
        model = Gemma3ForCausalLM(build_config_of_tiny_gemma3(common, overrides))
        _norms_made_to_count(model, 0.0)  # as Gemma 2's, the q/k norms' weights too
    elif arch == "smollm3":
        # Layer 1 of 2 without rotary (NoPE every second layer, where SmolLM3's is every
        # fourth), and tied: left at SmolLM3's default, so config.json leaves it out.
        model = SmolLM3ForCausalLM(SmolLM3Config(**{**common, "tie_word_embeddings": True,
                                                    "no_rope_layer_interval": 2, **overrides}))
    elif arch == "olmo2":
        model = Olmo2ForCausalLM(Olmo2Config(**common))
        _norms_made_to_count(model, 1.0)  # (q/k's over all heads too)
    elif arch == "olmo3":
        # A window of 24 on layer 0 and the global layer 1 on YaRN-scaled rotary, its base
        # apart from the windowed layer's: a layer on the other's table changes the outputs.
        olmo3 = {"sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"],
                 "max_position_embeddings": 256, "rope_parameters": {
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                                        "original_max_position_embeddings": 64}}}
        model = Olmo3ForCausalLM(Olmo3Config(**{**common, **olmo3, **overrides}))
        _norms_made_to_count(model, 1.0)  # as OLMo 2's
    elif arch in ("mistral3_multimodal", "ministral3_multimodal"):
        # Mistral Small 3.1's shape of files: a Mistral text_config and language model beside
        # Pixtral's vision tower and a projector; untied, as the outer config says. Ministral
        # 3's: the same around a Ministral 3 (its queries scaled past the pretrained context).
        from transformers import Ministral3Config

        vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=28, patch_size=14)
        text = MistralConfig(**{"sliding_window": None, **common, **overrides}) if arch == "mistral3_multimodal" \
            else Ministral3Config(**{"head_dim": 16, **common, **copy.deepcopy(MINISTRAL3_ROPE), **overrides})
        model = Mistral3ForConditionalGeneration(Mistral3Config(
            text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=common["vocab_size"] - 1,
            tie_word_embeddings=common["tie_word_embeddings"]))
    elif arch in ("glm", "glm4"):
        # half of each head rotating by interleaved pairs, q/k/v biases (made to count), gate/up
        # fused; GLM-4-0414's four norms (glm4) moved off one
        from transformers import Glm4Config, Glm4ForCausalLM, GlmConfig, GlmForCausalLM

        config_class, model_class = (GlmConfig, GlmForCausalLM) if arch == "glm" else (Glm4Config, Glm4ForCausalLM)
        model = model_class(config_class(**{"head_dim": 16, **common, "pad_token_id": common["pad_token_id"]}))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "_proj.bias" in name or "layernorm" in name:
                    param.normal_(1.0 if "layernorm" in name else 0.0, 0.3 if "layernorm" in name else 0.1)
    elif arch == "exaone4":  # windows of 24 on three layers in four, the fourth global without rotary
        from transformers import Exaone4Config, Exaone4ForCausalLM

        exaone = {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 24, "sliding_window_pattern": 4}
        model = Exaone4ForCausalLM(Exaone4Config(**{**common, **exaone, **overrides}))
        _norms_made_to_count(model, 1.0)
    elif arch == "exaone4_5":
        # EXAONE 4.5's shape of files: an EXAONE 4.0 text_config (its windows, its global layer
        # without rotary) behind Qwen2.5-VL's vision tower
        from transformers import Exaone4_5_Config, Exaone4_5_ForConditionalGeneration

        text = {**common, "model_type": "exaone4", "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 24,
                "sliding_window_pattern": 4, **overrides}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=common["hidden_size"])
        model = Exaone4_5_ForConditionalGeneration(Exaone4_5_Config(text_config=text, vision_config=vision))
        _norms_made_to_count(model, 1.0)
    elif arch == "exaone_moe":
        # EXAONE 4.0's attention (windows of 24 on three layers in four, the fourth global
        # without rotary, q/k norms drawn to count) under pre-norms; layers 0 and 2 dense, 1
        # and 3 sparse: 8 experts of 32 in 4 groups, the best 2 kept, top 2, scaled by 2.5,
        # a shared expert, the correction bias drawn to count
        from transformers import ExaoneMoeConfig, ExaoneMoeForCausalLM

        exaone = {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 24, "sliding_window_pattern": 4,
                  "mlp_layer_types": ["dense", "sparse", "dense", "sparse"], "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_shared_experts": 1, "n_group": 4,
                  "topk_group": 2, "routed_scaling_factor": 2.5}
        model = ExaoneMoeForCausalLM(ExaoneMoeConfig(**{**common, **exaone, **overrides}))
        _router_bias_and_qk_norms_made_to_count(model, 0.5)
    elif arch == "afmoe":
        # Trinity's shape: four layers, windows of 24 on three (they alone rotate), the fourth
        # global; q/k norms and the four norms drawn to count, the attention gate as drawn;
        # layer 0 dense, then 8 experts of 32, top 2 by sigmoid score + the expert bias (drawn
        # to count), renormalized, scaled by 2.5, a shared expert; muP's embedding scale
        from transformers import AfmoeConfig, AfmoeForCausalLM

        afmoe = {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 24, "global_attn_every_n_layers": 4,
                 "num_dense_layers": 1, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                 "num_shared_experts": 1, "route_scale": 2.5, "mup_enabled": True}
        model = AfmoeForCausalLM(AfmoeConfig(**{**common, **afmoe, **overrides}))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(1.0, 0.3)
                elif name.endswith("expert_bias") or name.endswith("router.gate.weight"):
                    param.normal_(0.0, 0.5)  # (transformers starts its router at zero)
    elif arch in ("qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_5_moe_vl", "qwen3_next"):
        # Qwen3.5's hybrid: three Gated DeltaNet layers then one of full attention (its
        # heads gated, a quarter of each head rotating); two key heads serving four value
        # heads; the 1 + w norms and the DeltaNet's gated norm (w) drawn to count, its decays
        # slow (_recurrent_parameters_made_to_count). qwen3_5_vl: the same language model as
        # Qwen3.5's checkpoints ship it, behind a vision tower (MRoPE's sections).
        # qwen3_5_moe: every MLP sparse, 8 experts of 32, top 2 renormalized, a gated shared
        # expert of 64; qwen3_next: its DeltaNet's products grouped by key head in the
        # checkpoint, layer 1 dense (mlp_only_layers)
        from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                                  Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeTextConfig,
                                  Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM)

        qwen = {**common, "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4, **overrides}
        experts = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 64}
        if arch == "qwen3_5":
            model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**qwen))
        elif arch == "qwen3_5_moe":
            model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**experts, **qwen}))
        elif arch == "qwen3_next":
            model = Qwen3NextForCausalLM(Qwen3NextConfig(**{**experts, "mlp_only_layers": [1], "norm_topk_prob": True,
                                                            "partial_rotary_factor": 0.25, **qwen}))
        else:
            qwen["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0],
                                       "mrope_interleaved": True, "partial_rotary_factor": 0.25}
            vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                          out_hidden_size=common["hidden_size"])
            config, model_class = ((Qwen3_5Config, Qwen3_5ForConditionalGeneration) if arch == "qwen3_5_vl" else
                                   (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration))
            text = qwen if arch == "qwen3_5_vl" else {**experts, **qwen}
            model = model_class(config(text_config=text, vision_config=vision,
                                       tie_word_embeddings=common["tie_word_embeddings"]))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight") and "visual" not in name:
                    param.normal_(1.0 if ".linear_attn." in name else 0.0, 0.3)
        _recurrent_parameters_made_to_count(model, ("mlp.gate.weight",))  # (transformers starts the router at zero)
    elif arch == "lfm2":
        # LFM2's hybrid: short convolutions (3 wide) on layers 0, 1 and 3, full attention on
        # 2 (q/k norms); its MLP's size from intermediate_size as LFM2's class adjusts it
        # (int(2/3 of 200) = 133, times 1.5 = 199, rounded up to 32: 224); norms drawn to count
        from transformers import Lfm2Config, Lfm2ForCausalLM

        lfm = {**{k: v for k, v in common.items() if k != "rms_norm_eps"}, "num_hidden_layers": 4, "head_dim": 16,
               "layer_types": ["conv", "conv", "full_attention", "conv"], "intermediate_size": 200,
               "block_ffn_dim_multiplier": 1.5, "block_multiple_of": 32, "norm_eps": 1e-5}
        model = Lfm2ForCausalLM(Lfm2Config(**{**lfm, **overrides}))
        _norms_made_to_count(model, 1.0)
    elif arch == "lfm3":
        # LFM3: LFM2's short convolutions (7 wide, its default) on layers 0 and 3, a sliding
        # layer (window 8, default rope) and a full one (proportional rope: half of each
        # head's frequencies, the rest zero), each head's output gated by a sigmoid of its
        # own (g_proj), four norms a layer (sandwich); norms drawn to count
        from transformers import Lfm3Config, Lfm3ForCausalLM

        lfm = {**{k: v for k, v in common.items() if k != "rms_norm_eps"}, "num_hidden_layers": 4, "head_dim": 16,
               "layer_types": ["conv", "sliding_attention", "full_attention", "conv"], "intermediate_size": 96,
               "sliding_window": 8, "norm_eps": 1e-5,
               # (a small base for the full layer's: its still frequencies would otherwise turn
               # too slowly over a test's positions for a wrong one to show)
               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "proportional", "rope_theta": 100.0,
                                                      "partial_rotary_factor": 0.5}}}
        model = Lfm3ForCausalLM(Lfm3Config(**{**lfm, **overrides}))
        _norms_made_to_count(model, 1.0)
    elif arch == "olmo_hybrid":
        # OLMo Hybrid: Gated DeltaNet layers (2 heads of 16, values 32 wide, beta up to 2)
        # normed as a Llama's, and one full attention layer in four normed as OLMo 2's
        # (each branch's output), its query/key norms over all heads; norms drawn to count
        from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

        olmo = {**common, "num_hidden_layers": 4, "num_key_value_heads": 4,
                "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
                "linear_value_head_dim": 32, "initializer_range": 0.2}
        model = OlmoHybridForCausalLM(OlmoHybridConfig(**{**olmo, **overrides}))
        _norms_made_to_count(model, 1.0)
        _recurrent_parameters_made_to_count(model, ())
    elif arch == "lfm2_moe":
        # LFM2's layers with, after one dense MLP, 8 experts of 32, top 2 by sigmoid score +
        # the expert bias, renormalized, scaled by 2.5; the router and the bias drawn to count
        from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

        lfm = {**{k: v for k, v in common.items() if k != "rms_norm_eps"}, "num_hidden_layers": 4, "head_dim": 16,
               "layer_types": ["conv", "conv", "full_attention", "conv"], "norm_eps": 1e-5, "num_dense_layers": 1,
               "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "routed_scaling_factor": 2.5}
        model = Lfm2MoeForCausalLM(Lfm2MoeConfig(**{**lfm, **overrides}))
        _norms_made_to_count(model, 1.0)
        with torch.no_grad():
            for name, tensor in (*model.named_buffers(), *model.named_parameters()):
                if name.endswith(("expert_bias", "feed_forward.gate.weight")):
                    tensor.normal_(0.0, 0.5)
    elif arch in ("granite_hybrid", "granite_hybrid_dense"):
        # Granite 4.0-H: Mamba2 on layers 0, 1 and 3 (8 heads of 16 at hidden 64, over a state of 16, B and
        # C in 2 groups, a convolution 4 wide), attention without positions on 2; Granite's
        # scalars; 8 experts of 32, top 2, beside a shared MLP of 64 (the dense one: that
        # MLP alone, H-Micro's); the norms, the router and the mixers' parameters drawn to count
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        head_dim = common["hidden_size"] // common["num_attention_heads"]
        granite = {**common, "embedding_multiplier": 3.0, "residual_multiplier": 0.6,
                   "attention_multiplier": 0.8 / head_dim**0.5, "logits_scaling": 2.5, "num_hidden_layers": 4,
                   "layer_types": ["mamba", "mamba", "attention", "mamba"], **_tiny_mamba2(common),
                   "num_local_experts": 0 if arch == "granite_hybrid_dense" else 8, "num_experts_per_tok": 2,
                   "intermediate_size": 32, "shared_intermediate_size": 64, **overrides}
        model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**granite))
        _norms_made_to_count(model, 1.0)
        _recurrent_parameters_made_to_count(model, ("router.layer.weight",))
    elif arch == "bamba":
        # Bamba: Mamba2 on layers 0, 1 and 3 (as Granite 4.0-H's), rotating attention on 2 (half
        # of each head), each layer with a Llama MLP; the norms and the mixers' parameters
        # drawn to count
        from transformers import BambaConfig, BambaForCausalLM

        bamba = {**common, "num_hidden_layers": 4, "attn_layer_indices": [2], **_tiny_mamba2(common), **overrides}
        model = BambaForCausalLM(BambaConfig(**bamba))
        _norms_made_to_count(model, 1.0)
        _recurrent_parameters_made_to_count(model)
    elif arch == "nemotron_h":
        # Nemotron-H: blocks of one branch, Mamba2 (8 heads of 16, a state of 16, 2 groups),
        # relu2 MLP, attention without positions: M - M * - M (as its pattern writes them)
        from transformers import NemotronHConfig, NemotronHForCausalLM

        nemotron = {**{k: v for k, v in common.items() if k not in ("rms_norm_eps", "num_hidden_layers")},
                    "hybrid_override_pattern": "M-M*-M", "head_dim": 16, "mamba_num_heads": 8,
                    "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
                    "layer_norm_epsilon": 1e-5, **overrides}
        model = NemotronHForCausalLM(NemotronHConfig(**nemotron))
        _norms_made_to_count(model, 1.0)
        _recurrent_parameters_made_to_count(model, ("mixer.D",))
    elif arch == "vaultgemma":
        # Gemma 2's attention (a window on every other layer, the caps, query_pre_attn_scalar
        # 24) without its output norms; the norms drawn to count
        from transformers import VaultGemmaConfig, VaultGemmaForCausalLM

        vault = {"head_dim": 16, "sliding_window": 24, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
                 "final_logit_softcapping": 10.0}
        model = VaultGemmaForCausalLM(VaultGemmaConfig(**{**common, **vault, **overrides}))
        _norms_made_to_count(model, 0.0)  # (weighing by 1 + w)
    elif arch == "jais2":  # biased LayerNorms and projections (drawn to count), GQA, an ungated relu2 MLP
        from transformers import Jais2Config, Jais2ForCausalLM

        model = Jais2ForCausalLM(Jais2Config(**{"head_dim": 16, **common, **overrides}))
        _biases_made_to_count(model)
        with torch.no_grad():  # the LayerNorms start at one and zero: make them count
            for name, param in model.named_parameters():
                if "norm." in name:
                    param.normal_(1.0 if name.endswith("weight") else 0.0, 0.3 if name.endswith("weight") else 0.1)
    elif arch == "arcee":  # an MLP without a gate: down(relu(up x) ** 2)
        from transformers import ArceeConfig, ArceeForCausalLM

        model = ArceeForCausalLM(ArceeConfig(**{**common, **overrides}))
    elif arch == "apertus":  # xIELU's scalars and the q/k norms moved off their starts
        from transformers import ApertusConfig, ApertusForCausalLM

        model = ApertusForCausalLM(ApertusConfig(**{**common, "dtype": "float32", "head_dim": 16,
                                                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                                    **overrides}))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "alpha" in name or "_norm.weight" in name:
                    param.add_(torch.randn_like(param) * 0.3)
    elif arch == "hunyuan":  # q/k norms after rotary (made to count), an NTK alpha on the base
        from transformers import HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM

        rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 50.0, "factor": 1.0}
        model = HunYuanDenseV1ForCausalLM(HunYuanDenseV1Config(**{"head_dim": 16, "rope_parameters": rope, **common,
                                                                    **overrides}))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "layernorm" in name and "self_attn" in name:
                    param.normal_(1.0, 0.3)
    elif arch == "hunyuan_moe":  # Hunyuan's attention; every layer sparse: 8 experts, top 2, a shared MLP
        from transformers import HunYuanMoEV1Config, HunYuanMoEV1ForCausalLM

        rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 50.0, "factor": 1.0}
        model = HunYuanMoEV1ForCausalLM(HunYuanMoEV1Config(**{
            "head_dim": 16, "rope_parameters": rope, "num_experts": 8, "moe_topk": 2, **common,
            "intermediate_size": 64, **overrides}))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "layernorm" in name and "self_attn" in name:
                    param.normal_(1.0, 0.3)
    elif arch == "seed_oss":  # q/k/v biases (o_proj's and the MLP's where overrides ask), made to count
        from transformers import SeedOssConfig, SeedOssForCausalLM

        model = SeedOssForCausalLM(SeedOssConfig(**{"head_dim": 16, **common}))
        _biases_made_to_count(model)
    elif arch in ("llama_classifier", "qwen3_classifier"):  # a score head of 3 labels over the decoder
        from transformers import LlamaForSequenceClassification, Qwen3ForSequenceClassification

        labels = {"num_labels": 3, "id2label": {0: "negative", 1: "neutral", 2: "positive"},
                  "label2id": {"negative": 0, "neutral": 1, "positive": 2}}
        if arch == "llama_classifier":
            model = LlamaForSequenceClassification(LlamaConfig(**{**common, **labels, **overrides}))
        else:
            model = Qwen3ForSequenceClassification(Qwen3Config(**{"head_dim": 16, **common, **labels, **overrides}))
    elif arch == "ernie4_5":  # interleaved rotary as GLM's; use_bias=True biases every projection
        from transformers import Ernie4_5Config, Ernie4_5ForCausalLM

        model = Ernie4_5ForCausalLM(Ernie4_5Config(**{"head_dim": 16, **common}))
        _biases_made_to_count(model)
    elif arch == "qwen3_vl_moe":
        # Qwen3-VL-MoE's language model: 8 experts of 48 (no dimension equal to hidden's 64, so
        # their stacked tensors' layout shows in their shape), top 2, every layer sparse
        from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

        text = {**common, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                    "mrope_interleaved": True}, **overrides}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=common["hidden_size"],
                      deepstack_visual_indexes=[0])
        ids = {f"{name}_id": tokenizer.convert_tokens_to_ids(token) for name, token in QWEN_VL_IMAGE_TOKENS.items()}
        model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=common["tie_word_embeddings"], **ids))
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 16).save_pretrained(folder)
        with torch.no_grad():  # the router and the q/k norms start at zero and one; make them count
            for name, param in model.named_parameters():
                if "language_model" in name and ("mlp.gate." in name or "_norm.weight" in name):
                    param.normal_(1.0 if "norm" in name else 0.0, 0.3)
                elif "deepstack_merger" in name and name.endswith("fc2.weight"):  # (at 0.02, features that add ~0)
                    param.normal_(0.0, 0.3)
    elif arch in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        # Qwen2.5-VL's and Qwen3-VL's shape of files: a Qwen2 (Qwen3) text_config whose rotary
        # is MRoPE (sections of 2, 3, 3 of a head's 8 frequencies), a vision tower beside it.
        from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                                  Qwen2VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration)

        mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=common["hidden_size"])
        text = {**common, "head_dim": 16, **overrides}
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        # (their image tokens the tokenizer's last four)
        ids = {f"{name}_id": tokenizer.convert_tokens_to_ids(token) for name, token in QWEN_VL_IMAGE_TOKENS.items()}
        if arch == "qwen2_vl":  # (its tower's width is embed_dim; hidden_size is the language model's)
            config = Qwen2VLConfig(text_config={**text, "rope_parameters": mrope},
                                   vision_config=dict(depth=1, embed_dim=32, hidden_size=common["hidden_size"],
                                                      mlp_ratio=2, num_heads=2),
                                   tie_word_embeddings=common["tie_word_embeddings"], **ids)
            model = Qwen2VLForConditionalGeneration(config)
            Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16).save_pretrained(folder)
        elif arch == "qwen2_5_vl":
            config = Qwen2_5_VLConfig(text_config={**text, "rope_parameters": mrope}, vision_config=vision,
                                      tie_word_embeddings=common["tie_word_embeddings"], **ids)
            model = Qwen2_5_VLForConditionalGeneration(config)
            # images of 4 to 16 merged tokens (2x2 patches of 14 pixels each)
            Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16).save_pretrained(folder)
        else:  # (deepstack features from its one block into the first layer)
            config = Qwen3VLConfig(text_config={**text, "rope_parameters": {**mrope, "mrope_interleaved": True}},
                                   vision_config={**vision, "deepstack_visual_indexes": [0]},
                                   tie_word_embeddings=common["tie_word_embeddings"], **ids)
            model = Qwen3VLForConditionalGeneration(config)
            # (patches of 16 pixels, as Qwen3-VL's)
            Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32 * 4,
                                     max_pixels=32 * 32 * 16).save_pretrained(folder)
        with torch.no_grad():  # the qkv biases start at zero and the q/k norms at one; make them count
            for name, param in model.named_parameters():
                if "language_model" in name and ("_proj.bias" in name or "_norm.weight" in name):
                    param.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.1)
                elif "deepstack_merger" in name and name.endswith("fc2.weight"):  # (at 0.02, features that add ~0)
                    param.normal_(0.0, 0.3)
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**{"sliding_window": None, **common}))
    elif arch == "olmoe":  # 8 experts of 32, top 2, unnormalized; q/k norms over all heads, made to count
        from transformers import OlmoeConfig, OlmoeForCausalLM

        model = OlmoeForCausalLM(OlmoeConfig(**{**common, "num_experts": 8, "num_experts_per_tok": 2,
                                                "intermediate_size": 32, **overrides}))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.normal_(1.0, 0.3)
    elif arch in LAYER_NORMED:
        model = _layer_normed_model(arch, common, overrides)
    elif arch == "gpt_oss":
        # 8 biased experts of 32, top 2, their clamp low enough to bite (1.0, where gpt-oss's
        # is 7: these weights' gates reach past it); a window of 24 on layer 0, the global
        # layer 1 on YaRN; sinks, biases and the router moved off their starts
        from transformers import GptOssConfig, GptOssForCausalLM

        oss = {"head_dim": 16, "max_position_embeddings": 256, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
               "sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 1.0,
               "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}}
        model = GptOssForCausalLM(GptOssConfig(**{**common, **oss, **overrides}))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("sinks", "bias")):
                    param.normal_(0.0, 1.0 if name.endswith("sinks") else 0.1)
    else:
        raise ValueError(arch)
    if max_shard_size is not None:
        model.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(folder, safe_serialization=True)
    if arch == "gemma3_multimodal":  # its processor: 28x28 pixels (the tower's), 4 tokens an image
        from transformers import Gemma3Processor
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}), tokenizer=tokenizer,
                        image_seq_length=4).save_pretrained(folder)
    if arch == "internlm3":  # (save_pretrained writes the class it ran, LlamaForCausalLM)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "architectures": ["InternLM3ForCausalLM"]}))
    return folder


# The LayerNorm decoders: biased LayerNorms and ungated biased MLPs (GPT-2 and OPT with
# learned positions and tied heads, GPT-NeoX and Phi with attention and MLP side by side)
LAYER_NORMED = ("gpt2", "opt", "gpt_neox", "phi", "starcoder2", "stablelm", "cohere", "cohere2")


def _layer_normed_model(arch: str, common: dict, overrides: dict):
    from transformers import (Cohere2Config, Cohere2ForCausalLM, CohereConfig, CohereForCausalLM, GPT2Config, GPT2LMHeadModel, GPTNeoXConfig,
                              GPTNeoXForCausalLM, OPTConfig, OPTForCausalLM, PhiConfig, PhiForCausalLM, StableLmConfig,
                              StableLmForCausalLM, Starcoder2Config, Starcoder2ForCausalLM)

    ids = {k: common[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    size, layers, heads = common["hidden_size"], common["num_hidden_layers"], common["num_attention_heads"]
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(**{**ids, "n_embd": size, "n_layer": layers, "n_head": heads,
                                              "n_inner": common["intermediate_size"], "n_positions": 1024,
                                              "initializer_range": 0.15, **overrides}))
    elif arch == "opt":
        model = OPTForCausalLM(OPTConfig(**{**ids, "hidden_size": size, "num_hidden_layers": layers,
                                            "num_attention_heads": heads, "ffn_dim": common["intermediate_size"],
                                            "word_embed_proj_dim": size, "max_position_embeddings": 1024,
                                            "init_std": 0.15, **overrides}))
    elif arch == "gpt_neox":  # half of each head rotating (Pythia's quarter turns 4 of 16 dims)
        model = GPTNeoXForCausalLM(GPTNeoXConfig(**{
            **ids, "hidden_size": size, "num_hidden_layers": layers, "num_attention_heads": heads,
            "intermediate_size": common["intermediate_size"], "initializer_range": 0.15,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            **overrides}))
    elif arch == "starcoder2":  # grouped queries, a window of 24 on every layer, tied
        model = Starcoder2ForCausalLM(Starcoder2Config(**{
            **ids, "hidden_size": size, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": common["num_key_value_heads"], "intermediate_size": common["intermediate_size"],
            "initializer_range": 0.15, "sliding_window": 24, **overrides}))
    elif arch == "stablelm":  # q/k/v biased, a quarter of each head rotating, grouped queries
        model = StableLmForCausalLM(StableLmConfig(**{
            **ids, "hidden_size": size, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": common["num_key_value_heads"], "intermediate_size": common["intermediate_size"],
            "initializer_range": 0.15, "use_qkv_bias": True, **overrides}))
    elif arch == "cohere":  # logits times 0.5, interleaved rotary, tied
        model = CohereForCausalLM(CohereConfig(**{
            **ids, "hidden_size": size, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": common["num_key_value_heads"], "intermediate_size": common["intermediate_size"],
            "initializer_range": 0.15, "logit_scale": 0.5, **overrides}))
    elif arch == "cohere2":  # Cohere's, 4 layers: windows of 24 on three, the fourth global without rotary
        model = Cohere2ForCausalLM(Cohere2Config(**{
            **ids, "hidden_size": size, "num_hidden_layers": 4, "num_attention_heads": heads,
            "num_key_value_heads": common["num_key_value_heads"], "intermediate_size": common["intermediate_size"],
            "initializer_range": 0.15, "logit_scale": 0.5, "sliding_window": 24, "sliding_window_pattern": 4,
            **overrides}))
    else:  # phi: grouped queries too
        model = PhiForCausalLM(PhiConfig(**{
            **ids, "hidden_size": size, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": common["num_key_value_heads"], "intermediate_size": common["intermediate_size"],
            "initializer_range": 0.15,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            **overrides}))
    with torch.no_grad():  # biases start at zero and norms at one; make them count
        for name, param in model.named_parameters():
            if param.dim() == 1:
                norm = "norm" in name or ".ln_" in name or name.startswith(("transformer.ln_f", "ln_f"))
                param.normal_(1.0 if norm and name.endswith("weight") else 0.0, 0.3 if norm else 0.1)
    return model


def _router_bias_and_qk_norms_made_to_count(model, bias_std: float) -> None:
    """A corrected router's bias (a buffer in some families, a parameter in others) starts at
    zero and query/key norms at one: draw them, so a bias or norm the engine dropped shows."""
    with torch.no_grad():
        for name, tensor in (*model.named_buffers(), *model.named_parameters()):
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, bias_std)
            elif name.endswith(("q_norm.weight", "k_norm.weight", "q_a_layernorm.weight", "kv_a_layernorm.weight")):
                tensor.normal_(1.0, 0.3)


def _tiny_mamba2(common: dict) -> dict:
    """A Mamba2 mixer's config at the tiny shape: 8 heads over a state of 16 (of 16 dims at
    hidden 64), B and C in 2 groups, a convolution 4 wide."""
    return {"mamba_n_heads": 8, "mamba_d_head": 2 * common["hidden_size"] // 8, "mamba_d_state": 16,
            "mamba_n_groups": 2, "mamba_d_conv": 4, "mamba_expand": 2}


def _recurrent_parameters_made_to_count(model, drawn: tuple[str, ...] = ()) -> None:
    """A recurrent mixer's decays slow enough (A from 0.005 to 0.5, where transformers draws
    up to 16) that a state carried over tens of tokens still counts; its time-step bias,
    Mamba2's skip D, and the `drawn` parameters (a router starting at zero) off their
    starts, so one the engine dropped would show."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.uniform_(math.log(0.005), math.log(0.5))
            elif name.endswith(("dt_bias", "mamba.D", *drawn)):
                param.normal_(0.0, 1.0)


def _norms_made_to_count(model, start: float) -> None:
    """Norm weights start at `start` (one; zero for Gemma's, which weigh by 1 + w): draw them
    around it, so a norm the engine dropped or misread would show."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(start, 0.3)


def _biases_made_to_count(model) -> None:
    """Linear biases start at zero; draw them, so a bias the engine dropped would show."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.1)


def random_prompts(lengths, vocab_size: int = 384, seed: int = 0) -> list[list[int]]:
    """Prompts of these lengths in token ids, drawn past the special tokens (ids 0-2)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def causal_lm_class(folder: Path):
    """transformers' class for a folder's causal LM: AutoModelForCausalLM, or the class
    itself where the auto classes do not map it (Mistral 4's text model)."""
    import transformers

    architectures = json.loads((Path(folder) / "config.json").read_text())["architectures"]
    if architectures == ["Mistral4ForCausalLM"]:
        return transformers.Mistral4ForCausalLM
    return transformers.AutoModelForCausalLM


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu", model_class=None,
              **generate_kwargs) -> list[list[int]]:
    """The oracle: transformers' own generate, one prompt at a time (no padding), EOS off;
    `model_class` where not AutoModelForCausalLM's (a multimodal checkpoint's own class);
    `generate_kwargs` go to generate as they are (e.g. `sequence_bias`)."""
    from transformers import AutoModelForCausalLM

    model = (model_class or causal_lm_class(folder)).from_pretrained(folder, dtype=torch.float32).to(device).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=0,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                **generate_kwargs,
            )
            results.append(out[0, len(prompt) :].tolist())
    return results


# PEFT's names for every projection of a decoder layer (Phi-3's are fused in its checkpoints)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS_FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def build_lora_adapter(base: Path, folder: Path, seed: int = 0, r: int = 8, lora_alpha: float = 16,
                       target_modules: list[str] | None = None, **options) -> Path:
    """A PEFT LoRA adapter of `base`, saved as PEFT saves one, its A and B drawn wide
    (PEFT would start B at zero: an adapter that changes nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules
                                                  or LORA_TARGETS, init_lora_weights=False, **options))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    peft_model.save_pretrained(folder)
    return Path(folder)


def peft_greedy(base: Path, adapter: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The LoRA oracle: PEFT's model over transformers', generating as hf_greedy does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            results.append(out[0, len(prompt):].tolist())
    return results


def fp8_checkpoint(source: Path, dest: Path, block: tuple[int, int]) -> Path:
    """`source`'s model as an FP8 checkpoint with block scales (DeepSeek-V3's and Qwen3-FP8's
    format): each decoder layer's projection weights float8_e4m3fn, scaled per block of
    `block` by the block's largest magnitude over e4m3's 448, the scale (what the FP8 values
    are multiplied by) stored as the format names it, `weight_scale_inv`; the rest as it is."""
    from safetensors.torch import load_file, save_file

    dest = Path(dest)
    shutil.copytree(source, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    out = {}
    for name, tensor in tensors.items():
        if ".layers." not in name or not name.endswith("_proj.weight") or tensor.dim() != 2:
            out[name] = tensor
            continue
        rows, columns = tensor.shape
        padded = torch.zeros(-(-rows // block[0]) * block[0], -(-columns // block[1]) * block[1])
        padded[:rows, :columns] = tensor.float()
        tiles = padded.unflatten(0, (-1, block[0])).unflatten(2, (-1, block[1]))  # [R, b0, C, b1]
        scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # [R, C]
        spread = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]
        out[name] = (tensor.float() / spread).to(torch.float8_e4m3fn)
        out[name[: -len(".weight")] + ".weight_scale_inv"] = scale
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block)}
    (dest / "config.json").write_text(json.dumps(config))
    return dest
