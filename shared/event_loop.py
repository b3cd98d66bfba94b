"""Every llmbus process's event loop: uvloop where it is installed (a pinned dependency
on Linux), as uvicorn runs the gateway's. Its loop, futures' callbacks and sockets are C:
the scheduler, which wakes for every step's reply and every batch of outputs, spends less
of a core a token on it (docs/performance/README.md, "The control plane")."""

from __future__ import annotations

import asyncio


def run(coroutine):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)
