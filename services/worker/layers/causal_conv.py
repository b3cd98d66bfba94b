"""The causal depthwise convolution of the hybrid models' recurrent layers, over a state a
request: each channel of a token is a weighed sum of that channel in the token and in
the `kernel - 1` before it (zeros before a request's first token), the last `kernel - 1`
inputs kept as the request's state (Qwen3.5's Gated DeltaNet convolves its q, k and v so,
LFM2's short convolution its gated input). A step's decodes (one token a request, the
first rows) take index ops only, graph-safe; its prefill chunks a request at a time."""

from __future__ import annotations

import torch

from services.worker.attention.metadata import AttentionMetadata


def causal_conv(inputs: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                metadata: AttentionMetadata) -> torch.Tensor:
    """inputs [tokens, channels] -> outputs [tokens, channels] (no activation); conv_state
    [rows, channels, kernel - 1], each request's row (`metadata.state_rows`) updated.
    `weight` [channels, kernel] (a Conv1d's, its middle dim dropped)."""
    out = torch.empty_like(inputs)
    d = metadata.num_decodes
    if d:
        rows, carried = metadata.decode_states()
        window = torch.cat((conv_state.index_select(0, rows) * carried.to(inputs.dtype)[:, None, None],
                            inputs[:d].unsqueeze(-1)), dim=-1)
        conv_state.index_copy_(0, rows, window[:, :, 1:])
        out[:d] = convolve(window, weight, bias)[:, :, 0]
    for first, last, row, carried in metadata.prefill_states():  # one request at a time
        past = conv_state[row] if carried else torch.zeros_like(conv_state[row])
        window = torch.cat((past, inputs[first:last].T), dim=-1)  # [channels, kernel - 1 + length]
        conv_state[row] = window[:, -conv_state.shape[-1]:]
        out[first:last] = convolve(window, weight, bias).T
    return out


def convolve(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[..., channels, kernel - 1 + n] inputs -> [..., channels, n] outputs: a weighed sum of
    shifted views, summed in float32 and cast back as a convolution's output is (oneDNN's
    depthwise kernel took 1.7 ms for one token of Qwen3.5-0.8B's 6144 channels, this a few
    microseconds)."""
    kernel = weight.shape[-1]
    weight = weight.float()
    n = window.shape[-1] - kernel + 1
    out = window[..., :n].float() * weight[:, :1]
    for tap in range(1, kernel):
        out.addcmul_(window[..., tap:tap + n], weight[:, tap:tap + 1])
    if bias is not None:
        out += bias.float()[:, None]
    return out.to(window.dtype)
