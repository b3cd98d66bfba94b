"""Decode-only steps from persistent buffers at fixed batch sizes: CUDA graphs on a GPU.

A decode step of SmolLM2 on an H200 launches ~680 kernels for under 2 ms of GPU work, and
launching them from Python takes many times that. A CUDA graph records the launches once
and replays them with one call, but it replays them with the addresses it recorded: every
input a decode step reads must sit in a buffer that outlives the graph and that each step
fills in place (token ids, positions, slot mapping, sequence lengths, query offsets, block
table rows), and nothing inside may read device data on the host (capture refuses a sync).

A step of n decodes runs at the smallest captured size >= n (vLLM's sizes: 1, 2, 4, then
every 8 up to --max-cudagraph-capture-size). Rows past n are pads: token 0 at position 0
with one key, whose slot and block table point into the reserved pad block, so a pad never
writes a real KV block. Steps with prefill chunks, and steps past the largest size, run
eager. What attention decides on the host is fixed per size at capture: one query per row,
and the split-KV count for max_model_len keys (kernels/paged_attention.py splits each row's
own keys, so a short row leaves splits empty and the reduction gives them no weight).

Two modes, one code path:
- "capture" (CUDA): every size is captured at start-up, largest first, in one memory pool;
  a step fills the buffers and replays its size's graph.
- "replay" (any device): the same fill, then the model runs eagerly on the padded buffers
  and its output is read from the output buffer — what a replay computes, minus the
  recording — so the buffer discipline is tested on CPU (tests/test_decode_graphs.py).

The pinned staging buffers are refilled by the next step only after this one's sampled
ids reached the host (the runner's `.tolist()`), so an asynchronous copy is never
overwritten in flight.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from services.worker.attention.metadata import AttentionMetadata
from services.worker.step_inputs import StepInputs

log = logging.getLogger(__name__)

MODES = ("capture", "replay")


def capture_sizes(max_size: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s <= max_size] + list(range(8, max_size + 1, 8))
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


class _Buffer:
    """A device buffer and the host array a step fills it from (the same tensor on CPU)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, fill: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.host = torch.full(shape, fill, dtype=dtype, pin_memory=pinned)
        self.device = self.host.to(device) if pinned else self.host
        self.array = self.host.numpy()  # numpy writes into the same memory

    def upload(self, rows: int) -> None:
        if self.device is not self.host:
            self.device[:rows].copy_(self.host[:rows], non_blocking=True)


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], *, mode: str, max_size: int, max_model_len: int,
                 block_size: int, pad_block: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 pad_state_row: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown decode graph mode {mode!r}: {', '.join(MODES)}")
        if mode == "capture" and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device (mode 'replay' runs the same buffers anywhere)")
        self.model, self.kv_caches, self.mode = model, kv_caches, mode
        self.sizes = capture_sizes(max_size)
        self.max_model_len = max_model_len
        self.pad_block, self.pad_slot = pad_block, pad_block * block_size
        size, max_blocks = self.sizes[-1], -(-max_model_len // block_size)
        self.input_ids = _Buffer((size,), torch.int64, 0, device)
        self.positions = _Buffer((size,), torch.int64, 0, device)
        self.slot_mapping = _Buffer((size,), torch.int64, self.pad_slot, device)
        self.seq_lens = _Buffer((size,), torch.int32, 1, device)
        self.block_table = _Buffer((size, max_blocks), torch.int32, pad_block, device)
        # (a hybrid's: each row's state row; a pad's the pad row, which no request holds)
        self.pad_state_row = pad_state_row
        self.state_rows = _Buffer((size,), torch.int64, pad_state_row, device)
        self._buffers = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_table,
                         self.state_rows)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)  # one query a row
        self.hidden = torch.zeros(size, hidden_size, dtype=dtype, device=device)  # what a step reads back
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.device = device
        self._uploaded = None  # a CUDA event after the last step's uploads
        self.steps = 0  # decode steps served from the buffers (tests and the step log read it)

    def takes(self, inputs: StepInputs) -> bool:
        return inputs.decode_only and inputs.num_rows <= self.sizes[-1]

    def run(self, inputs: StepInputs, patch=None) -> torch.Tensor:
        """The step's hidden states [num_rows, hidden_size], after the final norm: a view of
        the output buffer, valid until the next step. `patch(input_ids)` fills in, on the
        device, the ids of tokens a launched step sampled there."""
        n = inputs.num_rows
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        if self._uploaded is not None:
            # The host buffers are about to be rewritten: the last step's copies out of
            # them must be done (a launched step's may still wait behind the device's work).
            self._uploaded.synchronize()
        self._fill(inputs, n, size)
        if self.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        if patch is not None:
            patch(self.input_ids.device[:n])
        if self.mode == "capture":
            self.graphs[size].replay()
        else:
            self.hidden[:size].copy_(self._forward(size))
        self.steps += 1
        return self.hidden[:n]

    def capture_all(self) -> None:
        """Record every size's graph, largest first so the smaller ones reuse its pool."""
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            self._fill_pads(0, size)
            for _ in range(2):  # compile and autotune outside the recording (pads only: the pad block)
                self.hidden[:size].copy_(self._forward(size))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:size].copy_(self._forward(size))
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info("decode CUDA graphs captured", extra={"sizes": len(self.sizes), "max_size": self.sizes[-1],
                                                       "seconds": round(time.perf_counter() - start, 2)})

    def _fill(self, inputs: StepInputs, n: int, size: int) -> None:
        self.input_ids.array[:n] = inputs.input_ids
        self.positions.array[:n] = inputs.positions
        self.slot_mapping.array[:n] = inputs.slot_mapping
        self.seq_lens.array[:n] = inputs.seq_lens
        # Columns past this step's width keep older block ids: attention reads a row's
        # table only up to its own length, which the width covers.
        self.block_table.array[:n, : inputs.block_table.shape[1]] = inputs.block_table
        self.state_rows.array[:n] = inputs.state_rows
        self._fill_pads(n, size)

    def _fill_pads(self, n: int, size: int) -> None:
        """Rows n..size are pads, then the rows 0..size go to the device."""
        self.input_ids.array[n:size] = 0
        self.positions.array[n:size] = 0
        self.slot_mapping.array[n:size] = self.pad_slot
        self.seq_lens.array[n:size] = 1
        self.block_table.array[n:size, 0] = self.pad_block
        self.state_rows.array[n:size] = self.pad_state_row
        for buffer in self._buffers:
            buffer.upload(size)

    def _forward(self, size: int) -> torch.Tensor:
        metadata = AttentionMetadata(
            num_decodes=size,
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,  # what a graph fixes: its split-KV choice
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens.device[:size],
            slot_mapping=self.slot_mapping.device[:size],
            block_table=self.block_table.device[:size],
            # Host copies are for the CPU backend, which never runs inside a graph.
            query_start_loc_cpu=np.arange(size + 1),
            seq_lens_cpu=self.seq_lens.array[:size].astype(np.int64),
            state_rows=self.state_rows.device[:size],
            state_rows_cpu=self.state_rows.array[:size],
        )
        return self.model(self.input_ids.device[:size], self.positions.device[:size], self.kv_caches, metadata)
