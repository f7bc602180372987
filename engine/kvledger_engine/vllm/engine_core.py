"""One engine core's ledger: the trackers, the throttle, the document and its server.

``EngineLedger`` is what the scheduler hooks call. Its engine-thread work per step is a
few set updates; a publication (throttled) reads the blocks and requests that changed
and hands the result to the document, which the server thread renders on request.
Every entry point catches everything: the first failure logs one line, stops the server
and turns the ledger off, and the engine goes on as if it had never been there.

One address, one engine core: a Unix socket is claimed (``claim_address``) before it is
bound, so a second engine core given the same address (data-parallel ranks without
``{dp_rank}``, two servers sharing a setting) is refused with one line naming the holder,
never unlinking the first one's socket; a TCP port is claimed by binding it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterable
from typing import Any

from kvledger_engine.document_server import LedgerServer
from kvledger_engine.iteration_window import IterationWindow
from kvledger_engine.vllm.internals import EngineView, step_facts
from kvledger_engine.vllm.published import PublishedLedger, RequestRow
from kvledger_engine.vllm.settings import DP_PLACEHOLDER, ENV_LEDGER, Settings
from kvledger_engine.vllm.tracker import PoolTracker, RequestTracker, Throttle

logger = logging.getLogger("vllm.kvledger")

#: the ledger socket's mode: the engine's user and group may connect, nobody else
SOCKET_MODE = 0o660
#: what a refused claim adds: the usual cause and its cure
_CLASH_HINT = f"with data parallelism put {DP_PLACEHOLDER} in {ENV_LEDGER} (each rank serves its own pool)"


class AddressTaken(Exception):
    """Another process serves (or holds the claim on) this engine core's ledger address."""


def claim_address(path: str) -> int:
    """This process's claim on the Unix socket ``path``: an exclusive ``flock`` on
    ``path + ".lock"`` (the kernel drops it when the process ends, so a killed engine leaves
    no stale claim; the file stays, holding the last holder's pid) and nothing answering at
    ``path``. Returns the lock's descriptor (closing it gives the claim up); AddressTaken."""
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, SOCKET_MODE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            raise AddressTaken(f"{path} is served by another engine core already (pid {holder}); {_CLASH_HINT}") from None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            answered = probe.connect_ex(path) == 0
        if answered:
            raise AddressTaken(f"{path}: another process answers on this socket already; {_CLASH_HINT}")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


class EngineLedger:
    def __init__(self, view: EngineView, settings: Settings, version: str) -> None:
        self.view = view
        self.on = True
        static = view.static
        self.pool = PoolTracker(len(view.blocks), static.num_blocks, ignored=(view.null_id,), groups=len(view.managers))
        self.reqs = RequestTracker()
        self.throttle = Throttle(settings.min_interval)
        self.known: set[str] = set()
        self.iteration_tokens: int | None = None
        self.window = IterationWindow()
        self.preempted_tokens = 0  # computed tokens the engine's preemptions threw away (cumulative)
        self.publications = 0
        self.publish_seconds = 0.0
        self._render_seen = 0.0
        # requests the document shows running: a publication reads them again (finished by
        # the model, preempted, or still running, their rows have changed)
        self.published_running: set[str] = set()
        self.document = PublishedLedger(
            engine={"kind": "vllm", "version": version},
            pool=static,
            integration={"name": "kvledger-vllm", "dp_rank": view.dp_rank, "pid": os.getpid()},
        )
        self.reqs.touched.update(view.requests)
        self.publish()
        kind, where = settings.endpoint(view.dp_rank, view.dp_size)
        self._claim: int | None = None
        self.server = self._serve(kind, where)
        self.url = self.server.url
        # last: from here on the pool reports what it changes (into a throwaway set once off)
        view.wrap_pool(self._dirty, self._after_reset)

    def _dirty(self) -> set[int]:
        return self.pool.dirty if self.on else set()

    def _serve(self, kind: str, where: str) -> LedgerServer:
        if kind == "unix":
            directory = os.path.dirname(where)
            if directory:
                os.makedirs(directory, exist_ok=True)
            self._claim = claim_address(where)
            try:
                server = LedgerServer(self.document.render_tagged, unix_path=where, columns=self.document.render_columns)
                # owner and group may connect (a sidecar shares the group, e.g. Kubernetes fsGroup)
                os.chmod(where, SOCKET_MODE)
                return server.start()
            except BaseException:
                self._release()
                raise
        host, _, port = where.rpartition(":")
        try:
            server = LedgerServer(self.document.render_tagged, host=host, port=int(port), columns=self.document.render_columns)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AddressTaken(f"{where}: {exc.strerror} (another process serves this port); {_CLASH_HINT}") from None
            raise
        return server.start()

    def _release(self) -> None:
        claim, self._claim = getattr(self, "_claim", None), None
        if claim is not None:
            os.close(claim)

    # ---------------------------------------------------------------- hooks (engine thread)
    def before_schedule(self) -> dict[str, int] | None:
        """The running requests' computed tokens ahead of a step (None when off)."""
        if not self.on:
            return None
        try:
            return self.view.running_computed()
        except Exception as exc:
            self.fail("before a scheduling step", exc)
            return None

    def after_schedule(self, output: Any, before: dict[str, int] | None = None) -> None:
        if not self.on:
            return
        try:
            # the step's scheduled requests are running: a publication reads every running
            # request anyway, so a step only notes what left the running list
            _, finished, preempted, tokens = step_facts(output)
            touched = self.reqs.touched
            touched.update(finished)
            if preempted:
                touched.update(preempted)
            self.iteration_tokens = tokens
            self.window.record(tokens)
            if before:
                self.preempted_tokens += self.view.preempted_tokens(before)
            if self.throttle.due(idle=self.view.is_idle()):
                self.publish()
        except Exception as exc:
            self.fail("after a scheduling step", exc)

    def after_add(self, request_id: str) -> None:
        if self.on:
            self.reqs.touched.add(request_id)

    def after_finish(self, request_ids: Iterable[str] | None) -> None:
        if not self.on:
            return
        try:
            self.reqs.touched.update(self.known if request_ids is None else request_ids)
            if self.view.is_idle():
                self.publish()
        except Exception as exc:
            self.fail("after finishing requests", exc)

    def _after_reset(self) -> None:
        if not self.on:
            return
        # every block is free and uncached now; reset_prefix_cache(reset_running_requests=True)
        # preempted every running request outside a step: publish_now re-reads every row
        self.pool.clear()  # the publication's cross-check with vLLM's free queue still runs
        self.publish_now("after a prefix-cache reset")

    def publish_now(self, where: str) -> None:
        """Publish outside a scheduling step (the engine paused, the cache was reset): what
        changed is not known there (a reset preempts every running request), so every
        request is read again."""
        if self.on:
            try:
                self.reqs.touched.update(self.known)
                self.reqs.touched.update(self.view.requests)
                self.publish()
            except Exception as exc:
                self.fail(where, exc)

    # ---------------------------------------------------------------- publication
    def publish(self) -> None:
        started = self.throttle.clock()
        began = time.perf_counter()
        view, pool = self.view, self.pool
        pool.refresh(view.read_block)
        if pool.capacity - pool.in_use != view.num_free():
            # a change we did not see: read every block again (counted, logged once per kind)
            if pool.resyncs == 0:
                logger.warning(
                    "kvledger: the ledger's in-use count (%d) disagreed with vLLM's free queue (%d free of %d); "
                    "re-reading every block (counted in the document's integration.resyncs)",
                    pool.in_use, view.num_free(), pool.capacity,
                )
            pool.resyncs += 1
            pool.resync(view.read_block)
        rows: dict[str, RequestRow] = {}
        gone: set[str] = set()
        known = self.known
        # what may have changed: every request running now (each step moves it), every
        # request last shown running (finished by the model, preempted), every request finished
        # since the last step (one finished by the model may never have been shown running: a
        # throttled step scheduled it), and what the hooks noted (added, finished, preempted,
        # aborted)
        touched = self.reqs.take()
        touched |= view.finished_unreported()  # finished by the model, not yet in a step's output
        running = set(view.running_ids())
        published_running = self.published_running
        touched |= running
        touched |= published_running - running
        # several KV-cache groups: each request's new blocks are assigned to their group
        assign = pool.assign if pool.groups > 1 else None
        for rid in touched:
            row = view.read_request(rid, assign)
            if row is None:
                published_running.discard(rid)
                if rid in known:
                    known.discard(rid)
                    gone.add(rid)
            else:
                rows[rid] = row
                known.add(rid)
                if row.state == "running":
                    published_running.add(rid)
                else:
                    published_running.discard(rid)
        self.publications += 1
        render = self.document.render_seconds
        cost = time.perf_counter() - began
        self.publish_seconds += cost
        stats = {
            "publications": self.publications,
            "publish_seconds_total": round(self.publish_seconds, 6),
            "resyncs": pool.resyncs,
        }
        budgets = {**view.budgets(self.iteration_tokens), **self.window.budgets()}
        self.document.publish(pool.summary(), budgets, rows, gone, stats, {"preempted_tokens": self.preempted_tokens})
        # the document thread's rendering holds the interpreter too: count it against the budget
        self.throttle.published(started, cost + (render - self._render_seen))
        self._render_seen = render

    # ---------------------------------------------------------------- failure and shutdown
    def fail(self, where: str, exc: BaseException) -> None:
        self.on = False
        logger.warning(
            "kvledger: the vLLM ledger integration stopped %s (%s: %s); vLLM continues without it",
            where, type(exc).__name__, exc,
        )
        self.close()

    def close(self) -> None:
        self.on = False
        server = getattr(self, "server", None)
        if server is not None:
            try:
                server.stop()
            except Exception:
                pass
        self._release()  # after the socket is gone: the next claimant binds a free path
