"""The cheaper reads of kvledger/v1 (issue 14; docs/ledger.md, "Cheaper reads"): the
columnar form and conditional reads give the same facts and the same Accounts as the row
form, in the converter, in the reference ledger and its server, in the vLLM integration's
document and in the daemon's ledger source; plain v1 servers and readers keep working.
"""

from __future__ import annotations

import base64
import http.client
import json
import random
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import orjson
import pytest
from accounting_support import accounts_of
from fuzz_support import FUZZ
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz_protocol import documents

from kvledger.collect.sources.document import LedgerSource
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import Snapshot
from kvledger.domain.request_table import RequestTable
from kvledger.output.prometheus import render_text
from kvledger.protocol.fast_decoder import TypedRows, decode, table_from_rows
from kvledger.protocol.reader import (
    COLUMNS_MEDIA_TYPE,
    ProtocolError,
    _requests_checked,
    facts_from_document,
    schema_errors,
)
from kvledger_engine.document_server import COLUMNS_TYPE, serve_http, wants_columns
from kvledger_engine.reference_ledger import Ledger, LedgerError, PoolSpec
from kvledger_engine.vllm.published import PoolStatic, PublishedLedger, RequestRow
from kvledger_engine.vllm.tracker import PoolSummary

REQUEST_KEYS = ("id", "tenant", "pool", "state", "prompt_tokens", "max_output_tokens", "output_bound", "generated_tokens",
                "computed_tokens", "contexts", "speculative_slots", "blocks_held", "block_ids")


INT_KEYS = ("prompt_tokens", "max_output_tokens", "generated_tokens", "computed_tokens", "contexts", "speculative_slots",
            "blocks_held")


def int64le(values: list[int]) -> dict[str, str]:
    """Machine integers written here with struct, independently of the integration's writer."""
    return {"int64le": base64.b64encode(struct.pack(f"<{len(values)}q", *values)).decode()}


def to_columns(doc: dict[str, Any], compact: bool = False, binary: bool = False) -> dict[str, Any]:
    """The columnar form of a row-form document, written independently of the converter: a
    field a row lacks is a null entry, a field no row has is an absent column; ``compact``
    writes a column whose entries are all the same (and not null) as that one value."""
    rows = doc["requests"]
    out = {k: v for k, v in doc.items() if k != "requests"}
    columns: dict[str, Any] = {key: [r.get(key) for r in rows] for key in REQUEST_KEYS if any(key in r for r in rows)}
    for key in ("id", "state", "prompt_tokens", "max_output_tokens"):
        columns.setdefault(key, [])
    if compact and rows:
        for key, values in list(columns.items()):
            if key not in ("id", "block_ids") and values[0] is not None and all(v == values[0] and type(v) is type(values[0]) for v in values):
                columns[key] = values[0]
    if binary:
        for key in INT_KEYS:
            values = columns.get(key)
            if isinstance(values, list) and all(type(v) is int for v in values):
                columns[key] = int64le(values)
    out["request_columns"] = columns
    return out


def exposition(facts: Any, sharing: str = "per-request") -> bytes:
    """Everything the daemon would export from these facts."""
    accounts = accounts_of(Snapshot(engines=[facts], sharing=sharing))  # type: ignore[arg-type]
    accounts.invariant_totals = {(e.name, c): 1 for e in accounts.engines for c in e.invariant_violations}
    return render_text(accounts)


# ---------------------------------------------------------------- the converter


@FUZZ
@given(documents(), st.sampled_from(["per-request", "reference-aware"]), st.booleans(), st.booleans())
def test_columnar_form_gives_the_same_facts_and_accounts(doc: dict[str, Any], sharing: str, compact: bool, binary: bool) -> None:
    rows = facts_from_document(doc, "e")
    columnar_doc = to_columns(doc, compact, binary)
    assert schema_errors(columnar_doc) == []
    columns = facts_from_document(columnar_doc, "e")
    assert list(columns.requests or []) == list(rows.requests or [])
    assert exposition(columns, sharing) == exposition(rows, sharing)


@FUZZ
@given(documents())
def test_row_form_read_by_type_agrees_with_the_request_by_request_reader(doc: dict[str, Any]) -> None:
    pools = {p["id"]: p["num_blocks"] for p in doc["pools"]}
    checked = _requests_checked(doc["requests"], doc["pools"][0]["id"], pools)
    typed = decode(orjson.dumps(doc))
    assert typed is not None and isinstance(typed["requests"], TypedRows)  # valid canonical documents are read by type
    fast = table_from_rows(typed["requests"].rows, doc["pools"][0]["id"], pools)
    assert fast is not None  # column by column
    assert list(fast) == list(checked)


def test_rows_missing_a_key_of_the_first_row_still_read() -> None:
    doc = {"schema": "kvledger/v1", "pools": [{"id": "0", "block_size": 16, "block_bytes": 1, "num_blocks": 100}],
           "requests": [{"id": "a", "state": "running", "prompt_tokens": 1, "max_output_tokens": 2, "tenant": "t"},
                        {"id": "b", "state": "waiting", "prompt_tokens": 3, "max_output_tokens": 4, "blocks_held": 7}]}
    facts = facts_from_document(doc, "e")
    assert isinstance(facts.requests, RequestTable)
    a, b = facts.requests
    assert (a.tenant, a.blocks_held, b.tenant, b.blocks_held) == ("t", 0, None, 7)


def _columnar() -> dict[str, Any]:
    return {"schema": "kvledger/v1",
            "pools": [{"id": "0", "block_size": 16, "block_bytes": 4096, "num_blocks": 127}],
            "request_columns": {"id": ["a", "b"], "state": ["running", "waiting"], "prompt_tokens": [10, 20],
                                "max_output_tokens": [5, 6]}}


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("prompt_tokens", [10, "x"], 'request_columns.prompt_tokens[1]: expected integer, got "x"'),
        ("prompt_tokens", [10, 2**63], "request_columns.prompt_tokens[1]: must be <= 1073741824, got 9223372036854775808"),
        ("prompt_tokens", [10], "request_columns.prompt_tokens: has 1 entries, request_columns.id has 2"),
        ("prompt_tokens", None, "request_columns.prompt_tokens: is required"),
        ("prompt_tokens", "10", 'request_columns.prompt_tokens: expected integer, got "10"'),  # one value for all
        ("state", ["running", "done"], 'request_columns.state[1]: expected one of running, waiting, preempted; got "done"'),
        ("id", ["a", "a"], 'request_columns.id[1]: duplicate request id "a"'),
        ("id", ["a", ""], "request_columns.id[1]: must not be empty"),
        ("pool", ["0", "9"], 'request_columns.pool[1]: no pool with id "9"'),
        ("blocks_held", [1, 200], 'request_columns.blocks_held[1]: holds 200 blocks, more than pool "0" has (127)'),
        ("contexts", [1, 0], "request_columns.contexts[1]: must be >= 1, got 0"),
        ("block_ids", [[1], [2, -1]], "request_columns.block_ids[1][1]: must be >= 0, got -1"),
        ("block_ids", [None, list(range(128))], 'request_columns.block_ids[1]: holds 128 blocks, more than pool "0" has (127)'),
        ("output_bound", ["cap", True], "request_columns.output_bound[1]: expected one of cap, estimate; got true"),
        ("pool", 7, "request_columns.pool: expected string, got 7"),
        ("contexts", 0, "request_columns.contexts: must be >= 1, got 0"),
        ("blocks_held", 200, 'request_columns.blocks_held: holds 200 blocks, more than pool "0" has (127)'),
        ("state", "done", 'request_columns.state: expected one of running, waiting, preempted; got "done"'),
        ("id", "a", 'request_columns.id: expected array, got "a"'),
        ("contexts", {"a": 1}, 'request_columns.contexts: expected array, one value, or {"int64le": base64}, got an object'),
        ("id", {"int64le": ""}, "request_columns.id: expected array, got an object"),
        ("prompt_tokens", {"int64le": "not base64!"}, "request_columns.prompt_tokens.int64le: is not base64"),
        ("prompt_tokens", {"int64le": base64.b64encode(b"\0" * 8).decode()},
         "request_columns.prompt_tokens.int64le: holds 8 bytes, not 8 for each of 2 requests"),
        ("prompt_tokens", {"int64le": base64.b64encode(struct.pack("<2q", 10, 2**40)).decode()},
         "request_columns.prompt_tokens[1]: must be <= 1073741824, got 1099511627776"),
        ("blocks_held", {"int64le": base64.b64encode(struct.pack("<2q", -1, 0)).decode()},
         "request_columns.blocks_held[0]: must be >= 0, got -1"),
        ("blocks_held", {"int64le": base64.b64encode(struct.pack("<2q", 1, 500)).decode()},
         'request_columns.blocks_held[1]: holds 500 blocks, more than pool "0" has (127)'),
    ],
)
def test_columnar_errors_name_the_column_and_entry(column: str, value: Any, message: str) -> None:
    doc = _columnar()
    if value is None:
        del doc["request_columns"][column]
    else:
        doc["request_columns"][column] = value
    with pytest.raises(ProtocolError) as err:
        facts_from_document(doc, "e")
    assert str(err.value) == message
    # what the JSON Schema cannot see: unique ids, known pools, capacity, lengths, values inside base64
    beyond_schema = any(word in message for word in ("duplicate", "no pool", "holds", "entries")) or (
        column != "id" and isinstance(value, dict) and "int64le" in value and "not base64" not in message)
    assert (schema_errors(doc) != []) is not beyond_schema  # ids, pools, capacity and lengths: the converter's rules


def test_columnar_integral_floats_and_nulls_are_read_like_rows() -> None:
    doc = _columnar()
    doc["request_columns"]["prompt_tokens"] = [10.0, 20]
    doc["request_columns"]["tenant"] = [None, "t"]
    doc["request_columns"]["contexts"] = [None, 2]
    facts = facts_from_document(doc, "e")
    a, b = facts.requests or []
    assert (a.prompt_tokens, type(a.prompt_tokens), a.tenant, a.contexts, b.tenant, b.contexts) == (10, int, None, 1, "t", 2)


def test_a_column_given_as_one_value_stands_for_every_request() -> None:
    doc = _columnar()
    doc["request_columns"].update(pool="0", contexts=2, output_bound="estimate", tenant="t", blocks_held=3)
    assert schema_errors(doc) == []
    a, b = facts_from_document(doc, "e").requests or []
    assert (a.pool, a.contexts, a.output_bound, a.tenant, a.blocks_held) == ("0", 2, "estimate", "t", 3)
    assert (b.pool, b.contexts, b.output_bound, b.tenant, b.blocks_held) == ("0", 2, "estimate", "t", 3)


def test_both_forms_at_once_are_refused() -> None:
    doc = _columnar()
    doc["requests"] = []
    with pytest.raises(ProtocolError, match=r"^request_columns: a document carries requests or request_columns, not both$"):
        facts_from_document(doc, "e")
    assert schema_errors(doc) != []


def test_a_columnar_document_read_as_plain_v1_fails_loudly() -> None:
    """A reader that knows only the row form (the schema without request_columns) cannot
    mistake a columnar document for an engine without requests: requests is missing."""
    doc = _columnar()
    assert "requests" not in doc
    plain_v1 = json.loads(json.dumps(doc))
    plain_v1.pop("request_columns")
    with pytest.raises(ProtocolError, match=r"^requests: is required$"):
        facts_from_document(plain_v1, "e")


def test_request_table_behaves_as_a_sequence() -> None:
    doc = _columnar()
    table = facts_from_document(doc, "e").requests
    assert isinstance(table, RequestTable)
    assert len(table) == 2 and table[-1].id == "b" and [r.id for r in table[0:1]] == ["a"]
    assert table == list(table) and table != [] and repr(table) == "RequestTable(2 requests)"
    with pytest.raises(IndexError):
        table[2]
    both = RequestTable.concat([table, table])
    assert [r.id for r in both] == ["a", "b", "a", "b"] and both.block_ids is None
    assert RequestTable.from_requests(list(table)) == table


# ---------------------------------------------------------------- the reference ledger and its server


def busy_ledger(seed: int, tenants: bool = True) -> Ledger:
    """A reference ledger after a random workload: admissions, growth, sharing, preemption, release."""
    rng = random.Random(seed)
    led = Ledger([PoolSpec("0", 16, 4096, 400), PoolSpec("w", 16, 4096, 200, sliding_window=64)],
                 max_model_len=2048, max_num_seqs=64)
    for i in range(40):
        rid = f"r{i}"
        pool = rng.choice(["0", "w"])
        try:
            led.admit(rid, rng.randint(1, 300), rng.randint(1, 200), pool=pool, tenant=f"t{i % 3}" if tenants else None,
                      output_bound=rng.choice(["cap", "estimate"]), contexts=rng.choice([1, 1, 2]))
            led.advance(rid, rng.randint(0, 300))
        except LedgerError:
            continue
        if rng.random() < 0.2:
            led.preempt(rid)
        elif rng.random() < 0.2:
            led.release(rid)
    led.submit("queued", 50, 50)
    return led


@FUZZ
@given(st.integers(0, 10_000), st.booleans(), st.booleans())
def test_reference_ledger_columnar_document_accounts_like_its_rows(seed: int, blocks: bool, tenants: bool) -> None:
    led = busy_ledger(seed, tenants)
    rows = led.to_document(include_blocks=blocks)
    columns = led.to_document(include_blocks=blocks, columns=True)
    assert schema_errors(columns) == [] and "requests" not in columns
    for sharing in ("per-request", "reference-aware"):
        assert exposition(facts_from_document(columns, "e"), sharing) == exposition(facts_from_document(rows, "e"), sharing)


def _get(url: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.request("GET", "/", headers=headers)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


def test_server_negotiates_the_form_and_answers_conditional_reads() -> None:
    led = busy_ledger(1)
    with serve_http(led.to_document, columns=lambda: led.to_document(columns=True)) as server:
        status, headers, body = _get(server.url, {"Accept": "application/json"})
        assert status == 200 and headers["content-type"] == "application/json" and "requests" in orjson.loads(body)
        assert headers["vary"] == "Accept"
        row_tag = headers["etag"]
        status, headers, body = _get(server.url, {"Accept": f"{COLUMNS_TYPE}, application/json;q=0.9"})
        assert status == 200 and headers["content-type"] == COLUMNS_TYPE and "request_columns" in orjson.loads(body)
        col_tag = headers["etag"]
        assert col_tag != row_tag
        # unchanged: 304 without a body, for each form under its own tag
        status, headers, body = _get(server.url, {"Accept": COLUMNS_TYPE, "If-None-Match": col_tag})
        assert (status, body, headers["etag"]) == (304, b"", col_tag)
        status, _, body = _get(server.url, {"Accept": "application/json", "If-None-Match": col_tag})
        assert status == 200 and "requests" in orjson.loads(body)  # the other form's tag does not match
        led.submit("new", 10, 10)
        status, headers, _ = _get(server.url, {"Accept": COLUMNS_TYPE, "If-None-Match": col_tag})
        assert status == 200 and headers["etag"] != col_tag


def test_server_without_a_columnar_render_serves_rows_to_everyone() -> None:
    led = busy_ledger(2)
    with serve_http(led.to_document) as server:
        status, headers, body = _get(server.url, {"Accept": COLUMNS_TYPE})
        assert status == 200 and headers["content-type"] == "application/json" and "requests" in orjson.loads(body)
        assert "vary" not in headers


@pytest.mark.parametrize(("accept", "wanted"), [
    (None, False), ("application/json", False), (COLUMNS_TYPE, True), (f"{COLUMNS_TYPE.upper()};q=0.5", True),
    (f"application/json, {COLUMNS_TYPE}; q=0", False), (f"text/html, {COLUMNS_TYPE};q=1", True),
])
def test_accept_header_parsing(accept: str | None, wanted: bool) -> None:
    assert wants_columns(accept) is wanted


def test_media_type_is_the_same_on_both_sides() -> None:
    assert COLUMNS_TYPE == COLUMNS_MEDIA_TYPE


# ---------------------------------------------------------------- the daemon's ledger source


def test_ledger_source_reads_the_columnar_form_and_skips_unchanged_documents() -> None:
    led = busy_ledger(3)
    with serve_http(led.to_document, columns=lambda: led.to_document(columns=True)) as server:
        source = LedgerSource(EngineConfig(name="e", kind="ledger", url=server.url, timeout_seconds=2.0))
        first = source.poll()
        assert source.reader.columnar == 1
        expected = facts_from_document(led.to_document(), "e")
        assert exposition(first.facts) == exposition(expected)
        assert source.poll() is first and source.reader.not_modified == 1  # 304: nothing parsed
        led.submit("more", 5, 5)
        changed = source.poll()
        assert changed is not first and source.reader.columnar == 2
        assert "more" in [r.id for r in changed.facts.requests or []]


class _PlainV1(BaseHTTPRequestHandler):
    """A plain v1 server of another make: no ETag, Accept ignored, HTTP/1.0."""

    body = b""
    seen: ClassVar[list[dict[str, str]]] = []

    def do_GET(self) -> None:
        _PlainV1.seen.append(dict(self.headers))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: Any) -> None:
        return


def test_ledger_source_reads_a_plain_v1_server_unchanged() -> None:
    led = busy_ledger(4)
    _PlainV1.body = json.dumps(led.to_document()).encode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PlainV1)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        source = LedgerSource(EngineConfig(name="e", kind="ledger", url=f"http://127.0.0.1:{server.server_address[1]}/",
                                           timeout_seconds=2.0))
        first = source.poll()
        assert exposition(first.facts) == exposition(facts_from_document(led.to_document(), "e"))
        assert source.poll() is first and source.reader.unchanged == 1 and source.reader.not_modified == 0
        assert "If-None-Match" not in _PlainV1.seen[-1]  # no ETag was given: none is sent
        assert COLUMNS_TYPE in _PlainV1.seen[-1]["Accept"]
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------- the vLLM integration's document


def vllm_document(n: int, seed: int, tenants: bool) -> PublishedLedger:
    rng = random.Random(seed)
    doc = PublishedLedger({"kind": "vllm", "version": "0.32.0"}, PoolStatic("0", 16, 65536, 5000, None, 2), {"name": "t"})
    rows = {}
    for i in range(n):
        state = rng.choice(["running", "running", "waiting", "preempted"])
        computed = rng.randint(0, 900) if state == "running" else 0
        rows[f"req-{i}"] = RequestRow(f"req-{i}", state, rng.randint(1, 500), rng.randint(1, 500), rng.randint(0, 400),
                                      computed, -(-computed // 16), f"t{i % 4}" if tenants else None)
    held = sum(r.blocks_held for r in rows.values())
    doc.publish(PoolSummary(held, 10, 5000 - held - 10, held, 0), {"max_num_batched_tokens": 2048, "max_num_seqs": 256,
                "max_model_len": 4096}, rows, set(), {"publications": 1})
    return doc


@FUZZ
@given(st.integers(0, 200), st.integers(0, 10_000), st.booleans())
def test_vllm_document_columnar_form_accounts_like_its_rows(n: int, seed: int, tenants: bool) -> None:
    doc = vllm_document(n, seed, tenants)
    rows_body, row_tag = doc.render_tagged()
    columns_body, col_tag = doc.render_columns()
    assert row_tag == col_tag  # one publication, one version, for both forms
    columns = orjson.loads(columns_body)
    assert schema_errors(columns) == [] and "requests" not in columns
    rows_facts = facts_from_document(orjson.loads(rows_body), "e")
    columns_facts = facts_from_document(columns, "e")
    by_id = lambda facts: sorted(facts.requests or [], key=lambda r: r.id)  # the row form's order is its render cache's
    assert by_id(columns_facts) == by_id(rows_facts)
    assert exposition(columns_facts, "reference-aware") == exposition(rows_facts, "reference-aware")
    assert doc.render_columns()[0] is columns_body  # unchanged: rendered once


def test_vllm_document_versions_move_with_publications() -> None:
    doc = vllm_document(5, 1, False)
    _, before = doc.render_columns()
    doc.publish(PoolSummary(0, 0, 5000, 0, 0), {}, {}, {"req-0"}, {})
    body, after = doc.render_columns()
    assert after != before and "req-0" not in orjson.loads(body)["request_columns"]["id"]


# ---------------------------------------------------------------- the HTTP client's conditional GET


def test_http_client_takes_304_only_for_a_conditional_get() -> None:
    from kvledger.collect.sources.base import SourceError
    from kvledger.collect.sources.http_client import HttpClient

    led = busy_ledger(5)
    with serve_http(led.to_document) as server:
        client = HttpClient(server.url, timeout=2.0, accept="application/json")
        first = client.fetch()
        assert first.status == 200 and first.etag and first.content_type == "application/json"
        again = client.fetch(if_none_match=first.etag)
        assert (again.status, again.body, again.etag) == (304, b"", first.etag)
        assert client.fetch(if_none_match='"another"').body == first.body

    class Always304(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(304)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return

    odd = ThreadingHTTPServer(("127.0.0.1", 0), Always304)
    threading.Thread(target=odd.serve_forever, daemon=True).start()
    try:
        client = HttpClient(f"http://127.0.0.1:{odd.server_address[1]}/", timeout=2.0)
        with pytest.raises(SourceError) as err:
            client.get()  # a 304 nobody asked for is no document
        assert err.value.reason == "http_status" and "HTTP 304" in err.value.message
    finally:
        odd.shutdown()
        odd.server_close()
