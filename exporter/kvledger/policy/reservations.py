"""Reservations: what a request may claim (R(r)), what it holds, and the per-request columns of a pool."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np

from kvledger.domain.facts import (
    GROUPS,
    AdmissionEstimate,
    GroupHolding,
    KvGroupFacts,
    PoolFacts,
    RequestFacts,
)
from kvledger.domain.limits import MAX_RESERVATION
from kvledger.domain.request_table import RequestTable
from kvledger_engine.reservation import ceil_div
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


@dataclass(frozen=True, slots=True)
class GroupShape:
    """A layer type's part of the block pool (the planner's layer types; a pool's stated
    KV-cache groups, ``group_shape``): its window (None: full attention), its groups, its
    block size when not the pool's, and for a state type the blocks one sequence's state
    takes (None: attention, which takes blocks by tokens)."""

    window: int | None
    groups: int
    block_size: int | None = None
    state_blocks: int | None = None


def request_blocks(
    groups: Sequence[GroupShape],
    prompt_tokens: Any,
    output_tokens: Any,
    block_size: int,
    max_model_len: int | None,
    *,
    contexts: Any = 1,
    speculative_slots: Any = 0,
    in_flight_tokens: int = 1,
) -> Any:
    """Blocks one request takes from the shared pool: R(r) of every layer group, summed
    (each group keeps its own block table; a window group holds at most its window)."""
    total: Any = 0
    for g in groups:
        if g.state_blocks is not None:
            total = total + g.groups * np.maximum(1, contexts) * g.state_blocks
            continue
        r = reservation_blocks(
            prompt_tokens,
            output_tokens,
            g.block_size or block_size,
            max_model_len=max_model_len,
            contexts=contexts,
            speculative_slots=speculative_slots,
            sliding_window=g.window,
            in_flight_tokens=in_flight_tokens,
        )
        total = total + g.groups * r
    return total


#: the shape of a stated KV-cache group by how its kind holds blocks (``GROUPS``: a new group
#: kind is one entry there, this formula chosen by its holding): a window group (a sliding
#: window, a local-attention chunk: a chunk of C tokens never needs more than a window of C)
#: holds at most the blocks its span covers, a state group its state blocks per context,
#: a tokens group (full attention) every block
GROUP_SHAPES: dict[GroupHolding, Callable[[KvGroupFacts], GroupShape]] = {
    "tokens": lambda group: GroupShape(None, 1),
    "window": lambda group: GroupShape(group.window, 1),
    "state": lambda group: GroupShape(None, 1, state_blocks=group.state_blocks or 1),
}


def group_shape(group: KvGroupFacts) -> GroupShape:
    """The shape of one stated KV-cache group (``GROUP_SHAPES`` of its kind's holding)."""
    return GROUP_SHAPES[GROUPS[group.kind]](group)


def cap_blocks(pool: PoolFacts, max_model_len: int) -> int:
    """Blocks one request at max_model_len may take from the pool: ceil(L / B), or with
    stated KV-cache groups the sum of every group's reservation for a one-token prompt
    whose output fills L (a window or chunk group its span, a state group its states)."""
    if not pool.groups:
        return int(ceil_div(max_model_len, pool.block_size))
    shapes = [group_shape(g) for g in pool.groups]
    return int(request_blocks(shapes, 1, max_model_len - 1, pool.block_size, max_model_len))


def group_cap_blocks(group: KvGroupFacts, block_size: int, max_model_len: int) -> int:
    """``cap_blocks`` of one group."""
    return int(request_blocks([group_shape(group)], 1, max_model_len - 1, block_size, max_model_len))


# ---------------------------------------------------------------- pool arithmetic


def _split_by_pool(table: RequestTable, pools: Sequence[PoolFacts]) -> dict[str, RequestTable]:
    """The requests of each pool (one table per pool id of ``pools``)."""
    names = table.pool_names()
    if len(names) <= 1:
        only = next(iter(names), pools[0].id if pools else "")
        return {p.id: table if p.id == only else table.select(np.zeros(len(table), dtype=bool)) for p in pools}
    codes = {p.id: i for i, p in enumerate(pools)}
    index = np.fromiter(map(codes.get, table.pools, repeat(-1)), dtype=np.int64, count=len(table))
    return {p.id: table.select(index == i) for i, p in enumerate(pools)}


#: a request's state as a code (``RequestColumns.states``): running 0, waiting 1, preempted 2
STATE_CODES = {"running": 0, "waiting": 1, "preempted": 2}


@dataclass(slots=True)
class RequestColumns:
    """The requests of one pool as numpy columns, with R(r) and held(r) computed once."""

    table: RequestTable
    reservation: np.ndarray  # R(r), blocks
    held: np.ndarray  # held(r), blocks
    states: np.ndarray  # each request's state as its code in STATE_CODES (int8)
    admitted: np.ndarray  # running or preempted
    running: np.ndarray
    estimate: np.ndarray  # output bound is an estimate
    computed: np.ndarray  # computed tokens
    contexts: np.ndarray  # n
    speculative: np.ndarray  # k
    # R_g(r) of each stated KV-cache group of the pool (their sum is ``reservation``); empty
    # for a pool without stated groups
    group_reservations: tuple[np.ndarray, ...] = ()
    # a request's R(r) summed over groups passed MAX_RESERVATION: the pool's reservations
    # are unknown (invariant ``reservation_in_range``)
    out_of_range: bool = False

    @property
    def tenants(self) -> list[str | None]:
        return self.table.tenants

    @property
    def preempted(self) -> np.ndarray:
        return np.asarray(self.states == STATE_CODES["preempted"])

    @property
    def waiting(self) -> np.ndarray:
        return np.asarray(self.states == STATE_CODES["waiting"])

    def state_counts(self) -> tuple[int, int, int]:
        """The requests running, waiting and preempted (one pass over the codes)."""
        running, waiting, preempted = np.bincount(self.states, minlength=3).tolist()
        return running, waiting, preempted

    @property
    def claimed(self) -> np.ndarray:
        """max(R(r), held(r)): what one request claims, counted alone (per-request rule)."""
        return np.asarray(np.maximum(self.reservation, self.held))

    @property
    def growth(self) -> np.ndarray:
        """max(0, R(r) - held(r)): the pending growth of one request."""
        return np.asarray(np.maximum(0, self.reservation - self.held))


def group_reservations(
    table: RequestTable, pool: PoolFacts, max_model_len: int | None
) -> tuple[tuple[np.ndarray, ...], np.ndarray, bool]:
    """R_g(r) of each stated KV-cache group of a shared pool, their sum R(r), and whether a
    sum passed MAX_RESERVATION (the pool's reservations are then unknown: invariant
    ``reservation_in_range``). For a pool with groups and at least one request."""
    contexts, speculative = table.column("contexts"), table.column("speculative_slots")
    prompt, output = table.column("prompt_tokens"), table.column("max_output_tokens")
    groups = tuple(
        np.asarray(
            request_blocks([group_shape(g)], prompt, output, pool.block_size, max_model_len,
                           contexts=contexts, speculative_slots=speculative),
            dtype=np.int64,
        )
        for g in pool.groups
    )  # fmt: skip
    reservation = np.asarray(np.sum(groups, axis=0, dtype=np.int64))
    return groups, reservation, bool(reservation.max() > MAX_RESERVATION)


def request_columns(requests: Sequence[RequestFacts], pool: PoolFacts, max_model_len: int | None) -> RequestColumns:
    table = RequestTable.from_requests(requests)
    n = len(table)
    states = np.fromiter(map(STATE_CODES.__getitem__, table.states), dtype=np.int8, count=n)
    contexts = table.column("contexts")
    speculative = table.column("speculative_slots")
    groups: tuple[np.ndarray, ...] = ()
    out_of_range = False
    if not n:
        reservation = np.zeros(0, dtype=np.int64)
        groups = tuple(np.zeros(0, dtype=np.int64) for _ in pool.groups)
    elif pool.groups:
        groups, reservation, out_of_range = group_reservations(table, pool, max_model_len)
    else:
        reservation = reservation_blocks(
            table.column("prompt_tokens"),
            table.column("max_output_tokens"),
            pool.block_size,
            max_model_len=max_model_len,
            contexts=contexts,
            speculative_slots=speculative,
            sliding_window=pool.sliding_window,
        )
    return RequestColumns(
        table=table,
        reservation=reservation,
        held=table.held(),
        states=states,
        admitted=states != STATE_CODES["waiting"],
        running=states == STATE_CODES["running"],
        # an object array compared in C: a third cheaper than a map over the strings
        estimate=np.asarray(np.array(table.output_bounds, dtype=object) == "estimate", dtype=bool)
        if "estimate" in table.output_bounds
        else np.zeros(n, dtype=bool),
        computed=table.column("computed_tokens"),
        contexts=contexts,
        speculative=speculative,
        group_reservations=groups,
        out_of_range=out_of_range,
    )


def admission_estimate_tokens(estimate: AdmissionEstimate, cols: RequestColumns) -> float:
    """The engine's own admission estimate (SGLang's ``PrefillAdder``): ``new_token_ratio``
    x the running requests' remaining output (cap less output so far), each remainder
    clipped at ``output_clip`` tokens. A figure beside the declared policy, never in it:
    the policy counts every admitted request at its cap."""
    t = cols.table
    remaining = np.maximum(0, t.column("max_output_tokens") - t.column("generated_tokens"))[cols.running]
    return float(estimate.new_token_ratio * int(np.minimum(remaining, estimate.output_clip).sum()))
