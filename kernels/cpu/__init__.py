"""CPU kernels for the model step: where eager PyTorch left the most time on the table.

- `linear`: a bfloat16 or float32 matrix product over weights packed once at load
  (`pack_weight`), streaming the weights at close to memory speed for decode-sized batches
  (kernels/cpu/linear.cpp).
- `linear_int4`, `linear_int8`: the same for 4-bit weights (a step and a low per group of
  32 inputs, `pack_int4`) or int8 weights (a scale per output, `pack_int8`) and bfloat16
  activations (kernels/cpu/linear_int4.cpp, linear_int8.cpp).
- `paged_decode_attention`: attention of one query token per sequence, reading keys and
  values in place from the paged cache (kernels/cpu/paged_decode_attention.cpp).
- `write_kv`: new keys and values into their cache slots; with an 8-bit float cache
  (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`) converted as PyTorch converts (kernels/cpu/fp8.h).
  Both attention kernels read such a cache too, for queries of either dtype.
- `paged_prefill_attention`: causal attention of one request's new tokens over its paged
  cache, flash-attention style (kernels/cpu/paged_prefill_attention.cpp).
- `add_rms_norm`, `rotary`, `act_and_mul`: the elementwise steps between the products, one
  pass each, with the roundings of the PyTorch ops they replace (kernels/cpu/elementwise.cpp).
- `decoder_layer`: all of the above for one Llama-family layer (Qwen3's and Gemma's
  additions included) of a decode-only step in one call (kernels/cpu/decoder_layer.cpp),
  described by `LayerSpec` and `StepSpec`.

Each takes bfloat16 or float32 (one C++ template, an entry point per dtype). They need
x86-64 with AVX-512 BF16 and a C++ compiler at run time; `available()` says whether they
loaded, `unavailable_reason()` why not, and every caller keeps a PyTorch path. They sum in
another order than PyTorch's kernels, so float32 results move in their last bits; float32
greedy output stays token-identical to transformers (the oracle tests and `llmbus bench
agreement`'s prompts).
"""

from __future__ import annotations

import torch

from kernels.cpu.elementwise import (  # noqa: F401 - the package's API
    ACTIVATIONS,
    act_and_mul,
    add_rms_norm,
    check_norm_args,
    check_rotary_args,
    decoder_layer,
    rotary,
    supports,
)
from kernels.cpu.library import (  # noqa: F401
    FP8_KV_FORMATS,
    INT4_GROUP_SIZE,
    LayerSpec,
    StepSpec,
    available,
    entry,
    kv_format,
    unavailable_reason,
)
from kernels.cpu.products import (  # noqa: F401
    int4_expand_rows,
    int8_expand_rows,
    linear,
    linear_int4,
    linear_int8,
    pack_int4,
    pack_int8,
    pack_weight,
)

# The attention kernels stay here: they ask `available()` through this module, as callers
# and tests that switch the kernels off do.


def attention_supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether both attention kernels (decode and prefill) take this query and cache."""
    head_dim = query.shape[-1]
    return (
        kv_format(query.dtype, kv_cache.dtype) is not None and query.device.type == "cpu"
        and head_dim in (64, 128, 256) and kv_cache.stride(-1) == 1 and query.stride(-1) == 1
        and query.shape[1] % kv_cache.shape[3] == 0 and query.shape[1] // kv_cache.shape[3] <= 64 and available()
    )


def _attention_entry(kernel: str, query: torch.Tensor, kv_cache: torch.Tensor):
    """The C entry point for this query and cache and the cache's format code, after the
    checks ctypes cannot make."""
    code = kv_format(query.dtype, kv_cache.dtype)
    if code is None:
        raise ValueError(f"{kernel} takes a bfloat16 or float32 query and a cache of the same dtype or of "
                         f"float8 (e4m3fn, e5m2), got {query.dtype} and {kv_cache.dtype}")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError(f"{kernel} needs head_dim contiguous in query and cache")
    return entry(kernel, query.dtype), code


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim] bfloat16 or float32, one token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], any layout, head_dim contiguous
    block_table: torch.Tensor,  # [>= num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= num_seqs] int32: tokens to attend over, the new one included
    scale: float,
    window: int = 0,  # > 0: only the last `window` of them (a sliding window)
    softcap: float | None = None,  # scores become softcap * tanh(score / softcap) (Gemma 2)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    entry, code = _attention_entry("paged_decode_attention", query, kv_cache)
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_table and seq_lens must be int32")
    block_table, seq_lens = block_table.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(query)
    k, v = kv_cache[0], kv_cache[1]
    status = entry(
        query.data_ptr(), query.stride(0), query.stride(1), k.data_ptr(), v.data_ptr(),
        k.stride(0), k.stride(1), k.stride(2), block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, out.data_ptr(), out.stride(0), out.stride(1),
        torch.get_num_threads(), code, window, softcap or 0.0,
    )
    if status == -1:
        raise ValueError(f"paged_decode_attention: head_dim {head_dim} has no compiled variant")
    if status != 0:
        raise ValueError(f"paged_decode_attention: {num_heads} query heads over {num_kv_heads} KV heads")
    return out


def paged_prefill_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim] bfloat16 or float32: one request's new tokens
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    blocks: torch.Tensor,  # [>= ceil(seq_len / block_size)] int32: the request's block table row
    seq_len: int,  # cached + new tokens; the new ones are the last query_len
    scale: float,
    window: int = 0,  # > 0: each token sees its last `window` positions only
    softcap: float | None = None,  # scores become softcap * tanh(score / softcap) (Gemma 2)
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    query_len, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    entry, code = _attention_entry("paged_prefill_attention", query, kv_cache)
    if blocks.dtype != torch.int32 or not blocks.is_contiguous() or blocks.numel() * block_size < seq_len:
        raise ValueError(f"paged_prefill_attention needs a contiguous int32 block row covering {seq_len} tokens")
    out = torch.empty_like(query)
    k, v = kv_cache[0], kv_cache[1]
    status = entry(
        query.data_ptr(), query.stride(0), query.stride(1), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
        k.stride(2), blocks.data_ptr(), query_len, seq_len, num_heads, num_kv_heads, head_dim, block_size, scale,
        out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads(), code, window, softcap or 0.0,
    )
    if status == -1:
        raise ValueError(f"paged_prefill_attention: head_dim {head_dim} has no compiled variant")
    if status != 0:
        raise ValueError(f"paged_prefill_attention: {query_len} new of {seq_len} tokens, "
                         f"{num_heads} heads over {num_kv_heads}")
    return out


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], bfloat16 or float32
    value: torch.Tensor,  # as key
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks a padded token
) -> None:
    """key and value into their slots, converted to the cache's dtype (float8: rounded to
    nearest even, saturating at the format's largest finite value)."""
    code = kv_format(key.dtype, kv_cache.dtype)
    if code is None or value.dtype != key.dtype or key.shape != value.shape:
        raise ValueError(f"write_kv: key and value of one dtype and shape into a cache of it or of float8; "
                         f"got {key.dtype} {tuple(key.shape)}, {value.dtype}, cache {kv_cache.dtype}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if kv_cache.shape[3:] != (num_kv_heads, head_dim) or kv_cache.stride(-1) != 1:
        raise ValueError(f"write_kv: cache {tuple(kv_cache.shape)} does not hold [{num_kv_heads}, {head_dim}] "
                         f"heads with head_dim contiguous")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError("write_kv: slot_mapping must be int64, one slot per token")
    if num_tokens and int(slot_mapping.max()) >= kv_cache.shape[1] * kv_cache.shape[2]:
        raise ValueError("write_kv: a slot lies past the cache")
    # The kernel takes heads adjacent within a row and one row stride for both.
    if key.stride()[1:] != (head_dim, 1) or value.stride() != key.stride():
        key, value = key.contiguous(), value.contiguous()
    slots = slot_mapping.contiguous()
    k, v = kv_cache[0], kv_cache[1]
    entry("write_kv", key.dtype)(
        key.data_ptr(), value.data_ptr(), key.stride(0), slots.data_ptr(), num_tokens, num_kv_heads, head_dim,
        k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2), kv_cache.shape[2], code,
    )
