"""The JSON view of the Accounts (opt-in on the server: it names tenants), also used by
`kvledger snapshot --json`. It reuses the catalogue so it shows exactly what /metrics shows."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvledger.domain.accounts import Accounts
from kvledger.domain.facts import SourceHealth
from kvledger.output.catalog import CATALOG


def accounts_to_json(accounts: Accounts | None, health: Iterable[tuple[SourceHealth, str | None]] = ()) -> dict[str, Any]:
    """``health``: each source's health and message (the collector's ``health()``)."""
    out: dict[str, Any] = {"taken_at": None, "sharing": None, "metrics": {}, "sources": []}
    if accounts is not None:
        out["taken_at"] = accounts.taken_at
        out["sharing"] = accounts.sharing
        for spec in CATALOG:
            samples = [{"labels": labels, "value": value} for labels, value in spec.labelled(accounts)]
            if samples:
                out["metrics"][spec.name] = samples
    for source, message in health:
        out["sources"].append(
            {
                "engine": source.engine,
                "source": source.source,
                "up": source.up,
                "reason": source.reason,
                "message": message,
                "last_success": source.last_success,
                "duration_seconds": source.duration_seconds,
            }
        )
    return out
