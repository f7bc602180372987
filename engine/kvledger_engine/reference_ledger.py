"""The embeddable reference ledger for custom engines (docs/design.md §2 and §7).

An engine calls the ledger as its scheduler and block manager act; a server thread
renders ``to_document()`` (kvledger/v1) for the exporter. Every block operation is
O(1): reference counts live in a list, free blocks in a stack, reclaimable (cached,
unreferenced) blocks in an LRU ``OrderedDict``, and the pool summary (in use,
references, shared, cached) is kept up to date incrementally. All public methods take
one lock, so rendering from another thread sees a consistent state.

Lifecycle of a request::

    submit (waiting) -> admit (running) -> allocate/share/advance ... -> release
                               \\-> preempt (preempted, blocks dropped) -> resume
    admit() directly registers and admits in one call.

A *leak* is a reservation whose request is gone: ``forget(request_id)`` drops the
request from the engine's request table but leaves its reservation and its block
references behind (what a lost release does); ``sweep_leaks()`` finds such
reservations, counts each once in ``reservation_leaks`` and returns their blocks.

See docs/ledger.md for an embedding example.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvledger_engine.iteration_window import IterationWindow
from kvledger_engine.request_wire import RequestWriter
from kvledger_engine.reservation import reservation_blocks
from kvledger_engine.wire_terms import (
    ADMISSIONS,
    BUDGET_CATEGORIES,
    LIMIT_KINDS,
    OUTPUT_BOUNDS,
    OVERFLOWS,
    SCHEMA_ID,
    SLIDING_WINDOW,
    TERM_SOURCES,
)

#: the one writer of a request (rows and columns)
_WRITER = RequestWriter()

#: ``listener(event, pool_id, block, key)``: event is "cached" (a block became cached under
#: ``key``) or "evicted" (a cached block lost its data to reuse or eviction; ``key`` is the
#: key it was cached under, None when it had none or another block held that key).
CacheListener = Callable[[str, str, int, "Hashable | None"], None]



class _StampedLock:
    """The ledger's lock. Leaving it after a change (every public method that changes the
    state takes it so) records when the engine last brought the state up to date, which the
    document says as ``published_at``; readers take ``plain`` and record nothing."""

    def __init__(self) -> None:
        self.plain = threading.RLock()
        self.stamp = time.time()

    def __enter__(self) -> _StampedLock:
        self.plain.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stamp = time.time()
        self.plain.release()

class LedgerError(Exception):
    """A call that breaks the ledger's rules (unknown request, wrong state, ...)."""


class OutOfBlocks(LedgerError):
    """Not enough free or reclaimable blocks; nothing was allocated."""

    def __init__(self, pool: str, needed: int, available: int) -> None:
        super().__init__(f"pool {pool!r}: need {needed} blocks, {available} free or reclaimable")
        self.pool = pool
        self.needed = needed
        self.available = available
        self.shortage = needed - available


@dataclass(frozen=True)
class PoolSpec:
    id: str
    block_size: int
    block_bytes: int
    num_blocks: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_bytes < 1 or self.num_blocks < 0:
            raise ValueError(f"pool {self.id!r}: block_size and block_bytes must be >= 1, num_blocks >= 0")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"pool {self.id!r}: sliding_window must be >= 1 tokens")


class _Pool:
    """Physical blocks of one pool."""

    __slots__ = (
        "by_hash",
        "cached",
        "cached_count",
        "free",
        "hash_of",
        "in_use",
        "listeners",
        "lru",
        "preempted_tokens",
        "ref",
        "references",
        "reported_used",
        "shared",
        "spec",
    )

    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self.ref = [0] * spec.num_blocks
        self.cached = bytearray(spec.num_blocks)
        self.hash_of: dict[int, Hashable] = {}
        self.by_hash: dict[Hashable, int] = {}
        self.free = list(range(spec.num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.lru: OrderedDict[int, None] = OrderedDict()  # reclaimable, least recently used first
        self.in_use = 0
        self.references = 0
        self.shared = 0
        self.cached_count = 0
        self.reported_used: float | None = None
        self.preempted_tokens = 0  # computed tokens preemption threw away (cumulative)
        self.listeners: list[CacheListener] = []

    def available(self) -> int:
        return len(self.free) + len(self.lru)

    def _drop_cache(self, block: int) -> None:
        if self.cached[block]:
            self.cached[block] = 0
            self.cached_count -= 1
            h = self.hash_of.pop(block, None)
            if h is not None and self.by_hash.get(h) == block:
                del self.by_hash[h]
            for listener in self.listeners:
                listener("evicted", self.spec.id, block, h)

    def take(self) -> int:
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.lru.popitem(last=False)  # evict the least recently used cached block
            self._drop_cache(block)
        self.ref[block] = 1
        self.in_use += 1
        self.references += 1
        return block

    def incref(self, block: int) -> None:
        count = self.ref[block]
        if count == 0:
            if block not in self.lru:
                raise LedgerError(f"pool {self.spec.id!r}: block {block} holds no data (free)")
            del self.lru[block]
            self.in_use += 1
        elif count == 1:
            self.shared += 1
        self.ref[block] = count + 1
        self.references += 1

    def decref(self, block: int) -> None:
        count = self.ref[block]
        if count <= 0:
            raise LedgerError(f"pool {self.spec.id!r}: block {block} is not referenced")
        self.ref[block] = count - 1
        self.references -= 1
        if count == 2:
            self.shared -= 1
        elif count == 1:
            self.in_use -= 1
            if self.cached[block]:
                self.lru[block] = None  # most recently used end
            else:
                self.free.append(block)

    def mark_cached(self, block: int, key: Hashable | None) -> None:
        if self.ref[block] == 0 and block not in self.lru:
            raise LedgerError(f"pool {self.spec.id!r}: cannot cache free block {block}")
        newly = not self.cached[block]
        if newly:
            self.cached[block] = 1
            self.cached_count += 1
        if key is not None and key not in self.by_hash:
            self.hash_of[block] = key
            self.by_hash[key] = block
        if newly:
            for listener in self.listeners:
                listener("cached", self.spec.id, block, key)

    def evict(self, n: int) -> int:
        done = 0
        while done < n and self.lru:
            block, _ = self.lru.popitem(last=False)
            self._drop_cache(block)
            self.free.append(block)
            done += 1
        return done


@dataclass
class _Request:
    id: str
    pool: str
    prompt_tokens: int
    max_output_tokens: int
    output_bound: str
    tenant: str | None
    contexts: int
    speculative_slots: int
    state: str = "waiting"
    generated_tokens: int = 0
    computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    reservation: int = 0
    overflowed: bool = False


class Ledger:
    """Per-request KV ledger of one engine; renders kvledger/v1 documents."""

    def __init__(
        self,
        pools: Sequence[PoolSpec],
        *,
        admission: str = "dynamic",
        overflow: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        engine_kind: str = "custom",
        engine_version: str | None = None,
        tenant_quotas: dict[str, int] | None = None,
    ) -> None:
        if not pools:
            raise ValueError("a ledger needs at least one pool")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
        if overflow is not None and overflow not in OVERFLOWS:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOWS)}, got {overflow!r}")
        self._lock = _StampedLock()  # mutators: `with self._lock`; readers: `with self._lock.plain`
        self._pools: dict[str, _Pool] = {}
        for spec in pools:
            if spec.id in self._pools:
                raise ValueError(f"duplicate pool id {spec.id!r}")
            self._pools[spec.id] = _Pool(spec)
        self._default_pool = pools[0].id
        self.admission = admission
        self.overflow = overflow
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.engine_kind = engine_kind
        self.engine_version = engine_version
        self.tenant_quotas = dict(tenant_quotas or {})
        self._requests: dict[str, _Request] = {}  # the engine's request table (live requests)
        # Reservation records: admitted requests (running, preempted) and leaked ones.
        self._reserved: dict[str, _Request] = {}
        self._reserved_blocks: dict[str, int] = {pid: 0 for pid in self._pools}  # sum of R per pool
        self._tenant_reserved: dict[str, int] = {}  # bytes, per-request rule
        self._iteration_tokens: int | None = None
        self._window = IterationWindow()
        self._memory: list[dict[str, Any]] = []
        self._host: dict[str, Any] = {}
        self.counters = {
            "preemptions": 0,
            "reservation_overflows": 0,
            "admission_rechecks_accepted": 0,
            "admission_rechecks_rejected": 0,
            "reservation_leaks": 0,
            "prefix_cache_queried_tokens": 0,
            "prefix_cache_hit_tokens": 0,
        }

    # ------------------------------------------------------------ helpers

    def _pool(self, pool_id: str) -> _Pool:
        try:
            return self._pools[pool_id]
        except KeyError:
            raise LedgerError(f"no pool {pool_id!r}") from None

    def _req(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise LedgerError(f"no request {request_id!r}") from None

    def _reservation(self, req: _Request, max_output_tokens: int | None = None) -> int:
        spec = self._pools[req.pool].spec
        blocks: int = reservation_blocks(  # int arguments give an int (min and max by default)
            req.prompt_tokens,
            req.max_output_tokens if max_output_tokens is None else max_output_tokens,
            spec.block_size,
            max_model_len=self.max_model_len,
            contexts=req.contexts,
            speculative_slots=req.speculative_slots,
            sliding_window=spec.sliding_window,
        )
        return blocks

    def _fits(self, req: _Request, reservation: int, previous: int) -> bool:
        """Whether replacing ``previous`` blocks of reservation by ``reservation`` keeps every promise."""
        pool = self._pools[req.pool]
        if self.admission == "reserve-cap":
            if self._reserved_blocks[req.pool] - previous + reservation > pool.spec.num_blocks:
                return False
        if req.tenant is not None and req.tenant in self.tenant_quotas:
            used = self._tenant_reserved.get(req.tenant, 0) - previous * pool.spec.block_bytes
            if used + reservation * pool.spec.block_bytes > self.tenant_quotas[req.tenant]:
                return False
        return True

    def _book(self, req: _Request, reservation: int) -> None:
        delta = reservation - req.reservation
        self._reserved_blocks[req.pool] += delta
        if req.tenant is not None:
            block_bytes = self._pools[req.pool].spec.block_bytes
            self._tenant_reserved[req.tenant] = self._tenant_reserved.get(req.tenant, 0) + delta * block_bytes
        req.reservation = reservation

    def _needed_blocks(self, req: _Request, computed: int) -> int:
        """Blocks a request holds once ``computed`` tokens are computed (branches copy the partial block)."""
        spec = self._pools[req.pool].spec
        size = spec.block_size
        tokens = computed
        if req.speculative_slots and computed >= req.prompt_tokens + req.generated_tokens:
            tokens += req.speculative_slots  # lookahead slots of a decoding request
        if self.max_model_len is not None:
            tokens = min(tokens, self.max_model_len)
        total = -(-tokens // size)
        if req.contexts > 1 and computed > req.prompt_tokens:
            total += (req.contexts - 1) * (total - req.prompt_tokens // size)
        if spec.sliding_window is not None:
            total = min(total, req.contexts * (-(-spec.sliding_window // size) + 1))
        return total

    def _drop_blocks(self, req: _Request) -> None:
        pool = self._pools[req.pool]
        for block in req.blocks:
            pool.decref(block)
        req.blocks = []

    # ------------------------------------------------------------ admission

    def submit(
        self,
        request_id: str,
        prompt_tokens: int,
        max_output_tokens: int,
        *,
        output_bound: str = "cap",
        tenant: str | None = None,
        contexts: int = 1,
        speculative_slots: int = 0,
        pool: str | None = None,
    ) -> None:
        """Register a waiting request (not admitted: it reserves nothing)."""
        if output_bound not in OUTPUT_BOUNDS:
            raise ValueError(f"output_bound must be cap or estimate, got {output_bound!r}")
        if prompt_tokens < 0 or max_output_tokens < 0 or contexts < 1 or speculative_slots < 0:
            raise ValueError("token counts must be >= 0 and contexts >= 1")
        with self._lock:
            if request_id in self._requests or request_id in self._reserved:
                raise LedgerError(f"request {request_id!r} already exists")
            pool_id = self._default_pool if pool is None else pool
            self._pool(pool_id)
            self._requests[request_id] = _Request(
                request_id, pool_id, prompt_tokens, max_output_tokens, output_bound, tenant, contexts, speculative_slots
            )

    def admit(
        self,
        request_id: str,
        prompt_tokens: int | None = None,
        max_output_tokens: int | None = None,
        *,
        output_bound: str = "cap",
        tenant: str | None = None,
        contexts: int = 1,
        speculative_slots: int = 0,
        pool: str | None = None,
        check: bool = True,
    ) -> bool:
        """Admit a request (running). A waiting request is admitted with its submitted shape.

        Under ``reserve-cap`` the request is admitted only if the sum of reservations
        R(r) of the pool's admitted requests stays within capacity; with tenant quotas
        its tenant's reserved bytes must stay within the quota. ``check=False`` skips
        both (an engine that admits against physical free memory instead).
        Returns False when rejected: a waiting request stays waiting, a new one is not
        registered.
        """
        with self._lock:
            new = request_id not in self._requests
            if new:
                if prompt_tokens is None or max_output_tokens is None:
                    raise LedgerError(f"request {request_id!r} is not submitted: give prompt and output tokens")
                self.submit(
                    request_id, prompt_tokens, max_output_tokens, output_bound=output_bound, tenant=tenant,
                    contexts=contexts, speculative_slots=speculative_slots, pool=pool,
                )
            req = self._requests[request_id]
            if req.state != "waiting":
                raise LedgerError(f"request {request_id!r} is already {req.state}")
            reservation = self._reservation(req)
            if check and not self._fits(req, reservation, 0):
                if new:
                    del self._requests[request_id]
                return False
            self._book(req, reservation)
            req.state = "running"
            self._reserved[request_id] = req
            return True

    def raise_bound(self, request_id: str, new_max_output_tokens: int) -> bool:
        """Re-check an admitted request whose output bound grows; counted accepted/rejected."""
        with self._lock:
            req = self._req(request_id)
            if req.state == "waiting":
                req.max_output_tokens = max(req.max_output_tokens, new_max_output_tokens)
                return True
            reservation = self._reservation(req, new_max_output_tokens)
            if self._fits(req, reservation, req.reservation):
                self._book(req, reservation)
                req.max_output_tokens = new_max_output_tokens
                req.overflowed = req.output_bound == "estimate" and req.generated_tokens > new_max_output_tokens
                self.counters["admission_rechecks_accepted"] += 1
                return True
            self.counters["admission_rechecks_rejected"] += 1
            return False

    # ------------------------------------------------------------ blocks

    def allocate(self, request_id: str, n_blocks: int) -> list[int]:
        """Give the request ``n_blocks`` new blocks (free first, then evicting LRU reclaimable ones).

        All or nothing: raises OutOfBlocks when the pool cannot supply them.
        """
        with self._lock:
            req = self._req(request_id)
            if req.state != "running":
                raise LedgerError(f"request {request_id!r} is {req.state}; only running requests allocate")
            return self._allocate(req, n_blocks)

    def _allocate(self, req: _Request, n_blocks: int) -> list[int]:
        pool = self._pools[req.pool]
        if n_blocks > pool.available():
            raise OutOfBlocks(req.pool, n_blocks, pool.available())
        new = [pool.take() for _ in range(n_blocks)]
        req.blocks.extend(new)
        return new

    def lookup(self, hashes: Iterable[Hashable], pool: str | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of ``hashes`` (a prefix-cache hit)."""
        with self._lock.plain:
            p = self._pool(self._default_pool if pool is None else pool)
            out = []
            for h in hashes:
                block = p.by_hash.get(h)
                if block is None:
                    break
                out.append(block)
            return out

    def count_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count a prefix-cache lookup at admission: prompt tokens queried, tokens found cached."""
        with self._lock:
            self.counters["prefix_cache_queried_tokens"] += queried_tokens
            self.counters["prefix_cache_hit_tokens"] += hit_tokens

    def share(self, request_id: str, block_ids: Iterable[int]) -> None:
        """Reference existing (in use or reclaimable cached) blocks: ref_count += 1 each."""
        with self._lock:
            req = self._req(request_id)
            if req.state != "running":
                raise LedgerError(f"request {request_id!r} is {req.state}; only running requests share blocks")
            pool = self._pools[req.pool]
            blocks = list(block_ids)
            for i, block in enumerate(blocks):
                try:
                    pool.incref(block)
                except LedgerError:
                    for done in blocks[:i]:
                        pool.decref(done)
                    raise
            req.blocks.extend(blocks)

    def cache(self, block_ids: Sequence[int], hashes: Sequence[Hashable | None], pool: str | None = None) -> None:
        """Mark full blocks as cached under their content hashes (they become reclaimable at ref 0)."""
        if len(block_ids) != len(hashes):
            raise ValueError("block_ids and hashes differ in length")
        with self._lock:
            p = self._pool(self._default_pool if pool is None else pool)
            for block, key in zip(block_ids, hashes, strict=False):  # extra hashes (none expected) are ignored
                p.mark_cached(block, key)

    def request_blocks(self, request_id: str) -> list[int]:
        with self._lock.plain:
            return list(self._req(request_id).blocks)

    def advance(self, request_id: str, tokens: int) -> list[int]:
        """The request computed ``tokens`` more tokens; allocates blocks as tokens cross block boundaries.

        Tokens first (re)compute the prompt and already generated output; beyond that
        they are new output tokens. Exceeding an ``estimate`` bound counts one
        reservation overflow per request; a ``cap`` cannot be exceeded (LedgerError).
        Returns the new block ids; raises OutOfBlocks (and changes nothing) when the
        pool cannot supply them.
        """
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        with self._lock:
            req = self._req(request_id)
            if req.state != "running":
                raise LedgerError(f"request {request_id!r} is {req.state}; only running requests advance")
            known = req.prompt_tokens + req.generated_tokens
            computed = req.computed_tokens + tokens
            generated = req.generated_tokens + max(0, computed - known)
            if req.output_bound == "cap" and generated > req.max_output_tokens:
                raise LedgerError(
                    f"request {request_id!r} would generate {generated} tokens over its cap {req.max_output_tokens}"
                )
            if self.max_model_len is not None and req.prompt_tokens + generated > self.max_model_len:
                raise LedgerError(f"request {request_id!r} would exceed max_model_len {self.max_model_len}")
            old_generated = req.generated_tokens
            req.generated_tokens = generated
            needed = self._needed_blocks(req, computed)
            pool = self._pools[req.pool]
            held = len(req.blocks)
            try:
                new = self._allocate(req, needed - held) if needed > held else []
            except OutOfBlocks:
                req.generated_tokens = old_generated
                raise
            if needed < held:  # sliding window: the oldest blocks fall out of the window
                for block in req.blocks[: held - needed]:
                    pool.decref(block)
                del req.blocks[: held - needed]
            req.computed_tokens = computed
            if req.output_bound == "estimate" and generated > req.max_output_tokens and not req.overflowed:
                req.overflowed = True
                self.counters["reservation_overflows"] += 1
            return new

    def preempt(self, request_id: str) -> None:
        """Dynamic admission: drop the request's blocks (it will recompute); state preempted, counted."""
        with self._lock:
            if self.admission != "dynamic":
                raise LedgerError("only dynamic admission preempts (reserve-cap never does)")
            req = self._req(request_id)
            if req.state != "running":
                raise LedgerError(f"request {request_id!r} is {req.state}; only running requests are preempted")
            self._drop_blocks(req)
            # what it computed is thrown away: recomputed when it resumes (the recompute tax)
            self._pools[req.pool].preempted_tokens += req.computed_tokens
            req.computed_tokens = 0
            req.state = "preempted"
            self.counters["preemptions"] += 1

    def resume(self, request_id: str) -> None:
        """A preempted request runs again (it recomputes through ``advance``)."""
        with self._lock:
            req = self._req(request_id)
            if req.state != "preempted":
                raise LedgerError(f"request {request_id!r} is {req.state}, not preempted")
            req.state = "running"

    def release(self, request_id: str) -> None:
        """Completion or cancellation: drop references and the reservation.

        Cached blocks that no request references become reclaimable, uncached ones
        free; blocks other requests still reference stay allocated.
        """
        with self._lock:
            req = self._req(request_id)
            self._drop_blocks(req)
            del self._requests[request_id]
            if self._reserved.pop(request_id, None) is not None:
                self._book(req, 0)

    def forget(self, request_id: str) -> None:
        """Lose a release: the request leaves the request table, its reservation and blocks stay (a leak)."""
        with self._lock:
            self._req(request_id)
            del self._requests[request_id]

    def sweep_leaks(self) -> int:
        """Count (once) and reclaim every reservation whose request is gone; returns how many."""
        with self._lock:
            leaked = [rid for rid in self._reserved if rid not in self._requests]
            for rid in leaked:
                req = self._reserved.pop(rid)
                self._drop_blocks(req)
                self._book(req, 0)
            self.counters["reservation_leaks"] += len(leaked)
            return len(leaked)

    def evict(self, n: int, pool: str | None = None) -> int:
        """Evict up to ``n`` reclaimable blocks (least recently used first) to free; returns how many."""
        with self._lock:
            return self._pool(self._default_pool if pool is None else pool).evict(n)

    def add_cache_listener(self, listener: CacheListener) -> None:
        """Call ``listener(event, pool_id, block, key)`` on every cached/evicted transition
        (see ``CacheListener``). It runs under the ledger's lock, inside the call that made
        the transition: it must be quick and must not call back into the ledger from
        another thread."""
        with self._lock:
            for pool in self._pools.values():
                pool.listeners.append(listener)

    # ------------------------------------------------------------ other figures

    def set_iteration_tokens(self, tokens: int | None) -> None:
        """The tokens the engine scheduled in its latest iteration (each call one iteration,
        also counted in the document's short window of iterations)."""
        with self._lock:
            self._iteration_tokens = tokens
            if tokens is not None:
                self._window.record(tokens)

    def set_host(self, **figures: Any) -> None:
        """Set host figures: output_buffer_bytes, output_buffer_limit_bytes, output_buffer_limit_kind,
        network_queue_depth, network_queue_limit, network_queue_limit_kind (None removes one)."""
        allowed = {
            "output_buffer_bytes", "output_buffer_limit_bytes", "output_buffer_limit_kind",
            "network_queue_depth", "network_queue_limit", "network_queue_limit_kind",
            "socket_send_queue_bytes", "socket_receive_queue_bytes",
        }
        unknown = set(figures) - allowed
        if unknown:
            raise ValueError(f"unknown host figure(s): {', '.join(sorted(unknown))}")
        for key in ("output_buffer_limit_kind", "network_queue_limit_kind"):
            if figures.get(key) is not None and figures[key] not in LIMIT_KINDS:
                raise ValueError(f"{key} must be hard or estimate")
        with self._lock:
            for key, value in figures.items():
                if value is None:
                    self._host.pop(key, None)
                else:
                    self._host[key] = value

    def set_memory(self, terms: Iterable[tuple[int, str, int, str]]) -> None:
        """Replace the GPU budget terms: (gpu, category, bytes, source) each."""
        out = []
        for gpu, category, size, source in terms:
            if category not in BUDGET_CATEGORIES or source not in TERM_SOURCES:
                raise ValueError(f"bad memory term ({gpu}, {category!r}, {size}, {source!r})")
            out.append({"gpu": gpu, "category": category, "bytes": int(size), "source": source})
        with self._lock:
            self._memory = out

    def set_reported_used_blocks(self, value: float | None, pool: str | None = None) -> None:
        """The engine's own claim of used blocks (``engine_reported_used_blocks``), for consistency checks."""
        with self._lock:
            self._pool(self._default_pool if pool is None else pool).reported_used = value

    # ------------------------------------------------------------ reading

    def state(self, request_id: str) -> str | None:
        with self._lock.plain:
            req = self._requests.get(request_id)
            return None if req is None else req.state

    def request_ids(self, state: str | None = None) -> list[str]:
        with self._lock.plain:
            return [r.id for r in self._requests.values() if state is None or r.state == state]

    def pool_stats(self, pool: str | None = None) -> dict[str, int]:
        """Physical state of a pool: in_use, reclaimable, free, references, shared, cached, reserved."""
        with self._lock.plain:
            p = self._pool(self._default_pool if pool is None else pool)
            reclaimable = len(p.lru)
            return {
                "in_use": p.in_use,
                "reclaimable": reclaimable,
                "free": p.spec.num_blocks - p.in_use - reclaimable,
                "references": p.references,
                "shared": p.shared,
                "cached": p.cached_count,
                "reserved": self._reserved_blocks[p.spec.id],
            }

    @staticmethod
    def _wire(r: _Request, include_blocks: bool) -> dict[str, Any]:
        """A request's fields by their wire names (``request_wire.REQUEST_FIELDS``)."""
        return {
            "id": r.id, "pool": r.pool, "state": r.state, "tenant": r.tenant, "prompt_tokens": r.prompt_tokens,
            "max_output_tokens": r.max_output_tokens, "output_bound": r.output_bound,
            "generated_tokens": r.generated_tokens, "computed_tokens": r.computed_tokens, "contexts": r.contexts,
            "speculative_slots": r.speculative_slots, "blocks_held": len(r.blocks),
            "block_ids": list(r.blocks) if include_blocks else None,
        }

    def to_document(self, *, include_blocks: bool = True, columns: bool = False) -> dict[str, Any]:
        """Render kvledger/v1; ``include_blocks=False`` omits block_refs and block_ids (big ledgers);
        ``columns=True`` renders the columnar form (``request_columns`` in place of
        ``requests``, docs/ledger.md): the same facts, for readers that ask for it."""
        with self._lock.plain:
            pools = []
            for p in self._pools.values():
                reclaimable = len(p.lru)
                pool_doc: dict[str, Any] = {
                    "id": p.spec.id,
                    "block_size": p.spec.block_size,
                    "block_bytes": p.spec.block_bytes,
                    "num_blocks": p.spec.num_blocks,
                    "sliding_window": p.spec.sliding_window,
                    "blocks": {
                        "in_use": p.in_use,
                        "reclaimable": reclaimable,
                        "free": p.spec.num_blocks - p.in_use - reclaimable,
                    },
                    "references": p.references,
                    "shared": p.shared,
                    "cached_blocks": p.cached_count,
                    "preempted_tokens": p.preempted_tokens,
                }
                if p.reported_used is not None:
                    pool_doc["engine_reported_used_blocks"] = p.reported_used
                if p.spec.sliding_window is not None:
                    # the pool's one KV-cache group, stated as kvledger/v1 states a hybrid model's
                    # groups (its blocks are the pool's: every block in use is the group's)
                    pool_doc["groups"] = [{"id": "0", "kind": SLIDING_WINDOW, "window": p.spec.sliding_window,
                                           "in_use": p.in_use}]  # fmt: skip
                if include_blocks:
                    ref, cached = p.ref, p.cached
                    pool_doc["block_refs"] = [
                        [b, ref[b], bool(cached[b])] for b in range(p.spec.num_blocks) if ref[b] or cached[b]
                    ]
                pools.append(pool_doc)
            live = [self._wire(r, include_blocks) for r in self._requests.values()]
            if columns:
                table = _WRITER.columns(live, machine_integers=False, collapse=True)
            else:
                requests = [_WRITER.row(r) for r in live]
            doc: dict[str, Any] = {
                "schema": SCHEMA_ID,
                "engine": {"kind": self.engine_kind, "version": self.engine_version},
                # when the engine last changed this state (the writer's clock): a reader gives up
                # exactness when it grows old while requests run (a hung scheduler, this thread answering)
                "published_at": self._lock.stamp,
                "admission": self.admission,
                "overflow": self.overflow,
                "budgets": {
                    "max_num_batched_tokens": self.max_num_batched_tokens,
                    "iteration_tokens": self._iteration_tokens,
                    **self._window.budgets(),
                    "max_num_seqs": self.max_num_seqs,
                    "max_model_len": self.max_model_len,
                },
                "pools": pools,
                "counters": dict(self.counters),
            }
            if columns:
                doc["request_columns"] = table
            else:
                doc["requests"] = requests
            if self._memory:
                doc["memory"] = [dict(t) for t in self._memory]
            if self._host:
                doc["host"] = dict(self._host)
            if self.tenant_quotas:
                doc["tenants"] = [{"name": n, "quota_bytes": q} for n, q in self.tenant_quotas.items()]
            return doc
