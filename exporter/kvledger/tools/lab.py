"""The cache lab: a working set fitting, or failing to fit, an LRU capacity.

It replays a repeating sequence of S identifiers through an LRU cache of capacity C.
This illustrates capacity versus working set only. It is NOT a model of safe KV
eviction: an engine can only drop KV blocks of live requests by recomputing them (or
another correctness-preserving policy); it may evict only blocks no request references.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_REQUESTS = 4096


@dataclass(frozen=True)
class Step:
    index: int
    key: int
    hit: bool
    evicted: int | None
    cache: tuple[int, ...]  # least recently used first


@dataclass(frozen=True)
class LabResult:
    steps: tuple[Step, ...]

    @property
    def hits(self) -> int:
        return sum(s.hit for s in self.steps)

    @property
    def misses(self) -> int:
        return len(self.steps) - self.hits

    @property
    def evictions(self) -> int:
        return sum(s.evicted is not None for s in self.steps)


def run_lab(capacity: int, working_set: int, requests: int = 16) -> LabResult:
    if capacity < 1:
        raise ValueError(f"--capacity must be at least 1, got {capacity}")
    if working_set < 1:
        raise ValueError(f"--working-set must be at least 1, got {working_set}")
    if not 1 <= requests <= MAX_REQUESTS:
        raise ValueError(f"--requests must be between 1 and {MAX_REQUESTS}, got {requests}")
    cache: OrderedDict[int, None] = OrderedDict()
    steps = []
    for i in range(requests):
        key = i % working_set
        evicted = None
        hit = key in cache
        if hit:
            cache.move_to_end(key)
        else:
            if len(cache) >= capacity:
                evicted, _ = cache.popitem(last=False)
            cache[key] = None
        steps.append(Step(i + 1, key, hit, evicted, tuple(cache)))
    return LabResult(tuple(steps))


def format_lab(result: LabResult, capacity: int, working_set: int) -> str:
    lines = [f"LRU capacity {capacity}, working set {working_set} (repeating 0..{working_set - 1})"]
    for s in result.steps:
        what = "hit " if s.hit else "miss"
        ev = f", evicted {s.evicted}" if s.evicted is not None else ""
        lines.append(f"step {s.index:4d}: request {s.key:4d}  {what}{ev}  cache={list(s.cache)}")
    lines.append(f"totals: hits={result.hits} misses={result.misses} evictions={result.evictions} of {len(result.steps)} requests")
    return "\n".join(lines)
