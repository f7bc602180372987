"""HTTP basic authentication against a web config's bcrypt hashes, and the gate that keeps
bcrypt from starving everything else.

bcrypt costs ~50-250 ms a check by design. Two things keep that cost from being turned
against the scrapers:

- **Verdicts are remembered** (``BasicAuth``), keyed by HMAC-SHA256 of the whole credential
  (``user:password``) under a random key made per process, so neither a password nor an
  unkeyed hash of one is kept, and a lookup's timing says nothing usable about a password.
  Successes (with the hash they matched, compared constant-time to the hash in force) and
  failures are two separate bounded LRU tables (``cache_size``, ``failure_cache_size``).
  A remembered failure can never lock the real user out: it is keyed by the exact wrong
  credential, so the right password is never in it; failures only ever evict failures,
  so a flood of wrong passwords cannot push the right one out of the success table;
  and both tables belong to this ``BasicAuth``, which a web config with other users or
  hashes replaces (kvledger.web.runtime). A client that repeats a wrong password costs
  one bcrypt check in all, then a keyed hash per request, as a right password does.
- **bcrypt runs behind a gate** (``AuthGate``): in its own small thread pool (one thread
  by default: bcrypt may take at most one core), never in the pool that answers requests;
  checks wait in one queue per client address (an IPv6 client by its /64), served round
  robin, so one address gets at most its share; a client with ``per_client`` checks
  already waiting or running, or a gate with ``queued`` waiting, is answered 429 at once
  (no bcrypt); the same credential already being checked is not checked twice.

Unknown users are checked against a dummy hash of the highest cost configured, so their
timing matches known users'.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import sys
import threading
from collections import Counter, OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import bcrypt

#: remembered successes (only right credentials ever enter) and failures
CACHE_SIZE = 1024
FAILURE_CACHE_SIZE = 8192

_COST = re.compile(rb"^\$2[aby]\$(\d\d)\$")


@functools.cache
def _dummy_hash(rounds: int = 10) -> bytes:
    """A valid bcrypt hash of cost ``rounds``: unknown users pay the same bcrypt cost as known ones."""
    return bcrypt.hashpw(b"kvledger-unknown-user", bcrypt.gensalt(rounds=rounds))


def _cost(hashed: bytes) -> int:
    m = _COST.match(hashed)
    return int(m.group(1)) if m else 10


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


@dataclass(frozen=True)
class Credential:
    user: str
    password: str = field(repr=False)
    #: HMAC-SHA256 of "user:password" under the BasicAuth's per-process key
    mac: bytes = field(repr=False)


class BasicAuth:
    """Verifies credentials against ``users`` (name -> bcrypt hash), remembering verdicts
    (see the module); thread-safe."""

    def __init__(self, users: dict[str, bytes], cache_size: int = CACHE_SIZE,
                 failure_cache_size: int = FAILURE_CACHE_SIZE) -> None:
        self.users = dict(users)
        self._key = secrets.token_bytes(32)
        self._cache_size = cache_size
        self._failure_cache_size = failure_cache_size
        self._ok: OrderedDict[bytes, bytes] = OrderedDict()  # mac -> the hash it matched
        self._failed: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self._rounds = max((_cost(h) for h in self.users.values()), default=10)
        self.bcrypt_checks = 0

    def credential(self, header: str | None) -> Credential | None:
        """The credential an Authorization header carries; None when it carries none."""
        creds = parse_basic(header)
        if creds is None:
            return None
        user, password = creds
        mac = hmac.new(self._key, f"{user}:{password}".encode(), hashlib.sha256).digest()
        return Credential(user, password, mac)

    def remembered(self, cred: Credential) -> bool | None:
        """The remembered verdict on ``cred`` (True, False), or None: bcrypt must decide.
        Costs a dictionary lookup: for the event loop."""
        hashed = self.users.get(cred.user)
        with self._lock:
            matched = self._ok.get(cred.mac)
            if matched is not None:
                self._ok.move_to_end(cred.mac)
            elif cred.mac in self._failed:
                self._failed.move_to_end(cred.mac)
                return False
        if matched is not None:
            return hashed is not None and hmac.compare_digest(matched, hashed)
        return None

    def verify(self, cred: Credential) -> bool:
        """bcrypt's verdict on ``cred``, remembered (for a worker thread: ~50-250 ms)."""
        hashed = self.users.get(cred.user)
        ok = bcrypt.checkpw(cred.password.encode(), hashed if hashed is not None else _dummy_hash(self._rounds))
        ok = ok and hashed is not None
        with self._lock:
            self.bcrypt_checks += 1
            if ok:
                assert hashed is not None
                self._ok[cred.mac] = hashed
                if len(self._ok) > self._cache_size:
                    self._ok.popitem(last=False)
            else:
                self._failed[cred.mac] = None
                if len(self._failed) > self._failure_cache_size:
                    self._failed.popitem(last=False)
        return ok

    def check(self, header: str | None) -> bool:
        """Whether ``header`` carries a valid credential (bcrypt on this thread when the
        verdict is not remembered)."""
        cred = self.credential(header)
        if cred is None:
            return False
        verdict = self.remembered(cred)
        return self.verify(cred) if verdict is None else verdict


def client_key(address: str) -> str:
    """The address a client's checks are queued under: an IPv4 address itself, an IPv6
    one by its /64 (one host usually holds a whole /64)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


#: the niceness of the bcrypt threads (Linux): any other runnable thread goes first
BCRYPT_NICE = 19


def _lower_priority() -> None:
    """Run this thread at BCRYPT_NICE: under load the event loop, the collector and the
    other processes of the host go before bcrypt. Linux only, where a thread has its own
    niceness (elsewhere setpriority would lower the whole process)."""
    if sys.platform != "linux":
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BCRYPT_NICE))
    except OSError:  # not permitted in some sandboxes: bcrypt then runs at the process' priority
        pass


@dataclass
class _Job:
    auth: BasicAuth
    cred: Credential
    client: str
    future: asyncio.Future[bool]


class AuthGate:
    """Runs the bcrypt checks of one server off its request pool (see the module). All
    methods but ``close`` run on the server's event loop."""

    def __init__(self, workers: int = 1, per_client: int = 4, queued: int = 256) -> None:
        self.workers = workers
        self.per_client = per_client
        self.queued = queued
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvledger-bcrypt",
                                        initializer=_lower_priority)
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()  # round robin: the next client first
        self._pending: Counter[str] = Counter()  # per client: waiting or running
        self._waiting = 0
        self._running = 0
        self._inflight: dict[tuple[int, bytes], asyncio.Future[bool]] = {}
        self.shed = 0  # checks refused (429)

    async def check(self, auth: BasicAuth, cred: Credential, client: str) -> bool | None:
        """bcrypt's verdict on ``cred`` from ``client`` (an address); None when the gate
        refuses the check (too many waiting: answer 429)."""
        key = (id(auth), cred.mac)
        future = self._inflight.get(key)
        if future is None:
            client = client_key(client)
            if self._pending[client] >= self.per_client or self._waiting >= self.queued:
                self.shed += 1
                return None
            future = asyncio.get_running_loop().create_future()
            self._inflight[key] = future
            future.add_done_callback(lambda _f: self._inflight.pop(key, None))
            self._pending[client] += 1
            self._waiting += 1
            self._queues.setdefault(client, deque()).append(_Job(auth, cred, client, future))
            self._pump()
        # a client that goes away does not cancel the check others may be waiting on
        return await asyncio.shield(future)

    def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        while self._running < self.workers and self._queues:
            client, queue = self._queues.popitem(last=False)
            job = queue.popleft()
            if queue:
                self._queues[client] = queue  # back of the line
            self._waiting -= 1
            self._running += 1
            done = loop.run_in_executor(self._pool, job.auth.verify, job.cred)
            done.add_done_callback(functools.partial(self._finished, job))

    def _finished(self, job: _Job, done: asyncio.Future[bool]) -> None:
        self._running -= 1
        self._pending[job.client] -= 1
        if self._pending[job.client] <= 0:
            del self._pending[job.client]
        if not job.future.done():
            if done.cancelled():
                job.future.cancel()
            elif (exc := done.exception()) is not None:
                job.future.set_exception(exc)
            else:
                job.future.set_result(done.result())
        self._pump()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
