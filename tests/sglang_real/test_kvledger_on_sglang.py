"""`kvledger serve` against a real SGLang 0.5.23 (CPU): the stock /metrics path proven against
the engine's own state, counted independently inside the scheduler by the test-only recount
plugin (``recount_plugin/``: the allocator's free lists, the radix tree's device slots and every
live request's ``req_to_token`` row; never SGLang's gauges).

One daemon (a real process, interval 0.2 s) reads two engines: ``tiny``, the session server's
/metrics (``--decode-log-interval 1``: SGLang refreshes its gauges at every step), and
``tiny-old``, the same /metrics through a proxy that removes what builds before the kv_* token
gauges lack (the ``kv_*``, ``swa_*``/``mamba_*`` token triples, ``page_size``, ``num_pages``):
only ``num_used_tokens`` and ``token_usage`` are left for the pool.

Frozen points: ``POST /pause_generation {"mode": "in_place"}`` then ``GET /get_server_info``
(answered once the scheduler handled the pause). The engine is resumed, runs until its decode
counter (``sglang:realtime_tokens_total{mode="decode"}``, moved at every step) has advanced,
and is paused again: no fixed sleep decides what is compared. At each point the recount is read
twice (equal: frozen), and a daemon poll that began after the pause must show, in blocks of one
token: in-use, reclaimable and free equal to the recount (``tiny``), in-use exact and the
reclaimable and free upper bounds containing the recount (``tiny-old``), and the running and
waiting requests. Bursts share a prefix cached beforehand; a second scenario, without
``ignore_eos``, overcommits a 2,048-token pool so that SGLang retracts (the session server admits
such requests on 0.2 of their output: ``SGLANG_INIT_NEW_TOKEN_RATIO``, conftest.py): the daemon's
preemptions equal the retractions the recount's hook saw. The prefix-cache counters equal the sums of what
each /generate answer reports (``cached_tokens``, ``prompt_tokens``).
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.kvledger_daemon import Daemon, run_serve

from .conftest import EXACT_POOL_TOKENS
from .server import Generation, SglangServer, http_post_json, prefix_ids, suffix_ids

pytestmark = pytest.mark.sglang

ENGINE = "tiny"
OLD = "tiny-old"
POOL = "0"
INTERVAL = 0.2
PREFIX_TOKENS = 199
BURST = 6
SUFFIX_TOKENS = 20
BURST_NEW_TOKENS = 64
STEP_TOKENS = BURST * 8  # decode tokens (all requests together) between two frozen points: 8 steps
MAX_POINTS = 8
#: bytes of one token's KV in the tiny Llama: 2 layers x (K, V) x 2 KV heads x 32 x bf16 (SGLang does
#: not export it: the configuration states it, as a user does)
BLOCK_BYTES = 512

#: what a build before the kv_* token gauges does not export (docs/engines/sglang.md)
OLD_BUILD_LACKS = ("sglang:kv_", "sglang:swa_available", "sglang:swa_evictable", "sglang:swa_used_tokens",
                   "sglang:mamba_available", "sglang:mamba_evictable", "sglang:mamba_used_tokens",
                   "sglang:page_size", "sglang:num_pages")


# ---------------------------------------------------------------- reading the daemon


@dataclass(frozen=True)
class Scrape:
    samples: tuple[tuple[str, dict[str, str], float], ...]

    @classmethod
    def fetch(cls, url: str) -> Scrape:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return cls(tuple((s.name, dict(s.labels), float(s.value))
                         for family in text_string_to_metric_families(text) for s in family.samples))

    def find(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        return [(lab, v) for n, lab, v in self.samples if n == name and labels.items() <= lab.items()]

    def get(self, name: str, **labels: str) -> float | None:
        found = self.find(name, **labels)
        assert len(found) <= 1, f"{len(found)} samples of {name} {labels}"
        return found[0][1] if found else None

    def blocks(self, engine: str, state: str) -> float | None:
        return self.get("kvledger_kv_blocks", engine=engine, pool=POOL, state=state)

    def by_basis(self, name: str, engine: str) -> dict[str, float]:
        return {lab["basis"]: v for lab, v in self.find(name, engine=engine, pool=POOL)}

    def poll_started(self, engine: str) -> float:
        last = self.get("kvledger_source_last_success_timestamp_seconds", engine=engine, source="sglang")
        took = self.get("kvledger_source_duration_seconds", engine=engine, source="sglang")
        return (last or 0.0) - (took or 0.0)


def wait_for_scrape(url: str, condition: Callable[[Scrape], bool], timeout: float, what: str) -> Scrape:
    deadline = time.monotonic() + timeout
    while True:
        s = Scrape.fetch(url)
        if condition(s):
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"daemon: {what} not seen within {timeout} s")
        time.sleep(INTERVAL / 2)


def polled_after(t: float) -> Callable[[Scrape], bool]:
    """Both engines' latest polls began after ``t`` (the SGLang engine was frozen by then)."""
    return lambda s: all(s.poll_started(e) > t for e in (ENGINE, OLD))


# ---------------------------------------------------------------- an older build's /metrics


class OldBuildProxy:
    """Serves the real /metrics without what builds before the kv_* token gauges lack."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with urllib.request.urlopen(proxy.upstream, timeout=10) as resp:
                    text = resp.read().decode()
                kept = [line for line in text.splitlines()
                        if not any(line.startswith(p) or line.startswith(("# HELP " + p, "# TYPE " + p))
                                   for p in OLD_BUILD_LACKS)]
                body = ("\n".join(kept) + "\n").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True, name="old-build proxy").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def daemon(sglang_server: SglangServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    proxy = OldBuildProxy(sglang_server.metrics_url)
    work = tmp_path_factory.mktemp("kvledger-sglang")
    config = work / "kvledger.yaml"
    config.write_text(f"""\
interval_seconds: {INTERVAL}
nvml: {{enabled: false}}
engines:
  - name: {ENGINE}
    kind: sglang
    url: {sglang_server.metrics_url}
    timeout_seconds: 10
    block_bytes: {BLOCK_BYTES}
  - name: {OLD}
    kind: sglang
    url: {proxy.url}
    timeout_seconds: 10
    block_bytes: {BLOCK_BYTES}
    decode_log_interval: 1  # the proxy has no /server_info: the configuration states it
""")
    try:
        with run_serve(work, config) as d:
            wait_for_scrape(d.url, lambda s: all(s.get("kvledger_source_up", engine=e, source="sglang") == 1
                                                 for e in (ENGINE, OLD)), 60, "both engines up")
            yield d
    finally:
        proxy.close()


# ---------------------------------------------------------------- frozen points


@dataclass
class Point:
    label: str
    recount: dict[str, Any]
    scrape: Scrape

    def describe(self) -> str:
        r = self.recount
        return (f"{self.label}: recount in_use {r['in_use']} evictable {r['evictable']} free {r['free']} "
                f"running {r['running']} waiting {r['waiting']} retractions {len(r['retractions'])}; daemon "
                f"{[self.scrape.blocks(ENGINE, s) for s in ('in_use', 'reclaimable', 'free')]} running "
                f"{self.scrape.get('kvledger_requests', engine=ENGINE, state='running')}")


def capture(label: str, server: SglangServer, daemon_url: str) -> Point:
    """The recount and a daemon poll at one frozen point (the caller paused the engine)."""
    recount = server.recount()
    since = time.time()
    scrape = wait_for_scrape(daemon_url, polled_after(since), 30, "a poll of both engines inside the pause")
    again = server.recount()
    assert again == recount, f"{label}: the engine moved while paused"
    return Point(label, recount, scrape)


def frozen_points(label: str, server: SglangServer, daemon_url: str, alive: Callable[[], bool],
                  step_tokens: int = STEP_TOKENS, limit: int = MAX_POINTS) -> list[Point]:
    """Points while ``alive()``: run until ``step_tokens`` more tokens were decoded, pause, capture."""
    points: list[Point] = []
    while alive() and len(points) < limit:
        since = server.decoded_tokens()
        server.wait_decoded(since, step_tokens, stop=lambda: not alive())  # raises only when decoding stalls
        if not alive():
            break
        with server.frozen():
            points.append(capture(f"{label} {len(points) + 1}", server, daemon_url))
    return points


@dataclass
class Record:
    idle_prefix: Point
    burst_points: list[Point]
    idle_cached: Point
    generations: list[Generation]
    before: Scrape
    after: Scrape
    retraction_points: list[Point] = field(default_factory=list)
    retraction_results: list[tuple[int, dict[str, Any]]] = field(default_factory=list)

    def all_points(self) -> list[Point]:
        return [self.idle_prefix, *self.burst_points, self.idle_cached, *self.retraction_points]


def _idle_point(label: str, server: SglangServer, daemon_url: str) -> Point:
    server.wait_idle()
    with server.frozen():
        return capture(label, server, daemon_url)


@pytest.fixture(scope="module")
def record(sglang_server: SglangServer, daemon: Daemon) -> Record:
    server, url = sglang_server, daemon.url
    server.wait_idle()
    since = time.time()
    before = wait_for_scrape(url, polled_after(since), 30, "a poll before the scenario")  # counters only
    # /flush_cache empties the tree but refreshes none of SGLang's gauges (they move at the next
    # batch, or after 30 s idle): the prefix request that follows is that batch
    server.flush_cache()
    prefix = prefix_ids(PREFIX_TOKENS)
    first = server.generate(prefix, 4)  # the shared prefix cached first
    idle_prefix = _idle_point("idle, prefix cached", server, url)
    burst = server.burst([prefix + suffix_ids(i, SUFFIX_TOKENS) for i in range(BURST)], BURST_NEW_TOKENS)
    points = frozen_points("burst", server, url, burst.alive)
    generations = [first, *burst.join()]
    idle_cached = _idle_point("idle, prefix and outputs cached", server, url)
    rec = Record(idle_prefix, points, idle_cached, generations, before, idle_cached.scrape)
    _retraction_scenario(server, url, rec)
    for p in rec.all_points():
        print(p.describe())
    return rec


#: the overcommitted burst: RETRACT_REQUESTS x (RETRACT_PROMPT + RETRACT_NEW) tokens = 2,320 > the pool
RETRACT_REQUESTS, RETRACT_PROMPT, RETRACT_NEW = 20, 16, 100


def _retraction_scenario(server: SglangServer, url: str, rec: Record) -> None:
    """20 requests of 16 + up to 100 tokens against a 2,048-token pool, without ignore_eos:
    SGLang admits them on its new_token_ratio estimate (0.7 of the output at most) and must
    retract once they have grown past the pool (~86 steps). (``min_new_tokens`` would make
    SGLang book the whole output: no overcommit.) The tiny model's greedy output loops over a
    few words and rarely meets EOS; a request that does stops early, which only lowers the
    total."""
    server.flush_cache()
    results: list[tuple[int, dict[str, Any]] | None] = [None] * RETRACT_REQUESTS

    def one(i: int) -> None:
        body = {"input_ids": prefix_ids(RETRACT_PROMPT, offset=500 + 37 * i),
                "sampling_params": {"max_new_tokens": RETRACT_NEW, "temperature": 0.0}}
        status, text = http_post_json(f"{server.base_url}/generate", body)
        results[i] = (status, json.loads(text) if status == 200 else {"error": text})

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(RETRACT_REQUESTS)]
    for t in threads:
        t.start()
    rec.retraction_points = frozen_points("overcommitted", server, url, lambda: any(t.is_alive() for t in threads),
                                          step_tokens=RETRACT_REQUESTS * 20, limit=5)
    for t in threads:
        t.join(300)
    rec.retraction_results = [r for r in results if r is not None]
    rec.retraction_points.append(_idle_point("idle after the retractions", server, url))


# ---------------------------------------------------------------- the checks


def test_the_pool_is_the_engines_pool(sglang_server: SglangServer, record: Record) -> None:
    s = record.idle_prefix.scrape
    assert s.get("kvledger_kv_capacity_blocks", engine=ENGINE, pool=POOL) == EXACT_POOL_TOKENS
    assert s.get("kvledger_kv_block_size_tokens", engine=ENGINE, pool=POOL) == 1
    assert record.idle_prefix.recount["capacity"] == EXACT_POOL_TOKENS
    assert s.get("kvledger_source_refresh_interval_steps", engine=ENGINE, source="sglang") == 1  # read from /server_info
    assert s.get("kvledger_source_refresh_interval_steps", engine=OLD, source="sglang") == 1  # stated in the config


def test_the_recount_accounts_for_every_slot(record: Record) -> None:
    """Every slot of the pool is free, in the radix tree or in a live request's row, never two
    of these at once: the recount is a partition, so comparing with it means something."""
    for p in record.all_points():
        r = p.recount
        assert r["unaccounted"] == 0 and set(r["overlaps"].values()) == {0}, p.describe()
        assert r["free"] + r["evictable"] + r["in_use"] == r["capacity"], p.describe()


def test_in_use_reclaimable_and_free_equal_the_recount(record: Record) -> None:
    assert len(record.burst_points) >= 2, "the burst gave fewer than two frozen points"
    for p in record.all_points():
        r = p.recount
        assert p.scrape.blocks(ENGINE, "in_use") == r["in_use"], p.describe()
        assert p.scrape.blocks(ENGINE, "reclaimable") == r["evictable"], p.describe()
        assert p.scrape.blocks(ENGINE, "free") == r["free"], p.describe()
        assert p.scrape.by_basis("kvledger_kv_in_use_bytes", ENGINE).keys() <= {"exact"}


def test_the_burst_shares_its_prefix_and_idle_keeps_it_reclaimable(record: Record) -> None:
    busy = [p for p in record.burst_points if p.recount["running"] == BURST]
    assert busy, "no frozen point saw the whole burst running"
    for p in busy:  # six requests, one copy of the prefix: fewer slots than six prompts
        assert p.recount["in_use"] < BURST * (PREFIX_TOKENS + SUFFIX_TOKENS), p.describe()
        assert p.recount["in_use"] >= PREFIX_TOKENS + BURST * SUFFIX_TOKENS, p.describe()
    idle = record.idle_cached
    assert idle.scrape.blocks(ENGINE, "in_use") == 0 == idle.recount["in_use"]
    assert idle.recount["evictable"] >= PREFIX_TOKENS + BURST * (SUFFIX_TOKENS + BURST_NEW_TOKENS - 1)
    assert idle.scrape.blocks(ENGINE, "reclaimable") == idle.recount["evictable"]
    first = record.idle_prefix  # only the prefix request's tokens are cached (the flush emptied the rest)
    assert first.recount["in_use"] == 0 and PREFIX_TOKENS <= first.recount["evictable"] <= PREFIX_TOKENS + 4
    assert first.scrape.blocks(ENGINE, "free") == EXACT_POOL_TOKENS - first.recount["evictable"]


def test_running_and_waiting_requests(record: Record) -> None:
    """Waiting is exact. Running is SGLang's ``num_running_reqs``: the length of its running
    batch, where requests that finished in the last step stay until the next batch is formed
    (they hold no KV: in-use is exact). kvledger reads exactly that
    count, never fewer than the requests really running (seen in CI: 17 read, 0 running,
    every one of them finished in the step before the pause)."""
    for p in record.all_points():
        running = p.scrape.get("kvledger_requests", engine=ENGINE, state="running")
        assert running == p.recount["running_batch"], p.describe()
        assert running is not None and running >= p.recount["running"], p.describe()
        assert p.scrape.get("kvledger_requests", engine=ENGINE, state="waiting") == p.recount["waiting"], p.describe()
    assert any(p.recount["running"] > 0 for p in record.all_points())  # the points saw requests run


def test_prefix_cache_counters_equal_what_each_answer_reports(record: Record) -> None:
    """Hit tokens equal the sum of the answers' cached_tokens; queried tokens (SGLang's prefill
    cache plus compute counts) the sum of their prompt tokens, plus at most one token a request
    (seen on 0.5.23: 1,520 queried for 1,513 prompt tokens over seven requests, hits exact)."""
    gens = record.generations
    assert all(g.status == 200 for g in gens) and len(gens) == 1 + BURST
    hit = sum(g.cached_tokens or 0 for g in gens)
    queried = sum(g.prompt_tokens or 0 for g in gens)
    assert hit >= BURST * (PREFIX_TOKENS - 1)  # the burst found the prefix cached
    name_hit, name_q = "kvledger_prefix_cache_hit_tokens_total", "kvledger_prefix_cache_queried_tokens_total"
    delta = lambda n: (record.after.get(n, engine=ENGINE) or 0) - (record.before.get(n, engine=ENGINE) or 0)
    assert delta(name_hit) == hit
    assert queried <= delta(name_q) <= queried + len(gens)


def test_retractions_are_counted_and_the_pool_stays_exact(record: Record) -> None:
    assert [s for s, _ in record.retraction_results] == [200] * RETRACT_REQUESTS
    assert all(0 < doc["meta_info"]["completion_tokens"] <= RETRACT_NEW for _, doc in record.retraction_results)
    last = record.retraction_points[-1]
    retracted = len(last.recount["retractions"])
    assert retracted > 0, "SGLang did not retract: the pool was not overcommitted"
    assert last.scrape.get("kvledger_preemptions_total", engine=ENGINE) == retracted
    assert len(record.retraction_points) >= 2


def test_the_older_build_path_keeps_its_bounds_around_the_truth(record: Record) -> None:
    """Only num_used_tokens: in-use exact; free and reclaimable are known together, each bounded
    above by the unreferenced pages (no exact series, no zero lower bound); allocated lies between
    in-use and in-use plus them. The truth lies inside the bounds at every frozen point."""
    for p in record.all_points():
        r, s = p.recount, p.scrape
        assert s.blocks(OLD, "in_use") == r["in_use"], p.describe()
        assert not [lab for lab, _ in s.find("kvledger_kv_blocks", engine=OLD, pool=POOL)
                    if lab["state"] in ("reclaimable", "free")], "an exact partition from an older build"
        reclaimable = {b: v / BLOCK_BYTES for b, v in s.by_basis("kvledger_kv_reclaimable_bytes", OLD).items()}
        free = {b: v / BLOCK_BYTES for b, v in s.by_basis("kvledger_kv_free_bytes", OLD).items()}
        allocated = {b: v / BLOCK_BYTES for b, v in s.by_basis("kvledger_kv_allocated_bytes", OLD).items()}
        unreferenced = r["capacity"] - r["in_use"]
        assert reclaimable.get("upper_bound") == unreferenced == free.get("upper_bound"), p.describe()
        assert "exact" not in reclaimable and "exact" not in free, p.describe()
        assert r["evictable"] <= reclaimable["upper_bound"] and r["free"] <= free["upper_bound"], p.describe()
        assert allocated.get("lower_bound", 0) <= r["in_use"] + r["evictable"] <= allocated["upper_bound"], p.describe()
        # the current build's exact figures lie inside the older build's bounds too
        assert s.blocks(ENGINE, "reclaimable") <= reclaimable["upper_bound"]  # type: ignore[operator]
