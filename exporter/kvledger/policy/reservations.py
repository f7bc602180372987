"""Reservations: what a request may claim (R(r)), what it holds, and the per-request columns of a pool."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import eq
from typing import Any

import numpy as np

from kvledger.model.facts import (
    PoolFacts,
    RequestFacts,
)
from kvledger.model.request_table import RequestTable
from kvledger_engine.reservation import reservation_blocks as engine_reservation_blocks
from kvledger_engine.reservation import window_blocks as window_blocks

# ---------------------------------------------------------------- per request


def reservation_blocks(
    prompt_tokens: Any,
    max_output_tokens: Any,
    block_size: int,
    *,
    max_model_len: int | None,
    contexts: Any = 1,
    speculative_slots: Any = 0,
    sliding_window: int | None = None,
    in_flight_tokens: int = 1,
) -> Any:
    """R(r) (``kvledger_engine.reservation``, where the formula is written once) over ints
    (returns an int) or, element-wise, numpy integer arrays (returns an array)."""
    r = engine_reservation_blocks(
        prompt_tokens,
        max_output_tokens,
        block_size,
        max_model_len=max_model_len,
        contexts=contexts,
        speculative_slots=speculative_slots,
        sliding_window=sliding_window,
        in_flight_tokens=in_flight_tokens,
        minimum=np.minimum,
        maximum=np.maximum,
    )
    return r if isinstance(r, np.ndarray) else int(r)


def held_blocks(req: RequestFacts) -> int:
    """held(r): blocks the request references now."""
    return len(req.block_ids) if req.block_ids is not None else req.blocks_held


# ---------------------------------------------------------------- pool arithmetic


def _split_by_pool(table: RequestTable, pools: Sequence[PoolFacts]) -> dict[str, RequestTable]:
    """The requests of each pool (one table per pool id of ``pools``)."""
    names = set(table.pools)
    if len(names) <= 1:
        only = next(iter(names), pools[0].id if pools else "")
        return {p.id: table if p.id == only else table.select(np.zeros(len(table), dtype=bool)) for p in pools}
    codes = {p.id: i for i, p in enumerate(pools)}
    index = np.fromiter(map(codes.get, table.pools, repeat(-1)), dtype=np.int64, count=len(table))
    return {p.id: table.select(index == i) for i, p in enumerate(pools)}


_STATE_CODE = {"running": 0, "waiting": 1, "preempted": 2}


@dataclass(slots=True)
class RequestColumns:
    """The requests of one pool as numpy columns, with R(r) and held(r) computed once."""

    table: RequestTable
    reservation: np.ndarray  # R(r), blocks
    held: np.ndarray  # held(r), blocks
    admitted: np.ndarray  # running or preempted
    running: np.ndarray
    estimate: np.ndarray  # output bound is an estimate
    computed: np.ndarray  # computed tokens
    contexts: np.ndarray  # n
    speculative: np.ndarray  # k

    @property
    def tenants(self) -> list[str | None]:
        return self.table.tenants

    @property
    def preempted(self) -> np.ndarray:
        return np.asarray(self.admitted & ~self.running)

    @property
    def waiting(self) -> np.ndarray:
        return np.asarray(~self.admitted)

    @property
    def claimed(self) -> np.ndarray:
        """max(R(r), held(r)): what one request claims, counted alone (per-request rule)."""
        return np.asarray(np.maximum(self.reservation, self.held))

    @property
    def growth(self) -> np.ndarray:
        """max(0, R(r) - held(r)): the pending growth of one request."""
        return np.asarray(np.maximum(0, self.reservation - self.held))


def request_columns(requests: Sequence[RequestFacts], pool: PoolFacts, max_model_len: int | None) -> RequestColumns:
    table = RequestTable.from_requests(requests)
    n = len(table)
    states = np.fromiter(map(_STATE_CODE.__getitem__, table.states), dtype=np.int8, count=n)
    contexts = table.column("contexts")
    speculative = table.column("speculative_slots")
    return RequestColumns(
        table=table,
        reservation=reservation_blocks(
            table.column("prompt_tokens"),
            table.column("max_output_tokens"),
            pool.block_size,
            max_model_len=max_model_len,
            contexts=contexts,
            speculative_slots=speculative,
            sliding_window=pool.sliding_window,
        )
        if n
        else np.zeros(0, dtype=np.int64),
        held=table.held(),
        admitted=states != 1,
        running=states == 0,
        estimate=np.fromiter(map(eq, table.output_bounds, repeat("estimate")), dtype=bool, count=n)
        if "estimate" in table.output_bounds
        else np.zeros(n, dtype=bool),
        computed=table.column("computed_tokens"),
        contexts=contexts,
        speculative=speculative,
    )
