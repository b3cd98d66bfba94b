"""The API keys a gateway accepts: given as flags (`--api-key`, repeatable) and in a file
(`--api-key-file`, one per line, read again on SIGHUP), compared in constant time.

A key is compared as its SHA-256 against every accepted key's with `hmac.compare_digest`,
all of them each time, so neither how much of a key matched nor which key it was shows
in the time an answer takes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

log = logging.getLogger("llmbus.gateway")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, keys: tuple[str, ...] = (), key_file: str | None = None) -> None:
        self._given = [_digest(k) for k in keys if k]
        self.key_file = key_file
        self._from_file: list[bytes] = []
        self.reload()

    @property
    def required(self) -> bool:
        return bool(self._given or self._from_file or self.key_file)

    def reload(self) -> None:
        """Read the key file again (SIGHUP); a file that cannot be read keeps the old keys."""
        if self.key_file is None:
            return
        try:
            lines = Path(self.key_file).read_text().splitlines()
        except OSError as exc:
            log.error("API key file %s not read (%s); the keys before stay", self.key_file, exc.strerror)
            return
        self._from_file = [_digest(line.strip()) for line in lines if line.strip() and not line.startswith("#")]
        log.warning("API keys read from %s: %d", self.key_file, len(self._from_file))

    def accepts(self, authorization: str) -> bool:
        """Whether an `Authorization` header carries an accepted key (`Bearer KEY`)."""
        scheme, _, key = authorization.partition(" ")
        given = _digest(key if scheme.lower() == "bearer" else "")
        matched = False
        for accepted in self._given + self._from_file:
            matched |= hmac.compare_digest(given, accepted)  # no early exit
        return matched and scheme.lower() == "bearer" and bool(key)
