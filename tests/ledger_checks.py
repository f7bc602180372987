"""Helpers shared by the ledger, simulator and policy tests: R(r) of docs/design.md §2 in
plain integers, and a kvledger/v1 document's pool summaries checked against counts made
independently, block by block and request by request."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any


def design_reservation(p: int, o: int, b: int, *, max_model_len: int, n: int, k: int, window: int | None) -> int:
    """R(r) of docs/design.md §2, in plain integers:
    T = ceil(min(P + O + k, L) / B); R = T + (n - 1) * (T - floor(P / B));
    with a window W: R = min(R, n * (ceil(W / B) + 1)).
    floor(P / B) is taken at most T: a prompt longer than L (an engine rejects it) shares
    at most the T blocks there are (the contract does not say; without it R could fall below T)."""
    t = math.ceil(min(p + o + k, max_model_len) / b)
    r = t + (n - 1) * (t - min(p // b, t))
    if window is not None:
        r = min(r, n * (math.ceil(window / b) + 1))
    return r


def walked_pool_state(pool: dict[str, Any]) -> dict[str, int]:
    """The pool's state from its per-block detail alone: every block id of the pool walked
    once (a block absent from block_refs has no reference and no cached data)."""
    detail: dict[int, tuple[int, bool]] = {}
    for block, count, cached in pool["block_refs"]:
        assert 0 <= block < pool["num_blocks"] and block not in detail, f"block_refs entry {block}"
        detail[block] = (count, cached)
    state = {"in_use": 0, "reclaimable": 0, "free": 0, "references": 0, "shared": 0}
    for block in range(pool["num_blocks"]):
        count, cached = detail.get(block, (0, False))
        if count > 0:
            state["in_use"] += 1
        elif cached:
            state["reclaimable"] += 1
        else:
            state["free"] += 1
        state["references"] += count
        if count >= 2:
            state["shared"] += 1
    return state


def held_by_requests(doc: dict[str, Any], pool_id: str) -> Counter[int]:
    """How many requests name each block of the pool in their block_ids."""
    return Counter(b for r in doc["requests"] if r["pool"] == pool_id for b in r["block_ids"])


def assert_consistent(doc: dict[str, Any], *, leaks_possible: bool = False) -> None:
    """The pool summaries (maintained incrementally by the ledger) agree with the block walk
    and with the requests' own block lists.

    Without leaks every reference belongs to a request: references, in_use and shared are
    counted from the requests' block_ids (pairs, distinct blocks, blocks named twice or
    more). With leaks (lost releases not yet swept) a block may hold references no request
    names, so the requests' counts are lower bounds, block by block.
    """
    for pool in doc["pools"]:
        walked = walked_pool_state(pool)
        assert pool["blocks"] == {k: walked[k] for k in ("in_use", "reclaimable", "free")}
        assert (pool["references"], pool["shared"]) == (walked["references"], walked["shared"])
        held = held_by_requests(doc, pool["id"])
        counts = {b: c for b, c, _ in pool["block_refs"] if c > 0}
        by_requests = {
            "references": sum(held.values()),
            "in_use": len(held),
            "shared": sum(1 for n in held.values() if n >= 2),
        }
        if leaks_possible:
            assert all(counts.get(b, 0) >= n for b, n in held.items())
            assert pool["references"] >= by_requests["references"]
            assert pool["blocks"]["in_use"] >= by_requests["in_use"]
            assert pool["shared"] >= by_requests["shared"]
        else:
            assert dict(held) == counts
            assert pool["references"] == by_requests["references"]
            assert pool["blocks"]["in_use"] == by_requests["in_use"]
            assert pool["shared"] == by_requests["shared"]
    for r in doc["requests"]:
        assert r["blocks_held"] == len(r["block_ids"])
