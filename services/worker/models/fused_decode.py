"""Decode-only steps of a bfloat16 or float32 Llama-family model on CPU, one C call per
decoder layer.

At one token per request a layer's ten kernels each take microseconds, and driving them
from PyTorch modules (module calls, ctypes, tensor allocation, views) cost about 3 ms of a
15 ms SmolLM2 step. `FusedDecode` describes each layer to kernels/cpu/decoder_layer.cpp
once (weight, cache and table pointers, in a `LayerSpec`), and each step once (a
`StepSpec`: positions, slots, block table, scratch), then makes one call per layer.

The kernels are the ones the module path calls (packed products, fused add-norm, rotary,
cache write, decode attention, SiLU- or GELU-mul), so both paths compute the same bits
(tests/test_fused_decode.py). The families: Llama's layer, Qwen3's query/key norms,
Gemma's (1-3) GeGLU, norms of each branch's output, soft-capped scores and per-layer rotary
bases and windows, and Phi-3's longrope and partial rotary. Layers packed for llmbus's
kernels take part: bfloat16 and float32, and int4 or int8 weights on llmbus's kernels (with
bfloat16 activations). Steps with prefill chunks, weights on PyTorch's kernels, other
attention backends, experts and exact GELU take the module path.
"""

from __future__ import annotations

import torch

import kernels.cpu as cpu_kernels
from services.worker.attention.metadata import AttentionMetadata
from services.worker.layers.packed_linear import PackedLinear
from services.worker.layers.quantized_linear import Int4Linear, Int8Linear
from services.worker.layers.rms_norm import RMSNorm

# LlmbusLayer.weight_format for each kind of product (kernels/cpu/decoder_layer.cpp).
_WEIGHT_FORMATS = {PackedLinear: 0, Int4Linear: 4, Int8Linear: 8}


class FusedDecode:
    def __init__(self, model, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype
        # (from this many rows some product is oneDNN's on this CPU: layers/kernel_choice.py)
        self.max_rows = min((m.rows_from for m in model.modules() if getattr(m, "rows_from", None)),
                            default=None)
        self._cache_key: tuple[int, ...] | None = None
        self._layers: list[cpu_kernels.LayerSpec] = []

    @classmethod
    def build(cls, model) -> FusedDecode | None:
        """The fused path for `model` (a LlamaForCausalLM), or None where it does not apply."""
        config = model.config
        if not cpu_kernels.available() or config.head_dim not in (64, 128, 256) or config.num_hidden_layers == 0:
            return None
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % kv_heads or heads // kv_heads > 64:  # what the attention kernel splits
            return None
        if model.attention_backend.name != "torch":
            return None  # another attention backend was asked for (Triton): keep to it
        if config.hidden_act not in cpu_kernels.ACTIVATIONS:
            return None  # exact GELU: the C layer's gates are SiLU and GELU's tanh form
        if config.moe_layers:
            return None  # the C layer has no experts: the module path for these
        if config.qk_norm_after_rope:
            return None  # the C layer norms queries and keys before rotary (Qwen3's order)
        if config.kv_lora_rank or config.attention_gate or config.recurrent_layers:
            return None  # the C layer's heads are the usual ones, not latent attention's nor gated ones, every layer's
        if config.layer_norm or config.parallel_residual or config.scale_queries:
            return None  # the C layer's norms are RMSNorms, its branches one after the other
        # (A partial rotary turns each head's leading rotary_dim; longrope's long rows are
        # picked by the positions themselves, offset in the step's inputs: both as on the
        # module path.)
        dtype = model.model.embed_tokens.weight.dtype
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            packed = all(isinstance(m, PackedLinear) and m.kernel == "llmbus" and m.dtype == dtype for m in linears)
            quantized = dtype == torch.bfloat16 and any(
                all(isinstance(m, kind) and m.kernel == "llmbus" for m in linears) for kind in (Int4Linear, Int8Linear))
            if not (packed or quantized):
                return None  # on PyTorch's quantized kernels, or oneDNN-packed weights
            if mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
                return None
            norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                     layer.post_feedforward_layernorm, attn.q_norm, attn.k_norm]
            if {norm.weight.dtype for norm in norms if isinstance(norm, RMSNorm)} != {dtype}:
                return None
        return cls(model, dtype)

    def takes(self, input_ids: torch.Tensor, metadata: AttentionMetadata, kv_caches: list[torch.Tensor]) -> bool:
        """Whether this step is one it runs: decodes only, one unpadded token each."""
        limit = self.model.config.query_scale_original  # (Ministral 3's queries scale past it: the C layer's do not)
        return (
            metadata.num_decodes == metadata.num_reqs == input_ids.numel() == metadata.num_actual_tokens
            and metadata.num_reqs > 0 and (self.max_rows is None or metadata.num_reqs < self.max_rows)
            and (not limit or metadata.max_seq_len <= limit)
            and cpu_kernels.kv_format(self.dtype, kv_caches[0].dtype) is not None and kv_caches[0].stride(-1) == 1
        )

    def _layer_specs(self, kv_caches: list[torch.Tensor]) -> list[cpu_kernels.LayerSpec]:
        key = tuple(cache.data_ptr() for cache in kv_caches)
        if key == self._cache_key:
            return self._layers
        config = self.model.config
        specs = []
        for layer, cache in zip(self.model.model.layers, kv_caches, strict=True):
            attn, mlp, rotary = layer.self_attn, layer.mlp, layer.self_attn.rotary  # Gemma 3: a base per layer kind
            # Gemma 2 and 3: post_attention_layernorm norms the attention's output alone, and
            # pre_feedforward_layernorm is the add-norm before the MLP (the module path's order).
            sandwich = layer.pre_feedforward_layernorm is not None
            pre_mlp_norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
            k, v = cache[0], cache[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
            specs.append(cpu_kernels.LayerSpec(
                hidden_size=config.hidden_size, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
                head_dim=attn.head_dim, intermediate_size=mlp.intermediate_size, block_size=cache.shape[2],
                eps=config.rms_norm_eps, scale=attn.scale,
                input_norm=_norm_ptr(layer.input_layernorm), post_norm=_norm_ptr(pre_mlp_norm),  # (OLMo 2: the add alone)
                qkv=attn.qkv_proj.weight_packed.data_ptr(), o=attn.o_proj.weight_packed.data_ptr(),
                gate_up=mlp.gate_up_proj.weight_packed.data_ptr(), down=mlp.down_proj.weight_packed.data_ptr(),
                qkv_bias=_ptr(attn.qkv_proj.bias), o_bias=_ptr(attn.o_proj.bias),
                k_cache=k.data_ptr(), v_cache=v.data_ptr(),
                block_stride=k.stride(0), slot_stride=k.stride(1), head_stride=k.stride(2),
                cos_table=rotary.cos_cache.data_ptr(), sin_table=rotary.sin_signed_cache.data_ptr(),
                weight_format=_WEIGHT_FORMATS[type(attn.qkv_proj)],
                kv_format=cpu_kernels.kv_format(self.dtype, cache.dtype),
                window=attn.window,  # a sliding window (Mistral's, Phi-3's, Gemma's), on the decode kernel
                q_norm=None if attn.q_norm is None else attn.q_norm.weight.data_ptr(),
                k_norm=None if attn.k_norm is None else attn.k_norm.weight.data_ptr(),
                post_attn_norm=layer.post_attention_layernorm.weight.data_ptr() if sandwich else None,
                post_mlp_norm=layer.post_feedforward_layernorm.weight.data_ptr() if sandwich else None,
                activation=cpu_kernels.ACTIVATIONS[mlp.hidden_act], softcap=attn.softcap or 0.0,
                rotary_dim=rotary.head_dim,  # the dims that rotate (fewer than head_dim: Phi-4-mini's partial rotary)
                qk_norm_over_heads=int(attn.qk_norm_over_heads),
            ))
        # The specs point into the model's parameters and these caches, which live as long as the runner.
        self._cache_key, self._layers = key, specs
        return specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:  # [num_tokens, hidden_size], after the final norm
        config = self.model.config
        self.model.model.rotary.check_positions(positions)
        rows = input_ids.numel()
        attn, mlp = self.model.model.layers[0].self_attn, self.model.model.layers[0].mlp
        qkv_size = (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim
        sizes = (config.hidden_size, qkv_size, attn.num_heads * attn.head_dim, 2 * mlp.intermediate_size,
                 mlp.intermediate_size)
        scratch = torch.empty(rows * sum(sizes), dtype=self.dtype).split([rows * size for size in sizes])
        positions = positions.to(torch.int64).contiguous()
        slots = metadata.slot_mapping.to(torch.int64).contiguous()
        block_table = metadata.block_table.to(torch.int32).contiguous()
        seq_lens = metadata.seq_lens.to(torch.int32).contiguous()
        step = cpu_kernels.StepSpec(
            rows=rows, table_stride=block_table.stride(0), threads=torch.get_num_threads(),
            positions=positions.data_ptr(), slots=slots.data_ptr(), block_table=block_table.data_ptr(),
            seq_lens=seq_lens.data_ptr(), normed=scratch[0].data_ptr(), qkv=scratch[1].data_ptr(),
            attn=scratch[2].data_ptr(), gate_up=scratch[3].data_ptr(), act=scratch[4].data_ptr(),
        )
        hidden = self.model.embed(input_ids).contiguous()
        residual = torch.empty_like(hidden)
        for i, layer in enumerate(self._layer_specs(kv_caches)):
            cpu_kernels.decoder_layer(layer, step, hidden, residual, first=i == 0)
        return self.model.model.norm(hidden, residual)[0]


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _norm_ptr(norm) -> int | None:
    """An RMSNorm's weight, or None for a ResidualAdd (the C layer then adds alone)."""
    return norm.weight.data_ptr() if isinstance(norm, RMSNorm) else None
