"""Accounts made for the reads that come (collect/read_cadence.py, Collector._account_due):
a reader with a steady cadence gets Accounts made in the last cycle before its read, the
cycles between make none, every poll's findings are still counted, and a read nobody
foresaw makes the Accounts of the latest polls itself."""

from __future__ import annotations

import threading
import time

import pytest

from kvledger.collect.collector import Collector
from kvledger.collect.read_cadence import MAX_READERS, ReadCadence
from kvledger.collect.sources.base import Contribution, EngineContribution, Source
from kvledger.domain.accounts import Accounts
from kvledger.domain.facts import EngineFacts, PoolFacts
from kvledger.output.prometheus import check_renderable


def test_no_cadence_before_three_steady_reads() -> None:
    r = ReadCadence()
    assert r.next_read() is None
    r.record("prometheus", 10.0)
    r.record("prometheus", 25.0)
    assert r.next_read() is None  # one interval is not a cadence
    r.record("prometheus", 40.1)
    assert r.next_read() == pytest.approx(55.2)


def test_an_irregular_reader_has_no_cadence_and_the_steadiest_soonest_wins() -> None:
    r = ReadCadence()
    for t in (0.0, 1.0, 5.0):  # intervals 1 and 4: no cadence
        r.record("human", t)
    assert r.next_read() is None
    for t in (0.0, 30.0, 60.0):
        r.record("slow", t)
    for t in (2.0, 17.0, 32.0):
        r.record("prometheus", t)
    assert r.next_read() == 47.0  # the soonest of the steady readers (slow: 90)
    r.record("prometheus", 32.0)  # a second read at the same instant breaks the cadence
    assert r.next_read() == 90.0


def test_readers_are_bounded_the_least_recent_forgotten() -> None:
    r = ReadCadence()
    for t in (0.0, 10.0, 20.0):
        r.record("prometheus", t)
    for i in range(MAX_READERS):  # a scan from many addresses
        r.record(f"scanner {i}", 21.0 + i)
    assert r.next_read() is None  # prometheus was the least recent reader: forgotten
    for t in (100.0, 110.0, 120.0):
        r.record("prometheus", t)
    assert r.next_read() == 130.0


class Busy(Source):
    """An engine whose document changes at every poll (its in_use is the poll's number), and
    whose references are below in_use (an invariant violated at every poll)."""

    kind = "ledger"

    def __init__(self) -> None:
        self.engine = "e"
        self.polls = 0
        self.lock = threading.Lock()

    def poll(self) -> Contribution:
        with self.lock:
            self.polls += 1
            n = self.polls
        pool = PoolFacts(id="0", block_size=16, num_blocks=10_000, block_bytes=100, in_use=n, reclaimable=0,
                         free=10_000 - n, references=0)  # fmt: skip
        return EngineContribution(EngineFacts(name="e", kind="ledger", source="ledger", pools=[pool], requests=[]))


def _collector(source: Busy, interval: float) -> tuple[Collector, list[int]]:
    checked: list[int] = []  # the in_use of each engine account made (the render check sees each)

    def check(accounts: Accounts) -> None:
        for e in accounts.engines:
            phys = e.pools[0].physical.in_use
            checked.append(int(phys.exact) if phys is not None and phys.exact is not None else -1)
        check_renderable(accounts)

    c = Collector([source], base_engines=[EngineFacts(name="e", kind="ledger", source="ledger")], interval=interval,
                  render_check=check)  # fmt: skip
    return c, checked


def _in_use(accounts: Accounts | None) -> int:
    assert accounts is not None
    m = accounts.engines[0].pools[0].physical.in_use
    assert m is not None and m.exact is not None
    return int(m.exact)


def test_a_steady_reader_gets_accounts_of_the_latest_poll_and_the_cycles_between_make_none() -> None:
    source = Busy()
    c, checked = _collector(source, interval=0.02)
    c.start()
    try:
        period = 0.8
        seen: list[tuple[int, int]] = []  # (in_use read, polls so far)
        next_read = time.monotonic() + period
        learnt = (0, 0)  # (accounts made, polls) once three reads taught the cadence
        for i in range(10):
            time.sleep(max(0.0, next_read - time.monotonic()))
            next_read += period
            with source.lock:
                polls = source.polls
            seen.append((_in_use(c.latest(reader="metrics 10.0.0.1")), polls))
            if i == 2:
                learnt = (len(checked), polls)
        with source.lock:
            polls = source.polls
    finally:
        c.stop()
    assert polls - learnt[1] >= 7 * 10  # 40 cycles between two reads, at least 10 on a loaded machine
    # each read shows a poll a cycle or two old (a few on a loaded machine), never one from
    # the previous read, ten cycles and more before
    for shown, polled in seen:
        assert polled - 6 <= shown <= polled + 1, seen
    # once the cadence is known, the cycles between reads make no accounts: about one or
    # two per read (a few where a loaded machine runs the cycles late), against forty polls
    made = len(checked) - learnt[0]
    assert made <= 5 * 7 and made < (polls - learnt[1]) / 3, (learnt, len(checked), polls)
    # every poll's invariant violation was counted, accounts made or not
    totals = c.latest()
    assert totals is not None
    assert totals.invariant_totals[("e", "references_ge_in_use")] >= polls - 2


def test_without_a_reader_every_cycle_makes_its_accounts() -> None:
    source = Busy()
    c, checked = _collector(source, interval=0.02)
    c.start()
    try:
        time.sleep(1.0)
        with source.lock:
            polls = source.polls
    finally:
        c.stop()
    assert len(checked) >= polls - 2  # as before: one account per poll


def test_an_unforeseen_read_makes_the_accounts_of_the_latest_poll_itself() -> None:
    source = Busy()
    c, checked = _collector(source, interval=0.02)
    for t in (0.0, 1000.0, 2000.0):  # a reader whose next read is far away: cycles make no accounts
        c.reads.record("metrics 10.0.0.2", time.monotonic() - 2000.0 + t + 500.0)
    c.start()
    try:
        time.sleep(0.5)
        made = len(checked)
        with source.lock:
            before = source.polls
        shown = _in_use(c.latest())  # a read without a cadence (a person, the JSON view)
        with source.lock:
            after = source.polls
    finally:
        c.stop()
    assert made <= 2, made  # the first cycle's, before the first skip was possible
    assert before - 1 <= shown <= after, (before, shown, after)
    assert len(checked) == made + 1  # made by the read, once
