"""Who may do what on a deployment's bus: one NATS user per service identity, each allowed
only the subjects its role needs, and the nats-server `authorization` config for them.

`PERMISSIONS` is the table (docs/serving/security.md renders it; a test keeps the two equal).
Each row is a role; `{id}` is the instance (a gateway reads only its own outputs, a
worker takes only its own steps), `{inbox}` the identity's inbox. Replies to a request go
to the requester's inbox, `_INBOX.<role>.<instance>.…` (shared.bus.inbox_of): a requester
may subscribe to its own inbox and nobody else's. `allow_responses` lets a responder
answer the requests it received, once — but it is state of the server that delivered the
request: an answer sent as the responder reconnects to another node of a cluster (nats-py
flushes its buffer there) is refused without a grant of its own, and the request waits
out its timeout (a lost step, a tokenize retried). So each responder may also publish into
the inboxes of the role that asks it: a worker into the scheduler's, a tokenizer and the
scheduler into gateways'. The inboxes' random tokens keep one from answering a request it
was not sent but by guessing them. A blanket `_INBOX.>` would let a gateway read every
worker's step answers.
"""

from __future__ import annotations

import json
import secrets
import uuid
from dataclasses import dataclass

from shared.bus import Subjects, inbox_of

# role -> (publish, subscribe, answers requests): subjects after `llmbus.<model>.`, or
# absolute ones (the inbox).
PERMISSIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool]] = {
    "gateway": (
        ("requests.*", "abort.*", "tokenize", "scheduler.info", "gateways.heartbeat", "responses", "gateways.metrics",
         "kv_snapshot.*"),
        ("outputs.{id}.*", "scheduler.heartbeat", "scheduler.stats", "gateways.heartbeat", "responses",
         "gateways.metrics", "kv_events.*", "{inbox}.>"),
        True,  # (the other gateways' questions: stored responses, a shared port's metrics; peers.py)
    ),
    "tokenizer": (("_INBOX.gateway.>",), ("tokenize",), True),
    "scheduler": (
        ("scheduler.hello", "scheduler.heartbeat", "scheduler.stats", "outputs.*.*", "workers.*.step",
         "kv_events.*", "_INBOX.gateway.>"),
        ("requests.*", "abort.*", "workers.announce", "scheduler.info", "gateways.heartbeat", "kv_snapshot.*",
         "{inbox}.>"),
        True,
    ),
    "worker": (("workers.announce", "_INBOX.scheduler.>"), ("workers.{id}.step", "scheduler.hello"), True),
}
ROLES = tuple(PERMISSIONS)


@dataclass(frozen=True, slots=True)
class Identity:
    role: str
    instance: str  # "" for roles whose replicas are interchangeable (tokenizers, the scheduler)
    password: str

    @property
    def user(self) -> str:
        return f"{self.role}-{self.instance}" if self.instance else self.role

    def env(self) -> dict[str, str]:
        """Its credentials as the service's flags' LLMBUS_* variables (not argv, which `ps` shows)."""
        return {"LLMBUS_NATS_USER": self.user, "LLMBUS_NATS_PASSWORD": self.password}

    def id_env(self) -> dict[str, str]:
        """Its instance id (--gateway-id, --worker-id), which its subjects are named by."""
        return {f"LLMBUS_{self.role.upper()}_ID": self.instance} if self.instance else {}


def new_identity(role: str, instance: str = "") -> Identity:
    if role not in PERMISSIONS:
        raise ValueError(f"unknown role {role!r}: {', '.join(ROLES)}")
    return Identity(role, instance, secrets.token_urlsafe(24))


def deployment_identities(num_workers: int, num_gateways: int = 1) -> dict[str, Identity]:
    """A deployment's identities by service name — scheduler, tokenizer (its replicas share
    one), gateway (and gateway-2..N), worker-1..N — with random instance ids, fixed for the
    deployment's life so a restarted replica logs in as itself."""
    return {"scheduler": new_identity("scheduler"), "tokenizer": new_identity("tokenizer"),
            **{gateway_name(i): new_identity("gateway", uuid.uuid4().hex[:8]) for i in range(num_gateways)},
            **{f"worker-{i + 1}": new_identity("worker", uuid.uuid4().hex[:8]) for i in range(num_workers)}}


def gateway_name(i: int) -> str:
    """The i-th gateway's service name (from 0): "gateway", then "gateway-2", ..."""
    return "gateway" if i == 0 else f"gateway-{i + 1}"


def subjects_of(identity: Identity, subjects: Subjects) -> dict:
    """Its role's grants: {"publish": [...], "subscribe": [...], "allow_responses": bool}."""
    publish, subscribe, responds = PERMISSIONS[identity.role]

    def expand(pattern: str) -> str:
        subject = pattern.format(id=identity.instance, inbox=inbox_of(identity.user))
        return subject if subject.startswith("_INBOX") else f"{subjects.prefix}.{subject}"

    return {"publish": [expand(p) for p in publish], "subscribe": [expand(p) for p in subscribe],
            "allow_responses": responds}


def _user_entry(identity: Identity, subjects: Subjects) -> dict:
    grants = subjects_of(identity, subjects)
    # An empty allow list means "anything" to nats-server: a role that publishes nothing
    # of its own is denied everything, and answers through allow_responses alone.
    publish = {"allow": grants["publish"]} if grants["publish"] else {"deny": [">"]}
    permissions = {"publish": publish, "subscribe": {"allow": grants["subscribe"]}}
    if grants["allow_responses"]:
        permissions["allow_responses"] = True
    return {"user": identity.user, "password": identity.password, "permissions": permissions}


def authorization_config(identities: list[Identity], subjects: Subjects) -> str:
    """nats-server's `authorization` block (its config takes JSON values) for these users."""
    users = [_user_entry(identity, subjects) for identity in identities]
    return "authorization: " + json.dumps({"users": users}, indent=1) + "\n"


def permission_table() -> str:
    """The table as markdown, for docs/serving/security.md."""
    rows = ["| role | publishes | subscribes | answers requests |", "|---|---|---|---|"]
    for role, (publish, subscribe, responds) in PERMISSIONS.items():
        rows.append(f"| {role} | {', '.join(f'`{p}`' for p in publish) or '—'} | "
                    f"{', '.join(f'`{s}`' for s in subscribe)} | {'yes' if responds else 'no'} |")
    return "\n".join(rows) + "\n"
