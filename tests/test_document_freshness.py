"""Freshness of a kvledger/v1 document (issue 25): an engine whose scheduling loop hangs while
its document server thread keeps answering must not have its last numbers exported as exact
and fresh. The document says when it was published (``published_at``, the writer's clock);
the reader measures its age against the server's ``Date`` header and refuses as ``stale`` a
document that shows running requests and is older than ``MAX_DOCUMENT_AGE``."""

from __future__ import annotations

import time
from email.utils import formatdate

import pytest

from kvledger.collect.collector import Collector
from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.document import LedgerSource, document_age
from kvledger.config.types import EngineConfig
from kvledger.domain.limits import MAX_DOCUMENT_AGE
from kvledger.output.prometheus import render_text
from kvledger.protocol.reader import facts_from_json
from kvledger_engine.document_server import serve_http
from kvledger_engine.reference_ledger import Ledger, PoolSpec


def _running_ledger() -> Ledger:
    led = Ledger([PoolSpec("0", 16, 4096, 64)], admission="dynamic", max_model_len=1024)
    led.admit("a", 40, 10)
    led.advance("a", 40)
    return led


def _stop_publishing(led: Ledger, seconds: float) -> None:
    """As if the engine had called nothing for ``seconds``: its last publication (the stamp
    its lock records when a change leaves it, served as ``published_at``) that much older,
    without the test waiting that long on the wall clock."""
    led._lock.stamp -= seconds


def _source(url: str, max_age: float) -> LedgerSource:
    source = LedgerSource(EngineConfig(name="eng", kind="ledger", url=url, timeout_seconds=1.0))
    source.reader.max_age = max_age
    return source


def test_the_reference_ledger_says_when_it_last_changed() -> None:
    led = _running_ledger()
    _stop_publishing(led, 1.0)
    first = led.to_document()["published_at"]
    assert led.to_document()["published_at"] == first  # reading changes nothing
    led.advance("a", 1)
    assert led.to_document()["published_at"] > first
    assert facts_from_json(__import__("json").dumps(led.to_document()), "eng").published_at == led.to_document()["published_at"]


def test_a_publisher_that_stops_while_its_server_answers_is_stale() -> None:
    led = _running_ledger()
    with serve_http(led.to_document) as server:
        source = _source(server.url, max_age=0.5)
        source.poll()
        age = source.document_age()
        assert age is not None and age < 0.5 + 1  # the Date header's whole seconds: at most 1 s short
        _stop_publishing(led, 2.1)  # the engine calls nothing: its scheduler "hangs", the server thread answers
        with pytest.raises(SourceError) as caught:
            source.poll()
        assert caught.value.reason == "stale" and "published" in caught.value.message and "running" in caught.value.message
        assert source.document_age() is not None and source.document_age() > 0.5
        led.advance("a", 1)  # it publishes again: exact again
        source.poll()
        assert source.document_age() is not None and source.document_age() < 1.5


def test_an_idle_document_may_be_old() -> None:
    """Nothing runs, so nothing moves: an old document of an idle engine is still the truth."""
    led = _running_ledger()
    led.release("a")
    with serve_http(led.to_document) as server:
        source = _source(server.url, max_age=0.5)
        _stop_publishing(led, 2.1)
        source.poll()
        age = source.document_age()
        assert age is not None and age > 0.5


def test_the_age_is_measured_on_the_servers_clock() -> None:
    """A remote engine whose clock is an hour ahead: its Date and its published_at agree,
    and the reader's own clock does not enter."""
    now = time.time()
    ahead = now + 3600
    assert document_age(ahead - 5, formatdate(ahead, usegmt=True), now) == pytest.approx(5, abs=1)
    assert document_age(ahead - 5, None, now) == 0  # no Date: the reader's clock, never negative
    assert document_age(now - 7, "not a date", now) == pytest.approx(7, abs=0.01)


def test_the_age_and_the_stale_reason_are_exported() -> None:
    led = _running_ledger()
    with serve_http(led.to_document) as server:
        source = _source(server.url, max_age=0.5)
        collector = Collector(sources=[source])
        text = render_text(collector.poll_once()).decode()
        assert 'kvledger_ledger_document_age_seconds{engine="eng",source="ledger"}' in text
        assert '\nkvledger_kv_blocks{engine="eng"' in text  # exact while fresh
        _stop_publishing(led, 2.1)
        text = render_text(collector.poll_once()).decode()
        assert 'kvledger_source_up{engine="eng",source="ledger"} 0.0' in text
        assert 'kvledger_source_errors_total{engine="eng",source="ledger",reason="stale"} 1.0' in text
        assert '\nkvledger_kv_blocks{engine="eng"' not in text  # stale: never exact-but-old


def test_the_bound_is_documented() -> None:
    assert MAX_DOCUMENT_AGE == 30.0
