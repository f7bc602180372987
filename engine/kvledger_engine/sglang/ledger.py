"""One SGLang scheduler's ledger: the throttle, the counters, the document and its server.

The scheduler hooks (``plugin``) call ``after_step`` at the end of every step and when the
scheduler looks for work; when a publication is due (``Throttle``: at most every
``KVLEDGER_SGLANG_INTERVAL`` seconds and at most 1 % of the scheduler's time, always when
the scheduler goes idle with something changed) the view's snapshot (one pass over the
requests the scheduler holds) goes to the document; the document server's thread writes
the JSON when a reader asks (``vllm.published.PublishedLedger``, through the one request
writer). Retractions are counted by ``on_retract`` (a wrapper of
``ScheduleBatch.retract_decode``).

Every entry point catches everything: the first failure logs one line, stops the server and
turns the ledger off, and SGLang goes on as if it had never been there.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import Any

from kvledger_engine.document_server import LedgerServer
from kvledger_engine.sglang.internals import SchedulerView, Snapshot
from kvledger_engine.sglang.settings import Settings
from kvledger_engine.vllm.engine_core import SOCKET_MODE, AddressTaken, claim_address
from kvledger_engine.vllm.published import PublishedLedger
from kvledger_engine.vllm.tracker import Throttle

logger = logging.getLogger("sglang.kvledger")


class SchedulerLedger:
    def __init__(self, view: SchedulerView, settings: Settings, version: str, *, serve: bool = True) -> None:
        self.view = view
        self.on = True
        self.throttle = Throttle(settings.min_interval)
        self.retractions = 0  # requests retracted (cumulative)
        self.retracted_tokens = 0  # computed tokens their retractions threw away (cumulative)
        self.publications = 0
        self.publish_seconds = 0.0
        self.iteration_tokens: int | None = None
        self._render_seen = 0.0
        self._fingerprint: tuple[int, ...] | None = None
        self._known: set[str] = set()
        self.last: Snapshot | None = None
        self.document = PublishedLedger(
            engine={"kind": "sglang", "version": version},
            pool=view.static,
            integration={"name": "kvledger-sglang", "dp_rank": view.dp_rank, "pid": os.getpid()},
        )
        self.publish()
        self._claim: int | None = None
        self.server: LedgerServer | None = None
        self.url = ""
        if serve:
            kind, where = settings.endpoint(view.dp_rank, view.dp_size)
            self.server = self._serve(kind, where)
            self.url = self.server.url

    def _serve(self, kind: str, where: str) -> LedgerServer:
        doc = self.document
        if kind == "unix":
            directory = os.path.dirname(where)
            if directory:
                os.makedirs(directory, exist_ok=True)
            self._claim = claim_address(where)
            try:
                server = LedgerServer(doc.render_tagged, unix_path=where, columns=doc.render_columns)
                os.chmod(where, SOCKET_MODE)
                return server.start()
            except BaseException:
                self._release()
                raise
        host, _, port = where.rpartition(":")
        try:
            return LedgerServer(doc.render_tagged, host=host, port=int(port), columns=doc.render_columns).start()
        except OSError as exc:
            raise AddressTaken(f"{where}: {exc.strerror} (another process serves this port)") from None

    def _release(self) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            os.close(claim)

    # ---------------------------------------------------------------- hooks (scheduler thread)
    def after_step(self, batches: tuple[Any, ...] = (), idle: bool = False) -> None:
        """The end of a step, or the scheduler having looked for work (``batches``: the
        batches the hook saw; ``idle``: the scheduler found nothing to run)."""
        if not self.on:
            return
        try:
            fingerprint = self.view.fingerprint(batches)
            if fingerprint == self._fingerprint:
                return
            if self.throttle.due(idle=idle):
                self.publish(fingerprint, batches)
        except Exception as exc:
            self.fail("after a scheduling step", exc)

    def on_retract(self, retracted: Iterable[Any], discarded: int) -> None:
        if not self.on:
            return
        self.retractions += sum(1 for _ in retracted)
        self.retracted_tokens += discarded

    def publish_now(self, where: str) -> None:
        """Publish outside a step (a pause): the state the scheduler stops in."""
        if self.on:
            try:
                self.publish()
            except Exception as exc:
                self.fail(where, exc)

    # ---------------------------------------------------------------- publication
    def publish(self, fingerprint: tuple[int, ...] | None = None, batches: tuple[Any, ...] = ()) -> None:
        started = self.throttle.clock()
        began = time.perf_counter()
        view = self.view
        snap = view.snapshot(self.iteration_tokens, batches)
        gone = self._known - snap.rows.keys()
        self._known = set(snap.rows)
        self.publications += 1
        render = self.document.render_seconds
        cost = time.perf_counter() - began
        self.publish_seconds += cost
        stats = {
            "publications": self.publications,
            "publish_seconds_total": round(self.publish_seconds, 6),
            "radix_protected_tokens": snap.radix_protected_tokens,
        }
        pool_extra: dict[str, Any] = {"preempted_tokens": self.retracted_tokens}
        if snap.new_token_ratio is not None:
            pool_extra["admission_estimate"] = {"new_token_ratio": snap.new_token_ratio, "output_clip": view.clip}
        self.document.publish(snap.summary, snap.budgets, snap.rows, gone, stats, pool_extra,
                              {"preemptions": self.retractions})
        self.last = snap
        self._fingerprint = fingerprint if fingerprint is not None else view.fingerprint(batches)
        self.throttle.published(started, cost + (render - self._render_seen))
        self._render_seen = render

    # ---------------------------------------------------------------- failure and shutdown
    def fail(self, where: str, exc: BaseException) -> None:
        self.on = False
        logger.warning("kvledger: the SGLang ledger stopped %s (%s: %s); SGLang continues without it",
                       where, type(exc).__name__, exc)
        self.close()

    def close(self) -> None:
        self.on = False
        server, self.server = self.server, None
        if server is not None:
            try:
                server.stop()
            except Exception:
                pass
        self._release()
