"""The traits a family's record may name (Family.traits): each something the decoder does
for several families, read by the config's mapping (models/decoder_config.py,
models/config_fields/) through the registry's groups."""

from __future__ import annotations

TRAITS = {
    "qwen": "Qwen's config keys (use_sliding_window, max_window_layers, the MoEs' decoder_sparse_step)",
    "gemma": "a GELU-gated MLP, norms that weigh by 1 + w, embeddings scaled by sqrt(hidden); tied by default",
    "glm": "GLM-4's layer: gate/up fused in the checkpoint, half of each head rotating",
    "olmo": "OLMo 2's and 3's layer",
    "cohere": "Cohere's layer: LayerNorms without a bias, side-by-side branches, logits times logit_scale",
    "hunyuan": "Hunyuan's attention: query/key norms after rotary, an NTK alpha on the rotary base",
    "exaone": "EXAONE's attention: windows by layer_types, the global layers without rotary",
    "layer_normed": "biased LayerNorms and (mostly) ungated biased MLPs (layers/layer_norm.py)",
    "linear_attention": "Gated DeltaNet layers (layers/gated_delta_net.py) between full-attention ones",
    "short_conv": "gated short convolutions (layers/short_conv.py) between attention layers",
    "mamba": "Mamba2's selective state spaces (layers/mamba2.py) between attention layers",
    "latent_attention": "multi-head latent attention (layers/latent_attention.py) in place of the usual heads",
    "deepseek_v3_experts": "DeepSeek-V3's experts: its grouped sigmoid router, ungated shared experts",
    "queries_scaled_by_position": "Llama 4's temperature by position on the queries (llama_4_scaling_beta)",
    "qk_norm": "a norm on each query and key head (or on all of them: qk_norm_over_heads) before rotary",
    "qk_norm_over_heads": "query/key norms over all of a token's heads at once (OLMo 2's)",
    "post_normed": "no norm before attention and the MLP, one on each's output instead",
    "sandwich_norms": "a norm on the attention's and the MLP's outputs beside the usual pre-norms",
    "o_proj_unbiased": "o_proj never biased, whatever attention_bias says of q/k/v",
    "attention_gate": "the heads' output gated by a sigmoid of the layer's input",
    "rotary_interleaved": "rotating interleaved pairs (reordered at load to the halves every kernel computes)",
    "ropes_by_layer_type": "rotary setups by layer type (rope_parameters' full_attention and sliding_attention)",
    "windowed": "sliding windows as transformers applies them (the kinds below), never a cap on the context",
    "every_layer_windowed": "a window on every layer, where the config has one",
    "windowed_by_layer_type": "windowed where use_sliding_window says, on the layers layer_types names",
    "always_windowed_by_layer_type": "windowed where layer_types says, always (no use_sliding_window switch)",
    "unclassified": "its *ForSequenceClassification refused (its classifier not held to transformers here)",
}
