"""kvledger's in-engine vLLM ledger on the real engine: exact numbers, checked at frozen points.

The session server runs with the integration enabled (``KVLEDGER_VLLM_LEDGER`` names a Unix
socket, ``KVLEDGER_VLLM_TENANT=request`` and the ``TenantHeader`` middleware: see server.py).
One daemon (a real process) reads it through /metrics, the ledger socket and the KV events.

Frozen points: the engine is paused with vLLM's own ``POST /pause?mode=keep``: it stops
stepping and its requests keep their blocks, while the EngineCore process keeps running, so
the ledger (a thread of that process) answers. SIGSTOP, which the /metrics suite uses, would
freeze the ledger too. At each point vLLM's /metrics, the ledger document, our own copy of the
KV-event stream and a daemon poll made inside the pause are compared.

A real Prometheus with kvledger's rules (the generator's test variant: every ``for`` is 0 s)
scrapes the daemon all along, to show the overcommit alert firing on a vLLM.

The last test restarts the shared server with the integration off (vLLM unchanged, the daemon
falls back to the /metrics bounds): this module must stay the last one on the session server
(test_vllm_ledger_dp_async.py, after it, stops that server and runs its own).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from alerts_support import load

from harness.kvledger_daemon import Daemon, run_serve
from harness.prometheus import PrometheusServer, start_prometheus

from .kv_events import iter_events
from .server import (
    BLOCK_SIZE,
    KV_CACHE_MEMORY_BYTES,
    MAX_MODEL_LEN,
    NUM_GPU_BLOCKS,
    REPO_ROOT,
    VllmServer,
    complete,
    run_burst,
    shared_prefix_ids,
    unique_suffix_ids,
    vllm_python,
    words,
)
from .test_kvledger_on_vllm import (
    EventStream,
    Scrape,
    VllmState,
    cached_count_by_events_applied,
    polled_after,
    wait_for_scrape,
)

pytestmark = pytest.mark.vllm

ENGINE = "tiny"
POOL = "0"
CAPACITY = NUM_GPU_BLOCKS - 1
BLOCK_BYTES = KV_CACHE_MEMORY_BYTES // NUM_GPU_BLOCKS
INTERVAL = 0.2
BURST_REQUESTS = 8
PREFIX, SUFFIX, MAX_TOKENS = 256, 32, 700  # 8 x ceil(988 / 32) = 248 blocks of caps against 127
SLICE = 0.12
MAX_POINTS = 25
MAX_POINTS_UNTIL_PREEMPTED = 150
ALERT = "KVLedgerOvercommitHigh"
ALERT_PARTS = (  # what the alert needs, queried when it does not fire
    'kvledger_kv_reserved_bytes{basis="exact"} / on (job, instance, engine, pool) group_left () kvledger_kv_capacity_bytes',
    "kvledger_preemptions_total",
    "rate(kvledger_preemptions_total[10m])",
    "kvledger_policy_info",
)


# ---------------------------------------------------------------- one frozen point


@dataclass
class Point:
    label: str
    vllm: VllmState
    doc: dict[str, Any]
    scrape: Scrape
    cached: int  # blocks holding cached data by our copy of the KV events (stored - removed)

    @property
    def pool(self) -> dict[str, Any]:
        pools = self.doc["pools"]
        assert len(pools) == 1
        return pools[0]  # type: ignore[no-any-return]

    @property
    def in_use(self) -> int:
        return int(self.pool["blocks"]["in_use"])

    @property
    def reclaimable(self) -> int:
        return int(self.pool["blocks"]["reclaimable"])

    def rows(self, *states: str) -> list[dict[str, Any]]:
        return [r for r in self.doc["requests"] if not states or r["state"] in states]

    def describe(self) -> str:
        p = self.pool
        states = [(r["state"], r["blocks_held"]) for r in self.rows()]
        return (f"{self.label}: vLLM used {self.vllm.used_blocks:g} running {self.vllm.running:g} waiting "
                f"{self.vllm.waiting:g}; ledger {p['blocks']} refs {p['references']} shared {p['shared']} "
                f"requests {states}; events cached {self.cached}")


def settle_vllm(server: VllmServer) -> VllmState:
    """vLLM's /metrics once two reads 0.2 s apart agree (outputs in flight applied)."""
    before = VllmState.of(server.metrics_text())
    for _ in range(25):
        time.sleep(0.2)
        now = VllmState.of(server.metrics_text())
        if now == before:
            return now
        before = now
    raise AssertionError(f"vLLM /metrics still moving while paused: {before}")


def capture(label: str, server: VllmServer, daemon_url: str, stream: EventStream) -> Point:
    """Everything at one point; the engine must be paused (or idle)."""
    vllm = settle_vllm(server)
    stable_since = time.time()
    doc = server.ledger_document()
    batches = stream.settle(quiet=0.3)
    cached = cached_count_by_events_applied(batches)[len(list(iter_events(batches)))]
    scrape = wait_for_scrape(daemon_url, lambda s: polled_after(stable_since)(s) and s.up("ledger") == 1, 20,
                             "a poll of vLLM and its ledger inside the pause")
    assert VllmState.of(server.metrics_text()) == vllm, f"{label}: vLLM moved while paused"
    again = server.ledger_document()
    assert again["pools"] == doc["pools"] and again["requests"] == doc["requests"], f"{label}: ledger moved while paused"
    return Point(label, vllm, doc, scrape, cached)


def reservation_blocks(row: dict[str, Any], speculative: int = 0) -> int:
    """docs/design.md §2: T = ceil(min(P + O + k, L) / B); n = 1 (vLLM fans n out as requests)."""
    tokens = min(row["prompt_tokens"] + row["max_output_tokens"] + speculative, MAX_MODEL_LEN)
    return math.ceil(tokens / BLOCK_SIZE)


# ---------------------------------------------------------------- the scenario


@dataclass
class Record:
    idle_before: Point
    points: list[Point] = field(default_factory=list)
    alert_seen_at: str | None = None
    alerts_at_fire: list[dict[str, Any]] = field(default_factory=list)
    alert_diagnosis: dict[str, Any] = field(default_factory=dict)
    overcommit_point: Point | None = None
    n_point: Point | None = None
    idle_after: Point | None = None
    aborted_status: str = ""
    burst_statuses: list[int] = field(default_factory=list)

    def all_points(self) -> list[Point]:
        out = [self.idle_before, *self.points]
        if self.overcommit_point:
            out.append(self.overcommit_point)
        if self.n_point:
            out.append(self.n_point)
        if self.idle_after:
            out.append(self.idle_after)
        return out

    def summary(self) -> str:
        return "\n".join(p.describe() for p in self.all_points())


@pytest.fixture(scope="module")
def daemon(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    work = tmp_path_factory.mktemp("kvledger-vllm-ledger")
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
    ledger: {vllm_server.ledger_url}
    kv_events: {vllm_server.events_url}
    kv_events_replay: {vllm_server.replay_url}
    tenants:  # only configured tenants get series (bounded cardinality)
      - {{name: team-n, quota_bytes: 1048576}}
"""
    )
    with run_serve(work, config) as d:
        wait_for_scrape(d.url, lambda s: s.up("vllm") == 1 and s.up("ledger") == 1 and s.up("kv_events") == 1, 60,
                        "vllm, ledger and kv_events sources up")
        yield d


@pytest.fixture(scope="module")
def prometheus(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    work = tmp_path_factory.mktemp("prometheus-vllm-ledger")
    rules = work / "rules.yml"
    rules.write_text(load("generate").render(for_override="0s"))
    with start_prometheus(work, targets=[daemon.url.removeprefix("http://")], rule_files=[rules]) as prom:
        prom.wait_for_target_up(timeout=30)
        yield prom


def firing(prom: PrometheusServer, name: str) -> list[dict[str, Any]]:
    return [a for a in prom.alerts() if a["labels"]["alertname"] == name and a["state"] == "firing"]


def _saw_preempted(rec: Record) -> bool:
    return any(p.rows("preempted") for p in rec.points)


@pytest.fixture(scope="module")
def record(vllm_server: VllmServer, daemon: Daemon, prometheus: PrometheusServer) -> Iterator[Record]:
    server = vllm_server
    stream = EventStream(server)
    try:
        stream.sub.wait_joined()  # (settle() also fills what the live stream missed from the replay)
        server.wait_idle()
        rec = Record(capture("idle before", server, daemon.url, stream))
        results: dict[str, Any] = {}
        burst = threading.Thread(target=lambda: results.update(burst=run_burst(
            server.base_url, requests=BURST_REQUESTS, prefix_tokens=PREFIX, suffix_tokens=SUFFIX,
            max_tokens=MAX_TOKENS, sample_every=None)), daemon=True)
        server.pause()
        try:
            burst.start()
            server.wait_engine_holds(BURST_REQUESTS)  # the requests reach the engine and wait
            # MAX_POINTS, or more until one shows a preempted request: on a loaded machine a
            # slice holds fewer steps, and 25 of them can end before the pool runs out
            while burst.is_alive() and len(rec.points) < (MAX_POINTS if _saw_preempted(rec) else MAX_POINTS_UNTIL_PREEMPTED):
                server.resume()
                time.sleep(SLICE)  # engine time between two frozen points: the slice is the test's pacing
                server.pause()
                point = capture(f"point {len(rec.points) + 1}", server, daemon.url, stream)
                rec.points.append(point)
        finally:
            server.resume()
        burst.join(300)
        rec.burst_statuses = [r.status for r in results["burst"].results]

        # the overcommit alert: vLLM has preempted (it counts a preemption when the request's
        # next output arrives, so the counter rose during the burst); now a second burst is
        # admitted whole (8 x 9 prompt blocks fit) while its caps need 248 of 127 blocks
        server.wait_idle()
        second = threading.Thread(target=lambda: run_burst(
            server.base_url, requests=BURST_REQUESTS, prefix_tokens=PREFIX, suffix_tokens=SUFFIX,
            max_tokens=MAX_TOKENS, sample_every=None), daemon=True)
        server.pause()
        try:
            second.start()
            server.wait_engine_holds(BURST_REQUESTS)  # the second burst reaches the engine and waits
            for _ in range(10):
                server.resume()
                time.sleep(SLICE)  # engine time between two frozen points
                server.pause()
                point = capture("overcommitted", server, daemon.url, stream)
                if sum(reservation_blocks(r) for r in point.rows("running", "preempted")) > 1.2 * CAPACITY:
                    break
            rec.overcommit_point = point
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (found := firing(prometheus, ALERT)):
                time.sleep(0.5)
            if found:
                rec.alert_seen_at, rec.alerts_at_fire = point.label, found
            else:
                rec.alert_diagnosis = {q: prometheus.query(q) for q in ALERT_PARTS}
        finally:
            server.resume()
        second.join(300)

        # n > 1, with a tenant header: three requests in the engine sharing the prompt's blocks
        server.wait_idle()
        prompt = words(shared_prefix_ids(100)[::-1])  # 100 tokens: 3 full blocks shared by the 3 samples
        n_done = threading.Thread(target=lambda: complete(server.base_url, prompt, 400, n=3,
                                                          headers={"X-Tenant": "team-n"}), daemon=True)
        server.pause()
        try:
            n_done.start()
            server.wait_engine_holds(3)  # the request's three samples are three requests in the engine
            server.resume()
            time.sleep(0.3)  # engine time: a few steps of the three samples before the frozen point
            server.pause()
            rec.n_point = capture("n=3", server, daemon.url, stream)
        finally:
            server.resume()
        n_done.join(120)

        # a client that goes away: vLLM aborts its request
        server.wait_idle()
        try:
            complete(server.base_url, words(unique_suffix_ids(99, 64)), 900, timeout=1.0)
            rec.aborted_status = "completed"
        except (TimeoutError, urllib.error.URLError, OSError) as exc:
            rec.aborted_status = f"client gave up: {type(exc).__name__}"
        server.wait_idle()  # no request left: the frozen point's own waits (settle_vllm, the event
        server.pause()      # stream's quiet, the poll after the pause) take the last outputs in
        try:
            rec.idle_after = capture("idle after", server, daemon.url, stream)
        finally:
            server.resume()
        print(rec.summary())
        yield rec
    finally:
        stream.close()


# ---------------------------------------------------------------- tests


def test_ledger_is_read_and_exact(record: Record) -> None:
    assert record.burst_statuses == [200] * BURST_REQUESTS
    for p in record.all_points():
        s = p.scrape
        assert (s.up("vllm"), s.up("ledger"), s.up("kv_events")) == (1, 1, 1), p.describe()
        assert set(s.by_basis("kvledger_kv_reserved_bytes")) == {"exact"}, p.describe()
        assert set(s.by_basis("kvledger_kv_reclaimable_bytes")) == {"exact"}, p.describe()
        assert p.pool["block_size"] == BLOCK_SIZE and p.pool["num_blocks"] == CAPACITY
        assert p.pool["block_bytes"] == BLOCK_BYTES  # from the engine's own KV-cache allocation
        assert s.get("kvledger_kv_capacity_bytes", engine=ENGINE, pool=POOL) == CAPACITY * BLOCK_BYTES


def test_in_use_and_request_counts_equal_vllm(record: Record) -> None:
    busy = [p for p in record.points if p.in_use > 0]
    assert len(busy) >= 3, record.summary()
    for p in record.all_points():
        assert p.in_use == round(p.vllm.used_blocks), p.describe()
        assert p.scrape.in_use() == p.in_use, p.describe()
        assert len(p.rows("running")) == p.vllm.running, p.describe()
        assert len(p.rows("waiting", "preempted")) == p.vllm.waiting, p.describe()
        assert p.scrape.requests("running") == p.vllm.running, p.describe()
        assert p.pool["blocks"]["free"] == CAPACITY - p.in_use - p.reclaimable


def test_reclaimable_agrees_with_the_kv_event_multiset(record: Record) -> None:
    for p in record.all_points():
        # H cached blocks by the events, U in use: the unreferenced cached ones lie in [H - U, H]
        assert max(0, p.cached - p.in_use) <= p.reclaimable <= min(p.cached, CAPACITY - p.in_use), p.describe()
        assert p.scrape.by_basis("kvledger_kv_reclaimable_bytes") == {"exact": p.reclaimable * BLOCK_BYTES}
    for p in (record.idle_before, record.idle_after):
        assert p is not None and p.in_use == 0
        assert p.reclaimable == p.cached, p.describe()  # idle: every cached block is reclaimable
    assert record.idle_after is not None and record.idle_after.reclaimable > 0  # the burst left prefixes cached


def test_each_reservation_follows_the_policy(record: Record) -> None:
    for p in record.points:
        admitted = p.rows("running", "preempted")
        for row in admitted:
            assert row["output_bound"] == "cap" and row["contexts"] == 1 and row["speculative_slots"] == 0
            assert row["prompt_tokens"] == PREFIX + SUFFIX and row["max_output_tokens"] == MAX_TOKENS
            assert row["computed_tokens"] <= row["blocks_held"] * BLOCK_SIZE
        expected = sum(max(reservation_blocks(r), r["blocks_held"]) for r in admitted)  # per-request sharing
        assert p.scrape.by_basis("kvledger_kv_reserved_bytes") == {"exact": expected * BLOCK_BYTES}, p.describe()
        held = sum(r["blocks_held"] for r in p.rows())
        assert held == p.pool["references"], p.describe()  # every reference belongs to a request


def test_shared_prefixes_make_references_exceed_in_use(record: Record) -> None:
    shared = [p for p in record.points if len(p.rows("running")) >= 2]
    assert shared, record.summary()
    for p in shared:
        assert p.pool["references"] > p.in_use >= p.pool["shared"] >= PREFIX // BLOCK_SIZE, p.describe()
        assert p.scrape.get("kvledger_kv_block_references", engine=ENGINE, pool=POOL) == p.pool["references"]
        assert p.scrape.get("kvledger_kv_shared_blocks", engine=ENGINE, pool=POOL) == p.pool["shared"]


def test_a_preempted_request_is_reported_preempted(record: Record) -> None:
    assert record.idle_after is not None
    assert record.idle_after.vllm.preemptions > record.idle_before.vllm.preemptions, record.summary()
    preempted = [p for p in record.points if p.rows("preempted")]
    assert preempted, record.summary()
    for p in preempted:
        assert all(r["blocks_held"] == 0 for r in p.rows("preempted")), p.describe()  # vLLM frees them
        assert p.scrape.requests("preempted") == len(p.rows("preempted"))


def test_n_samples_are_requests_sharing_the_prompt(record: Record) -> None:
    p = record.n_point
    assert p is not None
    rows = p.rows("running")
    assert len(rows) == 3, p.describe()
    assert {r["prompt_tokens"] for r in rows} == {100} and {r["max_output_tokens"] for r in rows} == {400}
    assert p.pool["references"] > p.in_use and p.pool["shared"] >= 100 // BLOCK_SIZE, p.describe()


def test_tenant_comes_from_the_header(record: Record) -> None:
    p = record.n_point
    assert p is not None
    assert {r.get("tenant") for r in p.rows()} == {"team-n"}
    assert p.scrape.get("kvledger_tenant_requests", engine=ENGINE, tenant="team-n", state="running") == 3
    expected = sum(max(reservation_blocks(r), r["blocks_held"]) for r in p.rows()) * BLOCK_BYTES
    assert p.scrape.get("kvledger_tenant_reserved_bytes", engine=ENGINE, tenant="team-n") == expected
    assert all("tenant" not in r for point in record.points for r in point.rows())  # the burst sent no header


def test_finished_and_aborted_requests_release_their_blocks(record: Record) -> None:
    p = record.idle_after
    assert p is not None
    assert record.aborted_status.startswith("client gave up"), record.aborted_status
    assert p.rows() == [] and p.in_use == 0 and p.pool["references"] == 0, p.describe()
    assert p.scrape.by_basis("kvledger_kv_reserved_bytes") == {"exact": 0.0}
    leaks = p.scrape.get("kvledger_reservation_leaks_total", engine=ENGINE)
    assert leaks in (None, 0.0)


def test_the_overcommit_alert_pages_on_vllm_with_the_real_rules(record: Record) -> None:
    assert record.alert_seen_at is not None, f"{record.summary()}\n{record.alert_diagnosis}"
    labels = record.alerts_at_fire[0]["labels"]
    assert (labels["engine"], labels["pool"], labels["basis"]) == (ENGINE, POOL, "exact")


def test_an_untested_vllm_release_is_one_log_line_and_no_change() -> None:
    script = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stdout, format='%(name)s %(levelname)s %(message)s')\n"
        "import vllm.version\n"
        "vllm.version.__version__ = '0.99.0'\n"
        "from vllm.config.scheduler import SchedulerConfig\n"
        "before = SchedulerConfig.get_scheduler_cls\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "print('unchanged' if SchedulerConfig.get_scheduler_cls is before else 'patched')\n"
    )
    env = {"KVLEDGER_VLLM_LEDGER": "unix:///tmp/kvledger-untested.sock", "PATH": "/usr/bin:/bin",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    out = subprocess.run([str(vllm_python()), "-c", script], capture_output=True, text=True, env=env, timeout=180,
                         cwd=REPO_ROOT)
    lines = [line for line in out.stdout.splitlines() if "kvledger" in line]
    assert out.stdout.splitlines()[-1] == "unchanged", out.stdout + out.stderr
    assert len(lines) == 1 and "0.99.0 is not a tested release" in lines[0], out.stdout + out.stderr
    assert not Path("/tmp/kvledger-untested.sock").exists()


@pytest.mark.fresh_engine("restarts the shared server without the integration")
def test_without_the_integration_vllm_is_unchanged_and_the_daemon_falls_back(
    vllm_server: VllmServer, daemon: Daemon, record: Record
) -> None:
    """Last: restarts the shared server with the integration off."""
    vllm_server.stop()
    vllm_server.ledger = False
    vllm_server.start()
    log = vllm_server.log_path.read_text(errors="replace").rsplit("==== start", 1)[1]
    # inert: not one line (the engine's own paths may name the machine's cache, ~/.cache/kvledger/vllm-<pins>)
    assert "kvledger" not in re.sub(r"\S*/\.cache/kvledger/\S*", "", log)
    with pytest.raises((ConnectionRefusedError, FileNotFoundError)):  # a killed engine may leave the file
        vllm_server.ledger_document()
    result = vllm_server.complete(words(unique_suffix_ids(7, 40)), 20)
    assert result.status == 200 and result.completion_tokens == 20
    s = wait_for_scrape(daemon.url, lambda s: s.up("vllm") == 1 and s.up("ledger") == 0, 60,
                        "vllm up and the ledger down after the restart without it")
    assert set(s.by_basis("kvledger_kv_reserved_bytes")) <= {"upper_bound"}
    reason = s.find("kvledger_source_errors_total", engine=ENGINE, source="ledger")
    assert sum(v for _, v in reason) > 0, reason  # a sub-source's failures count as "unavailable"
    assert json.dumps(s.by_basis("kvledger_kv_reclaimable_bytes"))  # bounds from the KV events, not exact
    assert "exact" not in s.by_basis("kvledger_kv_reclaimable_bytes") or s.in_use() == 0
