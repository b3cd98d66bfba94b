"""The LayerNorm decoders: biased LayerNorms and (mostly) ungated biased MLPs, several with
attention and MLP side by side off one residual: GPT-2, OPT, GPT-NeoX, Phi, StarCoder2,
StableLM, Jais 2, Cohere, Cohere 2."""

from __future__ import annotations

from services.worker.models.families.family import Family

GPT_2 = Family(
    name="GPT-2",
    architectures=("GPT2LMHeadModel",),
    served="`GPT2LMHeadModel` (gpt2, distilgpt2, gpt2-medium to -xl)",
    adds=("the LayerNorm decoders' layer (`layers/layer_norm.py`: LayerNorm with a bias, in the activations' dtype"
          " as transformers' `nn.LayerNorm`; an ungated MLP with biases, `down(act(up x))`); learned absolute "
          "positions added to the embeddings (`wpe`), no layer rotating (each gets the identity rotary, as "
          "SmolLM3's NoPE layers); its products stored transposed (Conv1D) and q/k/v fused (`c_attn`), both read "
          "as they are; `gelu_new` as transformers computes it; the Hub's names without `transformer.` and its "
          "causal-mask buffers (skipped) read too; tied; per-layer attention scaling and upcast reordering refused"
          " by name"),
    cpu="all dtypes and int8/int4 on the module path (the one-call layer's norms are RMSNorms)",
    gpu="as Llama, the norms and activation in PyTorch",
    tests=("gpt2",),
    traits=("layer_normed", "unclassified"),
    config_class="gpt2",
    ungated_acts=("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"),
    tensor_fixups=("conv1d_transposed",),
    checkpoint_prefixes=("transformer.",),
    checkpoint_renames=((r"^wte\.", "model.embed_tokens."),
                        (r"^wpe\.", "model.embed_positions."),
                        (r"^ln_f\.", "model.norm."),
                        (r"^h\.(\d+)\.ln_1\.", r"model.layers.\1.input_layernorm."),
                        (r"^h\.(\d+)\.ln_2\.", r"model.layers.\1.post_attention_layernorm."),
                        (r"^h\.(\d+)\.attn\.c_attn\.", r"model.layers.\1.self_attn.qkv_proj."),
                        (r"^h\.(\d+)\.attn\.c_proj\.", r"model.layers.\1.self_attn.o_proj."),
                        (r"^h\.(\d+)\.mlp\.c_fc\.", r"model.layers.\1.mlp.up_proj."),
                        (r"^h\.(\d+)\.mlp\.c_proj\.", r"model.layers.\1.mlp.down_proj.")),
    learned_positions_offset=0,
)


OPT = Family(
    name="OPT",
    architectures=("OPTForCausalLM",),
    served="`OPTForCausalLM` (opt-125m, vLLM's quickstart model, to opt-66b)",
    adds=("GPT-2's layer with OPT's names; positions learned two rows on (OPT's offset); queries scaled by "
          "1/sqrt(head_dim) as they leave their projection and the scores then unscaled (transformers' order of "
          "roundings); ReLU; `enable_bias`; opt-350m's projected embeddings and norms after each branch refused by"
          " name"),
    cpu="as GPT-2",
    gpu="as GPT-2",
    tests=("opt",),
    traits=("layer_normed", "unclassified"),
    config_class="opt",
    ungated_acts=("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"),
    checkpoint_prefixes=("model.",),
    checkpoint_renames=((r"^decoder\.embed_tokens\.", "model.embed_tokens."),
                        (r"^decoder\.embed_positions\.", "model.embed_positions."),
                        (r"^decoder\.final_layer_norm\.", "model.norm."),
                        (r"^decoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"model.layers.\1.input_layernorm."),
                        (r"^decoder\.layers\.(\d+)\.final_layer_norm\.",
                         r"model.layers.\1.post_attention_layernorm."),
                        (r"^decoder\.layers\.(\d+)\.self_attn\.out_proj\.", r"model.layers.\1.self_attn.o_proj."),
                        (r"^decoder\.layers\.(\d+)\.fc1\.", r"model.layers.\1.mlp.up_proj."),
                        (r"^decoder\.layers\.(\d+)\.fc2\.", r"model.layers.\1.mlp.down_proj."),
                        (r"^decoder\.layers\.", "model.layers.")),
    learned_positions_offset=2,
)


GPT_NEOX = Family(
    name="GPT-NeoX",
    architectures=("GPTNeoXForCausalLM",),
    served="`GPTNeoXForCausalLM` (Pythia, GPT-NeoX-20B)",
    adds=("attention and MLP side by side off the same residual, each with its own norm (`use_parallel_residual`; "
          "the sequential form too), summed into it at once; q/k/v fused and interleaved head by head in the "
          "checkpoint (reordered at load to q, k, v); a partial rotary (`rotary_pct`, or transformers 5's "
          "`rope_parameters`); exact GELU"),
    cpu="as GPT-2",
    gpu="as GPT-2",
    tests=("gpt_neox",),
    traits=("layer_normed", "unclassified"),
    config_class="gpt_neox",
    ungated_acts=("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"),
    tensor_fixups=("qkv_interleaved_by_head",),
    checkpoint_prefixes=("gpt_neox.",),
    checkpoint_renames=((r"^embed_in\.", "model.embed_tokens."),
                        (r"^final_layer_norm\.", "model.norm."),
                        (r"^embed_out\.", "lm_head."),
                        (r"^layers\.(\d+)\.attention\.query_key_value\.", r"model.layers.\1.self_attn.qkv_proj."),
                        (r"^layers\.(\d+)\.attention\.dense\.", r"model.layers.\1.self_attn.o_proj."),
                        (r"^layers\.(\d+)\.mlp\.dense_h_to_4h\.", r"model.layers.\1.mlp.up_proj."),
                        (r"^layers\.(\d+)\.mlp\.dense_4h_to_h\.", r"model.layers.\1.mlp.down_proj."),
                        (r"^layers\.", "model.layers.")),
)


PHI = Family(
    name="Phi",
    architectures=("PhiForCausalLM",),
    served="`PhiForCausalLM` (phi-1, phi-1.5, phi-2)",
    adds=("attention and MLP side by side off one norm; partial rotary; grouped queries where the config says; an "
          "LM head with a bias (int8's too); `gelu_new`; query/key norms (`qk_layernorm`) refused by name"),
    cpu="as GPT-2",
    gpu="as GPT-2",
    tests=("phi",),
    traits=("layer_normed", "unclassified"),
    config_class="phi",
    ungated_acts=("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"),
    checkpoint_prefixes=(),
    checkpoint_renames=((r"^model\.final_layernorm\.", "model.norm."),
                        (r"^model\.layers\.(\d+)\.self_attn\.dense\.", r"model.layers.\1.self_attn.o_proj."),
                        (r"^model\.layers\.(\d+)\.mlp\.fc1\.", r"model.layers.\1.mlp.up_proj."),
                        (r"^model\.layers\.(\d+)\.mlp\.fc2\.", r"model.layers.\1.mlp.down_proj.")),
)


STARCODER2 = Family(
    name="StarCoder2",
    architectures=("Starcoder2ForCausalLM",),
    served="`Starcoder2ForCausalLM` (starcoder2-3b, 7b, 15b)",
    adds=("the LayerNorm decoders' layer with grouped queries and rotary; its ungated MLP named `c_fc`, `c_proj` "
          "(biased, `use_bias`); `gelu_pytorch_tanh`; a window on every layer where `sliding_window` is set (as "
          "Mistral's); tied"),
    cpu="as GPT-2",
    gpu="as GPT-2",
    tests=("starcoder2",),
    traits=("layer_normed", "unclassified", "every_layer_windowed", "windowed"),
    config_class="starcoder2",
    ungated_acts=("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"),
    checkpoint_prefixes=(),
    checkpoint_renames=((r"^model\.layers\.(\d+)\.mlp\.c_fc\.", r"model.layers.\1.mlp.up_proj."),
                        (r"^model\.layers\.(\d+)\.mlp\.c_proj\.", r"model.layers.\1.mlp.down_proj.")),
)


STABLELM = Family(
    name="StableLM",
    architectures=("StableLmForCausalLM",),
    served="`StableLmForCausalLM` (stablelm-2-1_6b, stablelm-3b-4e1t)",
    adds=("Llama's gated MLP and grouped queries under biased LayerNorms; a quarter of each head rotating; q/k/v "
          "biased where `use_qkv_bias` says (o_proj never); with `use_parallel_residual` attention and MLP side by"
          " side off one norm, summed residual first (transformers' order of roundings); query/key norms "
          "(`qk_layernorm`) refused by name"),
    cpu="as GPT-2",
    gpu="as GPT-2",
    tests=("stablelm",),
    traits=("layer_normed", "unclassified", "o_proj_unbiased"),
    config_class="stablelm",
)


JAIS_2 = Family(
    name="Jais 2",
    architectures=("Jais2ForCausalLM",),
    served="`Jais2ForCausalLM` (Jais-2-8B)",
    adds=("the LayerNorm decoders' layer as StarCoder2's (biased LayerNorms, biased projections, grouped queries, "
          "rotary) with an ungated `relu2` MLP (`up_proj`, `down_proj`)"),
    cpu="all dtypes and int8/int4 on the module path (the one-call layer's norms are RMSNorms)",
    gpu="as Llama, the activation in PyTorch",
    tests=("jais2",),
    traits=("layer_normed", "unclassified"),
    config_class="jais2",
    ungated_acts=("relu2",),
)


COHERE = Family(
    name="Cohere",
    architectures=("CohereForCausalLM",),
    served="`CohereForCausalLM` (Command R, Aya Expanse)",
    adds=("LayerNorms without a bias; attention and MLP side by side off one norm, summed residual first; "
          "interleaved rotary (reordered at load, as GLM's); logits times `logit_scale`; tied; query/key norms "
          "(`use_qk_norm`, Command R+) refused by name"),
    cpu="as GPT-2",
    gpu="as GPT-2",
    tests=("cohere",),
    traits=("cohere", "layer_normed", "unclassified", "rotary_interleaved"),
    config_class="cohere",
)


COHERE_2 = Family(
    name="Cohere 2",
    architectures=("Cohere2ForCausalLM",),
    served="`Cohere2ForCausalLM` (Command R7B, Command A)",
    adds=("Cohere's layer; windowed layers and global ones by `layer_types` (three to one, from "
          "`sliding_window_pattern` in older configs), only the windowed ones rotating (the global ones attend "
          "without positions, NoPE; with no `sliding_window`, no layer rotates, as transformers runs it)"),
    cpu="as GPT-2",
    gpu="as GPT-2",
    tests=("cohere2",),
    traits=("cohere", "layer_normed", "unclassified", "always_windowed_by_layer_type", "windowed",
           "rotary_interleaved"),
    config_class="cohere2",
)


FAMILIES = (GPT_2, OPT, GPT_NEOX, PHI, STARCODER2, STABLELM, JAIS_2, COHERE, COHERE_2)
