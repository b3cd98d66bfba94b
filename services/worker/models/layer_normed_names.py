"""The LayerNorm decoders' checkpoint names (GPT-2, OPT, GPT-NeoX, Phi, StarCoder2) in the Llama
layout the loader reads (models/decoder.py), and their tensors as our modules hold them:
GPT-2's products stored transposed (Conv1D), GPT-NeoX's q/k/v rows interleaved head by
head. Buffers some checkpoints carry (causal masks) are skipped.
"""

from __future__ import annotations

import re

import torch

# (pattern, replacement) by architecture, applied in order to a name its prefix was taken off
_RENAMES = {
    "GPT2LMHeadModel": [
        (r"^wte\.", "model.embed_tokens."), (r"^wpe\.", "model.embed_positions."), (r"^ln_f\.", "model.norm."),
        (r"^h\.(\d+)\.ln_1\.", r"model.layers.\1.input_layernorm."),
        (r"^h\.(\d+)\.ln_2\.", r"model.layers.\1.post_attention_layernorm."),
        (r"^h\.(\d+)\.attn\.c_attn\.", r"model.layers.\1.self_attn.qkv_proj."),
        (r"^h\.(\d+)\.attn\.c_proj\.", r"model.layers.\1.self_attn.o_proj."),
        (r"^h\.(\d+)\.mlp\.c_fc\.", r"model.layers.\1.mlp.up_proj."),
        (r"^h\.(\d+)\.mlp\.c_proj\.", r"model.layers.\1.mlp.down_proj."),
    ],
    "OPTForCausalLM": [
        (r"^decoder\.embed_tokens\.", "model.embed_tokens."),
        (r"^decoder\.embed_positions\.", "model.embed_positions."),
        (r"^decoder\.final_layer_norm\.", "model.norm."),
        (r"^decoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"model.layers.\1.input_layernorm."),
        (r"^decoder\.layers\.(\d+)\.final_layer_norm\.", r"model.layers.\1.post_attention_layernorm."),
        (r"^decoder\.layers\.(\d+)\.self_attn\.out_proj\.", r"model.layers.\1.self_attn.o_proj."),
        (r"^decoder\.layers\.(\d+)\.fc1\.", r"model.layers.\1.mlp.up_proj."),
        (r"^decoder\.layers\.(\d+)\.fc2\.", r"model.layers.\1.mlp.down_proj."),
        (r"^decoder\.layers\.", "model.layers."),
    ],
    "GPTNeoXForCausalLM": [
        (r"^embed_in\.", "model.embed_tokens."), (r"^final_layer_norm\.", "model.norm."),
        (r"^embed_out\.", "lm_head."),
        (r"^layers\.(\d+)\.attention\.query_key_value\.", r"model.layers.\1.self_attn.qkv_proj."),
        (r"^layers\.(\d+)\.attention\.dense\.", r"model.layers.\1.self_attn.o_proj."),
        (r"^layers\.(\d+)\.mlp\.dense_h_to_4h\.", r"model.layers.\1.mlp.up_proj."),
        (r"^layers\.(\d+)\.mlp\.dense_4h_to_h\.", r"model.layers.\1.mlp.down_proj."),
        (r"^layers\.", "model.layers."),
    ],
    "Starcoder2ForCausalLM": [
        (r"^model\.layers\.(\d+)\.mlp\.c_fc\.", r"model.layers.\1.mlp.up_proj."),
        (r"^model\.layers\.(\d+)\.mlp\.c_proj\.", r"model.layers.\1.mlp.down_proj."),
    ],
    "PhiForCausalLM": [
        (r"^model\.final_layernorm\.", "model.norm."),
        (r"^model\.layers\.(\d+)\.self_attn\.dense\.", r"model.layers.\1.self_attn.o_proj."),
        (r"^model\.layers\.(\d+)\.mlp\.fc1\.", r"model.layers.\1.mlp.up_proj."),
        (r"^model\.layers\.(\d+)\.mlp\.fc2\.", r"model.layers.\1.mlp.down_proj."),
    ],
}
# The prefix each one's decoder is saved under (taken off; some checkpoints have none)
_PREFIXES = {"GPT2LMHeadModel": ("transformer.",), "OPTForCausalLM": ("model.",), "GPTNeoXForCausalLM": ("gpt_neox.",),
             "PhiForCausalLM": (), "Starcoder2ForCausalLM": ()}
_COMPILED = {arch: [(re.compile(p), r) for p, r in rules] for arch, rules in _RENAMES.items()}
# Buffers, not weights: GPT-2's and GPT-NeoX's causal masks, old checkpoints' rotary tables
_SKIPPED = re.compile(r"\.attn\.(masked_)?bias$|\.attention\.(masked_)?bias$|rotary_emb\.inv_freq$")


def checkpoint_tensor(arch: str, name: str, tensor: torch.Tensor, num_heads: int
                      ) -> tuple[str, torch.Tensor] | None:
    """(our name, the tensor as our module holds it), or None for a buffer to skip; names of
    other families pass unchanged."""
    rules = _COMPILED.get(arch)
    if rules is None:
        return name, tensor
    if _SKIPPED.search(name):
        return None
    for prefix in _PREFIXES[arch]:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    for pattern, replacement in rules:
        renamed = pattern.sub(replacement, name)
        if renamed != name:
            name = renamed
            break
    if arch == "GPT2LMHeadModel" and tensor.dim() == 2 and ".layers." in name:
        tensor = tensor.T  # Conv1D: [in, out]
    if arch == "GPTNeoXForCausalLM" and ".qkv_proj." in name:
        # [heads, (q, k, v), head_dim, ...] -> [(q, k, v), heads, head_dim, ...]
        rows = tensor.shape[0]
        tensor = tensor.reshape(num_heads, 3, rows // (3 * num_heads), *tensor.shape[1:]).transpose(0, 1)
        tensor = tensor.reshape(rows, *tensor.shape[3:])
    return name, tensor
