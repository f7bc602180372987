"""Collector isolation: a failing or hanging source is marked down with its reason and
never delays the accounting of the others or a scrape."""

from __future__ import annotations

import threading
import time
import urllib.request

from kvledger.collect.collector import Collector
from kvledger.collect.sources.base import Contribution, EngineContribution, Source, SourceError, SubsourceReport
from kvledger.domain.facts import EngineFacts, PoolFacts
from kvledger.web.server import KvledgerHTTPServer


class Fixed(Source):
    kind = "ledger"

    def __init__(self, engine: str, in_use: int = 3) -> None:
        self.engine = engine
        self.in_use = in_use
        self.polls = 0
        self._polled = threading.Condition()

    def count_poll(self) -> None:
        with self._polled:
            self.polls += 1
            self._polled.notify_all()

    def wait_polls(self, n: int, timeout: float = 10.0) -> bool:
        """Block until this source has been polled ``n`` times (False after ``timeout``)."""
        with self._polled:
            return self._polled.wait_for(lambda: self.polls >= n, timeout)

    def poll(self) -> Contribution:
        self.count_poll()
        pool = PoolFacts(id="0", block_size=16, num_blocks=10, block_bytes=100, in_use=self.in_use, reclaimable=0, free=10 - self.in_use)
        return EngineContribution(EngineFacts(name=self.engine, kind="ledger", source="ledger", pools=[pool], requests=[]))


class Failing(Fixed):
    def poll(self) -> Contribution:
        self.count_poll()
        raise SourceError("schema", "pools[0].num_blocks: expected integer, got 'x'")


class Hanging(Fixed):
    def __init__(self, engine: str) -> None:
        super().__init__(engine)
        self.release = threading.Event()

    def poll(self) -> Contribution:
        self.count_poll()
        self.release.wait(30)
        return super().poll()


class Buggy(Fixed):
    def poll(self) -> Contribution:
        raise KeyError("oops")


def base(*names: str) -> list[EngineFacts]:
    return [EngineFacts(name=n, kind="ledger", source="ledger") for n in names]


def test_failing_source_is_down_with_reason_others_unaffected() -> None:
    good, bad = Fixed("good"), Failing("bad")
    c = Collector([good, bad], base_engines=base("good", "bad"), default_timeout=1.0)
    acc = c.poll_once()
    names = {e.name: e for e in acc.engines}
    assert names["good"].pools[0].physical.in_use.exact == 3  # type: ignore[union-attr]
    assert names["bad"].pools == []  # known engine, no facts: no pool series
    health = {h.engine: (h, m) for h, m in c.health()}
    assert health["good"][0].up and not health["bad"][0].up
    assert health["bad"][0].reason == "schema"
    assert "pools[0].num_blocks" in (health["bad"][1] or "")
    assert health["bad"][0].errors == {"schema": 1}
    c.stop()


def test_unexpected_exception_in_a_source_is_contained() -> None:
    c = Collector([Buggy("x"), Fixed("y")], base_engines=base("x", "y"))
    c.poll_once()
    h = {h.engine: h for h, _ in c.health()}
    assert h["x"].reason == "internal" and h["y"].up
    c.stop()


def test_hanging_source_times_out_without_delaying_others() -> None:
    hang, good = Hanging("slow"), Fixed("good")
    c = Collector([hang, good], base_engines=base("slow", "good"), interval=0.2,
                  timeouts={id(hang): 0.5}, default_timeout=1.0)
    c.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            h = {x.engine: x for x, _ in c.health()}
            if h["slow"].reason == "timeout":
                break
            time.sleep(0.05)
        assert h["slow"].reason == "timeout" and not h["slow"].up
        polls_before = good.polls
        # the good source keeps its cadence: three more of its polls while the slow one is
        # still hung (waited for by count, not by the clock)
        assert good.wait_polls(polls_before + 3), good.polls - polls_before
        assert not hang.release.is_set() and hang.polls == 1  # never resubmitted while hung
        acc = c.latest()
        assert acc is not None and any(e.name == "good" and e.pools for e in acc.engines)
        # the hung poll returns: the source comes back up
        hang.release.set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not {x.engine: x for x, _ in c.health()}["slow"].up:
            time.sleep(0.05)
        assert {x.engine: x for x, _ in c.health()}["slow"].up
    finally:
        hang.release.set()
        c.stop()


def test_scrape_is_served_while_a_source_hangs() -> None:
    hang = Hanging("slow")
    c = Collector([hang, Fixed("good")], base_engines=base("slow", "good"), interval=0.2, timeouts={id(hang): 0.3})
    c.start()
    server = KvledgerHTTPServer("127.0.0.1:0", c)
    server.start()
    try:
        deadline = time.monotonic() + 5
        while not c.ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        body = urllib.request.urlopen(server.url + "/metrics", timeout=2).read().decode()
        assert 'kvledger_kv_capacity_blocks{engine="good",pool="0"} 10.0' in body
        assert 'kvledger_source_up{engine="slow",source="ledger"}' in body
        assert urllib.request.urlopen(server.url + "/-/ready", timeout=2).status == 200
        assert urllib.request.urlopen(server.url + "/-/healthy", timeout=2).status == 200
    finally:
        hang.release.set()
        server.stop()
        c.stop()


def test_invariant_violations_counted_once_per_fresh_poll() -> None:
    broken = Fixed("e", in_use=3)

    def poll() -> Contribution:
        pool = PoolFacts(id="0", block_size=16, num_blocks=10, in_use=3, references=1)
        return EngineContribution(EngineFacts(name="e", kind="ledger", source="ledger", pools=[pool]))

    broken.poll = poll  # type: ignore[method-assign]
    c = Collector([broken], base_engines=base("e"))
    c.poll_once()
    acc = c.poll_once()
    assert acc.invariant_totals[("e", "references_ge_in_use")] == 2
    c.stop()


def test_subsource_health_is_reported() -> None:
    class WithEvents(Fixed):
        state = (False, "rank 0: sequence gap 4..6, no replay endpoint")

        def subsource_health(self) -> list[SubsourceReport]:
            return [SubsourceReport("kv_events", *self.state)]

    src = WithEvents("v")
    c = Collector([src], base_engines=base("v"))
    acc = c.poll_once()
    h = {x.source: x for x in acc.health}
    assert not h["kv_events"].up and h["kv_events"].errors == {"unavailable": 1}
    assert dict((x.source, m) for x, m in c.health())["kv_events"] == "rank 0: sequence gap 4..6, no replay endpoint"
    src.state = (True, None)
    acc = c.poll_once()
    assert {x.source: x for x in acc.health}["kv_events"].up
    c.stop()
