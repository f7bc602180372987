"""The polls of a cycle in lanes (collect/poll_lanes.py): quick polls run one after another
in one thread; a slow one gets the rest of the queue moved to another lane; never more
lanes than threads; closing cancels what is queued."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

from kvledger.collect.poll_lanes import PollLanes, spill_after


class Record:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.threads: set[int] = set()

    def poll(self, seconds: float = 0.0, release: threading.Event | None = None) -> int:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.add(threading.get_ident())
        try:
            if release is not None:
                release.wait(10)
            time.sleep(seconds)
            return threading.get_ident()
        finally:
            with self.lock:
                self.running -= 1


def test_quick_polls_run_one_after_another_in_one_thread() -> None:
    pool = ThreadPoolExecutor(max_workers=8)
    lanes = PollLanes(pool, 8, spill_after=0.1)
    rec = Record()
    futures = [lanes.submit(lambda: rec.poll(0.002)) for _ in range(20)]
    done, _ = wait(futures, timeout=10)
    assert len(done) == 20
    for _ in range(3):  # asked to spill while quick polls move: no second lane
        assert not lanes.spill()
    assert rec.most == 1 and len(rec.threads) == 1
    pool.shutdown()


def test_a_hung_poll_moves_the_rest_of_the_queue_to_another_lane() -> None:
    pool = ThreadPoolExecutor(max_workers=4)
    lanes = PollLanes(pool, 4, spill_after=0.05)
    rec = Record()
    release = threading.Event()
    hung = lanes.submit(lambda: rec.poll(release=release))
    quick = [lanes.submit(lambda: rec.poll(0.001)) for _ in range(10)]
    time.sleep(0.02)
    assert not lanes.spill()  # in its poll for less than spill_after: not stalled yet
    time.sleep(0.05)
    assert lanes.spill()  # now it is: the queue gets a lane of its own
    done, _ = wait(quick, timeout=5)
    assert len(done) == 10 and not hung.done()  # the others went on while it hangs
    release.set()
    assert hung.result(5) != quick[0].result()  # two threads
    pool.shutdown()


def test_never_more_lanes_than_threads() -> None:
    pool = ThreadPoolExecutor(max_workers=2)
    lanes = PollLanes(pool, 2, spill_after=0.02)
    rec = Record()
    release = threading.Event()
    futures = [lanes.submit(lambda: rec.poll(release=release)) for _ in range(5)]
    time.sleep(0.05)
    spilled = [lanes.spill() for _ in range(5)]
    assert spilled.count(True) == 1 and lanes.lanes() == 2
    release.set()
    done, _ = wait(futures, timeout=5)
    assert len(done) == 5 and rec.most == 2
    pool.shutdown()


def test_close_cancels_the_queued_polls_and_lets_the_running_one_end() -> None:
    pool = ThreadPoolExecutor(max_workers=2)
    lanes = PollLanes(pool, 2, spill_after=0.1)
    rec = Record()
    release = threading.Event()
    running = lanes.submit(lambda: rec.poll(release=release))
    queued = [lanes.submit(lambda: rec.poll()) for _ in range(3)]
    time.sleep(0.05)
    cancelled = lanes.close()
    assert set(cancelled) == set(queued) and all(f.cancelled() for f in queued)
    release.set()
    assert running.result(5) is not None
    late = lanes.submit(lambda: rec.poll())  # a closed lane set takes nothing more
    time.sleep(0.05)
    assert not late.done()
    pool.shutdown()


def test_an_exception_ends_its_future_and_the_lane_goes_on() -> None:
    pool = ThreadPoolExecutor(max_workers=1)
    lanes = PollLanes(pool, 1, spill_after=0.1)

    def boom() -> int:
        raise ValueError("a bug in a source")

    bad = lanes.submit(boom)
    good = lanes.submit(lambda: 7)
    assert isinstance(bad.exception(5), ValueError)
    assert good.result(5) == 7
    pool.shutdown()


def test_a_long_queue_of_polls_that_wait_on_the_network_gets_more_lanes() -> None:
    """Engines far away: each poll waits its round trip (20 ms here). One lane would take
    them one after another (2 s for 100); the queue head waiting spill_after starts
    another lane, and another, while the queue does not drain."""
    pool = ThreadPoolExecutor(max_workers=16)
    lanes = PollLanes(pool, 16, spill_after=0.05)
    rec = Record()
    futures = [lanes.submit(lambda: rec.poll(0.02)) for _ in range(100)]
    start = time.monotonic()
    pending = futures
    while pending:
        _, not_done = wait(pending, timeout=0.05)
        lanes.spill()
        pending = list(not_done)
    took = time.monotonic() - start
    assert rec.most > 4, rec.most
    assert took < 1.5, took  # one lane: 2 s
    pool.shutdown()


def test_the_wait_for_a_lane_follows_the_interval_within_bounds() -> None:
    assert spill_after(1.0) == pytest.approx(0.1)
    assert spill_after(0.1) == pytest.approx(0.01)
    assert spill_after(3600.0) == 0.5


def test_a_poll_queued_behind_a_lane_hung_since_an_earlier_cycle_gets_a_lane_at_once() -> None:
    pool = ThreadPoolExecutor(max_workers=2)
    lanes = PollLanes(pool, 2, spill_after=0.05)
    rec = Record()
    release = threading.Event()
    hung = lanes.submit(lambda: rec.poll(release=release))
    time.sleep(0.1)  # the next cycle: the lane has been in that poll longer than spill_after
    quick = lanes.submit(lambda: rec.poll())
    assert quick.result(0.04) is not None  # without waiting spill_after, nobody asked to spill
    assert not hung.done()
    release.set()
    hung.result(5)
    pool.shutdown()


def test_a_reload_while_a_lane_is_held_by_a_hung_engine_keeps_the_others_polled() -> None:
    """The polls queued behind a hung engine's lane when the configuration is applied go to
    the new lanes: the old lane, held for as long as the engine hangs, would keep them."""
    from kvledger.collect.collector import Collector
    from kvledger.collect.sources.base import Contribution, EngineContribution, Source
    from kvledger.domain.facts import EngineFacts, PoolFacts

    release = threading.Event()

    class Engine(Source):
        kind = "ledger"

        def __init__(self, name: str, hang: bool) -> None:
            self.engine, self.hang, self.polls = name, hang, 0

        def poll(self) -> Contribution:
            self.polls += 1
            if self.hang:
                release.wait(30)
            pool = PoolFacts(id="0", block_size=16, num_blocks=10, block_bytes=100, in_use=1, reclaimable=0, free=9)
            return EngineContribution(EngineFacts(name=self.engine, kind="ledger", source="ledger", pools=[pool], requests=[]))

    hung, good = Engine("hung", True), Engine("good", False)
    base = [EngineFacts(name=n, kind="ledger", source="ledger") for n in ("hung", "good")]
    c = Collector([hung, good], base_engines=base, interval=1.0, default_timeout=30.0)
    try:
        c._submit_idle()  # one lane: the hung engine first, the good one queued behind it
        time.sleep(0.05)
        assert good.polls == 0
        c.reconfigure([hung, good], base, {}, "per-request", 1.0, c.limits)  # applied now: no loop running
        c._submit_idle()
        deadline = time.monotonic() + 5
        while good.polls == 0 and time.monotonic() < deadline:
            c._wait_polls([r.future for r in c._runners if r.future is not None], time.monotonic() + 0.1)
            c._harvest()
        assert good.polls >= 1
    finally:
        release.set()
        c.stop()
