"""/lab/run.json off the scrape path: cached, bounded, and run in a process of its own.

A lab run is deterministic (``run_lab(capacity, working_set, requests)`` gives the same
steps every time), and costs tens of milliseconds of CPU at the page's caps. The server
answers it with ``LabRuns.respond``:

- the query is read on the event loop (cheap; a bad parameter is a 400 at once);
- a run already made is answered from an LRU cache (``cache_entries`` runs, at most
  ``cache_bytes`` of bodies), a run in progress for the same parameters is awaited by every
  request that asks for it (made once);
- a new run goes to a single worker *process* at a lower CPU priority (``nice``): its CPU
  never holds the daemon's interpreter lock, so scrapes and polls keep their pace whatever
  the lab does; at most ``queue`` distinct runs wait or run at a time, more are answered
  503 with ``Retry-After`` (the page retries);
- the worker is started at the first run and stopped after ``idle_seconds`` without one;
  a worker that dies is replaced at the next run (that request gets a 500).
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
from collections import OrderedDict
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from urllib.parse import urlsplit

from kvledger.web.connection import Response
from kvledger.web.pages import JSON, TEXT, LabRequestError, json_response, lab_page_data, lab_params

log = logging.getLogger("kvledger.web.server")

#: the worker process' niceness increment (scrapes and polls come first on a busy host)
LAB_NICE = 10

Key = tuple[int, int, int]


def _worker_init() -> None:
    try:
        os.nice(LAB_NICE)
    except OSError:
        pass


def lab_body(capacity: int, working_set: int, requests: int) -> bytes:
    """The /lab/run.json body of one run (in the worker process)."""
    doc = lab_page_data(f"capacity={capacity}&working_set={working_set}&requests={requests}")
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _response(body: bytes) -> Response:
    return Response(200, body, (("Content-Type", JSON), ("Cache-Control", "no-store")))


BUSY = Response(503, b"too many lab runs in progress; retry later\n", (("Content-Type", TEXT), ("Retry-After", "1")))


class LabRuns:
    """The lab runs of one server (event loop only, except ``close``)."""

    def __init__(self, *, queue: int = 4, cache_entries: int = 64, cache_bytes: int = 16 << 20,
                 idle_seconds: float = 60.0, executor: Executor | None = None) -> None:
        self.queue = queue
        self.cache_entries = cache_entries
        self.cache_bytes = cache_bytes
        self.idle_seconds = idle_seconds
        self._cache: OrderedDict[Key, bytes] = OrderedDict()
        self._cached_bytes = 0
        self._running: dict[Key, asyncio.Future[bytes]] = {}
        self._executor: Executor | None = executor
        self._own_executor = executor is None
        self._idle: asyncio.TimerHandle | None = None
        self.runs = 0  # runs made (cache misses)
        self.hits = 0  # answered from the cache or from a run in progress
        self.refused = 0  # answered 503: too many runs waiting

    async def respond(self, target: str) -> Response:
        try:
            key = lab_params(urlsplit(target).query)
        except LabRequestError as exc:
            return json_response({"error": str(exc)}, status=400)
        body = self._cache.get(key)
        if body is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return _response(body)
        running = self._running.get(key)
        if running is not None:
            self.hits += 1
            return _response(await asyncio.shield(running))
        if len(self._running) >= self.queue:
            self.refused += 1
            return BUSY
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes] = loop.create_future()
        self._running[key] = future
        try:
            body = await self._run(loop, key)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: the waiters each get it, none is left unretrieved
            raise
        else:
            future.set_result(body)
        finally:
            del self._running[key]
            self._schedule_idle(loop)
        self.runs += 1
        self._remember(key, body)
        return _response(body)

    async def _run(self, loop: asyncio.AbstractEventLoop, key: Key) -> bytes:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init)
        try:
            return await loop.run_in_executor(self._executor, lab_body, *key)
        except BrokenProcessPool:
            log.error("the lab's worker process died; a new one starts at the next run")
            self._stop_executor()
            raise

    def _remember(self, key: Key, body: bytes) -> None:
        if len(body) > self.cache_bytes:
            return
        self._cache[key] = body
        self._cached_bytes += len(body)
        while len(self._cache) > self.cache_entries or self._cached_bytes > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= len(old)

    def _schedule_idle(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = loop.call_later(self.idle_seconds, self._on_idle)

    def _on_idle(self) -> None:
        self._idle = None
        if not self._running:
            self._stop_executor()

    def _stop_executor(self) -> None:
        executor = self._executor
        if executor is not None and self._own_executor:
            self._executor = None
            executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self._stop_executor()
