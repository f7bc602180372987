"""The JSON view of the Accounts (opt-in on the server: it names tenants), also used by
`kvledger snapshot --json`. It reuses the catalogue so it shows exactly what /metrics shows."""

from __future__ import annotations

from typing import Any

from kvledger.collect.collector import Collector
from kvledger.model.accounts import Accounts
from kvledger.output.catalog import CATALOG


def accounts_to_json(accounts: Accounts | None, collector: Collector | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"taken_at": None, "sharing": None, "metrics": {}, "sources": []}
    if accounts is not None:
        out["taken_at"] = accounts.taken_at
        out["sharing"] = accounts.sharing
        for spec in CATALOG:
            samples = [
                {"labels": dict(zip(spec.labels, labels, strict=True)), "value": value}
                for labels, value in spec.samples(accounts)
            ]
            if samples:
                out["metrics"][spec.name] = samples
    if collector is not None:
        for health, message in collector.health():
            out["sources"].append(
                {
                    "engine": health.engine,
                    "source": health.source,
                    "up": health.up,
                    "reason": health.reason,
                    "message": message,
                    "last_success": health.last_success,
                    "duration_seconds": health.duration_seconds,
                }
            )
    return out
