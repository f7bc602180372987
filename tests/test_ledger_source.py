import os
import socket
import tempfile

import pytest

from kvledger.collect.merge import apply_contribution, configured_facts
from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.document import LedgerSource
from kvledger.config.types import EngineConfig, HostConfig, LimitConfig, MemoryConfig, ProcessMatch, SizeWithSource, TenantConfig
from kvledger.domain.facts import Limit, MemoryTerm, Snapshot, TenantQuota
from kvledger_engine.document_server import serve_http, serve_unix
from kvledger_engine.reference_ledger import Ledger, PoolSpec


def polled(url, **kw):
    """The engine's facts as the collector sees them: polled, then the configuration merged in."""
    cfg = config(url, **kw)
    snap = Snapshot(engines=[configured_facts(cfg)])
    apply_contribution(snap, LedgerSource(cfg).poll())
    return snap.engines[0]


def ledger():
    led = Ledger([PoolSpec("0", 16, 4096, 64)], admission="reserve-cap", engine_kind="tgi", engine_version="3.0",
                 max_model_len=1024)
    led.admit("a", 40, 10, tenant="t1")
    led.advance("a", 40)
    led.set_memory([(0, "weights", 1000, "measured")])
    led.set_host(output_buffer_bytes=5, network_queue_depth=2, network_queue_limit=99, network_queue_limit_kind="hard")
    return led


def config(url, **kw):
    base = dict(
        name="eng", kind="ledger", url=url, timeout_seconds=1.0,
        max_num_seqs=32, max_model_len=4096, max_num_batched_tokens=2048,
        gpus=(0, 1), processes=ProcessMatch(pids=(4242,)),
        memory=MemoryConfig({"weights": SizeWithSource(7, "configured"), "reserve": SizeWithSource(9, "configured")}),
        host=HostConfig(output_buffer_limit_bytes=LimitConfig(100.0, "hard"), network_queue_limit=LimitConfig(5.0, "estimate")),
        tenants=(TenantConfig("t1", 123),),
    )
    base.update(kw)
    return EngineConfig(**base)


@pytest.fixture()
def sock_dir():
    d = tempfile.mkdtemp(prefix="kvl-test-")
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


def check_facts(facts):
    assert facts.name == "eng" and facts.source == "ledger" and facts.kind == "tgi" and facts.version == "3.0"
    assert facts.admission == "reserve-cap"
    assert facts.budgets.max_model_len == 1024  # the document wins
    assert facts.budgets.max_num_seqs == 32  # config fills what it lacks
    assert facts.budgets.max_num_batched_tokens == 2048
    assert facts.pools[0].in_use == 3 and len(facts.pools[0].block_refs) == 3
    assert facts.requests[0].block_ids == [0, 1, 2]
    assert facts.tenants == [TenantQuota("t1", 123)]
    assert facts.gpus == [0, 1] and facts.pids == [4242]
    assert MemoryTerm(0, "weights", 1000, "measured") in facts.memory  # the document's term wins
    assert MemoryTerm(0, "weights", 7, "configured") not in facts.memory
    assert MemoryTerm(1, "weights", 7, "configured") in facts.memory
    assert MemoryTerm(0, "reserve", 9, "configured") in facts.memory
    assert facts.host.output_buffer_limit == Limit(100.0, "hard")  # from config
    assert facts.host.network_queue_limit == Limit(99.0, "hard")  # from the document


def test_poll_over_http():
    led = ledger()
    with serve_http(led.to_document) as server:
        src = LedgerSource(config(server.url))
        assert src.kind == "ledger" and src.engine == "eng"
        contribution = src.poll()
        check_facts(polled(server.url))
    assert contribution.facts.budgets.max_num_seqs is None  # the document's own facts
    snap = Snapshot()
    apply_contribution(snap, contribution)
    assert snap.engines[0].name == "eng"


def test_poll_over_unix_socket(sock_dir):
    led = ledger()
    path = os.path.join(sock_dir, "ledger.sock")
    with serve_unix(led.to_document, path) as server:
        assert server.url == f"unix://{path}"
        check_facts(polled(server.url))


def test_config_overrides_admission_and_overflow():
    with serve_http(ledger().to_document) as server:
        facts = polled(server.url, admission="dynamic", overflow="swap")
    assert (facts.admission, facts.overflow) == ("dynamic", "swap")


@pytest.mark.parametrize("transport", ["http", "unix"])
@pytest.mark.parametrize(("fault", "reason", "text"), [
    ("garbage", "parse", "document is not JSON"),
    ("status", "http_status", "HTTP 500"),
    ("hang", "timeout", "within 0.5s"),
])
def test_faults(transport, fault, reason, text, sock_dir):
    led = ledger()
    if transport == "http":
        server = serve_http(led.to_document)
    else:
        server = serve_unix(led.to_document, os.path.join(sock_dir, "s.sock"))
    with server:
        server.fault = fault
        with pytest.raises(SourceError) as err:
            LedgerSource(config(server.url, timeout_seconds=0.5)).poll()
    assert err.value.reason == reason
    assert text in err.value.message


def test_schema_error_names_the_field():
    def bad():
        doc = ledger().to_document()
        doc["pools"][0]["num_blocks"] = "abc"
        return doc

    with serve_http(bad) as server:
        with pytest.raises(SourceError) as err:
            LedgerSource(config(server.url)).poll()
    assert err.value.reason == "schema"
    assert 'pools[0].num_blocks: expected integer, got "abc"' in err.value.message


def test_connect_errors(sock_dir):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(SourceError) as err:
        LedgerSource(config(f"http://127.0.0.1:{port}/")).poll()
    assert err.value.reason == "connect"
    missing = os.path.join(sock_dir, "missing.sock")
    with pytest.raises(SourceError) as err:
        LedgerSource(config(f"unix://{missing}")).poll()
    assert err.value.reason == "connect" and missing in err.value.message


def test_listening_but_never_accepting_times_out():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(0)
    try:
        with pytest.raises(SourceError) as err:
            LedgerSource(config(f"http://127.0.0.1:{s.getsockname()[1]}/", timeout_seconds=0.3)).poll()
    finally:
        s.close()
    assert err.value.reason == "timeout"


def test_document_without_budgets_takes_them_from_config():
    def minimal():
        return {"schema": "kvledger/v1", "pools": [{"id": "0", "block_size": 16, "block_bytes": 1, "num_blocks": 4}],
                "requests": []}

    with serve_http(minimal) as server:
        facts = polled(server.url, tenants=())
    assert facts.budgets.max_model_len == 4096 and facts.budgets.iteration_tokens is None
    assert facts.tenants == [] and facts.admission is None


def test_unchanged_document_is_not_parsed_again(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An idle engine serves the same bytes: the source reuses its facts; a change is seen."""
    import kvledger.collect.sources.document as ledger_mod
    from kvledger.config.types import EngineConfig
    from kvledger_engine.document_server import serve_http

    doc = {"schema": "kvledger/v1", "pools": [{"id": "0", "block_size": 16, "block_bytes": 1, "num_blocks": 10}], "requests": []}
    calls = []
    real = ledger_mod.facts_from_json
    monkeypatch.setattr(ledger_mod, "facts_from_json", lambda d, n, **kw: calls.append(1) or real(d, n, **kw))
    with serve_http(lambda: doc) as server:
        src = ledger_mod.LedgerSource(EngineConfig(name="e", kind="ledger", url=server.url))
        first = src.poll()
        assert src.poll() is first and len(calls) == 1
        doc["pools"][0]["num_blocks"] = 11
        assert src.poll().facts.pools[0].num_blocks == 11 and len(calls) == 2
