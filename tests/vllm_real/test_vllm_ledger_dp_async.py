"""The in-engine ledger on a real two-rank data-parallel vLLM running the async scheduler.

One server (one start, for CI time) covers both configurations of issue 24 that the session
server does not: ``--data-parallel-size 2`` (two EngineCore processes; inside each, vLLM
says ``data_parallel_size`` 1 and ``data_parallel_rank`` 0, only ``data_parallel_index``
tells them apart; two API servers) and ``--scheduler-cls ...AsyncScheduler`` (the CPU
platform turns ``--async-scheduling`` off silently). ``KVLEDGER_VLLM_LEDGER`` names
``ledger-{dp_rank}.sock``: each rank serves its own pool.

The daemon starts before the engine has served anything: vLLM's /metrics then has no usage
gauge at all (a rank's gauges appear once it has served a request), and the ledger's pools
must be exported anyway; then with one rank's gauges; then with the API servers stopped
(SIGSTOP: /metrics does not answer, the engine cores and their ledgers do). Then the frozen
points of test_vllm_ledger.py, per rank: the engine paused with ``POST /pause?mode=keep``
(it pauses both ranks), vLLM's per-rank gauges, each rank's document, each rank's KV events
and a daemon poll made inside the pause are compared.

This module stops the session server first (it is the suite's last module, after
test_vllm_ledger.py, whose last test is done with it) so the two-rank engine has the machine.
"""

from __future__ import annotations

import math
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harness.kvledger_daemon import Daemon, run_serve

from .conftest import stop_shared_servers, track_server
from .kv_events import EventBatch, KvEventSubscriber, iter_events, replay
from .server import (
    BLOCK_SIZE,
    KV_CACHE_MEMORY_BYTES,
    MAX_MODEL_LEN,
    NUM_GPU_BLOCKS,
    VllmServer,
    run_burst,
    unique_suffix_ids,
    words,
)
from .test_kvledger_on_vllm import Scrape, cached_count_by_events_applied, engine_pids, polled_after, wait_for_scrape

pytestmark = [pytest.mark.vllm, pytest.mark.fresh_engine("stops the shared server for its own two-rank shape")]

ENGINE = "tiny"
RANKS = ("0", "1")
SCHEDULER = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
CAPACITY = NUM_GPU_BLOCKS - 1  # per rank: --kv-cache-memory-bytes sizes each engine core
BLOCK_BYTES = KV_CACHE_MEMORY_BYTES // NUM_GPU_BLOCKS
INTERVAL = 0.2
TIMEOUT = 3.0  # the daemon's per-engine deadline (each of /metrics and the ledger)
BURST_REQUESTS = 12  # the API servers spread them over the two ranks
PREFIX, SUFFIX, MAX_TOKENS = 256, 32, 600
SLICE = 0.12
MAX_POINTS = 10
STARTUP_TIMEOUT = 300.0  # two engine cores and two API servers on two shared cores


def port_run(n: int) -> int:
    """The first of ``n`` consecutive TCP ports free now, below the ephemeral range (vLLM
    binds rank r's KV-event ports at port + r, and takes ephemeral ports of its own while
    it starts: a run there could be taken meanwhile)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports")


class DpServer(VllmServer):
    """The session server's flags plus two DP ranks and the async scheduler; rank r's KV
    events on ``kv_events_port + r`` (replay ``replay_port + r``), its ledger at
    ``ledger-r.sock``."""

    @property
    def ledger_url(self) -> str:
        return f"unix://{self._work_dir}/ledger-{{dp_rank}}.sock"

    def ledger_of(self, rank: str, timeout: float = 10.0) -> dict[str, Any]:
        return self.ledger_document(timeout, self._work_dir / f"ledger-{rank}.sock")

    def engine_requests(self) -> int:
        """Both ranks' requests, as their ledgers last published them."""
        return sum(len(self.ledger_of(rank)["requests"]) for rank in RANKS)

    def rank_events_url(self, rank: str) -> str:
        return f"tcp://127.0.0.1:{self.kv_events_port + int(rank)}"

    def rank_replay_url(self, rank: str) -> str:
        return f"tcp://127.0.0.1:{self.replay_port + int(rank)}"

    def api_server_pids(self) -> list[int]:
        """vLLM's API-server processes (``VLLM::APIServer_i``): they answer /metrics."""
        out = []
        for pid in engine_pids(self):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"APIServer" in title:
                out.append(pid)
        return out


@dataclass(frozen=True)
class RankState:
    """vLLM's own gauges for one rank."""

    used_blocks: float
    running: float
    waiting: float


def rank_states(text: str) -> dict[str, RankState]:
    """Per rank that has gauges: usage x capacity, running, waiting."""
    wanted = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
    found: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        name, brace, rest = line.partition("{")
        if brace and name in wanted:
            for rank in RANKS:
                if f'engine="{rank}"' in rest:
                    assert (name, rank) not in found, f"two samples of {name}{{engine={rank}}}"
                    found[name, rank] = float(line.rsplit(" ", 1)[1])
    return {
        rank: RankState(found[wanted[0], rank] * CAPACITY, found[wanted[1], rank], found[wanted[2], rank])
        for rank in RANKS
        if all((name, rank) in found for name in wanted)
    }


class RankEvents:
    """Each rank's KV events: live (SUB) plus the replay from seq 0."""

    def __init__(self, server: DpServer) -> None:
        self.server = server
        self.subs = {rank: KvEventSubscriber(server.rank_events_url(rank)) for rank in RANKS}

    def cached(self) -> dict[str, int]:
        """Per rank: stored-minus-removed blocks over the whole run, once the stream is quiet."""
        out = {}
        for rank, sub in self.subs.items():
            live = sub.wait_quiet(quiet=0.3)
            by_seq = {b.seq: b for b in replay(self.server.rank_replay_url(rank), 0)}
            for b in live:
                by_seq.setdefault(b.seq, b)
            seqs = sorted(by_seq)
            assert seqs == list(range(len(seqs))), f"our copy of rank {rank}'s KV events has a gap"
            batches: list[EventBatch] = [by_seq[s] for s in seqs]
            out[rank] = cached_count_by_events_applied(batches)[len(list(iter_events(batches)))]
        return out

    def close(self) -> None:
        for sub in self.subs.values():
            sub.close()


@dataclass
class Point:
    label: str
    vllm: dict[str, RankState]
    docs: dict[str, dict[str, Any]]
    scrape: Scrape
    cached: dict[str, int]

    def pool(self, rank: str) -> dict[str, Any]:
        (pool,) = self.docs[rank]["pools"]
        assert pool["id"] == rank
        return pool  # type: ignore[no-any-return]

    def in_use(self, rank: str) -> int:
        return int(self.pool(rank)["blocks"]["in_use"])

    def reclaimable(self, rank: str) -> int:
        return int(self.pool(rank)["blocks"]["reclaimable"])

    def rows(self, rank: str, *states: str) -> list[dict[str, Any]]:
        return [r for r in self.docs[rank]["requests"] if not states or r["state"] in states]

    def describe(self) -> str:
        parts = []
        for rank in RANKS:
            v = self.vllm.get(rank)
            p = self.pool(rank)
            parts.append(f"rank {rank}: vLLM {v}; ledger {p['blocks']} refs {p['references']} requests "
                         f"{[(r['state'], r['blocks_held']) for r in self.rows(rank)]}; events cached {self.cached.get(rank)}")
        return f"{self.label}: " + " | ".join(parts)


def scrape_blocks(s: Scrape, rank: str, state: str) -> float | None:
    return s.get("kvledger_kv_blocks", engine=ENGINE, pool=rank, state=state)


def scrape_basis(s: Scrape, name: str, rank: str) -> dict[str, float]:
    return {lab["basis"]: v for lab, v in s.find(name, engine=ENGINE, pool=rank)}


def both_exact(s: Scrape) -> bool:
    return s.up("vllm") == 1 and s.up("ledger") == 1 and all(
        set(scrape_basis(s, "kvledger_kv_reserved_bytes", rank)) == {"exact"} for rank in RANKS)


def reservation_blocks(row: dict[str, Any]) -> int:
    """docs/design.md §2: T = ceil(min(P + O + k, L) / B); n = 1 (vLLM fans n out as requests)."""
    tokens = min(row["prompt_tokens"] + row["max_output_tokens"] + row["speculative_slots"], MAX_MODEL_LEN)
    return math.ceil(tokens / BLOCK_SIZE)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DpServer]:
    stop_shared_servers()
    base = port_run(5)  # HTTP, then two KV-event ports and two replay ports
    log = tmp_path_factory.mktemp("vllm-dp-log") / "vllm.log"
    server = DpServer(tiny_model_dir, base, base + 1, base + 3, log_path=log, startup_timeout=STARTUP_TIMEOUT,
                      extra_args=("--data-parallel-size", "2", "--scheduler-cls", SCHEDULER))
    track_server(server)
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def daemon(dp_server: DpServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    work = tmp_path_factory.mktemp("kvledger-vllm-dp")
    config = work / "kvledger.yaml"
    config.write_text(
        f"""\
interval_seconds: {INTERVAL}
nvml: {{enabled: false}}
engines:
  - name: {ENGINE}
    kind: vllm
    url: {dp_server.metrics_url}
    timeout_seconds: {TIMEOUT}
    ledger: {dp_server.ledger_url}
    kv_events: {dp_server.rank_events_url("0")}
    kv_events_replay: {dp_server.rank_replay_url("0")}
"""
    )
    with run_serve(work, config) as d:
        yield d


@dataclass
class Record:
    log: str = ""
    fresh_metrics: dict[str, RankState] = field(default_factory=dict)
    fresh: Scrape | None = None
    one_rank_metrics: dict[str, RankState] = field(default_factory=dict)
    one_rank: Scrape | None = None
    metrics_down: Scrape | None = None
    points: list[Point] = field(default_factory=list)
    idle_after: Point | None = None
    burst_statuses: list[int] = field(default_factory=list)

    def summary(self) -> str:
        return "\n".join(p.describe() for p in [*self.points, *([self.idle_after] if self.idle_after else [])])


def capture(label: str, server: DpServer, daemon_url: str, events: RankEvents) -> Point:
    """Everything at one point, per rank; the engine must be paused (or idle)."""
    before = rank_states(server.metrics_text())
    for _ in range(25):
        time.sleep(0.2)
        now = rank_states(server.metrics_text())
        if now == before:
            break
        before = now
    else:
        raise AssertionError(f"vLLM /metrics still moving while paused: {before}")
    stable_since = time.time()
    docs = {rank: server.ledger_of(rank) for rank in RANKS}
    cached = events.cached()
    scrape = wait_for_scrape(daemon_url, lambda s: polled_after(stable_since)(s) and s.up("ledger") == 1, 30,
                             "a poll of vLLM and both ledgers inside the pause")
    assert rank_states(server.metrics_text()) == before, f"{label}: vLLM moved while paused"
    again = {rank: server.ledger_of(rank) for rank in RANKS}
    for rank in RANKS:
        assert again[rank]["pools"] == docs[rank]["pools"] and again[rank]["requests"] == docs[rank]["requests"], (
            f"{label}: rank {rank}'s ledger moved while paused")
    return Point(label, before, docs, scrape, cached)


@pytest.fixture(scope="module")
def record(dp_server: DpServer, daemon: Daemon) -> Iterator[Record]:
    server = dp_server
    rec = Record()
    # 1. fresh: no rank has served a request, so vLLM's /metrics has no usage gauge
    rec.fresh_metrics = rank_states(server.metrics_text())
    rec.fresh = wait_for_scrape(daemon.url, both_exact, 60, "both ranks exact on a fresh engine")
    # 2. one request: one rank gets its gauges, the other has none yet
    result = server.complete(words(unique_suffix_ids(1, 40)), 4)
    assert result.status == 200, result.body
    # the rank that served it has its gauges once its stats reach the API server
    deadline = time.monotonic() + 30
    while not (states := rank_states(server.metrics_text())):
        assert time.monotonic() < deadline, "no rank's gauges on /metrics 30 s after a request"
        time.sleep(0.1)  # pacing of the poll
    rec.one_rank_metrics = states
    if len(rec.one_rank_metrics) == 1:
        since = time.time()
        rec.one_rank = wait_for_scrape(daemon.url, lambda s: polled_after(since)(s) and both_exact(s), 30,
                                       "both ranks exact while /metrics shows one")
    # 3. the API servers stopped: /metrics does not answer, the ledgers do
    api = server.api_server_pids()
    assert api, "no VLLM::APIServer process found"
    try:
        for pid in api:
            os.kill(pid, signal.SIGSTOP)
        rec.metrics_down = wait_for_scrape(
            daemon.url, lambda s: s.up("metrics") == 0 and both_exact(s), 4 * TIMEOUT + 10,
            "the ledgers exported while /metrics does not answer")
    finally:
        for pid in api:
            os.kill(pid, signal.SIGCONT)

    # 4. frozen points through a burst spread over both ranks
    events = RankEvents(server)
    try:
        for sub in events.subs.values():
            sub.wait_joined()  # (cached() also fills what the live stream missed from the replay)
        server.wait_idle()
        results: dict[str, Any] = {}
        burst = threading.Thread(target=lambda: results.update(burst=run_burst(
            server.base_url, requests=BURST_REQUESTS, prefix_tokens=PREFIX, suffix_tokens=SUFFIX,
            max_tokens=MAX_TOKENS, sample_every=None)), daemon=True)
        server.pause()
        try:
            burst.start()
            server.wait_engine_holds(BURST_REQUESTS)  # the requests reach both engines and wait
            while burst.is_alive() and len(rec.points) < MAX_POINTS:
                server.resume()
                time.sleep(SLICE)  # engine time between two frozen points: the slice is the test's pacing
                server.pause()
                rec.points.append(capture(f"point {len(rec.points) + 1}", server, daemon.url, events))
        finally:
            server.resume()
        burst.join(300)
        rec.burst_statuses = [r.status for r in results["burst"].results]
        server.wait_idle()  # the frozen point's own waits take the last outputs in
        server.pause()
        try:
            rec.idle_after = capture("idle after", server, daemon.url, events)
        finally:
            server.resume()
        rec.log = server.log_path.read_text(errors="replace")
        print(rec.summary())
        yield rec
    finally:
        events.close()


# ---------------------------------------------------------------- tests


def test_each_rank_serves_its_own_socket_under_the_async_scheduler(record: Record) -> None:
    for rank in RANKS:
        lines = [line for line in record.log.splitlines() if f"serving the KV ledger of data-parallel rank {rank} " in line]
        assert len(lines) == 1, lines
        assert f"ledger-{rank}.sock" in lines[0] and lines[0].endswith("; AsyncScheduler)"), lines[0]
    assert "integration is off" not in record.log


def test_a_fresh_two_rank_engine_is_exact_before_metrics_has_its_gauges(record: Record) -> None:
    assert record.fresh_metrics == {}  # vLLM: no usage gauge before a rank has served a request
    s = record.fresh
    assert s is not None and (s.up("vllm"), s.up("ledger"), s.up("metrics")) == (1, 1, 0)
    for rank in RANKS:
        assert scrape_blocks(s, rank, "in_use") == 0
        assert s.get("kvledger_kv_capacity_bytes", engine=ENGINE, pool=rank) == CAPACITY * BLOCK_BYTES
        assert scrape_basis(s, "kvledger_kv_reclaimable_bytes", rank) == {"exact": 0.0}


def test_a_rank_without_its_gauges_is_exact(record: Record) -> None:
    if record.one_rank is None:
        pytest.skip(f"both ranks had gauges after one request: {record.one_rank_metrics}")
    s = record.one_rank
    assert (s.up("ledger"), s.up("metrics")) == (1, 1)
    for rank in RANKS:
        assert s.get("kvledger_kv_capacity_bytes", engine=ENGINE, pool=rank) == CAPACITY * BLOCK_BYTES
        assert set(scrape_basis(s, "kvledger_kv_reserved_bytes", rank)) == {"exact"}


def test_the_ledgers_are_exported_while_metrics_does_not_answer(record: Record) -> None:
    s = record.metrics_down
    assert s is not None and (s.up("vllm"), s.up("ledger"), s.up("metrics")) == (1, 1, 0)
    for rank in RANKS:
        assert s.get("kvledger_kv_capacity_bytes", engine=ENGINE, pool=rank) == CAPACITY * BLOCK_BYTES
        assert scrape_blocks(s, rank, "in_use") == 0  # idle (the requests so far finished)
    assert s.get("kvledger_preemptions_total", engine=ENGINE) is None  # what only /metrics says is unknown


def test_in_use_and_request_counts_equal_vllm_on_each_rank(record: Record) -> None:
    assert record.burst_statuses == [200] * BURST_REQUESTS
    points = [*record.points, *([record.idle_after] if record.idle_after else [])]
    for rank in RANKS:  # both ranks were busy at some point: the burst reached both engines
        assert [p for p in record.points if p.in_use(rank) > 0], record.summary()
    for p in points:
        assert p.scrape.up("ledger") == 1 and p.scrape.up("vllm") == 1, p.describe()
        for rank in RANKS:
            pool = p.pool(rank)
            assert (pool["num_blocks"], pool["block_size"], pool["block_bytes"]) == (CAPACITY, BLOCK_SIZE, BLOCK_BYTES)
            v = p.vllm.get(rank)
            if v is None:  # this rank has not served a request: vLLM shows no gauge, the ledger an idle pool
                assert p.in_use(rank) == 0 and p.rows(rank) == [], p.describe()
            else:
                assert p.in_use(rank) == round(v.used_blocks), p.describe()
                assert len(p.rows(rank, "running")) == v.running, p.describe()
                assert len(p.rows(rank, "waiting", "preempted")) == v.waiting, p.describe()
            assert scrape_blocks(p.scrape, rank, "in_use") == p.in_use(rank), p.describe()
            assert pool["blocks"]["free"] == CAPACITY - p.in_use(rank) - p.reclaimable(rank)
            assert set(scrape_basis(p.scrape, "kvledger_kv_reserved_bytes", rank)) == {"exact"}, p.describe()


def test_reclaimable_is_the_cached_unreferenced_blocks_on_each_rank(record: Record) -> None:
    for p in record.points:
        for rank in RANKS:
            # H cached blocks by the rank's events, U in use: the unreferenced cached ones lie in [H - U, H]
            h, u, r = p.cached[rank], p.in_use(rank), p.reclaimable(rank)
            assert max(0, h - u) <= r <= min(h, CAPACITY - u), p.describe()
            assert scrape_basis(p.scrape, "kvledger_kv_reclaimable_bytes", rank) == {"exact": r * BLOCK_BYTES}
    idle = record.idle_after
    assert idle is not None
    for rank in RANKS:
        assert idle.in_use(rank) == 0 and idle.reclaimable(rank) == idle.cached[rank], idle.describe()
    assert sum(idle.reclaimable(rank) for rank in RANKS) > 0  # the burst left prefixes cached


def test_each_reservation_follows_the_policy_on_each_rank(record: Record) -> None:
    for p in record.points:
        for rank in RANKS:
            admitted = p.rows(rank, "running", "preempted")
            for row in admitted:
                assert row["pool"] == rank and row["output_bound"] == "cap" and row["contexts"] == 1
                assert row["prompt_tokens"] == PREFIX + SUFFIX and row["max_output_tokens"] == MAX_TOKENS
                assert row["computed_tokens"] <= row["blocks_held"] * BLOCK_SIZE
            expected = sum(max(reservation_blocks(r), r["blocks_held"]) for r in admitted)  # per-request sharing
            assert scrape_basis(p.scrape, "kvledger_kv_reserved_bytes", rank) == {"exact": expected * BLOCK_BYTES}, p.describe()
            held = sum(r["blocks_held"] for r in p.rows(rank))
            assert held == p.pool(rank)["references"], p.describe()  # every reference belongs to a request
