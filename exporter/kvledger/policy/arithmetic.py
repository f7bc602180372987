"""Arithmetic the formulas share: ceiling division, ratios of a capacity, sums of optional values."""

from __future__ import annotations

from kvledger.domain.measure import Measure
from kvledger_engine.reservation import ceil_div as ceil_div  # written once, beside R(r)

# ---------------------------------------------------------------- measures


def ratio_of_capacity(blocks: Measure | None, capacity: int) -> Measure | None:
    """blocks / C, bounds kept on their sides (physical: in_use / C, the share of the pool
    requests hold, reclaimable blocks counting as available; quota: reserved / C, above 1
    when admitted requests may claim more than the pool)."""
    if blocks is None:
        return None
    return Measure(*(None if v is None else v / capacity for v in (blocks.exact, blocks.lower, blocks.upper)))


def _add(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b
