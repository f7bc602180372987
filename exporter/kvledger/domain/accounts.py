"""The Accounts: what the policy concludes per pool, tenant, engine and GPU (numbers, no formulas)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.domain.facts import (
    EngineFacts,
    GpuFacts,
    HostFacts,
    SourceHealth,
)
from kvledger.domain.measure import Measure, scaled


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


@dataclass(frozen=True, slots=True)
class GroupAccount:
    """One KV-cache group of a pool shared by several (a hybrid model), in blocks of the pool."""

    group: str
    kind: str
    window: int | None
    in_use: Measure | None  # distinct blocks the group's requests reference
    reserved: Measure | None  # the group's share of R(r), summed over admitted requests


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
    # the engine's own admission estimate (SGLang's new_token_ratio x remaining output), in
    # tokens, and its ratio: beside the declared policy's figures, never in them
    engine_admission_estimate_tokens: float | None = None
    engine_new_token_ratio: float | None = None
    # in_use / capacity and reserved / capacity: one basis-consistent usage gauge per kind
    physical_utilization: Measure | None = None
    quota_utilization: Measure | None = None
    # kv_quota and kv_physical saturation (policy/saturation.py), by constraint
    saturation: dict[str, Measure] = field(default_factory=dict)
    # the KV-cache groups sharing the pool (hybrid models); empty for a one-group pool
    groups: tuple[GroupAccount, ...] = ()

    def bytes_of(self, blocks: Measure | None) -> Measure | None:
        return scaled(blocks, self.block_bytes)


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
    # the engine's own constraints' saturation (sequences, token_budget), by constraint
    saturation: dict[str, Measure] = field(default_factory=dict)
    # the constraint that binds now and those that took part (policy/saturation.py)
    binding: str | None = None
    binding_candidates: frozenset[str] = frozenset()
    #: this engine's sample lines in each engine family, as the exposition writes them
    #: (kvledger.output.prometheus.engine_lines): made once per account, by the first render
    #: that shows it; an account kept from cycle to cycle (an idle engine) is not rendered again
    rendered: dict[str, str] | None = field(default=None, compare=False, repr=False)

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


@dataclass(frozen=True, slots=True)
class ConfigReload:
    """The daemon's configuration file: whether its latest load (start or SIGHUP) succeeded,
    and when the latest successful one was (Unix time)."""

    successful: bool
    success_at: float


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
    # the configuration file's load status (``kvledger serve``; None where no file is reloaded)
    config_reload: ConfigReload | None = None
