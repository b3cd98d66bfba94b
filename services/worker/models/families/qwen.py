"""Qwen's families: Qwen2 and Qwen3 (and the text of Qwen2-VL, Qwen2.5-VL, Qwen3-VL), their MoEs,
and the hybrids Qwen3.5, Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet layers between attention
ones)."""

from __future__ import annotations

from services.worker.models.families.family import Family

# (a hybrid's token mixer is `self_attn` whatever it is; its gated norm weighs by w alone)
_GATED_DELTA_NET_NAMES = {".linear_attn.norm.weight": ".self_attn.norm_weight", ".linear_attn.": ".self_attn."}

QWEN2 = Family(
    name="Qwen2",
    architectures=("Qwen2ForCausalLM",),
    fields=lambda raw: {"qkv_bias": True},
    served=("`Qwen2ForCausalLM`, and the language model of `Qwen2VLForConditionalGeneration` and "
            "`Qwen2_5_VLForConditionalGeneration` checkpoints (Qwen2-VL, Qwen2.5-VL: the config read through "
            "transformers' class, so the first releases' top-level keys serve as a `text_config` does; their "
            "MRoPE on text, where a token's time, height and width positions are all its index, is the ordinary "
            "rotary); their images in through the `visual.*` tower, an image's tokens at MRoPE's three "
            "positions (docs/features/multimodal_inputs.md))"),
    adds="q/k/v biases",
    cpu="as Llama",
    gpu="as Llama",
    tests=("qwen2", "qwen2_5_vl"),
    traits=("qwen", "windowed_by_layer_type", "windowed", "o_proj_unbiased"),
)


QWEN3 = Family(
    name="Qwen3",
    architectures=("Qwen3ForCausalLM",),
    served=("`Qwen3ForCausalLM`, and the language model of `Qwen3VLForConditionalGeneration` (Qwen3-VL, as "
            "Qwen2.5-VL's; interleaved MRoPE sections, on text the ordinary rotary too; the chat template from the"
            " processor's `chat_template.json` where the tokenizer has none; images in through its `visual.*` "
            "tower, their deepstack features added to its first layers' outputs: "
            "docs/features/multimodal_inputs.md)"),
    adds=("a per-head RMSNorm on queries and keys before rotary (`q_norm`, `k_norm`); a `sliding_window` with "
          "`use_sliding_window: false` is not windowed"),
    cpu=("all dtypes and int8/int4; the one-call decode layer included (it norms each query and key head in place "
         "before rotary)"),
    gpu="as Llama",
    tests=("qwen3", "qwen3_vl"),
    traits=("qwen", "windowed_by_layer_type", "windowed", "qk_norm"),
)


QWEN3_5 = Family(
    name="Qwen3.5",
    architectures=("Qwen3_5ForCausalLM",),
    served=("`Qwen3_5ForCausalLM`, and the language model of `Qwen3_5ForConditionalGeneration` checkpoints (every "
            "Qwen3.5 size as released: its `text_config`, its `model.language_model.*` weights; the vision tower "
            "and the multi-token-prediction module `mtp.*` unread; on text its interleaved MRoPE is the ordinary "
            "rotary)"),
    adds=("a hybrid: in three layers of four (`layer_types`) a Gated DeltaNet (layers/gated_delta_net.py) in place"
          " of attention - q, k and v through a causal depthwise convolution (`linear_conv_kernel_dim`, SiLU), "
          "queries and keys L2-normed, the delta rule over a [key dim, value dim] state per value head decayed by "
          "exp(-exp(`A_log`) softplus(a + `dt_bias`)), the output RMSNormed per head and gated by SiLU(z); in the "
          "others full attention with Qwen3's per-head query/key norms, a quarter of each head rotating, and the "
          "heads' output times sigmoid of a gate whose rows q_proj interleaves head by head with the queries' "
          "(split at load into AFMoE's `output_gate`); Gemma's 1 + w norms. The linear layers keep a state a "
          "request (the convolution's last inputs in the model's dtype, the delta rule's matrices in float32, as "
          "transformers keeps them) in place of KV blocks, a row for each of `--max-num-seqs` requests, paid out "
          "of the KV cache's budget; a cached prefix restores it from a snapshot saved at the prefix's last block "
          "(below); such a model refuses speculative decoding and LoRA by name; served, the worker tells the "
          "scheduler its rows. Prefill chunks run the delta rule 64 tokens at a time in matrix products (the UT "
          "transform), decodes one vectorized step for the batch"),
    cpu=("float32 as transformers in every scheduling mode (and the CUDA-graph buffers, whose pads write to a pad "
         "row); bfloat16 and int8/int4 run (in bfloat16, greedy output parts from float32's early, in "
         "transformers' own bfloat16 too: prompt logprobs held within twice its error, measured 1.0-1.5x); the "
         "one-call decode layer steps aside"),
    gpu=("the full-attention layers on the Triton kernel, the linear ones in PyTorch (index ops only in a decode "
         "step: CUDA graphs take it; not yet run on a GPU)"),
    tests=("qwen3_5", "qwen3_5_vl"),
    traits=("linear_attention", "unclassified", "qk_norm", "attention_gate"),
    config_class="qwen3_5_text",
    weight_names=_GATED_DELTA_NET_NAMES,
    unread=("mtp.",),
    tensor_fixups=("gated_queries",),
)


QWEN3_5_MOE = Family(
    name="Qwen3.5-MoE",
    architectures=("Qwen3_5MoeForCausalLM",),
    config_rewrites=("sparse_every_layer",),
    served=("`Qwen3_5MoeForCausalLM`, and the language model of `Qwen3_5MoeForConditionalGeneration` "
            "(Qwen3.5-35B-A3B to 397B-A17B, as released: vision tower and `mtp.*` unread)"),
    adds=("Qwen3.5's hybrid layers with Qwen2-MoE's sparse MLP in every layer: top `num_experts_per_tok` of "
          "`num_experts` by softmax, always renormalized (transformers' router), beside a shared expert of "
          "`shared_expert_intermediate_size` weighed by sigmoid(`shared_expert_gate` . x)"),
    cpu="as Qwen3.5, the experts as Mixtral's",
    gpu="as Qwen3.5, the experts as Mixtral's",
    tests=("qwen3_5_moe",),
    traits=("linear_attention", "unclassified", "qk_norm", "attention_gate"),
    config_class="qwen3_5_moe_text",
    weight_names=_GATED_DELTA_NET_NAMES,
    unread=("mtp.",),
    tensor_fixups=("gated_queries",),
)


QWEN3_NEXT = Family(
    name="Qwen3-Next",
    architectures=("Qwen3NextForCausalLM",),
    served="`Qwen3NextForCausalLM` (Qwen3-Next-80B-A3B)",
    adds=("Qwen3.5-MoE's model, sparse layers every `decoder_sparse_step` but `mlp_only_layers`, renormalized "
          "where `norm_topk_prob` says; its checkpoints group the DeltaNet's input products by key head "
          "(`in_proj_qkvz`: a key head's query and key, then its value heads' values and gates; `in_proj_ba`), "
          "regrouped at load into Qwen3.5's four (layers/gated_delta_net.py `key_head_grouped_tensors`)"),
    cpu="as Qwen3.5-MoE",
    gpu="as Qwen3.5-MoE",
    tests=("qwen3_next",),
    traits=("linear_attention", "unclassified", "qk_norm", "attention_gate"),
    config_class="qwen3_next",
    weight_names=_GATED_DELTA_NET_NAMES,
    unread=("mtp.",),
    tensor_fixups=("gated_queries", "key_head_grouped"),
)


QWEN3_MOE = Family(
    name="Qwen3-MoE",
    architectures=("Qwen3MoeForCausalLM",),
    served=("`Qwen3MoeForCausalLM`, and the language model of `Qwen3VLMoeForConditionalGeneration` "
            "(Qwen3-VL-30B-A3B, 235B-A22B: its router always renormalizes; its experts stacked in the checkpoint, "
            "`[experts, in, out]` as the Hub ships them and `[experts, out, in]` as transformers 5 saves them, "
            "told apart by shape, the Hub's where the shape cannot tell; images in as Qwen3-VL's: "
            "docs/features/multimodal_inputs.md)"),
    adds=("Qwen3's attention; sparse layers every `decoder_sparse_step` but `mlp_only_layers` (dense); "
          "`norm_topk_prob` chooses whether top-k weights are renormalized"),
    cpu="as Mixtral",
    gpu="as Mixtral",
    tests=("qwen3_moe", "qwen3_vl_moe"),
    traits=("qwen", "windowed_by_layer_type", "windowed", "qk_norm"),
)


QWEN2_MOE = Family(
    name="Qwen2-MoE",
    architectures=("Qwen2MoeForCausalLM",),
    fields=lambda raw: {"qkv_bias": bool(raw.get("qkv_bias", True) or raw.get("attention_bias"))},
    served="`Qwen2MoeForCausalLM` (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B)",
    adds=("Qwen2's attention (q/k/v biases); Qwen3-MoE's sparse layers, and in each a shared expert every token "
          "takes (`shared_expert`, a dense MLP of `shared_expert_intermediate_size`), its output weighed by "
          "`sigmoid(shared_expert_gate · x)` (that one-row gate unquantized, as the router) and added to the "
          "routed experts'"),
    cpu="as Mixtral, the shared expert on the dense layers' kernels",
    gpu="as Mixtral, the shared expert beside the grouped GEMMs",
    tests=("qwen2_moe",),
    traits=("qwen", "windowed_by_layer_type", "windowed", "o_proj_unbiased"),
)


FAMILIES = (QWEN2, QWEN3, QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT, QWEN3_MOE, QWEN2_MOE)
