"""Bounds on the label values that engine data adds to the exported series.

An engine's document names pools, tenants, its kind and version; each becomes a label
value. A broken or hostile engine could name 100,000 tenants or send a 1 MB version
string, so before accounting every engine's facts pass through ``limit_labels``:

- a label value longer than ``label_value_length`` characters is shortened to a prefix
  plus ``~`` and 8 hex digits of its SHA-256 (distinct values stay distinct);
- tenants past ``tenants_per_engine`` are dropped from the tenant series (sorted by name,
  configured tenants first; their requests still count in the engine's totals);
- more than ``pools_per_engine`` pools make the engine's facts invalid (a partial set of
  pools would misstate capacity and the GPU budget): ``LabelLimitError``.

What was shortened or dropped is returned as counts by label, which the collector adds
to ``kvledger_label_values_limited_total{engine, label, action}``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from kvledger.config.types import LimitsConfig
from kvledger.domain.facts import EngineFacts

LimitCounts = dict[tuple[str, str], int]  # (label, action) -> distinct values


class LabelLimitError(ValueError):
    """The facts name more of something than the limits allow; ``counts`` says what."""

    def __init__(self, message: str, counts: LimitCounts) -> None:
        super().__init__(message)
        self.counts = counts


def shorten(value: str, limit: int) -> str:
    """``value`` if it fits in ``limit`` characters, else a prefix and a hash suffix."""
    if len(value) <= limit:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{value[: limit - 9]}~{digest}"


def limit_labels(facts: EngineFacts, limits: LimitsConfig) -> tuple[EngineFacts, LimitCounts]:
    """A copy of ``facts`` within ``limits`` (``facts`` itself when nothing needed to change)."""
    n = limits.label_value_length
    counts: LimitCounts = {}
    changes: dict[str, Any] = {}  # EngineFacts field -> its new value, for dataclasses.replace
    if len(facts.pools) > limits.pools_per_engine:
        counts[("pool", "dropped")] = len(facts.pools) - limits.pools_per_engine
        raise LabelLimitError(
            f"{len(facts.pools)} pools, more than the limit of {limits.pools_per_engine} (limits.pools_per_engine)",
            counts,
        )
    for attr in ("kind", "version"):
        value = getattr(facts, attr)
        if isinstance(value, str) and len(value) > n:
            changes[attr] = shorten(value, n)
            counts[(attr, "shortened")] = 1

    long_pools = {p.id for p in facts.pools if len(p.id) > n}
    tenants = facts.tenants
    if len(tenants) > limits.tenants_per_engine:
        kept = sorted(tenants, key=lambda t: t.name)[: limits.tenants_per_engine]
        counts[("tenant", "dropped")] = len(tenants) - len(kept)
        keep = {id(t) for t in kept}
        tenants = [t for t in tenants if id(t) in keep]
        changes["tenants"] = tenants
    long_tenants = {t.name for t in tenants if len(t.name) > n}
    if long_pools:
        counts[("pool", "shortened")] = len(long_pools)
        changes["pools"] = [dataclasses.replace(p, id=shorten(p.id, n)) if p.id in long_pools else p for p in facts.pools]
    if long_tenants:
        counts[("tenant", "shortened")] = len(long_tenants)
        changes["tenants"] = [
            dataclasses.replace(t, name=shorten(t.name, n)) if t.name in long_tenants else t for t in tenants
        ]
    if (long_pools or long_tenants) and facts.requests is not None:
        changes["requests"] = [
            dataclasses.replace(
                r,
                pool=shorten(r.pool, n) if r.pool in long_pools else r.pool,
                tenant=shorten(r.tenant, n) if r.tenant is not None and r.tenant in long_tenants else r.tenant,
            )
            if r.pool in long_pools or (r.tenant is not None and r.tenant in long_tenants)
            else r
            for r in facts.requests
        ]
    if not changes:
        return facts, counts
    return dataclasses.replace(facts, **changes), counts
