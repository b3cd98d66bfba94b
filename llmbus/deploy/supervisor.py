"""The process manager behind `llmbus serve`: each service replica a child process that is
restarted when it exits, with backoff, until it crash-loops.

A replica that exits is logged with its exit status and started again after a delay that
doubles from `backoff_s` up to `max_backoff_s` while it keeps exiting soon after starting,
and falls back once it has stayed up for `healthy_after_s`. `max_restarts` exits within
`window_s` is a crash loop: the supervisor reports it and gives up. Stopping goes in
order (the caller's), each group asked with SIGTERM and given time to drain.

A plain object: `poll(now)` is called from the serving loop, and time is passed in.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("llmbus.deploy.serve")


class CrashLoop(RuntimeError):
    """A replica exited too often to keep restarting it."""


@dataclass(slots=True)
class Replica:
    name: str  # "worker-2": what the logs call it
    start: Callable[[], subprocess.Popen]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None  # when it is due to start again (it exited)
    backoff_s: float = 0.0
    exits: deque[float] = field(default_factory=deque)  # recent exit times
    num_restarts: int = 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(
        self,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        healthy_after_s: float = 30.0,
        max_restarts: int = 5,
        window_s: float = 60.0,
    ) -> None:
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.healthy_after_s = healthy_after_s
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.replicas: list[Replica] = []

    def add(self, name: str, start: Callable[[], subprocess.Popen], now: float) -> Replica:
        replica = Replica(name, start)
        self._start(replica, now)
        self.replicas.append(replica)
        return replica

    def adopt(self, name: str, start: Callable[[], subprocess.Popen], proc: subprocess.Popen, now: float) -> Replica:
        """A replica already started (and waited for) by the caller."""
        replica = Replica(name, start, proc, started_at=now)
        self.replicas.append(replica)
        return replica

    def processes(self) -> list[subprocess.Popen]:
        return [r.proc for r in self.replicas if r.proc is not None]

    def poll(self, now: float) -> None:
        """Restart what exited and is due; raises CrashLoop."""
        for replica in self.replicas:
            if replica.restart_at is not None:
                if now >= replica.restart_at:
                    replica.num_restarts += 1
                    self._start(replica, now)
                continue
            code = replica.proc.poll() if replica.proc is not None else None
            if code is None:
                continue
            self._exited(replica, code, now)

    def _exited(self, replica: Replica, code: int, now: float) -> None:
        replica.exits.append(now)
        while replica.exits and now - replica.exits[0] > self.window_s:
            replica.exits.popleft()
        status = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        if len(replica.exits) >= self.max_restarts:
            raise CrashLoop(
                f"{replica.name} exited {len(replica.exits)} times in {self.window_s:.0f} s "
                f"(last: {status}); giving up"
            )
        if now - replica.started_at >= self.healthy_after_s:
            replica.backoff_s = self.backoff_s  # it had been up a while: a fresh failure
        else:
            replica.backoff_s = min(self.max_backoff_s, max(self.backoff_s, 2 * replica.backoff_s))
        replica.restart_at = now + replica.backoff_s
        log.warning("%s exited with %s; restarting in %.1f s", replica.name, status, replica.backoff_s)

    def _start(self, replica: Replica, now: float) -> None:
        replica.proc = replica.start()
        replica.started_at = now
        replica.restart_at = None

    def stop(self, groups: list[tuple[str, ...]], timeout_s: float = 10.0) -> None:
        """Stop the replicas whose names start with a group's prefixes, group after group,
        each group SIGTERMed together and waited for; then everything left."""
        for prefixes in groups:
            stop_all([r.proc for r in self.replicas if r.name.startswith(prefixes) and r.proc is not None],
                     timeout_s)
        stop_all(self.processes(), timeout_s)


def stop_all(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """SIGTERM each, then wait for all together; what is still there at the end is killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
