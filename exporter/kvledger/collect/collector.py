"""Background polling of every source, each isolated with its own timeout, the assembly
of the Snapshot and the publication of its Accounts. A scrape reads ``latest()``; it
never waits on an engine.

Each cycle (every ``interval`` seconds) submits a poll for every source that is not
already in flight, waits at most until the next cycle, then assembles a fresh
Snapshot from the latest contribution of every source that is *up* and runs the
policy. A source that raises is marked down with its reason; one that hangs past its
timeout is marked down (``timeout``) and is not polled again until the hung poll
returns. A down source contributes nothing: its series disappear rather than go stale.

The accounting itself is a pure step (``accounting.account_snapshot``): the collector
passes it the Snapshot, what each engine was made from, its ``AccountCache`` and the
output side's render check, then applies the result: findings counted once per fresh
poll, the sources of invalid engines marked down (``invalid``), health, logging.

Accounts are made for the reads that come (``read_cadence``): a cycle makes them when no
reader keeps a cadence, or when the next read is due before the next cycle would have
made them; the other cycles poll, assemble and count the fresh polls' findings
(``engine_findings``: every poll's label limits and invariant checks are counted, as
before) and leave the Accounts to be made. A read that finds them not made from the latest
polls makes them itself (``latest``), from the same polls, so every read sees what a cycle
that accounted would have shown. At a 1 s poll and a 15 s scrape, one cycle in fifteen
makes the busy accounts (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from kvledger.collect import poll_budget
from kvledger.collect.accounting import AccountCache, EngineInputs, RenderCheck, account_snapshot, engine_findings
from kvledger.collect.label_limits import LabelLimitError, LimitCounts
from kvledger.collect.merge import apply_contribution, replace
from kvledger.collect.poll_lanes import PollLanes, spill_after
from kvledger.collect.read_cadence import ReadCadence
from kvledger.collect.sources.base import (
    Contribution,
    EngineContribution,
    GpuContribution,
    Source,
    SourceError,
    engine_position,
)
from kvledger.collect.sources.http_client import redact_text
from kvledger.config.types import LimitsConfig
from kvledger.domain.accounts import Accounts, ConfigReload
from kvledger.domain.facts import EngineFacts, Sharing, Snapshot, SourceHealth
from kvledger.output.prometheus import check_renderable

log = logging.getLogger("kvledger.collect.collector")


@dataclass
class _PollOutcome:
    contribution: Contribution | None
    error: SourceError | None
    duration: float
    #: what the poll was doing past its answer when it ended (``PollContext.phase``)
    phase: str | None = None
    #: the exception a source raised unexpectedly (a bug of ours): logged with its
    #: traceback once, when the failure changes (``Collector._mark_down``)
    unexpected: BaseException | None = None


@dataclass
class _Runner:
    source: Source
    timeout: float
    health: SourceHealth
    latest: Contribution | None = None
    future: Future[_PollOutcome] | None = None
    started: float = 0.0  # when the poll in flight started running (a queued one has not)
    running: bool = False
    context: poll_budget.PollContext | None = None  # the poll in flight's, once it runs
    timed_out: bool = False
    generation: int = 0  # successful polls so far
    message: str | None = None  # the full text of the latest failure
    accounted_at: float | None = None  # last_success of the latest poll whose facts were accounted
    logged: tuple[str, str] | None = None  # (reason, message) of the failure last logged; None once accounted again


@dataclass
class _Reconfiguration:
    sources: list[Source]
    base_engines: list[EngineFacts]
    timeouts: dict[int, float]
    sharing: Sharing
    interval: float
    limits: LimitsConfig
    done: threading.Event = field(default_factory=threading.Event)


def _close(source: Source) -> None:
    try:
        source.close()
    except Exception:  # closing is best effort; report and go on
        log.exception("closing source %s/%s", source.engine, source.kind)


#: threads polling sources: one per SOURCES_PER_WORKER sources, at least MIN_POLL_WORKERS
#: (or one per source, when fewer) and at most POLL_WORKERS. A poll waits on the network or
#: parses, and every HTTP exchange is bounded by its engine's timeout, so a few threads keep
#: a thousand engines polled (a healthy engine answers in milliseconds); more would fight
#: over the interpreter lock. The floor leaves room for engines that answer slowly: a poll
#: that waits its whole timeout holds a thread that long.
POLL_WORKERS = 64
MIN_POLL_WORKERS = 16
SOURCES_PER_WORKER = 16


def _timed_poll(r: _Runner, budget: poll_budget.MemoryBudget | None = None) -> _PollOutcome:
    start = time.monotonic()
    context = poll_budget.begin(budget)
    r.context = context
    r.started = start
    r.running = True
    try:
        contribution = r.source.poll()
        return _PollOutcome(contribution, None, time.monotonic() - start, context.phase(r.timeout))
    except SourceError as exc:
        return _PollOutcome(None, exc, time.monotonic() - start, context.phase(r.timeout))
    except Exception as exc:  # a bug in a source must not stop the others: report it as one
        error = SourceError("internal", f"{type(exc).__name__}: {exc}")
        return _PollOutcome(None, error, time.monotonic() - start, unexpected=exc)
    finally:
        poll_budget.end(context)


@dataclass
class Collector:
    sources: Sequence[Source]
    base_engines: Sequence[EngineFacts] = ()
    sharing: Sharing = "per-request"
    interval: float = 1.0
    timeouts: dict[int, float] = field(default_factory=dict)  # id(source) -> seconds
    default_timeout: float = 2.0
    on_cycle: Callable[[Accounts], None] | None = None
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    #: the output side's check that an engine's Accounts can be exported (each engine alone)
    render_check: RenderCheck = check_renderable
    #: the configuration file's load status, set by ``kvledger serve`` at start and at each SIGHUP
    config_reload: ConfigReload | None = None
    #: the wall clock of the timestamps it exports (last successes, the snapshot's time); a
    #: simulated demo run faster than real time passes its own (tests/test_demo_quiet.py)
    clock: Callable[[], float] = time.time
    #: the most threads polling at once (``POLL_WORKERS``); a slow source holds one for at
    #: most its timeout
    poll_workers: int = POLL_WORKERS
    #: the memory budget of engine answers in flight (``poll_budget.BUDGET`` by default)
    budget: poll_budget.MemoryBudget | None = None

    def __post_init__(self) -> None:
        if self.budget is None:
            self.budget = poll_budget.BUDGET
        self.budget.total = self.limits.memory_budget_bytes
        self._runners = [
            _Runner(s, self.timeouts.get(id(s), self.default_timeout), SourceHealth(s.engine, s.kind, up=False, reason="not polled yet"))
            for s in self.sources
        ]
        self._pool, self._lanes = self._new_pool(len(self._runners))
        self._lock = threading.Lock()
        self._abandoned: set[Future[_PollOutcome]] = set()  # polls left stuck in a replaced pool
        #: id(runner) -> (its primary contribution, the engine's configured facts, their merge) of the last cycle
        self._merged: dict[int, tuple[Contribution, EngineFacts, EngineFacts]] = {}
        self._latest: Accounts | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._invariant_totals: dict[tuple[str, str], int] = {}
        self._counted_generation: dict[int, int] = {}
        self._limited_totals: dict[tuple[str, str, str], int] = {}
        self._subs: dict[tuple[str, str], SourceHealth] = {}
        self._sub_messages: dict[tuple[str, str], str | None] = {}
        self._pending: _Reconfiguration | None = None
        # each engine's account with the inputs it was made from (reused while they stay the same objects)
        self._cache = AccountCache()
        self._cycle_error: str | None = None  # the accounting failure last logged
        self.cycles = 0  # Accounts made
        #: the reads of the Accounts, by reader: when the next one is due
        self.reads = ReadCadence()
        #: held by a cycle while it polls, harvests and accounts, and by a read that makes
        #: the Accounts itself (``latest``)
        self._cycle_lock = threading.RLock()
        #: the latest polls were harvested into no Accounts yet (a cycle left them to the read)
        self._stale = False
        self._account_seconds = 0.0  # how long the latest Accounts took to make

    def _new_pool(self, sources: int) -> tuple[ThreadPoolExecutor, PollLanes]:
        """The poll threads, and the lanes that queue the polls of a cycle on them."""
        wanted = max(MIN_POLL_WORKERS, -(-sources // SOURCES_PER_WORKER))
        self.workers = max(1, min(sources, wanted, self.poll_workers))
        pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="kvledger-poll")
        return pool, PollLanes(pool, self.workers, spill_after(self.interval))

    # ------------------------------------------------------------ public

    def latest(self, reader: str | None = None) -> Accounts | None:
        """The Accounts of the latest polls: made now if the cycles since the last ones left
        them to the read (``ReadCadence``). ``reader`` names who reads, to learn its cadence
        (the /metrics handler: the client's address; the OTLP exporter)."""
        if reader is not None:
            self.reads.record(reader, time.monotonic())
        if self._stale:
            with self._cycle_lock:
                if self._stale:
                    self._account_or_report()
        return self._latest

    def made(self) -> Accounts | None:
        """The latest Accounts if they are made from the latest polls, else None: for a
        caller that must not make them (the server's event loop), which then asks
        ``latest`` from a worker thread; one that answers from them records its read
        (``read_by``)."""
        return None if self._stale else self._latest

    def read_by(self, reader: str) -> None:
        """``reader`` read the Accounts (``made``'s caller): its cadence is learnt."""
        self.reads.record(reader, time.monotonic())

    def ready(self) -> bool:
        return self._latest is not None

    def health(self) -> list[tuple[SourceHealth, str | None]]:
        """Each source's health with the full message of its latest failure."""
        main = [(dataclasses.replace(r.health), r.message) for r in self._runners]
        subs = [(dataclasses.replace(h), self._sub_messages.get(k)) for k, h in self._subs.items()]
        return main + subs

    def reconfigure(
        self,
        sources: Sequence[Source],
        base_engines: Sequence[EngineFacts],
        timeouts: dict[int, float],
        sharing: Sharing,
        interval: float,
        limits: LimitsConfig,
        wait: float = 10.0,
    ) -> bool:
        """Take a new configuration (SIGHUP): sources that are the same objects as before
        keep their state (health, counters, a poll in flight); the others are closed. It is
        applied by the polling thread at its next cycle (or now, if it is not running);
        returns False if that did not happen within ``wait`` seconds."""
        change = _Reconfiguration(list(sources), list(base_engines), dict(timeouts), sharing, interval, limits)
        if self._thread is None or not self._thread.is_alive():
            self._apply(change)
            return True
        with self._lock:
            self._pending = change
        return change.done.wait(wait)

    def _apply(self, change: _Reconfiguration) -> None:
        old = {id(r.source): r for r in self._runners}
        runners: list[_Runner] = []
        for s in change.sources:
            timeout = change.timeouts.get(id(s), self.default_timeout)
            r = old.pop(id(s), None)
            if r is None:
                r = _Runner(s, timeout, SourceHealth(s.engine, s.kind, up=False, reason="not polled yet"))
            r.timeout = timeout
            runners.append(r)
        for r in old.values():  # removed or changed: closed off the polling thread
            threading.Thread(target=_close, args=(r.source,), name="kvledger-close", daemon=True).start()
        self._runners = runners
        self.sources = change.sources
        self.base_engines = change.base_engines
        self.timeouts = change.timeouts
        self.sharing = change.sharing
        self.interval = change.interval
        self.limits = change.limits
        if self.budget is not None:
            self.budget.total = change.limits.memory_budget_bytes
        self._lanes.close()  # queued polls go to the new lanes (a lane held by a hung engine would keep them)
        self._pool.shutdown(wait=False)  # polls in flight finish there
        self._pool, self._lanes = self._new_pool(len(runners))
        for r in runners:
            if r.future is not None and r.future.cancelled():
                r.future = None
        engines = {s.engine for s in change.sources} | {e.name for e in change.base_engines}
        self._invariant_totals = {k: v for k, v in self._invariant_totals.items() if k[0] in engines}
        self._limited_totals = {k: v for k, v in self._limited_totals.items() if k[0] in engines}
        self._subs = {k: v for k, v in self._subs.items() if k[0] in engines}
        change.done.set()

    def _take_pending(self) -> None:
        with self._lock:
            change, self._pending = self._pending, None
        if change is not None:
            self._apply(change)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvledger-collector", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)
        for r in self._runners:
            _close(r.source)
        self._lanes.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def poll_once(self) -> Accounts:
        """Poll every source once, waiting for each up to its timeout (for `snapshot`)."""
        self._submit_idle()
        deadline = time.monotonic() + max((r.timeout for r in self._runners), default=0.0)
        while any(r.future is not None for r in self._runners) and time.monotonic() < deadline:
            pending = [r.future for r in self._runners if r.future is not None]
            # harvested every tenth of a second, not at each completion (that was quadratic in the sources)
            self._wait_polls(pending, min(time.monotonic() + 0.1, deadline))
            self._harvest()
        self._harvest(force_timeouts=True)
        return self._account()

    # ------------------------------------------------------------ cycle

    def _loop(self) -> None:
        next_cycle = time.monotonic()
        while not self._stop.is_set():
            with self._cycle_lock:
                self._take_pending()
                self._submit_idle()
                pending = [r.future for r in self._runners if r.future is not None]
            # wait for this cycle's polls, but never past the next cycle
            self._wait_polls(pending, next_cycle + self.interval * 0.9)
            with self._cycle_lock:
                self._harvest()
                if self._account_due(next_cycle):
                    self._account_or_report()
                else:
                    self._leave_to_read()
            next_cycle += self.interval
            delay = next_cycle - time.monotonic()
            if delay < 0:
                next_cycle = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    def _account_or_report(self) -> None:
        """Make and publish the Accounts; a failure (a bug of ours) publishes none, as
        ``_account_failed`` says, never the old numbers as fresh."""
        start = time.monotonic()
        try:
            self._account()
        except Exception as exc:  # a bug of ours: never keep serving the old numbers as fresh
            text = f"{type(exc).__name__}: {exc}"
            if text != self._cycle_error:  # logged once per change, not at every cycle
                log.exception("accounting failed; no engine is exported this cycle")
                self._cycle_error = text
            self._account_failed(exc)
        else:
            if self._cycle_error is not None:
                log.info("accounting works again")
                self._cycle_error = None
        self._account_seconds = time.monotonic() - start

    def _account_due(self, cycle_start: float) -> bool:
        """Whether this cycle makes the Accounts: when no reader keeps a cadence, or when the
        next read is due before the next cycle's Accounts would be made (that cycle starts
        an interval after this one and makes them as long after its start as this one
        harvested, plus what making them took, plus a tenth of the interval); a read due
        earlier than foreseen makes them itself (``latest``)."""
        due = self.reads.next_read()
        if due is None or self._latest is None:  # nobody keeps a cadence; none made yet (not ready)
            return True
        lead = (time.monotonic() - cycle_start) + self._account_seconds + 0.1 * self.interval
        return due <= cycle_start + self.interval + lead

    def _leave_to_read(self) -> None:
        """A cycle that makes no Accounts: the fresh polls' findings are counted (label
        limits, invariant checks: each poll's, as an accounting cycle counts them), the
        sub-sources' health follows every change, and the Accounts are left for the read."""
        self._stale = True
        try:
            snapshot, _, _, fresh = self._assemble()
            for facts in snapshot.engines:
                if facts.name in fresh:
                    limited, invariants = engine_findings(facts, self.limits)
                    self._count_limited(facts.name, limited)
                    self._count_invariants(facts.name, invariants)
            self._sub_health()
        except Exception:  # a bug of ours: the Accounts made for the next read report it
            log.debug("counting the findings of a cycle left to the read failed", exc_info=True)

    def _submit_idle(self) -> None:
        """Queue a poll of every source not still polling (``PollLanes``: taken in turn by
        one thread while they are quick, another thread taking the rest of the queue when a
        source is slow, so a slow source delays no other for long)."""
        now = time.monotonic()
        self._replace_stuck_pool(now)
        for r in self._runners:
            if r.future is None:
                r.started = now
                r.running = False
                r.context = None
                r.timed_out = False
                r.future = self._lanes.submit(functools.partial(_timed_poll, r, self.budget))

    def _wait_polls(self, pending: list[Future[_PollOutcome]], until: float) -> None:
        """Wait until ``pending`` are done or ``until`` (monotonic), giving the queued polls
        another lane whenever every lane has been in one poll too long (``PollLanes.spill``)."""
        while pending:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return
            _, not_done = wait(pending, timeout=min(remaining, self._lanes.spill_after))
            if not not_done:
                return
            self._lanes.spill()
            pending = list(not_done)

    def _replace_stuck_pool(self, now: float) -> None:
        """Every poll but an HTTP fetch's own is bounded by its source alone: when half the
        poll threads hold polls stuck past twice their timeout (a source blocked where no
        deadline reaches), new polls go to a fresh pool and the stuck ones end in the old
        one, so the other engines keep being polled; logged each time."""
        self._abandoned = {f for f in self._abandoned if not f.done()}
        stuck = [r for r in self._runners if r.future is not None and r.future not in self._abandoned
                 and r.running and now - r.started > 2 * r.timeout]
        if len(stuck) < max(1, self.workers // 2):
            return
        self._abandoned.update(r.future for r in stuck if r.future is not None)
        names = ", ".join(f"{r.source.engine or '-'}/{r.source.kind}" for r in stuck[:5])
        log.warning("%d polls stuck past twice their timeout (%s%s): the other sources are polled by new threads",
                    len(stuck), names, ", ..." if len(stuck) > 5 else "")
        self._lanes.close()  # the polls queued there are submitted again
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool, self._lanes = self._new_pool(len(self._runners))
        for r in self._runners:
            if r.future is not None and r.future.cancelled():
                r.future = None

    def _harvest(self, force_timeouts: bool = False) -> None:
        now = time.monotonic()
        for r in self._runners:
            if r.future is None:
                continue
            if r.future.cancelled():  # queued in lanes closed since: polled again at the next cycle
                r.future = None
                continue
            if r.future.done():
                outcome = r.future.result()
                r.future = None
                r.running = False
                r.health.duration_seconds = outcome.duration
                if outcome.error is None and outcome.duration > r.timeout and outcome.phase is not None:
                    # answered in time but read too slowly: down, saying so, at every such poll (never up
                    # between two of them): the engine's series are more than its timeout can read
                    self._mark_down(r, "timeout", outcome.phase)
                elif outcome.error is None:
                    r.latest = outcome.contribution
                    r.generation += 1
                    r.health.up = True
                    r.health.reason = None
                    r.message = None
                    r.health.last_success = self.clock()
                    r.health.document_age_seconds = r.source.document_age()
                    r.health.refresh_interval_steps = r.source.refresh_interval_steps()
                else:
                    self._mark_down(r, outcome.error.reason, outcome.error.message, outcome.unexpected)
            elif (force_timeouts or (r.running and now - r.started > r.timeout)) and not r.timed_out:
                r.timed_out = True
                context = r.context if r.running else None
                phase = context.phase(r.timeout) if context is not None else None
                if phase is not None and context is not None:
                    log.debug("source %s/%s: %s", r.source.engine or "-", r.source.kind, context.detail(now))
                    self._mark_down(r, "timeout", phase)
                elif r.running:
                    self._mark_down(r, "timeout", f"no answer within {r.timeout:g} s")
                else:
                    self._mark_down(r, "timeout", f"not polled within {r.timeout:g} s: every one of the "
                                    f"{self.workers} poll threads was busy with slower sources")

    def _mark_down(self, r: _Runner, reason: str, message: str, unexpected: BaseException | None = None) -> None:
        """Mark ``r`` down and count the failure (every one, in its reason's counter). It is
        logged once per change: when the source goes down, or when the reason or the message
        differs from the previous failure's, never again for each poll that repeats it (an
        unexpected exception's traceback with it, likewise once). A source whose polls succeed
        but whose facts are invalid at every cycle is logged once too: it counts as recovered
        only once its facts were accounted (``_account``)."""
        message = redact_text(message)
        if r.logged != (reason, message):
            log.warning("source %s/%s down (%s): %s", r.source.engine or "-", r.source.kind, reason, message,
                        exc_info=unexpected)
            r.logged = (reason, message)
        r.latest = None
        r.health.up = False
        r.health.reason = reason
        r.message = message
        r.health.errors[reason] = r.health.errors.get(reason, 0) + 1

    def _sub_health(self) -> list[SourceHealth]:
        """Health of parts a source runs itself (e.g. vLLM's KV-event subscriber and log reader)."""
        out = []
        now = self.clock()
        for r in self._runners:
            for report in r.source.subsource_health():
                name, up, message = report.name, report.up, report.message
                key = (r.source.engine, name)
                h = self._subs.get(key)
                if h is None:
                    h = self._subs[key] = SourceHealth(r.source.engine, name, up=False)
                    h.last_success = None
                if not up and (h.up or h.reason is None):
                    h.errors["unavailable"] = h.errors.get("unavailable", 0) + 1
                    log.warning("source %s/%s down: %s", r.source.engine, name, message)
                elif up and not h.up and h.reason is not None:
                    log.info("source %s/%s up again", r.source.engine, name)
                h.up = up
                h.reason = None if up else "unavailable"
                h.document_age_seconds = report.document_age_seconds
                self._sub_messages[key] = None if message is None else redact_text(message)
                if up:
                    h.last_success = now
                out.append(dataclasses.replace(h, errors=dict(h.errors)))
        return out

    def _account(self) -> Accounts:
        """Assemble the Snapshot, account it (``account_snapshot``: each engine alone) and
        publish the Accounts: an engine whose facts cannot be accounted or rendered has its
        primary source marked down (``invalid``), every other engine's numbers stay fresh."""
        snapshot, inputs, primary, fresh = self._assemble()
        result = account_snapshot(snapshot, inputs, self.limits, self._cache, self.render_check)
        for facts in snapshot.engines:  # a fresh poll counts its findings, also when its account is reused
            name = facts.name
            if name in fresh:
                self._count_limited(name, result.limited.get(name, {}))
                self._count_invariants(name, result.invariants.get(name, []))
        for name, exc in result.invalid.items():
            self._invalid(primary.get(name), exc, engine=name)
        if result.gpu_error is not None:  # GPU facts that cannot be accounted fail the GPU sources alone
            for r in self._runners:
                if isinstance(r.latest, GpuContribution):
                    self._invalid(r, result.gpu_error)

        for r in self._runners:  # a poll counts as a success once its facts were accounted
            if r.health.up:
                r.accounted_at = r.health.last_success
                if r.logged is not None:  # one line when a source that was logged down recovers
                    log.info("source %s/%s up again (was down: %s)", r.source.engine or "-", r.source.kind, r.logged[0])
                    r.logged = None
        accounts = Accounts(
            engines=result.accounts.engines,
            gpus=result.accounts.gpus,
            budget=result.accounts.budget,
            driver_version=result.accounts.driver_version,
            health=[dataclasses.replace(r.health, errors=dict(r.health.errors)) for r in self._runners]
            + self._sub_health(),
            sharing=self.sharing,
            taken_at=snapshot.taken_at,
            invariant_totals=dict(self._invariant_totals),
            labels_limited=dict(self._limited_totals),
            config_reload=self.config_reload,
        )
        with self._lock:
            self._latest = accounts
            self._stale = False
            self.cycles += 1
        if self.on_cycle is not None:
            self.on_cycle(accounts)
        return accounts

    def _assemble(self) -> tuple[Snapshot, dict[str, EngineInputs], dict[str, _Runner], set[str]]:
        """A fresh Snapshot: the configured facts of every engine, then the latest
        contribution of every source that is up. Returned with what each engine's facts were
        made from, the runner that gave each engine its primary facts, and the engines whose
        primary facts are new this cycle (their findings are counted)."""
        snapshot = Snapshot(
            engines=[replace(e) for e in self.base_engines],
            sharing=self.sharing,
            taken_at=self.clock(),
        )
        fresh: set[str] = set()  # engines whose primary facts are new this cycle
        primary: dict[str, _Runner] = {}
        applied: dict[str, list[Contribution]] = {}  # what was applied to each engine, in order
        contributions = [(r.latest.order, i, r) for i, r in enumerate(self._runners) if r.latest is not None]
        bases: dict[str, EngineFacts] = {}  # the configured facts of each engine (the objects themselves)
        for e in self.base_engines:
            bases.setdefault(e.name, e)
        merged: dict[int, tuple[Contribution, EngineFacts, EngineFacts]] = {}
        touched: set[str] = set()  # engines something was applied to this cycle
        for _, _, r in sorted(contributions, key=lambda t: (t[0], t[1])):
            contribution = r.latest
            assert contribution is not None
            try:
                if not self._apply_merged(snapshot, r, contribution, bases, touched, merged):
                    apply_contribution(snapshot, contribution)
            except Exception as exc:  # a malformed contribution fails its own source alone
                self._invalid(r, exc)
                continue
            target = contribution.facts.name if isinstance(contribution, EngineContribution) else getattr(contribution, "engine", None)
            if isinstance(target, str):
                applied.setdefault(target, []).append(contribution)
            if isinstance(contribution, EngineContribution):
                name = contribution.facts.name
                primary[name] = r
                if self._counted_generation.get(id(r)) != r.generation:
                    self._counted_generation[id(r)] = r.generation
                    fresh.add(name)

        self._merged = merged
        configured: dict[str, EngineFacts] = {}
        for e in self.base_engines:
            configured.setdefault(e.name, e)
        inputs = {
            e.name: EngineInputs(configured.get(e.name), tuple(applied.get(e.name, ()))) for e in snapshot.engines
        }
        return snapshot, inputs, primary, fresh

    def _apply_merged(self, snapshot: Snapshot, r: _Runner, contribution: Contribution, bases: dict[str, EngineFacts],
                      touched: set[str], merged: dict[int, tuple[Contribution, EngineFacts, EngineFacts]]) -> bool:
        """Apply an engine's primary facts as last cycle's merge when they and the engine's
        configured facts are the same objects as then (an idle engine: its 304 keeps the
        contribution), and keep this cycle's merge for the next; False when not applied
        here (``apply_contribution`` does it). Merging copies dataclasses field by field:
        three copies per engine and cycle were most of an idle fleet's assembly."""
        name = contribution.facts.name if isinstance(contribution, EngineContribution) else None
        target = getattr(contribution, "engine", None) if name is None else name
        if isinstance(target, str):
            first = target not in touched
            touched.add(target)
        else:
            return False
        base = bases.get(target)
        i = engine_position(snapshot, target)
        if name is None or base is None or i is None or not first:
            return False
        last = self._merged.get(id(r))
        if last is not None and last[0] is contribution and last[1] is base:
            snapshot.engines[i] = last[2]
        else:
            apply_contribution(snapshot, contribution)
        merged[id(r)] = (contribution, base, snapshot.engines[i])
        return True

    def _count_invariants(self, engine: str, checks: list[str]) -> None:
        for check in checks:
            key = (engine, check)
            self._invariant_totals[key] = self._invariant_totals.get(key, 0) + 1

    def _account_failed(self, exc: BaseException) -> None:
        for r in self._runners:
            if r.latest is not None:
                self._mark_down(r, "internal", f"accounting failed: {type(exc).__name__}: {exc}")
        accounts = Accounts(
            [], [], [], None, [dataclasses.replace(r.health, errors=dict(r.health.errors)) for r in self._runners],
            self.sharing, self.clock(),
        )
        with self._lock:
            self._latest = accounts
            self._stale = False

    def _invalid(self, r: _Runner | None, exc: BaseException, engine: str | None = None) -> None:
        """Mark ``r`` down as ``invalid``: its facts passed the parser but cannot be accounted."""
        text = str(exc) or type(exc).__name__
        if len(text) > 300:
            text = text[:300] + "..."
        message = f"facts cannot be accounted: {type(exc).__name__}: {text}"
        if not isinstance(exc, LabelLimitError):
            log.debug("engine %s: accounting failed", engine or (r.source.engine if r else "-"), exc_info=exc)
        if r is None:
            log.warning("engine %s: configured facts cannot be accounted: %s", engine, message)
            return
        self._mark_down(r, "invalid", message)
        r.health.last_success = r.accounted_at  # an invalid poll is no success

    def _count_limited(self, engine: str, counts: LimitCounts) -> None:
        for (label, action), n in counts.items():
            key = (engine, label, action)
            self._limited_totals[key] = self._limited_totals.get(key, 0) + n

