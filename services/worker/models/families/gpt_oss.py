"""OpenAI's gpt-oss: biased routers and experts with a clamped SwiGLU, attention sinks, MXFP4
experts widened at load."""

from __future__ import annotations

from services.worker.models.families.family import Family

GPT_OSS = Family(
    name="gpt-oss",
    architectures=("GptOssForCausalLM",),
    fields=lambda raw: {"attention_sinks": True},
    served="`GptOssForCausalLM` (gpt-oss-20b, gpt-oss-120b)",
    adds=("every layer sparse, top-k over a biased router (`mlp.router`) weighed by a softmax over the k chosen "
          "logits; experts with biases, their gate a clamped SwiGLU (gate at most `swiglu_limit`, up within ±limit,"
          " `(up + 1) * gate * sigmoid(swiglu_alpha * gate)`, as transformers computes it), stacked in the "
          "checkpoint with gate and up columns interleaved (reordered at load, "
          "models/checkpoints/gpt_oss_weights.py), as the released MXFP4 blocks and scales (widened exactly to "
          "bfloat16 at load, then the model's dtype: the same bits as transformers' dequantization) or widened as "
          "transformers saves them; attention sinks (a learned logit per query head joining each softmax as one "
          "more column, dropped after it); windowed and global layers alternating (`layer_types`); YaRN (`truncate:"
          " false` read). In bfloat16 its norms apply the weight before the cast back (transformers' GptOssRMSNorm)"
          " where llmbus applies it after: a last-bit difference"),
    cpu=("all dtypes and int8/int4 on the module path, attention on the PyTorch path that takes sinks (the CPU "
         "kernels do not)"),
    gpu=("the paged-attention kernel with a sinks switch (folded into each row's final max and sum; with split-KV "
         "by the reduction); the grouped-GEMM experts with their biases gathered per pair and the clamped SwiGLU "
         "between the two products, all device ops (CUDA graphs take it). Chat is rendered by the checkpoint's "
         "harmony template, and answers are read by harmony's parsers (`openai_gptoss`, `openai`: reasoning, "
         "content and tool calls), which a gpt-oss checkpoint is served with by default"),
    tests=("gpt_oss",),
    traits=("unclassified", "always_windowed_by_layer_type", "windowed"),
    config_class="gpt_oss",
    tensor_fixups=("gpt_oss_experts",),
)


FAMILIES = (GPT_OSS,)
