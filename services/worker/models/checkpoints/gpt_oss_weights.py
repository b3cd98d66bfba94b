"""gpt-oss's checkpoint tensors in the layout the loader reads (models/decoder.py).

Its experts come stacked, one tensor per projection for all experts of a layer, with the
gate and up columns interleaved (gate at even indices, up at odd ones, as transformers'
GptOssExperts splits them) and biased. Released checkpoints (gpt-oss-20b, 120b) hold the
two products in MXFP4: `*_blocks` (uint8, two 4-bit e2m1 values a byte, the low nibble
first, 32 values a block) and `*_scales` (uint8, a block's power of two, biased by 127),
[experts, out rows, blocks, 16] and [experts, out rows, blocks]; a checkpoint saved by
transformers holds them widened, [experts, in, out]. Both become one tensor per expert,
[out, in], its gate rows before its up rows (ClampedSwiGLUExpert's layout). MXFP4 widens
exactly (every value is a small integer or half times a power of two), to bfloat16 here;
the loader then casts the model to its dtype. The router (`mlp.router`) is the loader's
`mlp.gate`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

# The 16 values of a 4-bit e2m1 code (sign, two exponent bits, one mantissa bit)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def widen_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., rows, blocks, 16] uint8 codes and [..., rows, blocks] uint8 scales ->
    [..., rows, blocks * 32] values."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(E2M1_VALUES, dtype=dtype)
    codes = blocks.to(torch.uint8)
    values = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1)  # low nibble first
    values = torch.ldexp(values.flatten(-2), (scales.to(torch.int32) - 127)[..., None])
    return values.flatten(-2)


def gpt_oss_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    pending: dict[tuple[str, str], tuple[str, torch.Tensor]] = {}  # (experts, projection) -> the other half
    for name, tensor in weights:
        if ".mlp.router." in name:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
            continue
        match = _EXPERTS.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, projection, kind = match.groups()
        if kind == "_bias":
            for e, bias in enumerate(tensor.unbind(0)):
                yield f"{prefix}.{e}.{projection}.bias", _gate_rows_first(bias) if projection == "gate_up_proj" else bias
            continue
        if kind is None:  # widened, as transformers saves it: [experts, in, out]
            yield from _per_expert(prefix, projection, tensor.transpose(1, 2))
            continue
        other = pending.pop((prefix, projection), None)
        if other is None:
            pending[(prefix, projection)] = (kind, tensor)
            continue
        blocks, scales = (tensor, other[1]) if kind == "_blocks" else (other[1], tensor)
        yield from _per_expert(prefix, projection, widen_mxfp4(blocks, scales))  # [experts, out, in]
    if pending:
        (prefix, projection), (kind, _) = next(iter(pending.items()))
        missing = "_scales" if kind == "_blocks" else "_blocks"
        raise ValueError(f"checkpoint has {prefix}.{projection}{kind} without its {projection}{missing}")


def _per_expert(prefix: str, projection: str, stacked: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for e, rows in enumerate(stacked.unbind(0)):  # rows: [out, in]
        yield f"{prefix}.{e}.{projection}.weight", _gate_rows_first(rows) if projection == "gate_up_proj" else rows


def _gate_rows_first(interleaved: torch.Tensor) -> torch.Tensor:
    """Rows (or a bias's entries) gate, up, gate, up, ... -> all the gate's, then the up's."""
    return torch.cat((interleaved[0::2], interleaved[1::2]))
