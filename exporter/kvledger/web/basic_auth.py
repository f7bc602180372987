"""HTTP basic authentication against a web config's bcrypt hashes.

bcrypt costs ~100 ms a check by design, and Prometheus sends the same credentials with
every scrape: a successful check is remembered under (user, sha256(password)) together
with the hash it matched, so later scrapes cost one SHA-256 and a constant-time compare.
Unknown users are checked against a dummy hash so their timing matches known users'.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import threading
from functools import cache

import bcrypt

_CACHE_LIMIT = 1024


@cache
def _dummy_hash() -> bytes:
    """A valid bcrypt hash (cost 10): unknown users pay the same bcrypt cost as known ones."""
    return bcrypt.hashpw(b"kvledger-unknown-user", bcrypt.gensalt(rounds=10))


def parse_basic(header: str | None) -> tuple[str, str] | None:
    """(user, password) from an ``Authorization: Basic ...`` value; None if absent or malformed."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None


class BasicAuth:
    """Verifies credentials against ``users`` (name -> bcrypt hash); thread-safe."""

    def __init__(self, users: dict[str, bytes]) -> None:
        self.users = dict(users)
        self._verified: dict[tuple[str, bytes], bytes] = {}
        self._lock = threading.Lock()

    def check(self, header: str | None) -> bool:
        creds = parse_basic(header)
        if creds is None:
            return False
        user, password = creds
        digest = hashlib.sha256(password.encode()).digest()
        hashed = self.users.get(user)
        with self._lock:
            remembered = self._verified.get((user, digest))
        if remembered is not None and hashed is not None and hmac.compare_digest(remembered, hashed):
            return True
        ok = bcrypt.checkpw(password.encode(), hashed if hashed is not None else _dummy_hash())
        if ok and hashed is not None:
            with self._lock:
                if len(self._verified) >= _CACHE_LIMIT:
                    self._verified.clear()
                self._verified[(user, digest)] = hashed
            return True
        return False
