"""The KV data plane between hosts: a worker serves its host tier's slots over TCP to the
workers of other hosts, which copy them into their own blocks (issue: a prompt prefilled on
one host, decoded on another; a request drained to another host).

A transfer is one connection, opened by the loading worker when its step orders it:
it sends [token, expiry, slots, its slot size, its rank] (msgpack, length first; a
tensor-parallel worker's ranks each fetch their own heads, from the serving worker's rank
of the same number, whose file rank 0 serves too: the same host); the server checks
the slot size is its own (a tier of another layout: nothing sent) and the token
(shared/kv_transfer_tokens.py: signed by the scheduler, once only) and sends each slot's
checksum and bytes as the tier holds them. The loader checks every slot's checksum as a
local load does: a block that is not what was stored is never used. NATS carries the
order, never the bytes (a 1k-token SmolLM2 context is ~47 MB in float32).

The server reads the shared file through numpy on threads of its own: no torch op runs off
the runner's thread (executor.py says why that matters)."""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading

import msgspec
import numpy as np

from shared.kv_transfer_tokens import TokenCheck

log = logging.getLogger("llmbus.worker")

_LENGTH = struct.Struct("!I")
_MAX_REQUEST = 1 << 20


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class TierServer:
    """Serves a host tier's slots (`data`: [slots, slot_bytes] uint8, `checksums`: int64
    [slots], numpy views of the shared file) at `host`:`port` (0: the kernel's choice).
    `peer(rank)`: a tensor-parallel worker's other ranks' files (data, checksums), mapped
    when first asked for (None: ranks 1.. have none)."""

    def __init__(self, data: np.ndarray, checksums: np.ndarray, secret: bytes, host: str = "0.0.0.0",
                 port: int = 0, advertise: str | None = None, ranks: int = 1, peer=None) -> None:
        self._files, self._peer = {0: (data, checksums)}, peer
        self.ranks = ranks
        served = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                served._serve(self.request)

        self._server = _Server((host, port), Handler)
        self.address = f"{advertise or _advertised(host)}:{self._server.server_address[1]}"
        self._tokens = TokenCheck(secret, self.address)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-transfer", daemon=True)
        self._thread.start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(30)
            (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
            if length > _MAX_REQUEST:
                return
            token, expires, slots, slot_bytes, *rest = msgspec.msgpack.decode(_recv_exactly(sock, length))
            rank = rest[0] if rest else 0
            with self._lock:
                refused = (self._tokens.accept(token, expires, slots, rank=rank)
                           if isinstance(rank, int) and 0 <= rank < self.ranks
                           else f"rank {rank!r} of a worker of {self.ranks}")
                if refused is None and rank not in self._files:
                    self._files[rank] = self._peer(rank)
            if refused is None:
                data, checksums = self._files[rank]
                if slot_bytes != data.shape[1]:
                    refused = f"slots of {slot_bytes} bytes asked of a tier of {data.shape[1]}"
                elif not all(0 <= s < len(data) for s in slots):
                    refused = "a slot out of range"
            if refused is not None:
                log.warning("KV transfer refused: %s", refused)
                return
            for slot in slots:
                sock.sendall(checksums[slot:slot + 1].tobytes())
                sock.sendall(memoryview(data[slot]))
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            log.warning("KV transfer failed: %s", exc)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _advertised(host: str) -> str:
    """The address other hosts reach this one by (bound to every interface: the host's own)."""
    if host not in ("0.0.0.0", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the KV server closed the transfer early")
        got += n


def fetch_slots(address: str, token: str, expires: float, slots: list[int], into: np.ndarray, slot_bytes: int,
                timeout_s: float = 30.0, rank: int = 0) -> np.ndarray:
    """Slots of `slot_bytes` (of rank `rank`'s file) from the server at `address` into
    `into` ([len(slots), slot_bytes] uint8, its rows in `slots`' order); their checksums as
    sent. Raises OSError (ConnectionError among them) where the transfer did not complete."""
    host, port = address.rsplit(":", 1)
    sums = np.empty(len(slots), dtype=np.int64)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = msgspec.msgpack.encode([token, expires, slots, slot_bytes, rank])
        sock.sendall(_LENGTH.pack(len(request)) + request)
        for i in range(len(slots)):
            _recv_into(sock, memoryview(sums[i:i + 1]).cast("B"))
            _recv_into(sock, memoryview(into[i]))
    return sums
