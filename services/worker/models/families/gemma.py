"""Gemma's families: GeGLU MLPs, norms that weigh by 1 + w, scaled embeddings; Gemma 2's windows
and soft caps, VaultGemma, Gemma 3's query/key norms and rotary bases by layer type."""

from __future__ import annotations

from services.worker.models.families.family import Family

GEMMA = Family(
    name="Gemma",
    architectures=("GemmaForCausalLM",),
    served="`GemmaForCausalLM`",
    adds=('a GeGLU MLP (`gelu_pytorch_tanh`; the first releases\' `"gelu"` read as that, as transformers and vLLM '
          "read it); norms that weigh by 1 + w (the 1 added at load, in float32 as transformers does; in bfloat16 "
          "the weight is then applied after the cast to bfloat16, Llama's order, where Gemma's is before it: a "
          "last-bit difference); embeddings times sqrt(hidden_size) rounded to the activations' dtype (as "
          "transformers); tied embeddings by default"),
    cpu=("all dtypes and int8/int4; the GELU-and-mul on the CPU kernels (PyTorch's own tanh form, bfloat16 bits as"
         " PyTorch's), the one-call decode layer included"),
    gpu="as Llama, the GELU in PyTorch",
    tests=("gemma",),
    traits=("gemma",),
)


GEMMA_2 = Family(
    name="Gemma 2",
    architectures=("Gemma2ForCausalLM",),
    served="`Gemma2ForCausalLM`",
    adds=("Gemma's, and: a norm on the attention's and on the MLP's output before each joins the residual stream "
          "(`post_attention_layernorm`, `post_feedforward_layernorm`; `pre_feedforward_layernorm` before the MLP);"
          " a sliding window on the layers `layer_types` names `sliding_attention` (transformers' default: every "
          "even layer; a query sees its last `sliding_window` positions, itself included), so the context is "
          "`max_position_embeddings`, not capped at the window; each attention score soft-capped, "
          "`attn_logit_softcapping * tanh(score / cap)`, and the logits by `final_logit_softcapping` (in float32; "
          "transformers caps them in the model's dtype); the attention scale `query_pre_attn_scalar ** -0.5`"),
    cpu=("all dtypes and int8/int4; the one-call decode layer included (both branch norms, the cap, each layer's "
         "window); attention on the CPU kernels, which take the window and the cap (decodes read only the window's"
         " keys; a prefill chunk starts at its window's first tile); where they do not load (float16, head sizes "
         "other than 64/128/256) a loop over the step's requests that gathers only the window's blocks"),
    gpu=("the paged-attention kernel with two constexpr switches (cap, window; a windowed program starts at the "
         "first tile its queries see, split-KV splits the window); the GELU in PyTorch"),
    tests=("gemma2",),
    traits=("gemma", "windowed"),
)


VAULTGEMMA = Family(
    name="VaultGemma",
    architectures=("VaultGemmaForCausalLM",),
    served="`VaultGemmaForCausalLM` (vaultgemma-1b)",
    adds=("Gemma 2's attention (windows on every other layer, the soft caps, `query_pre_attn_scalar`), embedding "
          "scale and 1 + w norms, without Gemma 2's norms on the attention's and the MLP's outputs: its "
          "`pre_feedforward_layernorm` is the MLP's input norm, as a Llama's"),
    cpu="all dtypes and int8/int4; the one-call decode layer included",
    gpu="as Gemma 2",
    tests=("vaultgemma",),
    traits=("gemma", "windowed"),
    config_class="vaultgemma",
    weight_names={".pre_feedforward_layernorm.": ".post_attention_layernorm."},
)


GEMMA_3 = Family(
    name="Gemma 3",
    architectures=("Gemma3ForCausalLM",),
    config_rewrites=("causal_only",),
    served=("`Gemma3ForCausalLM` (gemma-3-1b), and the language model of `Gemma3ForConditionalGeneration` "
            "checkpoints (gemma-3-4b/12b/27b-it: its `text_config`, filled in with transformers' defaults as "
            "transformers reads it, and its `language_model.*` weights; images in through its SigLIP tower and "
            "projector, read by the worker's image encoder: docs/features/multimodal_inputs.md)"),
    adds=("Gemma 2's layer without its caps (null in Gemma 3's configs; honoured if set); Qwen3's per-head "
          "query/key norms (weighing by 1 + w); windowed layers five in six by default (`sliding_window_pattern`, "
          "or `layer_types`), which rotate with their own base (`rope_local_base_freq`, default 10000, default "
          "rope) while the global layers take `rope_theta` (default 1e6) and `rope_scaling`; transformers 5's "
          "`rope_parameters` by layer type read the same; `use_bidirectional_attention` (embedding Gemma) refused"),
    cpu="as Gemma 2 (the one-call decode layer takes each layer's rotary table)",
    gpu="as Gemma 2",
    tests=("gemma3", "gemma3_multimodal"),
    traits=("ropes_by_layer_type", "gemma", "windowed", "qk_norm"),
)


FAMILIES = (GEMMA, GEMMA_2, VAULTGEMMA, GEMMA_3)
