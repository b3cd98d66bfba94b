"""`llmbus nats-config`: the files that close a compose deployment's bus.

compose.secure.yaml runs the same containers as compose.yaml, but its NATS cluster reads
the config written here — one user per identity with its role's subjects
(llmbus/deploy/nats_auth.py), routes with a password, TLS where asked — and each service gets
its identity from its own env file. Secrets land 0600; the containers see the config and
TLS files as compose secrets under `--secrets-dir` (/run/secrets).

    llmbus nats-config --out bus --served-model-name smollm2 --workers 1 --tls
    docker compose -f compose.yaml -f compose.secure.yaml up
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from llmbus.deploy.nats_auth import Identity, authorization_config, deployment_identities
from llmbus.deploy.nats_tls import TlsFiles, make_tls_files, server_tls_block, write_file
from shared.bus import Subjects

NODES = ("nats-1", "nats-2", "nats-3")  # compose.yaml's cluster


def write_bus_files(out: Path, model: str, num_workers: int = 1, tls: bool = False,
                    secrets_dir: str = "/run/secrets", client_port: int = 4222, cluster_port: int = 6222,
                    extra_hosts: tuple[str, ...] = ()) -> dict[str, Identity]:
    """nats.conf, `<service>.env` for scheduler, tokenizer, gateway, worker-1..N, and
    tls/ (ca.pem, server.pem, server.key) when `tls`; returns the identities by file stem."""
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    identities = deployment_identities(num_workers)
    in_container = TlsFiles(Path(secrets_dir) / "nats-ca", Path(secrets_dir) / "nats-cert", Path(secrets_dir) / "nats-key")
    if tls:
        make_tls_files(out / "tls", [*NODES, *extra_hosts, "localhost"])
    route_password = secrets.token_urlsafe(24)
    routes = ", ".join(f"nats-route://route:{route_password}@{node}:{cluster_port}" for node in NODES)
    lines = ["max_payload: 8MB", f"listen: 0.0.0.0:{client_port}", "cluster {", "  name: llmbus",
             f"  listen: 0.0.0.0:{cluster_port}", f"  routes: [{routes}]",  # its own route is skipped
             f'  authorization {{ user: route, password: "{route_password}" }}']
    if tls:
        lines.append(server_tls_block(in_container, "  "))
    lines.append("}")
    if tls:
        lines.append(server_tls_block(in_container))
    lines.append(authorization_config(list(identities.values()), Subjects(model)))
    write_file(out / "nats.conf", "\n".join(lines) + "\n")
    for stem, identity in identities.items():
        env = {**identity.env(), **identity.id_env()}
        if tls:
            env["LLMBUS_NATS_TLS_CA"] = str(in_container.ca)
        write_file(out / f"{stem}.env", "".join(f"{k}={v}\n" for k, v in env.items()))
    return identities


def add_parser(sub) -> None:
    p = sub.add_parser("nats-config", help="write a closed bus's NATS config and credentials (compose.secure.yaml)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for nats.conf, the env files and tls/")
    p.add_argument("--served-model-name", default="smollm2", help="the deployment's model name (its subjects)")
    p.add_argument("--workers", type=int, default=1, help="worker identities (worker-1.env, …)")
    p.add_argument("--tls", action="store_true", help="a CA and a certificate for nats-1..3; TLS for clients and routes")
    p.add_argument("--secrets-dir", default="/run/secrets", help="where the containers see the secrets")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    write_bus_files(Path(args.out), args.served_model_name, args.workers, args.tls, args.secrets_dir)
    print(f"wrote {args.out}/nats.conf, its env files{' and tls/' if args.tls else ''} (0600: keep them out of git)")
    return 0
