"""The serving half of the in-engine vLLM ledger: publications in, kvledger/v1 bytes out.

The engine thread calls ``publish()`` with what changed (the pool summary, budgets, and
the rows of the requests it touched, ``None`` for a request that is gone); that costs a
dictionary update under a lock held for no longer. The server thread calls ``render()``:
it copies the rows under the lock, re-renders the JSON of the rows that changed since
its last render (each row's text is kept), and joins them. Between two publications a
render returns the same bytes without work.

Readers that ask for it get the columnar form (``render_columns``: ``request_columns``, one
column per field, integers as base64 machine integers, docs/ledger.md), cheaper to write here and to read in the daemon when
every running request moves at every step; both forms carry the publication's version as
their ETag, so a reader's conditional GET of an unchanged ledger is answered 304.

Standard library only: this module runs inside vLLM's EngineCore process.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvledger_engine.request_wire import RequestWriter
from kvledger_engine.request_wire import int64le as int64le
from kvledger_engine.vllm.tracker import PoolSummary
from kvledger_engine.wire_terms import SCHEMA_ID


@dataclass(frozen=True, slots=True)
class RequestRow:
    """One request as the ledger states it (admitted or waiting)."""

    id: str
    state: str  # running | waiting | preempted
    prompt_tokens: int
    max_output_tokens: int
    generated_tokens: int
    computed_tokens: int
    blocks_held: int
    tenant: str | None = None

    def wire(self) -> dict[str, Any]:
        """The request's fields by their wire names (``request_wire.REQUEST_FIELDS``)."""
        return {
            "id": self.id, "state": self.state, "tenant": self.tenant, "prompt_tokens": self.prompt_tokens,
            "max_output_tokens": self.max_output_tokens, "generated_tokens": self.generated_tokens,
            "computed_tokens": self.computed_tokens, "blocks_held": self.blocks_held,
        }


@dataclass(frozen=True, slots=True)
class GroupStatic:
    """One KV-cache group sharing the pool (a hybrid model's layers of one type)."""

    id: str
    kind: str  # full_attention | sliding_window | chunked_local_attention | mamba
    window: int | None  # tokens a sliding window or a local-attention chunk spans
    state_blocks: int | None  # blocks one sequence's state takes (mamba)


@dataclass(frozen=True, slots=True)
class PoolStatic:
    """What does not change while the engine runs."""

    id: str
    block_size: int
    block_bytes: int
    num_blocks: int
    sliding_window: int | None
    speculative_slots: int
    groups: tuple[GroupStatic, ...] = ()  # stated when the pool is shared by several groups


def _group_doc(group: GroupStatic, in_use: int | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"id": group.id, "kind": group.kind}
    if group.window is not None:
        doc["window"] = group.window
    if group.state_blocks is not None:
        doc["state_blocks"] = group.state_blocks
    doc["in_use"] = in_use
    return doc


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


class PublishedLedger:
    """The kvledger/v1 document of one engine core (one data-parallel rank)."""

    def __init__(self, engine: dict[str, Any], pool: PoolStatic, integration: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._render_lock = threading.Lock()
        self._head = {
            "schema": SCHEMA_ID,
            "engine": engine,
            "admission": "dynamic",
            "overflow": "preempt-recompute",
        }
        self._pool = pool
        # every request of this core is in its one pool, bounded by its cap, one context
        self._writer = RequestWriter({"pool": pool.id, "output_bound": "cap", "contexts": 1,
                                      "speculative_slots": pool.speculative_slots})
        self._integration = dict(integration)
        self._rows: dict[str, RequestRow] = {}
        self._changed: set[str] = set()
        self._summary: PoolSummary | None = None
        self._budgets: dict[str, int] = {}
        self._pool_counters: dict[str, Any] = {}
        self._counters: dict[str, int] = {}
        self._version = 0
        self._published_at: float | None = None
        self._stats: dict[str, Any] = {}
        # owned by the render side
        self._fragments: dict[str, str] = {}
        self._rendered: tuple[int, bytes] | None = None
        self._rendered_columns: tuple[int, bytes] | None = None
        self.render_seconds = 0.0  # cumulative: the engine's throttle counts it

    # ---------------------------------------------------------------- engine side
    def publish(
        self,
        summary: PoolSummary,
        budgets: dict[str, int],
        rows: dict[str, RequestRow],
        gone: set[str],
        stats: dict[str, Any],
        pool_counters: dict[str, Any] | None = None,
        counters: dict[str, int] | None = None,
    ) -> None:
        """``pool_counters``: further keys of the pool (cumulative counts, the engine's own
        estimate); ``counters``: the document's ``counters`` (COUNTER_NAMES)."""
        with self._lock:
            self._pool_counters = dict(pool_counters or {})
            self._counters = dict(counters or {})
            self._rows.update(rows)
            for rid in gone:
                self._rows.pop(rid, None)
            self._changed.update(rows)
            self._changed.update(gone)
            self._summary = summary
            self._budgets = budgets
            self._stats = stats
            self._published_at = time.time()
            self._version += 1

    @property
    def published(self) -> bool:
        return self._summary is not None

    # ---------------------------------------------------------------- server side
    def render(self) -> bytes:
        """The current document as JSON bytes (a 503-worthy ``ValueError`` before the first publication)."""
        return self._render_versioned()[1]

    def _render_versioned(self) -> tuple[int, bytes]:
        with self._render_lock:
            began = time.perf_counter()
            with self._lock:
                version = self._version
                if self._rendered is not None and self._rendered[0] == version:
                    return self._rendered
                if self._summary is None:
                    raise ValueError("the engine has not scheduled yet: no ledger to serve")
                rows = dict(self._rows)
                changed, self._changed = self._changed, set()
                summary, budgets, stats, published_at = self._summary, self._budgets, self._stats, self._published_at
            fragments = self._fragments
            for rid in changed:
                row = rows.get(rid)
                if row is None:
                    fragments.pop(rid, None)
                else:
                    fragments[rid] = self._row_json(row)
            body = self._document(summary, budgets, stats, published_at, fragments.values()).encode()
            self._rendered = (version, body)
            self.render_seconds += time.perf_counter() - began
            return self._rendered

    def render_tagged(self) -> tuple[bytes, str]:
        """(the row form, its ETag): the publication's version names it."""
        version, body = self._render_versioned()
        return body, f"v{version}"

    def render_columns(self) -> tuple[bytes, str]:
        """(the columnar form, its ETag): ``request_columns`` in place of ``requests``."""
        with self._render_lock:
            began = time.perf_counter()
            with self._lock:
                version = self._version
                cached = self._rendered_columns
                if cached is not None and cached[0] == version:
                    return cached[1], f"v{version}"
                if self._summary is None:
                    raise ValueError("the engine has not scheduled yet: no ledger to serve")
                rows = list(self._rows.values())
                summary, budgets, stats, published_at = self._summary, self._budgets, self._stats, self._published_at
            columns = self._writer.columns([r.wire() for r in rows], check=False)  # RequestRow: typed, complete
            head = self._document(summary, budgets, stats, published_at, ())
            head = head[: head.rindex(',"requests":[')]
            body = (head + ',"request_columns":' + _dumps(columns) + "}").encode()
            self._rendered_columns = (version, body)
            self.render_seconds += time.perf_counter() - began
            return body, f"v{version}"

    def _row_json(self, row: RequestRow) -> str:
        return self._writer.row_json(row.wire())

    def _document(
        self,
        summary: PoolSummary,
        budgets: dict[str, int],
        stats: dict[str, Any],
        published_at: float | None,
        fragments: Any,
    ) -> str:
        pool = self._pool
        pool_doc: dict[str, Any] = {
            "id": pool.id,
            "block_size": pool.block_size,
            "block_bytes": pool.block_bytes,
            "num_blocks": pool.num_blocks,
            "sliding_window": pool.sliding_window,
            "blocks": {"in_use": summary.in_use, "reclaimable": summary.reclaimable, "free": summary.free},
            "references": summary.references,
            "shared": summary.shared,
            **self._pool_counters,
        }
        if pool.groups:
            # one stated group (a chunked or state layer type alone) holds every block in use
            in_use = summary.group_in_use or ((summary.in_use,) if len(pool.groups) == 1 else ())
            pool_doc["groups"] = [_group_doc(g, in_use[i] if i < len(in_use) else None) for i, g in enumerate(pool.groups)]
        integration = dict(self._integration, published_at=published_at, **stats)
        # published_at: when the engine thread last published (a reader stops calling the figures
        # exact when it grows old while requests run: the scheduler hung, this thread answering)
        doc = dict(self._head, published_at=published_at, budgets=budgets, pools=[pool_doc], integration=integration)
        if self._counters:
            doc["counters"] = self._counters
        head = _dumps(doc)
        return head[:-1] + ',"requests":[' + ",".join(fragments) + "]}"
