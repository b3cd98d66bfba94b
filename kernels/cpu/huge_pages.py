"""Memory the CPU kernels stream (packed weights, the KV cache) on 2 MB pages, where Linux
offers transparent huge pages.

With 4 KB pages every 4 KB of a weight stream is a new page: a TLB entry to walk for, and a
boundary the hardware prefetchers stop at. This machine's kernel gives huge pages only to
memory that asks (`/sys/kernel/mm/transparent_hugepage/enabled`: madvise), so buffers here
are allocated untouched, marked with madvise(MADV_HUGEPAGE), and only then written: the
first touch of each 2 MB then faults in one huge page. Measured (scripts in
docs/performance/history.md, "Fourth pass"): a float32 decode step's weights at one row 34 -> 40 GB/s;
decode attention over a shuffled cache 10-17% faster.

Where huge pages are not on offer (not Linux, THP off, madvise refused) or are turned off
(`LLMBUS_HUGE_PAGES=0`), the same calls return ordinary tensors.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger("llmbus.kernels")

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_ALIGN = 64  # each tensor in an arena starts on a cache line


@functools.cache
def _madvise():
    """libc's madvise, or None where transparent huge pages cannot be asked for."""
    if os.environ.get("LLMBUS_HUGE_PAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return None
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    if "[never]" in mode:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized 1-D CPU tensor; 2 MB-aligned and on huge pages if it spans one."""
    nbytes = numel * dtype.itemsize
    madvise = _madvise()
    if madvise is None or nbytes < HUGE_PAGE:
        return torch.empty(numel, dtype=dtype)
    # Room to align the start, and to round the advised range up to whole pages; the slack
    # is never touched, so it costs address space, not memory.
    base = torch.empty(nbytes + 2 * HUGE_PAGE, dtype=torch.uint8)
    start = -base.data_ptr() % HUGE_PAGE
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    if madvise(base.data_ptr() + start, length, _MADV_HUGEPAGE) != 0:
        log.info("madvise(MADV_HUGEPAGE) refused", extra={"errno": ctypes.get_errno()})
    return base[start : start + nbytes].view(dtype)


def consolidate(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` side by side in one huge-page arena (same shapes and dtypes,
    contiguous). Weights of a few MB each would each fall short of a 2 MB page alone."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    arena = empty(total, torch.uint8)
    out = []
    for t, offset in zip(tensors, offsets):
        view = arena[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out
