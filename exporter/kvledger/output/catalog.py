"""The metric catalogue: every exported family defined once (name, type, unit, help,
labels, stability) together with how its samples are read from the Accounts, and the
vocabulary of label names (LABELS: each name's one meaning and its closed set of values).

The Prometheus collector, the OTLP output, the metric reference (docs/metrics.md), the
dashboards and the alert lint all read this list; nothing else names a metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from kvledger import build_info
from kvledger.domain.accounts import Accounts, ConfigReload, EngineAccount, PoolAccount
from kvledger.domain.facts import GROUP_KINDS
from kvledger.domain.limits import MAX_DOCUMENT_AGE
from kvledger.domain.measure import Measure

#: a sample's label values under their names (every name of its family's ``labels``, no other)
Labels = dict[str, str]
Sample = tuple[Labels, float]
Extract = Callable[[Accounts], Iterable[Sample]]


Stability = Literal["stable", "experimental"]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: Literal["gauge", "counter"]
    unit: str  # bytes, blocks, tokens, requests, seconds, ratio, "" (a count or info)
    group: str  # kv, scheduler, tenant, gpu, host, info, health
    labels: tuple[str, ...]  # the label names, in the exposition's order
    help: str
    samples: Extract  # each sample's labels by name (``Labels``): nothing pairs names and values by position

    @property
    def stability(self) -> Stability:
        """stable: renamed only with a CHANGELOG "Renamed" entry (tests/test_metric_stability.py);
        experimental: may change in any release. Every family is one or the other (STABLE)."""
        return "stable" if self.name in STABLE else "experimental"

    def labelled(self, accounts: Accounts) -> Iterator[tuple[Labels, float]]:
        """The samples with their labels in the family's order (``labels``), each read by its name
        (KeyError for a name the sample lacks): what the JSON view, OTLP and the pages read."""
        names = self.labels
        for labels, value in self.samples(accounts):
            yield {n: labels[n] for n in names}, value


@dataclass(frozen=True)
class Label:
    """A label name of the catalogue: its one meaning, and its values where they are a closed set
    (None: open, e.g. names from the configuration or from an engine)."""

    meaning: str
    values: frozenset[str] | None = None


#: every reason a source's failure can carry (the ``reason`` label of kvledger_source_errors_total; what
#: ``kvledger check`` prints), with what it means: written once here, listed in docs/metrics.md
#: (kvledger.tools.docgen); a test fails when the code gives a reason this table lacks
#: (tests/test_engine_text_hardening.py).
#: reason -> what happened (engine sources first, then the node's own sources)
REASONS: dict[str, str] = {
    "connect": "the engine could not be reached (refused, unreachable, DNS, TLS handshake)",
    "timeout": "no complete answer within timeout_seconds (connect, headers and body together)",
    "http_status": "the engine answered with a status other than 200 (401: it refused the credentials)",
    "too_large": "the answer was over max_response_bytes, or Prometheus text over max_response_lines (50,000 by default), "
                 "or it did not fit beside the other engines' answers in limits.memory_budget_bytes; refused before it is parsed",
    "parse": "the answer is not what the kind reads (not Prometheus text, not JSON, a broken value)",
    "schema": "a kvledger/v1 document that breaks its schema",
    "missing": "a series the kind needs is absent from the engine's /metrics",
    "stale": "a kvledger/v1 document that shows running requests but was published more than 30 s ago, by the "
             "server's clock: the engine stopped publishing while its server answers, so its numbers are not given as exact",
    "config": "the configuration cannot be applied to what the engine reports (a credentials file that cannot be read, "
              "a block size the configuration needs and does not give)",
    "invalid": "facts that cannot be accounted or exported (a number beyond 2^53 - 1, not finite, or over a limit)",
    "internal": "a bug of kvledger's: the traceback is logged",
    "unavailable": "a part a source runs itself is down: KV events, the startup log, the in-engine ledger, llama.cpp's /metrics",
    "absent": "NVML: no libnvidia-ml.so.1 on this node",
    "library": "NVML: the library loaded but failed",
    "driver": "NVML: the driver failed or a GPU was lost",
    "disabled": "NVML is off in the configuration (nvml.enabled: false)",
    "proc": "/proc (process attribution or the socket queues of /proc/net/tcp) could not be read",
}


#: every label name of the catalogue and the one thing it means (one meaning per label name).
#: ``kind``'s values are the registered engine kinds (kvledger.config.engine_kinds, which the
#: outputs do not import): open here, checked against the registry by the tests.
LABELS: dict[str, Label] = {
    "engine": Label("the engine's name in the configuration"),
    "pool": Label("a KV pool's id"),
    "gpu": Label("a GPU index"),
    "tenant": Label("a tenant named in the configuration"),
    "basis": Label("whether a figure is exact or a bound", frozenset({"exact", "upper_bound", "lower_bound"})),
    "kind": Label("the engine kind of the configuration"),
    "view": Label("the quota view (reservations) or the physical one (blocks holding data)", frozenset({"quota", "physical"})),
    "limit": Label("whether a limit is a hard cap or an estimate", frozenset({"hard", "estimate"})),
    "purpose": Label("what an extra context slot is for", frozenset({"speculative", "branch"})),
    "provenance": Label("where a budget figure comes from", frozenset({"measured", "configured", "estimate"})),
    "source": Label("the kvledger source reading an engine"),
    "state": Label("the state of the blocks or requests counted",
                   frozenset({"in_use", "reclaimable", "free", "running", "waiting", "preempted"})),
    "output_bound": Label("the kind of a request's output bound", frozenset({"cap", "estimate"})),
    "category": Label("a device budget term", frozenset({"weights", "workspace", "runtime_buffers", "reserve", "kv_pool"})),
    "direction": Label("a socket queue's direction", frozenset({"send", "receive"})),
    "result": Label("an admission re-check's result", frozenset({"accepted", "rejected"})),
    "type": Label("a KV event's type"),
    "reason": Label("why a source failed", frozenset(REASONS)),
    "check": Label("the ledger invariant violated"),
    "label": Label("the label whose values were limited"),
    "action": Label("what was done to a label value over the limit"),
    "memory_type": Label("the engine's own memory category"),
    "sharing": Label("the sharing rule", frozenset({"per-request", "reference-aware"})),
    "admission": Label("the engine's admission behaviour", frozenset({"reserve-cap", "dynamic", "unknown"})),
    "overflow": Label("what happens when an estimate is exceeded", frozenset({"preempt-recompute", "reject", "swap", "unknown"})),
    "tenant_rule": Label("the rule tenant figures use", frozenset({"per-request"})),
    "version": Label("the version of what the info family describes (kvledger, an engine)"),
    "revision": Label("kvledger's git revision"),
    "python_version": Label("the Python running kvledger"),
    "uuid": Label("a GPU's UUID"),
    "name": Label("a GPU's product name"),
    "driver_version": Label("the NVIDIA driver's version"),
    "mig": Label("whether the GPU is a MIG instance", frozenset({"true", "false"})),
    "group": Label("a KV-cache group of a pool (a hybrid model's layer type)"),
    "layer_type": Label("the layer type of a KV-cache group", frozenset(GROUP_KINDS)),
    "window_tokens": Label("the tokens a KV-cache group's window or chunk spans (empty: none)"),
    "constraint": Label("a limit that stops an engine admitting work",
                        frozenset({"kv_quota", "kv_physical", "sequences", "token_budget"})),
}


# ---------------------------------------------------------------- sample helpers


def _pools(a: Accounts) -> Iterator[tuple[EngineAccount, PoolAccount]]:
    for e in a.engines:
        for p in e.pools:
            yield e, p


def _pool_value(get: Callable[[PoolAccount], float | None]) -> Extract:
    def extract(a: Accounts) -> Iterator[Sample]:
        for e, p in _pools(a):
            v = get(p)
            if v is not None:
                yield {"engine": e.name, "pool": p.pool}, float(v)

    return extract


def _pool_measure(get: Callable[[PoolAccount], Measure | None]) -> Extract:
    def extract(a: Accounts) -> Iterator[Sample]:
        for e, p in _pools(a):
            m = get(p)
            if m is not None:
                for basis, v in m.series():
                    yield {"engine": e.name, "pool": p.pool, "basis": basis}, float(v)

    return extract


def _engine_value(get: Callable[[EngineAccount], float | None]) -> Extract:
    def extract(a: Accounts) -> Iterator[Sample]:
        for e in a.engines:
            v = get(e)
            if v is not None:
                yield {"engine": e.name}, float(v)

    return extract


def _counter(name: str) -> Extract:
    return _engine_value(lambda e: e.facts.counters.get(name))


def _kv_blocks(a: Accounts) -> Iterator[Sample]:
    for e, p in _pools(a):
        phys = p.physical
        for state, m in (("in_use", phys.in_use), ("reclaimable", phys.reclaimable), ("free", phys.free)):
            if m is not None and m.exact is not None:
                yield {"engine": e.name, "pool": p.pool, "state": state}, float(m.exact)


def _headroom(a: Accounts) -> Iterator[Sample]:
    for e, p in _pools(a):
        for view, m in (("quota", p.quota_headroom_blocks), ("physical", p.physical_headroom_blocks)):
            mb = p.bytes_of(m)
            if mb is not None:
                for basis, v in mb.series():
                    yield {"engine": e.name, "pool": p.pool, "view": view, "basis": basis}, float(v)


def _utilization(a: Accounts) -> Iterator[Sample]:
    for e, p in _pools(a):
        for view, m in (("physical", p.physical_utilization), ("quota", p.quota_utilization)):
            if m is not None:
                for basis, v in m.series():
                    yield {"engine": e.name, "pool": p.pool, "view": view, "basis": basis}, float(v)


def _pending(a: Accounts) -> Iterator[Sample]:
    for e, p in _pools(a):
        if p.block_bytes is None:
            continue
        for bound, blocks in sorted(p.pending_growth_blocks.items()):
            yield {"engine": e.name, "pool": p.pool, "output_bound": bound}, float(blocks * p.block_bytes)


def _admission_headroom(a: Accounts) -> Iterator[Sample]:
    for e, p in _pools(a):
        if p.admission_headroom_requests is not None:
            for basis, v in p.admission_headroom_requests.series():
                yield {"engine": e.name, "pool": p.pool, "basis": basis}, float(v)


def _saturation(a: Accounts) -> Iterator[Sample]:
    for e in a.engines:
        for p in e.pools:
            for constraint, m in p.saturation.items():
                for basis, v in m.series():
                    yield {"engine": e.name, "pool": p.pool, "constraint": constraint, "basis": basis}, float(v)
        for constraint, m in e.saturation.items():  # the engine's own budgets: no pool
            for basis, v in m.series():
                yield {"engine": e.name, "pool": "", "constraint": constraint, "basis": basis}, float(v)


def _binding(a: Accounts) -> Iterator[Sample]:
    for e in a.engines:
        for constraint in sorted(e.binding_candidates):
            yield {"engine": e.name, "constraint": constraint}, 1.0 if constraint == e.binding else 0.0


def _preempted_tokens(a: Accounts) -> Iterator[Sample]:
    for e in a.engines:
        for facts in e.facts.pools:  # a counter the engine keeps: read as it reports it
            if facts.preempted_tokens is not None:
                yield {"engine": e.name, "pool": facts.id}, float(facts.preempted_tokens)


def _requests(a: Accounts) -> Iterator[Sample]:
    for e in a.engines:
        for state, n in e.requests.items():
            if n is not None:
                yield {"engine": e.name, "state": state}, float(n)


def _slots(a: Accounts) -> Iterator[Sample]:
    for e in a.engines:
        for purpose, n in sorted(e.extra_context_slots.items()):
            yield {"engine": e.name, "purpose": purpose}, float(n)


def _rechecks(a: Accounts) -> Iterator[Sample]:
    for e in a.engines:
        for result in ("accepted", "rejected"):
            v = e.facts.counters.get(f"admission_rechecks_{result}")
            if v is not None:
                yield {"engine": e.name, "result": result}, float(v)


def _tenants(get: Callable[..., float | None]) -> Extract:
    def extract(a: Accounts) -> Iterator[Sample]:
        for e in a.engines:
            for t in e.tenants:
                v = get(t)
                if v is not None:
                    yield {"engine": e.name, "tenant": t.tenant}, float(v)

    return extract


def _tenant_requests(a: Accounts) -> Iterator[Sample]:
    for e in a.engines:
        for t in e.tenants:
            for state, n in sorted(t.requests.items()):
                yield {"engine": e.name, "tenant": t.tenant, "state": state}, float(n)


def _gpu_value(get: Callable[..., float | None], only_up: bool = True) -> Extract:
    def extract(a: Accounts) -> Iterator[Sample]:
        for g in a.gpus:
            if only_up and not g.facts.up:
                continue
            v = get(g.facts)
            if v is not None:
                yield {"gpu": str(g.facts.index)}, float(v)

    return extract


def _gpu_info(a: Accounts) -> Iterator[Sample]:
    for g in a.gpus:
        f = g.facts
        yield {"gpu": str(f.index), "uuid": f.uuid or "", "name": f.name or "", "driver_version": a.driver_version or "",
               "mig": "true" if f.mig else "false"}, 1.0


def _gpu_process(a: Accounts) -> Iterator[Sample]:
    for g in a.gpus:
        for engine, b in sorted(g.process_bytes.items()):
            yield {"gpu": str(g.facts.index), "engine": engine}, float(b)


def _budget(a: Accounts) -> Iterator[Sample]:
    for t in a.budget:
        yield {"gpu": str(t.gpu), "engine": t.engine, "category": t.category, "provenance": t.source}, float(t.bytes)


def _gpu_slack(a: Accounts) -> Iterator[Sample]:
    for g in a.gpus:
        if g.budget_slack is not None:
            yield {"gpu": str(g.facts.index)}, float(g.budget_slack)


def _unaccounted(a: Accounts) -> Iterator[Sample]:
    for g in a.gpus:
        if g.unaccounted is not None:
            for basis, v in g.unaccounted.series():
                yield {"gpu": str(g.facts.index), "basis": basis}, float(v)


def _host_limit(attr: str) -> Extract:
    def extract(a: Accounts) -> Iterator[Sample]:
        for e in a.engines:
            lim = getattr(e.host, attr)
            if lim is not None:
                yield {"engine": e.name, "limit": lim.kind}, float(lim.value)

    return extract


def _socket_queue(a: Accounts) -> Iterator[Sample]:
    for e in a.engines:
        for direction, v in (("send", e.host.socket_send_queue_bytes), ("receive", e.host.socket_receive_queue_bytes)):
            if v is not None:
                yield {"engine": e.name, "direction": direction}, float(v)


def _reported_memory(a: Accounts) -> Iterator[Sample]:
    for e in a.engines:
        for memory_type, b in sorted(e.facts.reported_memory.items()):
            yield {"engine": e.name, "memory_type": memory_type}, float(b)


def _policy_info(a: Accounts) -> Iterator[Sample]:
    for e in a.engines:
        f = e.facts
        yield {"engine": e.name, "sharing": e.sharing, "admission": f.admission or "unknown",
               "overflow": f.overflow or "unknown", "tenant_rule": "per-request"}, 1.0


def _engine_info(a: Accounts) -> Iterator[Sample]:
    for e in a.engines:
        f = e.facts
        yield {"engine": e.name, "kind": f.kind, "version": f.version or "", "source": f.source}, 1.0


def _health(get: Callable[..., float | None]) -> Extract:
    def extract(a: Accounts) -> Iterator[Sample]:
        for h in a.health:
            v = get(h)
            if v is not None:
                yield {"engine": h.engine, "source": h.source}, float(v)

    return extract


def _source_errors(a: Accounts) -> Iterator[Sample]:
    for h in a.health:
        for reason, n in sorted(h.errors.items()):
            yield {"engine": h.engine, "source": h.source, "reason": reason}, float(n)


def _kv_events(a: Accounts) -> Iterator[Sample]:
    for e in a.engines:
        for kind, n in sorted(e.facts.kv_events.items()):
            yield {"engine": e.name, "type": kind}, float(n)


def _invariants(a: Accounts) -> Iterator[Sample]:
    for (engine, check), n in sorted(a.invariant_totals.items()):
        yield {"engine": engine, "check": check}, float(n)


def _labels_limited(a: Accounts) -> Iterator[Sample]:
    for (engine, label, action), n in sorted(a.labels_limited.items()):
        yield {"engine": engine, "label": label, "action": action}, float(n)


def _config_reload(value: Callable[[ConfigReload], float]) -> Callable[[Accounts], Iterator[Sample]]:
    def samples(a: Accounts) -> Iterator[Sample]:
        if a.config_reload is not None:
            yield {}, value(a.config_reload)

    return samples


def _group_info(a: Accounts) -> Iterator[Sample]:
    for e, p in _pools(a):
        for g in p.groups:
            yield {"engine": e.name, "pool": p.pool, "group": g.group, "layer_type": g.kind,
                   "window_tokens": "" if g.window is None else str(g.window)}, 1.0


def _group_in_use(a: Accounts) -> Iterator[Sample]:
    for e, p in _pools(a):
        for g in p.groups:
            if g.in_use is not None and g.in_use.exact is not None:
                yield {"engine": e.name, "pool": p.pool, "group": g.group}, float(g.in_use.exact)


def _group_reserved(a: Accounts) -> Iterator[Sample]:
    for e, p in _pools(a):
        for g in p.groups:
            if g.reserved is not None:
                for basis, v in g.reserved.series():
                    yield {"engine": e.name, "pool": p.pool, "group": g.group, "basis": basis}, float(v)


def _build_info(a: Accounts) -> Iterator[Sample]:
    b = build_info()
    yield {"version": b.version, "revision": b.revision, "python_version": b.python_version}, 1.0


# ---------------------------------------------------------------- renames

#: families renamed since 0.1.0, old name -> new name: units last (CHANGELOG.md, "Renamed", says why).
#: ``kvledger plan --from`` reads a daemon of either version through these tables.
RENAMED_FAMILIES: dict[str, str] = {
    "kvledger_kv_token_capacity": "kvledger_kv_capacity_tokens",
    "kvledger_iteration_token_budget": "kvledger_iteration_budget_tokens",
}
#: labels renamed since 0.1.0, (family, old label) -> new label: one meaning per label name. ``kind`` is
#: the engine kind (kvledger_engine_info) and ``source`` the kvledger source reading an engine, nothing else.
RENAMED_LABELS: dict[tuple[str, str], str] = {
    ("kvledger_kv_headroom_bytes", "kind"): "view",
    ("kvledger_kv_utilization_ratio", "kind"): "view",
    ("kvledger_extra_context_slots", "kind"): "purpose",
    ("kvledger_host_buffer_limit_bytes", "kind"): "limit",
    ("kvledger_network_queue_limit", "kind"): "limit",
    ("kvledger_gpu_budget_bytes", "source"): "provenance",
}


# ---------------------------------------------------------------- the catalogue

EP = ("engine", "pool")
EPB = ("engine", "pool", "basis")

CATALOG: tuple[MetricSpec, ...] = (
    # KV pool
    MetricSpec("kvledger_kv_capacity_bytes", "gauge", "bytes", "kv", EP,
               "KV pool capacity in bytes (blocks x bytes per block, all layers and TP ranks).",
               _pool_value(lambda p: p.capacity_bytes)),
    MetricSpec("kvledger_kv_capacity_blocks", "gauge", "blocks", "kv", EP,
               "KV pool capacity in blocks.", _pool_value(lambda p: p.capacity_blocks)),
    MetricSpec("kvledger_kv_block_size_tokens", "gauge", "tokens", "kv", EP,
               "Tokens per KV block.", _pool_value(lambda p: p.block_size)),
    MetricSpec("kvledger_kv_reserved_bytes", "gauge", "bytes", "kv", EPB,
               "KV bytes claimed by admitted requests (running and preempted) under the declared sharing rule; "
               "basis says whether exact or a hard bound.",
               _pool_measure(lambda p: p.bytes_of(p.reserved_blocks))),
    MetricSpec("kvledger_kv_reserved_blocks", "gauge", "blocks", "kv", EPB,
               "KV blocks claimed by admitted requests under the declared sharing rule.",
               _pool_measure(lambda p: p.reserved_blocks)),
    MetricSpec("kvledger_kv_pending_growth_bytes", "gauge", "bytes", "kv", ("engine", "pool", "output_bound"),
               "Growth admitted requests may still create (reservation minus held), by the kind of output bound "
               "it rests on: cap (enforced max_tokens) or estimate (can be exceeded).", _pending),
    MetricSpec("kvledger_kv_allocated_bytes", "gauge", "bytes", "kv", EPB,
               "KV bytes physically holding data: in-use plus reclaimable unique blocks.",
               _pool_measure(lambda p: p.bytes_of(p.physical.allocated))),
    MetricSpec("kvledger_kv_in_use_bytes", "gauge", "bytes", "kv", EPB,
               "KV bytes of unique blocks referenced by at least one request.",
               _pool_measure(lambda p: p.bytes_of(p.physical.in_use))),
    MetricSpec("kvledger_kv_reclaimable_bytes", "gauge", "bytes", "kv", EPB,
               "KV bytes of cached blocks no request references (evictable; a later hit would recompute them).",
               _pool_measure(lambda p: p.bytes_of(p.physical.reclaimable))),
    MetricSpec("kvledger_kv_free_bytes", "gauge", "bytes", "kv", EPB,
               "KV bytes holding no data (capacity minus allocated).",
               _pool_measure(lambda p: p.bytes_of(p.physical.free))),
    MetricSpec("kvledger_kv_blocks", "gauge", "blocks", "kv", ("engine", "pool", "state"),
               "Unique KV blocks by state (in_use, reclaimable, free): a partition of capacity; a state is "
               "present only when known exactly.", _kv_blocks),
    MetricSpec("kvledger_kv_block_references", "gauge", "", "kv", EP,
               "Sum of block reference counts (the per-request view of in-use blocks): a count of references, "
               "not of blocks (a block three requests share counts three).",
               _pool_value(lambda p: p.physical.references)),
    MetricSpec("kvledger_kv_shared_blocks", "gauge", "blocks", "kv", EP,
               "Unique blocks referenced by more than one request (shared prefixes).",
               _pool_value(lambda p: p.physical.shared)),
    MetricSpec("kvledger_kv_headroom_bytes", "gauge", "bytes", "kv", ("engine", "pool", "view", "basis"),
               "Headroom: view=quota is capacity minus reserved (negative = overcommit); view=physical is free "
               "plus reclaimable. Different numbers, never one.", _headroom),
    MetricSpec("kvledger_kv_utilization_ratio", "gauge", "ratio", "kv", ("engine", "pool", "view", "basis"),
               "Share of the pool's capacity: view=physical is in-use blocks / capacity (reclaimable blocks count "
               "as available), view=quota is reserved / capacity (above 1: overcommit). The same meaning for every "
               "engine kind: the gauge a router should read instead of each engine's own usage gauge.", _utilization),
    MetricSpec("kvledger_kv_resident_tokens", "gauge", "tokens", "kv", EPB,
               "Tokens resident in the KV cache for running requests under the declared sharing rule.",
               _pool_measure(lambda p: p.resident_tokens)),
    MetricSpec("kvledger_kv_capacity_tokens", "gauge", "tokens", "kv", EP,
               "Tokens the pool can hold (blocks per layer group x block size).",
               _pool_value(lambda p: p.token_capacity)),
    MetricSpec("kvledger_kv_group_info", "gauge", "", "kv", ("engine", "pool", "group", "layer_type", "window_tokens"),
               f"A KV-cache group sharing the pool (a hybrid model's layers of one type: {', '.join(GROUP_KINDS)}) "
               "and the tokens its window or chunk spans; 1. A "
               "block belongs to one group at a time; every request holds blocks in every group.", _group_info),
    MetricSpec("kvledger_kv_group_in_use_blocks", "gauge", "blocks", "kv", ("engine", "pool", "group"),
               "Unique blocks of the pool the group's requests reference (exact; the groups' sum is at most the "
               "pool's in-use blocks). Never summed across pools.", _group_in_use),
    MetricSpec("kvledger_kv_group_reserved_blocks", "gauge", "blocks", "kv", ("engine", "pool", "group", "basis"),
               "The group's share of admitted requests' reservations: the sum of R_g(r), each request counted "
               "alone (a window group its window, a mamba group its state blocks, full attention every block).",
               _group_reserved),
    MetricSpec("kvledger_engine_reported_kv_used_blocks", "gauge", "blocks", "kv", EP,
               "The engine's own claim of used KV blocks, for consistency checks against unique in-use blocks.",
               _pool_value(lambda p: p.engine_reported_used_blocks)),
    MetricSpec("kvledger_engine_admission_estimate_tokens", "gauge", "tokens", "kv", EP,
               "The engine's own bet on the tokens its running requests will still add, which it admits against "
               "(SGLang: new_token_ratio x each running request's remaining output, clipped): a separate figure "
               "from the declared policy's reservation (kvledger_kv_reserved_bytes counts every cap), never mixed "
               "into it. From the SGLang plugin; absent elsewhere.", _pool_value(lambda p: p.engine_admission_estimate_tokens)),
    MetricSpec("kvledger_engine_new_token_ratio", "gauge", "ratio", "kv", EP,
               "The share of each running request's remaining output the engine expects it to use (SGLang's "
               "new_token_ratio: it decays while no request is retracted, and jumps back after a retraction). From "
               "the SGLang plugin; absent elsewhere.",
               _pool_value(lambda p: p.engine_new_token_ratio)),
    # Scheduler
    MetricSpec("kvledger_requests", "gauge", "requests", "scheduler", ("engine", "state"),
               "Requests by state: running, waiting (not admitted), preempted (admitted, holding a reservation).",
               _requests),
    MetricSpec("kvledger_iteration_budget_tokens", "gauge", "tokens", "scheduler", ("engine",),
               "Per-iteration token budget (max_num_batched_tokens): tokens computed per step, not resident.",
               _engine_value(lambda e: e.facts.budgets.max_num_batched_tokens)),
    MetricSpec("kvledger_iteration_tokens", "gauge", "tokens", "scheduler", ("engine",),
               "Tokens scheduled in the latest iteration.", _engine_value(lambda e: e.facts.budgets.iteration_tokens)),
    MetricSpec("kvledger_max_running_requests", "gauge", "requests", "scheduler", ("engine",),
               "Maximum concurrently running requests (max_num_seqs).",
               _engine_value(lambda e: e.facts.budgets.max_num_seqs)),
    MetricSpec("kvledger_max_model_len_tokens", "gauge", "tokens", "scheduler", ("engine",),
               "Maximum context length per request (max_model_len).",
               _engine_value(lambda e: e.facts.budgets.max_model_len)),
    MetricSpec("kvledger_admission_headroom_requests", "gauge", "requests", "scheduler", EPB,
               "More requests of the largest supported shape that fit under the quota and the work budget.",
               _admission_headroom),
    MetricSpec("kvledger_saturation_ratio", "gauge", "ratio", "scheduler", ("engine", "pool", "constraint", "basis"),
               "How close the engine is to each limit that stops it admitting work: constraint=kv_quota is reserved / "
               "capacity, kv_physical in-use / capacity (reclaimable blocks count as free), sequences running / "
               "max_num_seqs, token_budget scheduled tokens per iteration / max_num_batched_tokens (the engine's "
               "recent iterations where it states them, else its latest). The engine's own constraints (sequences, "
               "token_budget) carry no pool. Absent where an input is unknown.", _saturation),
    MetricSpec("kvledger_saturation_binding", "gauge", "", "scheduler", ("engine", "constraint"),
               "1 for the constraint that binds now, 0 for the others that took part: the largest saturation ratio "
               "(exact or lower bound) among the constraints the engine's admission enforces (reserve-cap: kv_quota, "
               "dynamic: kv_physical, both when unknown; sequences and token_budget always); ties go to kv_quota, "
               "kv_physical, sequences, token_budget in that order.", _binding),
    MetricSpec("kvledger_extra_context_slots", "gauge", "", "scheduler", ("engine", "purpose"),
               "Extra contexts of running requests by purpose: speculative lookahead slots and extra branches (n-1).",
               _slots),
    MetricSpec("kvledger_preemptions_total", "counter", "", "scheduler", ("engine",),
               "Preemptions reported by the engine.", _counter("preemptions")),
    MetricSpec("kvledger_preempted_tokens_total", "counter", "tokens", "scheduler", EP,
               "Computed tokens the engine threw away by preempting requests (to be recomputed): the recompute tax "
               "of saturation. From in-engine ledgers; absent where the engine does not say.", _preempted_tokens),
    MetricSpec("kvledger_reservation_overflows_total", "counter", "", "scheduler", ("engine",),
               "Requests whose output exceeded an estimated bound.", _counter("reservation_overflows")),
    MetricSpec("kvledger_admission_rechecks_total", "counter", "", "scheduler", ("engine", "result"),
               "Admission re-checks after a request raised its bound, by result.", _rechecks),
    MetricSpec("kvledger_prefix_cache_queried_tokens_total", "counter", "tokens", "scheduler", ("engine",),
               "Prompt tokens looked up in the prefix cache at admission.",
               _counter("prefix_cache_queried_tokens")),
    MetricSpec("kvledger_prefix_cache_hit_tokens_total", "counter", "tokens", "scheduler", ("engine",),
               "Prompt tokens found in the prefix cache (not recomputed).", _counter("prefix_cache_hit_tokens")),
    MetricSpec("kvledger_kv_host_offloaded_tokens_total", "counter", "tokens", "scheduler", ("engine",),
               "Tokens the engine moved from its GPU KV pool to a host (CPU) tier (SGLang HiCache evictions); "
               "kept there for a later load back, not lost.", _counter("host_offloaded_tokens")),
    MetricSpec("kvledger_kv_host_loaded_tokens_total", "counter", "tokens", "scheduler", ("engine",),
               "Tokens the engine loaded back from a host (CPU) tier into its GPU KV pool instead of recomputing them.",
               _counter("host_loaded_tokens")),
    MetricSpec("kvledger_reservation_leaks_total", "counter", "", "scheduler", ("engine",),
               "Reservations found with no live request.", _counter("reservation_leaks")),
    # Tenants
    MetricSpec("kvledger_tenant_reserved_bytes", "gauge", "bytes", "tenant", ("engine", "tenant"),
               "KV bytes claimed by a tenant's admitted requests, per-request rule (what a quota must cover).",
               _tenants(lambda t: t.reserved_bytes)),
    MetricSpec("kvledger_tenant_quota_bytes", "gauge", "bytes", "tenant", ("engine", "tenant"),
               "A tenant's configured KV quota.", _tenants(lambda t: t.quota_bytes)),
    MetricSpec("kvledger_tenant_requests", "gauge", "requests", "tenant", ("engine", "tenant", "state"),
               "A tenant's requests by state.", _tenant_requests),
    # GPU
    MetricSpec("kvledger_gpu_memory_total_bytes", "gauge", "bytes", "gpu", ("gpu",),
               "Device memory total (NVML).", _gpu_value(lambda g: g.total_bytes)),
    MetricSpec("kvledger_gpu_memory_used_bytes", "gauge", "bytes", "gpu", ("gpu",),
               "Device memory used (NVML; v2 excludes driver-reserved memory).", _gpu_value(lambda g: g.used_bytes)),
    MetricSpec("kvledger_gpu_memory_free_bytes", "gauge", "bytes", "gpu", ("gpu",),
               "Device memory free (NVML).", _gpu_value(lambda g: g.free_bytes)),
    MetricSpec("kvledger_gpu_memory_driver_reserved_bytes", "gauge", "bytes", "gpu", ("gpu",),
               "Device memory reserved by the driver and firmware (NVML memory v2).",
               _gpu_value(lambda g: g.driver_reserved_bytes)),
    MetricSpec("kvledger_gpu_up", "gauge", "", "gpu", ("gpu",),
               "1 when the GPU answers NVML, 0 when it is lost or failing.",
               _gpu_value(lambda g: 1.0 if g.up else 0.0, only_up=False)),
    MetricSpec("kvledger_gpu_info", "gauge", "", "gpu", ("gpu", "uuid", "name", "driver_version", "mig"),
               "GPU identity (value 1).", _gpu_info),
    MetricSpec("kvledger_gpu_process_memory_bytes", "gauge", "bytes", "gpu", ("gpu", "engine"),
               "Device memory held by an engine's processes (NVML per-process figures).", _gpu_process),
    MetricSpec("kvledger_gpu_budget_bytes", "gauge", "bytes", "gpu", ("gpu", "engine", "category", "provenance"),
               "Declared device budget terms: weights, workspace, runtime_buffers, reserve (headroom, not an "
               "allocation) and kv_pool, with where each figure comes from (provenance: measured, configured or "
               "estimate).", _budget),
    MetricSpec("kvledger_gpu_budget_slack_bytes", "gauge", "bytes", "gpu", ("gpu",),
               "Device total minus every declared budget term including the reserve: the budget inequality "
               "weights + workspace + runtime_buffers + reserve + kv_pool <= total holds when >= 0.",
               _gpu_slack),
    MetricSpec("kvledger_gpu_memory_unaccounted_bytes", "gauge", "bytes", "gpu", ("gpu", "basis"),
               "NVML used minus the allocations the engines on the GPU declared (weights, workspace, runtime "
               "buffers, KV pool).", _unaccounted),
    MetricSpec("kvledger_engine_reported_memory_bytes", "gauge", "bytes", "gpu", ("engine", "memory_type"),
               "Memory an engine's runtime reports holding, by memory_type (gpu, cpu, pinned), as the engine counts "
               "it (TensorRT-LLM's runtime memory counters): shown beside the device budget, never added to it.",
               _reported_memory),
    # Host
    MetricSpec("kvledger_host_buffer_bytes", "gauge", "bytes", "host", ("engine",),
               "Host output buffer bytes held by the engine.", _engine_value(lambda e: e.host.output_buffer_bytes)),
    MetricSpec("kvledger_host_buffer_limit_bytes", "gauge", "bytes", "host", ("engine", "limit"),
               "Limit of the host output buffer; limit says hard cap or estimate.", _host_limit("output_buffer_limit")),
    MetricSpec("kvledger_network_queue_depth", "gauge", "", "host", ("engine",),
               "Application network queue depth (responses waiting to be sent).",
               _engine_value(lambda e: e.host.network_queue_depth)),
    MetricSpec("kvledger_network_queue_limit", "gauge", "", "host", ("engine", "limit"),
               "Limit of the application network queue; limit says hard cap or estimate.",
               _host_limit("network_queue_limit")),
    MetricSpec("kvledger_network_socket_queue_bytes", "gauge", "bytes", "host", ("engine", "direction"),
               "Kernel socket queue bytes of the engine's serving port (/proc/net/tcp and tcp6).", _socket_queue),
    # Info and health
    MetricSpec("kvledger_policy_info", "gauge", "", "info",
               ("engine", "sharing", "admission", "overflow", "tenant_rule"),
               "The declared accounting policy (value 1): sharing rule, the engine's admission behaviour and "
               "overflow handling; tenant figures always use the per-request rule.", _policy_info),
    MetricSpec("kvledger_engine_info", "gauge", "", "info", ("engine", "kind", "version", "source"),
               "Engine identity (value 1): kind is the engine kind of the configuration (vllm, ledger, ...), the "
               "only meaning the label kind has.", _engine_info),
    MetricSpec("kvledger_build_info", "gauge", "", "info", ("version", "revision", "python_version"),
               "kvledger build (value 1): its version, the git revision it was built from (unknown when the build "
               "had none) and the Python running it.", _build_info),
    MetricSpec("kvledger_config_last_reload_successful", "gauge", "", "health", (),
               "1 when the latest load of the configuration file (at start or on SIGHUP) succeeded; 0 when a "
               "reload failed and the daemon kept running the previous configuration.",
               _config_reload(lambda c: 1.0 if c.successful else 0.0)),
    MetricSpec("kvledger_config_last_reload_success_timestamp_seconds", "gauge", "seconds", "health", (),
               "Unix time of the latest successful load of the configuration file.",
               _config_reload(lambda c: c.success_at)),
    MetricSpec("kvledger_source_up", "gauge", "", "health", ("engine", "source"),
               "1 when the source's latest poll succeeded.", _health(lambda h: 1.0 if h.up else 0.0)),
    MetricSpec("kvledger_source_last_success_timestamp_seconds", "gauge", "seconds", "health", ("engine", "source"),
               "Unix time of the source's latest successful poll (an engine's facts also accounted and rendered).",
               _health(lambda h: h.last_success)),
    MetricSpec("kvledger_source_duration_seconds", "gauge", "seconds", "health", ("engine", "source"),
               "Duration of the source's latest completed poll.", _health(lambda h: h.duration_seconds)),
    MetricSpec("kvledger_ledger_document_age_seconds", "gauge", "seconds", "health", ("engine", "source"),
               "Age of the engine's kvledger/v1 document at its latest read: the server's Date less the "
               "document's published_at (the writer's clock). A document showing running requests that is older "
               f"than {MAX_DOCUMENT_AGE:g} s is not exact: its source is down with reason stale.",
               _health(lambda h: h.document_age_seconds)),
    MetricSpec("kvledger_source_refresh_interval_steps", "gauge", "", "health", ("engine", "source"),
               "Engine steps between the engine's own refreshes of the figures this source reads: SGLang "
               "refreshes its KV and request gauges at prefill batches and every --decode-log-interval decode "
               "steps (default 40), so the pool figures from its /metrics can lag the pool by up to this many "
               "decode steps (running requests x steps tokens). 1: every step. Absent: every read is current, "
               "or the interval is unknown.",
               _health(lambda h: h.refresh_interval_steps)),
    MetricSpec("kvledger_source_errors_total", "counter", "", "health", ("engine", "source", "reason"),
               "Failed polls by reason.", _source_errors),
    MetricSpec("kvledger_kv_events_total", "counter", "", "health", ("engine", "type"),
               "KV cache events received, by type.", _kv_events),
    MetricSpec("kvledger_kv_events_lost_total", "counter", "", "health", ("engine",),
               "KV cache event batches lost (sequence gaps not replayed).",
               _engine_value(lambda e: e.facts.kv_events_lost)),
    MetricSpec("kvledger_ledger_invariant_violations_total", "counter", "", "health", ("engine", "check"),
               "Polls whose facts violated an accounting invariant, by check.", _invariants),
    MetricSpec("kvledger_label_values_limited_total", "counter", "", "health", ("engine", "label", "action"),
               "Label values from engine data shortened (too long) or dropped (over the per-engine limit), "
               "counted once per poll that carried them.", _labels_limited),
)

#: the stable families (as kube-state-metrics keeps its STABLE list): the contract of
#: docs/design.md and what the dashboards, alerts and routers are told to read. A stable family
#: or one of its labels is renamed only with CHANGELOG.md's "Renamed" entry and RENAMED_* above
#: (tests/test_metric_stability.py); every other family is experimental.
STABLE: frozenset[str] = frozenset({
    # KV pool
    "kvledger_kv_capacity_bytes", "kvledger_kv_capacity_blocks", "kvledger_kv_block_size_tokens",
    "kvledger_kv_reserved_bytes", "kvledger_kv_reserved_blocks", "kvledger_kv_pending_growth_bytes",
    "kvledger_kv_allocated_bytes", "kvledger_kv_in_use_bytes", "kvledger_kv_reclaimable_bytes", "kvledger_kv_free_bytes",
    "kvledger_kv_blocks", "kvledger_kv_block_references", "kvledger_kv_shared_blocks", "kvledger_kv_headroom_bytes",
    "kvledger_kv_utilization_ratio", "kvledger_kv_resident_tokens", "kvledger_kv_capacity_tokens",
    "kvledger_engine_reported_kv_used_blocks",
    # Scheduler
    "kvledger_requests", "kvledger_iteration_budget_tokens", "kvledger_iteration_tokens", "kvledger_max_running_requests",
    "kvledger_admission_headroom_requests", "kvledger_saturation_ratio", "kvledger_saturation_binding",
    "kvledger_extra_context_slots", "kvledger_preemptions_total", "kvledger_preempted_tokens_total",
    "kvledger_reservation_overflows_total", "kvledger_admission_rechecks_total", "kvledger_reservation_leaks_total",
    # Tenants
    "kvledger_tenant_reserved_bytes", "kvledger_tenant_quota_bytes", "kvledger_tenant_requests",
    # GPU
    "kvledger_gpu_memory_total_bytes", "kvledger_gpu_memory_used_bytes", "kvledger_gpu_memory_free_bytes",
    "kvledger_gpu_memory_driver_reserved_bytes", "kvledger_gpu_up", "kvledger_gpu_info", "kvledger_gpu_process_memory_bytes",
    "kvledger_gpu_budget_bytes", "kvledger_gpu_memory_unaccounted_bytes",
    # Host
    "kvledger_host_buffer_bytes", "kvledger_host_buffer_limit_bytes", "kvledger_network_queue_depth",
    "kvledger_network_queue_limit", "kvledger_network_socket_queue_bytes",
    # Info and health
    "kvledger_policy_info", "kvledger_engine_info", "kvledger_build_info", "kvledger_config_last_reload_successful",
    "kvledger_config_last_reload_success_timestamp_seconds", "kvledger_source_up",
    "kvledger_source_last_success_timestamp_seconds", "kvledger_source_duration_seconds", "kvledger_source_errors_total",
    "kvledger_kv_events_total", "kvledger_kv_events_lost_total", "kvledger_ledger_invariant_violations_total",
})

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in CATALOG}
