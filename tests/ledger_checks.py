"""Helpers shared by the ledger and simulator tests: derive pool state from block_refs."""

from __future__ import annotations

from collections import Counter
from typing import Any


def derived_pool_state(pool: dict[str, Any]) -> dict[str, int]:
    refs = pool["block_refs"]
    in_use = sum(1 for _, count, _ in refs if count > 0)
    reclaimable = sum(1 for _, count, cached in refs if count == 0 and cached)
    return {
        "in_use": in_use,
        "reclaimable": reclaimable,
        "free": pool["num_blocks"] - in_use - reclaimable,
        "references": sum(count for _, count, _ in refs),
        "shared": sum(1 for _, count, _ in refs if count > 1),
    }


def assert_consistent(doc: dict[str, Any], *, leaks_possible: bool = False) -> None:
    """Summary fields agree with block_refs; request block_ids agree with reference counts."""
    for pool in doc["pools"]:
        derived = derived_pool_state(pool)
        assert pool["blocks"] == {k: derived[k] for k in ("in_use", "reclaimable", "free")}
        assert pool["references"] == derived["references"]
        assert pool["shared"] == derived["shared"]
        assert derived["references"] >= derived["in_use"] >= derived["shared"]
        held = Counter(b for r in doc["requests"] if r["pool"] == pool["id"] for b in r["block_ids"])
        counts = {b: c for b, c, _ in pool["block_refs"] if c > 0}
        if leaks_possible:
            assert all(counts.get(b, 0) >= c for b, c in held.items())
        else:
            assert dict(held) == counts
    for r in doc["requests"]:
        assert r["blocks_held"] == len(r["block_ids"])
