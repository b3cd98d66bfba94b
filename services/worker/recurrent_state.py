"""A hybrid model's recurrent state on the worker: its recurrent layers (linear attention,
short convolutions, Mamba2: layers/gated_delta_net.py, short_conv.py, mamba2.py) keep a
state a request in place of KV blocks, a row for each request it may hold at once (found
by the request's block-table row), one more where a decode graph's pads write, and past
that pad row the prefix cache's snapshots (services/scheduler/core/state_snapshots.py)."""

from __future__ import annotations

import math

import torch

from services.worker.host_values import to_device


def state_shapes(model, layer: int, rows: int, dtype: torch.dtype) -> tuple:
    """A recurrent layer's state: its tensors' (shape, dtype) for `rows` rows and the pad row."""
    return model.model.layers[layer].self_attn.state_shapes(rows + 1, dtype)


def state_bytes(model, layers: tuple[int, ...], rows: int, dtype: torch.dtype) -> int:
    """The recurrent layers' state for `rows` rows (and the pad row)."""
    return sum(math.prod(shape) * t.itemsize for i in layers for shape, t in state_shapes(model, i, rows, dtype))


def refusal(new, snapshot: int | None, recurrent_rows: int, snapshot_rows: int, rows_in_use: int,
            architecture: str) -> str | None:
    """Why a hybrid model cannot take this request now (None: it can): its recurrent
    layers' state starts from a request's first token or from a `snapshot` of the state
    at a cached block's end, in one of `recurrent_rows` rows. The scheduler keeps within
    both (Scheduler's recurrent_rows); this says so should anything else reach here."""
    if new.num_computed_tokens and (snapshot is None or not 0 <= snapshot < snapshot_rows):
        return (f"a {architecture} request cannot start at token {new.num_computed_tokens}: "
                "its recurrent layers' state is computed from the first token or a snapshot")
    if rows_in_use >= recurrent_rows:
        return (f"this worker holds {recurrent_rows} requests at most (--max-num-seqs): its "
                "recurrent state has no row left")
    return None


def copy_states(kv_caches: list, layers: tuple[int, ...], requests: dict, slots: dict[str, int], recurrent_rows: int,
                device: torch.device, to_snapshot: bool) -> None:
    """Copy each request's recurrent state (`slots`: request id -> snapshot slot) to its
    slot, or back: every recurrent layer's tensors, in the step's stream order (a restore
    lands before the forward reads the row, a save after the forward wrote it). Snapshots
    lie past the pad row. A request the worker dropped (it failed as it arrived: not in
    `requests`) is skipped: the scheduler hears of its error and never finds that save."""
    pairs = [(requests[rid].block_row, slot) for rid, slot in slots.items() if rid in requests]
    if not pairs:
        return
    rows, snapshots = (to_device(side, device, torch.int64)
                       for side in zip(*((row, recurrent_rows + 1 + slot) for row, slot in pairs)))
    src, dst = (rows, snapshots) if to_snapshot else (snapshots, rows)
    for layer in layers:
        for tensor in kv_caches[layer]:
            tensor.index_copy_(0, dst, tensor.index_select(0, src))
