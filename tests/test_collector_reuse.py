"""An idle engine's account is reused (issue 14): when every input of an engine (its
configured facts, the contributions applied to it, the sharing rule and the limits) is
the same object as in the last cycle, the collector keeps its account instead of
accounting and checking it again; anything new accounts it afresh."""

from __future__ import annotations

from kvledger.collect.collector import Collector
from kvledger.collect.sources.document import LedgerSource
from kvledger.config.types import EngineConfig
from kvledger_engine.document_server import serve_http
from kvledger_engine.reference_ledger import Ledger, PoolSpec


def test_unchanged_document_keeps_its_account_and_its_counts() -> None:
    led = Ledger([PoolSpec("0", 16, 4096, 64)], max_model_len=1024)
    led.admit("a", 40, 10)
    led.advance("a", 40)
    led.set_reported_used_blocks(1000.0)  # outside [0, capacity]: an invariant violation, counted per poll
    with serve_http(led.to_document, columns=lambda: led.to_document(columns=True)) as server:
        source = LedgerSource(EngineConfig(name="e", kind="ledger", url=server.url, timeout_seconds=2.0))
        collector = Collector([source])
        first = collector.poll_once()
        second = collector.poll_once()  # 304: the same facts
        assert source.reader.not_modified == 1
        assert second.engines[0] is first.engines[0]
        key = ("e", "engine_reported_used_in_range")
        assert first.invariant_totals[key] == 1 and second.invariant_totals[key] == 2  # still an observation per poll
        led.admit("b", 10, 10)
        third = collector.poll_once()
        assert third.engines[0] is not first.engines[0]
        assert third.engines[0].requests["running"] == 2 and third.invariant_totals[key] == 3
        collector.sharing = "reference-aware"  # another rule: accounted again
        fourth = collector.poll_once()
        assert fourth.engines[0] is not third.engines[0] and fourth.engines[0].sharing == "reference-aware"
