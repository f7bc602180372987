"""Polling many engines on a bounded pool, under one memory budget (issue 31, findings 5 and 6).

- the collector polls on at most ``poll_workers`` threads, whatever the number of sources
  (before: one thread per source, 1,007 threads for 1,000 engines); a poll waiting for a
  thread is not timed out, one running past its timeout is;
- polls stuck where no deadline reaches are left in a replaced pool, the others go on;
- engine answers in flight and their parses are bounded together (``limits.memory_budget_bytes``):
  an answer that does not fit beside the others is refused with a reason naming the budget;
- a poll whose answer came in time but whose parse outlives the timeout is down (timeout)
  saying so, at every such poll: before, it was "no answer within 2 s" and then up again
  when the parse ended, flapping at every poll;
- the line limit of Prometheus text is configurable per engine (``max_response_lines``).
"""

from __future__ import annotations

import dataclasses
import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvledger.collect.collector import Collector
from kvledger.collect.sources.base import Contribution, EngineContribution, Source, SourceError
from kvledger.collect.sources.http_client import HttpClient
from kvledger.config.loader import load_config
from kvledger.domain.facts import EngineFacts, PoolFacts


def facts(engine: str) -> EngineContribution:
    pool = PoolFacts(id="0", block_size=16, num_blocks=10, block_bytes=100, in_use=3, reclaimable=0, free=7)
    return EngineContribution(EngineFacts(name=engine, kind="ledger", source="ledger", pools=[pool], requests=[]))


def base(*names: str) -> list[EngineFacts]:
    return [EngineFacts(name=n, kind="ledger", source="ledger") for n in names]


class Counting(Source):
    """A poll that takes ``seconds`` and records how many run at once."""

    kind = "ledger"
    running = 0
    most = 0
    lock = threading.Lock()

    def __init__(self, engine: str, seconds: float) -> None:
        self.engine, self.seconds = engine, seconds

    def poll(self) -> Contribution:
        cls = type(self)
        with cls.lock:
            cls.running += 1
            cls.most = max(cls.most, cls.running)
        try:
            time.sleep(self.seconds)
            return facts(self.engine)
        finally:
            with cls.lock:
                cls.running -= 1


def poll_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("kvledger-poll"))


def test_two_hundred_sources_are_polled_on_a_bounded_pool() -> None:
    sources = [Counting(f"e{i}", 0.02) for i in range(200)]
    c = Collector(sources, base_engines=base(*(s.engine for s in sources)), default_timeout=1.0, poll_workers=8)
    try:
        before = poll_threads()
        deadline = time.monotonic() + 30
        c._submit_idle()
        threads = 0
        while any(r.future is not None for r in c._runners) and time.monotonic() < deadline:
            threads = max(threads, poll_threads() - before)
            c._harvest()
            time.sleep(0.01)
        assert threads <= 8 and Counting.most <= 8
        # 200 polls of 20 ms on 8 threads take about 0.5 s: longer than the 1 s timeout? no:
        # a poll waiting for a thread is not timed out, only one running past its timeout
        health = [h for h, _ in c.health()]
        assert all(h.up for h in health), [(h.engine, h.reason) for h in health if not h.up]
    finally:
        c.stop()


class Stuck(Source):
    kind = "ledger"

    def __init__(self, engine: str, release: threading.Event) -> None:
        self.engine, self.release = engine, release

    def poll(self) -> Contribution:
        self.release.wait(30)
        return facts(self.engine)


def test_polls_stuck_where_no_deadline_reaches_do_not_stop_the_others() -> None:
    release = threading.Event()
    stuck = [Stuck(f"stuck{i}", release) for i in range(4)]
    good = [Counting(f"good{i}", 0.0) for i in range(4)]
    sources: list[Source] = [*stuck, *good]
    c = Collector(sources, base_engines=base(*(s.engine for s in sources)), interval=0.1, default_timeout=0.2,
                  poll_workers=4)
    c.start()
    try:
        deadline = time.monotonic() + 10
        up: dict[str, bool] = {}
        while time.monotonic() < deadline:
            up = {h.engine: h.up for h, _ in c.health()}
            if all(up[f"good{i}"] for i in range(4)):
                break
            time.sleep(0.05)
        assert all(up[f"good{i}"] for i in range(4)) and not any(up[f"stuck{i}"] for i in range(4))
    finally:
        release.set()
        c.stop()


# ---------------------------------------------------------------- engine answers over HTTP


@contextmanager
def text_server(body: bytes) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


class SlowParse(Source):
    """Fetches the text, then "parses" it for ``parse_seconds`` (as 49,000 lines took 3.6 s)."""

    kind = "vllm"

    def __init__(self, engine: str, url: str, parse_seconds: float, timeout: float) -> None:
        self.engine, self.parse_seconds = engine, parse_seconds
        self.http = HttpClient(url, timeout=timeout, accept="text/plain;version=0.0.4")

    def poll(self) -> Contribution:
        self.http.get()
        time.sleep(self.parse_seconds)
        return facts(self.engine)

    def close(self) -> None:
        self.http.close()


def test_a_parse_past_the_timeout_is_reported_as_such_not_as_flapping() -> None:
    body = b"".join(b"m{i=\"%d\"} 1\n" % i for i in range(2000))
    with text_server(body) as url:
        source = SlowParse("big", url, parse_seconds=0.5, timeout=0.3)
        c = Collector([source], base_engines=base("big"), interval=0.2, timeouts={id(source): 0.3})
        c.start()
        try:
            seen: list[tuple[bool, str | None]] = []
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                (h, message), *_ = c.health()
                seen.append((h.up, message))
                time.sleep(0.02)
            assert not any(up for up, _ in seen), "the engine flapped up between polls that read too slowly"
            (h, message), *_ = c.health()
            assert h.reason == "timeout" and h.errors["timeout"] >= 3
            assert message is not None and "reading its answer did not end within the 0.3 s timeout" in message
            assert "max_response_lines" in message
        finally:
            c.stop()


class HeldFetch(Source):
    """Fetches its engine's answer, then holds it (and its share of the budget) until told."""

    kind = "vllm"

    def __init__(self, engine: str, url: str, fetched: threading.Event, hold: threading.Event | None) -> None:
        self.engine, self.fetched, self.hold = engine, fetched, hold
        self.http = HttpClient(url, timeout=10, accept="text/plain;version=0.0.4", max_lines=10**6)

    def poll(self) -> Contribution:
        try:
            self.http.get()
        finally:
            self.fetched.set()
        if self.hold is not None:
            self.hold.wait(10)
        return facts(self.engine)

    def close(self) -> None:
        self.http.close()


def test_answers_in_flight_are_bounded_together_by_the_memory_budget() -> None:
    from kvledger.collect.poll_budget import PARSE_FACTOR, MemoryBudget

    body = b"x 1\n" * (512 << 10)  # 2 MiB: 2 MiB x PARSE_FACTOR of the budget while it is held
    budget = MemoryBudget()
    with text_server(body) as url:
        first_fetched, second_fetched, release = threading.Event(), threading.Event(), threading.Event()
        first = HeldFetch("first", url, first_fetched, release)

        class Second(HeldFetch):
            def poll(self) -> Contribution:
                first_fetched.wait(10)
                try:
                    return super().poll()
                finally:
                    release.set()

        second = Second("second", url, second_fetched, None)
        c = Collector([first, second], base_engines=base("first", "second"), default_timeout=10, budget=budget)
        budget.total = int(len(body) * PARSE_FACTOR * 1.5)  # room for one answer, not two
        try:
            c.poll_once()
            health = {h.engine: (h, m) for h, m in c.health()}
            assert health["first"][0].up
            h, message = health["second"]
            assert not h.up and h.reason == "too_large"
            assert message is not None and "memory budget" in message and "limits.memory_budget_bytes" in message
            assert budget.in_use == 0 and budget.refused == 1  # every poll gave back what it took
            assert budget.peak <= budget.total
        finally:
            release.set()
            c.stop()


def test_budget_and_line_limit_are_configurable(tmp_path: Path) -> None:
    from kvledger.collect.sources.registry import build_sources

    path = tmp_path / "kvledger.yml"
    path.write_text(yaml.safe_dump({
        "nvml": {"enabled": False},
        "limits": {"memory_budget_bytes": "64MiB"},
        "engines": [{"name": "e", "kind": "tgi", "url": "http://127.0.0.1:1/metrics", "max_response_lines": 1000}],
    }))
    config = load_config(str(path))
    assert config.limits.memory_budget_bytes == 64 << 20 and config.engines[0].max_response_lines == 1000
    c = Collector([], limits=config.limits)
    assert c.budget is not None and c.budget.total == 64 << 20
    body = b"m 1\n" * 1001
    with text_server(body) as url:
        cfg = config.engines[0].__class__(**{**config.engines[0].__dict__, "url": url})
        sources, _, _ = build_sources(config.__class__(**{**config.__dict__, "engines": (cfg,)}))
        source = sources[0]
        with pytest.raises(SourceError) as info:
            source.poll()
        assert info.value.reason == "too_large" and "1000 lines" in info.value.message
        source.close()
    for bad in ({"limits": {"memory_budget_bytes": "1KiB"}}, {"engines": [{"name": "e", "kind": "tgi", "url": "http://x/",
                                                                             "max_response_lines": 0}]}):
        path.write_text(yaml.safe_dump({"nvml": {"enabled": False}, **bad}))
        with pytest.raises(Exception, match=r"memory_budget_bytes|max_response_lines"):
            load_config(str(path))


def test_engine_families_are_each_engines_lines_made_once() -> None:
    """Each engine account's lines are made once, by the first render that shows it, and
    kept on the account: an engine whose account is kept (idle) is not rendered again by
    the next cycle's scrape (before: every engine at every cycle's first scrape, 4.8 MB for
    1,000 engines). The families so joined are exactly the engines' own: rendering the
    whole Accounts the old way gives the same bytes."""
    import dataclasses
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from workload import scrape_snapshot

    from kvledger.collect.accounting import AccountCache, account_snapshot
    from kvledger.config.types import LimitsConfig
    from kvledger.output import prometheus as out
    from kvledger.output.catalog import CATALOG

    def compute_accounts(snapshot: Any) -> Any:
        return account_snapshot(snapshot, {}, LimitsConfig(), AccountCache(), out.check_renderable).accounts

    accounts = compute_accounts(scrape_snapshot(blocks=10_000))
    for spec in CATALOG:  # every engine family reads Accounts.engines alone
        if spec.name in out.ENGINE_FAMILIES:
            whole = list(spec.samples(accounts))
            each = [s for e in accounts.engines for s in spec.samples(dataclasses.replace(accounts, engines=[e]))]
            assert whole == each, spec.name
    body = out.render_text(accounts)
    assert all(e.rendered is not None for e in accounts.engines)
    fresh = compute_accounts(scrape_snapshot(blocks=10_000))
    old_way = "".join(out._HEADERS[spec.name] + out._family_lines(spec, fresh, check=False) for spec in CATALOG)
    assert body == old_way.encode()
    # made by the first render of an account, joined by every later one (an engine whose
    # account is kept, idle, is never rendered again)
    kept = [e.rendered for e in accounts.engines]
    assert out.render_openmetrics(accounts).startswith(b"# HELP")
    assert [e.rendered for e in accounts.engines] == kept and all(
        a is b for a, b in zip([e.rendered for e in accounts.engines], kept, strict=True))


def test_an_engines_lines_are_the_same_made_by_the_render_check_or_by_a_scrape() -> None:
    """An engine's lines are made by the render check, in its pass over the samples it checks
    (so that a scrape of a fleet whose every engine changed joins lines, docs/performance.md),
    or else by the first scrape that shows the engine: the same bytes either way, and the same
    as rendering every family whole; an account the check refuses keeps none."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from accounting_support import no_render_check
    from workload import scrape_snapshot

    from kvledger.collect.accounting import AccountCache, account_snapshot
    from kvledger.config.types import LimitsConfig
    from kvledger.output import prometheus as out
    from kvledger.output.catalog import CATALOG

    def compute_accounts(check: Any) -> Any:
        snapshot = scrape_snapshot(engines=6, gpus=2, tenants=3, requests=60, blocks=10_000)
        return account_snapshot(snapshot, {}, LimitsConfig(), AccountCache(), check).accounts

    checked = compute_accounts(out.check_renderable)
    assert all(e.rendered is not None for e in checked.engines)  # made by the check, before any scrape
    unchecked = compute_accounts(no_render_check)
    assert all(e.rendered is None for e in unchecked.engines)
    whole = compute_accounts(no_render_check)
    old_way = "".join(out._HEADERS[spec.name] + out._family_lines(spec, whole, check=False) for spec in CATALOG).encode()
    assert b'kvledger_kv_capacity_bytes{engine="' in old_way and len(whole.engines) == 6
    assert out.render_text(checked) == old_way
    assert out.render_text(unchecked) == old_way
    assert out.render_openmetrics(checked) == out.render_openmetrics(unchecked)
    # a second check of an account whose lines are made leaves them as they are
    lines = checked.engines[0].rendered
    out.check_renderable(dataclasses.replace(checked, engines=[checked.engines[0]]))
    assert checked.engines[0].rendered is lines


class Same(Source):
    """An idle engine: the same contribution object at every poll (as a 304 keeps it)."""

    kind = "ledger"

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.contribution = facts(engine)

    def poll(self) -> Contribution:
        return self.contribution


def test_an_idle_engines_merge_is_kept_until_its_configuration_changes() -> None:
    source = Same("idle")
    configured = [EngineFacts(name="idle", kind="ledger", source="ledger", admission="reserve-cap")]
    c = Collector([source], base_engines=configured)
    try:
        first = c.poll_once().engines[0].facts
        second = c.poll_once().engines[0].facts
        assert second is first and first.admission == "reserve-cap"  # merged once, reused
        changed = [EngineFacts(name="idle", kind="ledger", source="ledger", admission="dynamic")]
        c.reconfigure([source], changed, {}, "per-request", 1.0, c.limits)
        third = c.poll_once().engines[0].facts
        assert third is not first and third.admission == "dynamic"
    finally:
        c.stop()
