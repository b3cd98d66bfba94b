"""Llama and the families that are a Llama with a difference or two: Mistral (its window), Mixtral
(its experts), Ministral 3, InternLM3, Helium, SmolLM3, Seed-OSS, Phi-3, Apertus."""

from __future__ import annotations

from services.worker.models.families.family import Family

LLAMA = Family(
    name="Llama",
    architectures=("LlamaForCausalLM",),
    served="`LlamaForCausalLM` (Llama 2, 3, 3.1, 3.2, 3.3; SmolLM2; and every checkpoint saved as one)",
    adds=("rope default, linear, llama3, yarn (any family's config may name it: Qwen's long-context ones do; its "
          "attention factor from the growth, as given, or DeepSeek's mscale pair); attention bias, and `mlp_bias` "
          "(the MLP's projections biased: modules, not the one-call layer); tied embeddings; a `sliding_window` in "
          "a Llama config (which transformers' Llama ignores) caps the context"),
    cpu="all dtypes and int8/int4; decode steps in one C call a layer (head dim 64, 128 or 256)",
    gpu=("float32, bfloat16; CUDA graphs for decode (on an H200: greedy equal to transformers in every scheduling "
         "mode, W0 ~1.0 ms a token at SmolLM2's shape)"),
    tests=("llama",),
)


MISTRAL = Family(
    name="Mistral",
    architectures=("MistralForCausalLM",),
    served=("`MistralForCausalLM`, and the language model of `Mistral3ForConditionalGeneration` checkpoints "
            "(Mistral Small 3.1 and 3.2: its `text_config`, filled in with transformers' defaults, its "
            "`language_model.*` weights; Pixtral's vision tower and the projector left unread, a message with an "
            "image part a 400; tied as the outer config says, as transformers ties it)"),
    adds=("Llama's layer with a `sliding_window` on every layer where the config sets one (Mistral-7B-v0.1: 4096 "
          "of 32768 positions): attention's window, not a cap on the context (below)"),
    cpu="as Llama (the one-call decode layer takes the window)",
    gpu="as Llama",
    tests=("mistral", "mistral3_multimodal"),
    traits=("every_layer_windowed", "windowed"),
)


MINISTRAL_3 = Family(
    name="Ministral 3",
    architectures=("Ministral3ForCausalLM",),
    served=("`Ministral3ForCausalLM`, and the language model of `Mistral3ForConditionalGeneration` checkpoints "
            "whose text model is one (Ministral 3 3B, 8B, 14B)"),
    adds=("a Mistral (its window where the config has one) whose queries, after rotary, are scaled by Llama 4's "
          "temperature, 1 + beta log(1 + floor(position / `original_max_position_embeddings`)) "
          "(`llama_4_scaling_beta` in its rope config; layers/query_scale.py): 1 exactly within the pretrained "
          "context, so the one-call decode layer (which knows no such scale) takes a step only while every "
          "position is within it"),
    cpu="all dtypes and int8/int4",
    gpu="as Llama, the scale in PyTorch",
    tests=("ministral3", "ministral3_multimodal"),
    traits=("queries_scaled_by_position", "unclassified", "every_layer_windowed", "windowed"),
    config_class="ministral3",
)


INTERNLM3 = Family(
    name="InternLM3",
    architectures=("InternLM3ForCausalLM",),
    served="`InternLM3ForCausalLM` (internlm3-8b-instruct)",
    adds=("a Llama (transformers runs it as one), its biases named `qkv_bias` (q/k/v and o_proj) and `bias` (the "
          "MLP's); dynamic NTK rope, which at every length llmbus serves (up to `max_position_embeddings`) is the "
          "default frequencies bit for bit, as transformers computes it; any family's config may name `dynamic` so"),
    cpu="as Llama",
    gpu="as Llama",
    tests=("internlm3",),
    config_class="internlm3",
)


HELIUM = Family(
    name="Helium",
    architectures=("HeliumForCausalLM",),
    served="`HeliumForCausalLM` (helium-1-2b)",
    adds=("a Llama rotating interleaved pairs (reordered at load, as GLM's), q/k/v biased where `attention_bias` "
          "says, o_proj never (in bfloat16 its norms weigh in float32 in transformers, in the model's dtype here, "
          "as Llama's)"),
    cpu="as Llama (the one-call layer included)",
    gpu="as Llama",
    tests=("helium",),
    traits=("o_proj_unbiased", "rotary_interleaved"),
    config_class="helium",
)


PHI_3 = Family(
    name="Phi-3",
    architectures=("Phi3ForCausalLM",),
    served="`Phi3ForCausalLM`",
    adds=("q/k/v and gate/up fused in the checkpoint (loaded as they are: our layout); `longrope` (or `su`) "
          "scaling with short and long factors; partial rotary (`partial_rotary_factor`: only the leading dims of "
          "each head rotate)"),
    cpu=("all dtypes and int8/int4; the one-call decode layer included (longrope's long or short rows picked by "
         "the step's positions, a partial rotary's leading dims on the rotary kernel, which the module path uses "
         "too)"),
    gpu="as Llama",
    tests=("phi3",),
    traits=("every_layer_windowed", "windowed"),
)


SMOLLM3 = Family(
    name="SmolLM3",
    architectures=("SmolLM3ForCausalLM",),
    served="`SmolLM3ForCausalLM`",
    adds=("Llama's layer, with the layers `no_rope_layers` marks 0 (every fourth by default, "
          "`no_rope_layer_interval`) attending without rotary positions (NoPE): those layers get a rotary table of"
          " cos 1 and sin 0, which every path's rotation returns bit for bit, so nothing else needs a case; what "
          "config.json leaves out read with SmolLM3's defaults through transformers' config class (tied "
          "embeddings, rotary base 2e6); a window where `use_sliding_window` says, on the layers `layer_types` "
          "names"),
    cpu="as Llama, the one-call decode layer included",
    gpu="as Llama",
    tests=("smollm3",),
    traits=("windowed_by_layer_type", "windowed"),
    config_class="smollm3",
)


SEED_OSS = Family(
    name="Seed-OSS",
    architectures=("SeedOssForCausalLM",),
    fields=lambda raw: {"o_bias": bool(raw.get("attention_out_bias", False))},
    served="`SeedOssForCausalLM` (Seed-OSS-36B)",
    adds=("a Llama with q/k/v biases (`attention_bias`, on by default), o_proj's apart (`attention_out_bias`) and "
          "the MLP's (`mlp_bias`); config defaults from transformers' class"),
    cpu="as Llama (the one-call layer unless the MLP is biased)",
    gpu="as Llama",
    tests=("seed_oss",),
    config_class="seed_oss",
)


APERTUS = Family(
    name="Apertus",
    architectures=("ApertusForCausalLM",),
    served="`ApertusForCausalLM` (Apertus-8B, 70B)",
    adds=("Arcee's ungated MLP with the xIELU activation (per layer `alpha_p`, `alpha_n` through softplus, `beta`,"
          " `eps`, all four read from the checkpoint, as transformers' Python form computes it); Qwen3's per-head "
          "query/key norms; its norms named `attention_layernorm` and `feedforward_layernorm`; llama3 rope scaling"
          " by default"),
    cpu="as Arcee",
    gpu="as Arcee",
    tests=("apertus",),
    traits=("qk_norm",),
    config_class="apertus",
    weight_names={".attention_layernorm.": ".input_layernorm.",
                  ".feedforward_layernorm.": ".post_attention_layernorm."},
    ungated_acts=("xielu",),
)


MIXTRAL = Family(
    name="Mixtral",
    architectures=("MixtralForCausalLM",),
    served="`MixtralForCausalLM`",
    adds=("a sparse MLP in every layer: router softmax, top-k renormalized (`block_sparse_moe`, experts "
          "`w1`/`w3`/`w2`)"),
    cpu=("tokens sorted by expert, one product per expert over its tokens, on the same kernels as dense layers "
         "(int8/int4 included; the router stays unquantized); module path"),
    gpu=("the experts as two grouped GEMMs (kernels/fused_moe.py, vLLM's fused_moe design; tested under the "
         "interpreter; on an H200 a Mixtral-shaped layer takes 1.07 ms at batch 1 against the per-expert loop's "
         "1.03, 16% of the memory bandwidth: not yet faster, its tiles untuned), with no host read, so decode "
         "steps are captured as CUDA graphs too (greedy equal to transformers on an H200, a Qwen3-MoE-shaped "
         "model)"),
    tests=("mixtral",),
    traits=("every_layer_windowed", "windowed"),
)


FAMILIES = (LLAMA, MISTRAL, MINISTRAL_3, INTERNLM3, HELIUM, PHI_3, SMOLLM3, SEED_OSS, APERTUS, MIXTRAL)
