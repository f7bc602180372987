"""Accounts of pools, tenants and engines: ``engine_account`` of one engine's facts.

The daemon accounts a Snapshot one engine at a time (``collect.accounting.account_snapshot``,
which isolates an engine whose facts cannot be accounted), then its GPUs (``device_budget``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvledger.domain.accounts import EngineAccount, GroupAccount, PoolAccount, TenantAccount
from kvledger.domain.facts import (
    EngineFacts,
    PoolFacts,
)
from kvledger.domain.measure import Measure
from kvledger.domain.request_table import RequestTable
from kvledger.policy.arithmetic import _add, ceil_div, ratio_of_capacity
from kvledger.policy.invariants import (
    ENGINE_REPORTED_CHECK,
    ENGINE_RESERVED_CHECK,
    GROUP_IN_USE_CHECK,
    PHYSICAL_CHECKS,
    RESERVATION_RANGE_CHECK,
    _request_invariants,
    invariant_violations,
)
from kvledger.policy.physical import physical_state
from kvledger.policy.reservations import (
    RequestColumns,
    _split_by_pool,
    admission_estimate_tokens,
    cap_blocks,
    group_cap_blocks,
    group_reservations,
    request_columns,
)
from kvledger.policy.saturation import binding_constraint, sequences_ratio, token_budget_ratio


def pool_account(engine: EngineFacts, pool: PoolFacts, cols: RequestColumns | None, sharing: str) -> PoolAccount:
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
        if pool.admission_estimate is not None:
            acc.engine_new_token_ratio = pool.admission_estimate.new_token_ratio
            acc.engine_admission_estimate_tokens = admission_estimate_tokens(pool.admission_estimate, cols)
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
        # per request at L: the policy's blocks over the known groups, or the engine's own
        # sizing when larger (a hybrid model whose groups its KV events have not named yet)
        bound = running * max(cap_blocks(pool, L), pool.engine_request_blocks or 0)
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
        acc.reserved_blocks, c, b, L, engine.budgets.max_num_seqs, running,
        per_request_blocks=None if L is None else cap_blocks(pool, L),
    )  # fmt: skip
    acc.physical_utilization = ratio_of_capacity(phys.in_use, c)
    acc.quota_utilization = ratio_of_capacity(acc.reserved_blocks, c)
    if pool.groups:
        acc.groups = group_accounts(pool, cols, L, running if cols is None else None)
    acc.saturation = {
        name: m for name, m in (("kv_quota", acc.quota_utilization), ("kv_physical", acc.physical_utilization)) if m is not None
    }
    return acc


def group_accounts(
    pool: PoolFacts, cols: RequestColumns | None, max_model_len: int | None, running: int | None
) -> tuple[GroupAccount, ...]:
    """Per KV-cache group of a shared pool: the distinct blocks its requests reference (as
    the engine states them) and its share of R(r) summed over admitted requests, each
    counted alone: exact from a request ledger, at most ``running x`` the group's cap from a
    count of admitted requests. Blocks of one group never count in another's."""
    out = []
    for i, g in enumerate(pool.groups):
        reserved: Measure | None = None
        if cols is not None and i < len(cols.group_reservations):
            reserved = Measure(exact=int(cols.group_reservations[i][cols.admitted].sum()))
        elif running is not None and max_model_len is not None:
            bound = running * group_cap_blocks(g, pool.block_size, max_model_len)
            reserved = Measure(upper=max(bound, g.in_use or 0))
        in_use = None if g.in_use is None else Measure(exact=g.in_use)
        out.append(GroupAccount(g.id, g.kind, g.window, in_use, reserved))
    return tuple(out)


def admission_headroom(
    reserved: Measure | None,
    capacity: int,
    block_size: int,
    max_model_len: int | None,
    max_num_seqs: int | None,
    running: int | None,
    *,
    per_request_blocks: int | None = None,
) -> Measure | None:
    """min(floor(max(0, C - reserved) / ceil(L / B)), max(0, max_num_seqs - running)).

    ``per_request_blocks`` replaces ceil(L / B) where a request at L takes more (a pool
    shared by KV-cache groups: ``cap_blocks``). An upper bound on reserved gives a lower
    bound on the headroom and vice versa.
    """
    if reserved is None or max_model_len is None:
        return None
    per_request: int = per_request_blocks or ceil_div(max_model_len, block_size)

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


# ---------------------------------------------------------------- engines, tenants, GPUs


class _Codes(dict[str | None, int]):
    """Tenant names to their position; -1 for a name the configuration does not list."""

    def __missing__(self, key: str | None) -> int:
        return -1


def tenant_accounts(engine: EngineFacts, pools: dict[str, PoolFacts], columns: dict[str, RequestColumns]) -> list[TenantAccount]:
    """Per tenant: the per-request rule (a quota covers what a tenant's requests may claim).
    Only tenants named in the configuration are exported (bounded cardinality)."""
    names = [t.name for t in engine.tenants]
    if not names:
        return []
    if engine.requests is None:
        return [TenantAccount(engine.name, t.name, t.quota_bytes) for t in engine.tenants]
    index = _Codes({name: i for i, name in enumerate(names)})
    k = len(names)
    blocks = np.zeros(k, dtype=np.int64)
    byte_sums: list[int | None] = [0] * k
    counts = np.zeros(3 * k, dtype=np.int64)  # running, waiting, preempted (STATE_CODES) x tenant
    for pool_id, cols in columns.items():
        tenant = np.fromiter(map(index.__getitem__, cols.tenants), dtype=np.int64, count=len(cols.tenants))
        named = tenant >= 0
        counts += np.bincount(cols.states[named].astype(np.int64) * k + tenant[named], minlength=3 * k)
        adm = named & cols.admitted
        pool_blocks = np.bincount(tenant[adm], weights=cols.claimed[adm], minlength=k).astype(np.int64)
        blocks += pool_blocks
        block_bytes = pools[pool_id].block_bytes
        nonzero = np.flatnonzero(pool_blocks)
        for t, held in zip(nonzero.tolist(), pool_blocks[nonzero].tolist(), strict=True):
            current = byte_sums[t]
            byte_sums[t] = None if current is None or block_bytes is None else current + held * block_bytes
    running, waiting, preempted = counts.reshape(3, k).tolist()
    return [
        TenantAccount(
            engine.name,
            t.name,
            t.quota_bytes,
            reserved,
            byte_sums[i],
            {"running": running[i], "waiting": waiting[i], "preempted": preempted[i]},
        )
        for i, (t, reserved) in enumerate(zip(engine.tenants, blocks.tolist(), strict=True))
    ]


def engine_violations(engine: EngineFacts) -> list[str]:
    """The invariant checks ``engine``'s facts violate, as its account lists them
    (``EngineAccount.invariant_violations``), without making the account: the collector
    counts them at every poll, also in cycles that make no Accounts (``Collector``; the
    property tests hold the two to the same list)."""
    by_pool: dict[str, RequestTable] = {}
    if engine.requests is not None:
        by_pool = _split_by_pool(RequestTable.from_requests(engine.requests), engine.pools)
    violations: list[str] = []
    for pool in engine.pools:
        table = by_pool.get(pool.id)
        violations.extend(invariant_violations(pool, physical_state(pool)))
        if table is not None and len(table):
            if pool.groups and group_reservations(table, pool, engine.budgets.max_model_len)[2]:
                violations.append(RESERVATION_RANGE_CHECK)
            violations.extend(_request_invariants(pool, table))
    return sorted(set(violations))


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
        pool_cols = columns.get(pool.id)
        if pool_cols is not None and pool_cols.out_of_range:
            pool_cols = None  # the requests' reservations are unknown; counts and tenants still stand
            bad_range = [RESERVATION_RANGE_CHECK]
        else:
            bad_range = []
        acc = pool_account(engine, pool, pool_cols, sharing)
        bad = invariant_violations(pool, acc.physical) + bad_range  # as engine_violations finds them
        if bad_range:
            acc.reserved_blocks = acc.quota_headroom_blocks = acc.admission_headroom_requests = None
            acc.quota_utilization = None
        if bad:
            acc = _without_impossible(engine, pool, acc, bad, pool_cols, sharing)
        pools.append(acc)
        violations.extend(bad)
        if pool.id in by_pool and len(by_pool[pool.id]):
            violations.extend(_request_invariants(pool, by_pool[pool.id]))
    requests: dict[str, int | None]
    slots: dict[str, int] = {}
    if engine.requests is not None:
        cols = list(columns.values())
        state_counts = [c.state_counts() for c in cols]
        requests = {
            "running": sum(c[0] for c in state_counts),
            "waiting": sum(c[1] for c in state_counts),
            "preempted": sum(c[2] for c in state_counts),
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
    saturation = {
        name: m
        for name, m in (
            ("sequences", sequences_ratio(requests["running"], engine.budgets.max_num_seqs)),
            ("token_budget", token_budget_ratio(engine.budgets)),
        )
        if m is not None
    }
    ratios = [item for p in pools for item in p.saturation.items()] + list(saturation.items())
    binding, candidates = binding_constraint(ratios, engine.admission)
    return EngineAccount(
        facts=engine,
        sharing=sharing,
        pools=pools,
        requests=requests,
        extra_context_slots=slots,
        tenants=tenant_accounts(engine, pool_map, columns),
        invariant_violations=sorted(set(violations)),
        saturation=saturation,
        binding=binding,
        binding_candidates=candidates,
    )


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
                unknown,
                in_use=None,
                reclaimable=None,
                free=None,
                block_refs=None,
                cached_blocks=None,
                unreferenced_blocks=None,
            )
        if ENGINE_RESERVED_CHECK in bad:
            unknown = dataclasses.replace(unknown, reserved_blocks=None)
        acc = pool_account(engine, unknown, cols, sharing)
    if ENGINE_REPORTED_CHECK in bad:
        acc.engine_reported_used_blocks = None
    if GROUP_IN_USE_CHECK in bad or not PHYSICAL_CHECKS.isdisjoint(bad):
        acc.groups = tuple(dataclasses.replace(g, in_use=None) for g in acc.groups)
    return acc
