"""How every child process of llmbus starts."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def child_setup() -> None:
    """In the child before exec: its own process group, so a terminal's Ctrl-C reaches
    `llmbus serve` alone (which then stops the children in order), and tied to its parent
    (PR_SET_PDEATHSIG), so not even a SIGKILL of the parent leaves orphans."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
