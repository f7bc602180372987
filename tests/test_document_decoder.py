"""The typed reading of kvledger/v1 bodies (``fast_decoder``) against the checked reader.

``facts_from_json`` decodes the common document by type (msgspec, structs built from
``wire.REQUEST_FIELDS``) and reads anything else the checked way (orjson, then field by
field, from the same definition). For every body, valid, mutated or not JSON at all, the
result must be the checked reader's: the same facts, or the same error. And the typed
way must really take the documents engines send (it is not a path that never runs).
"""

from __future__ import annotations

import base64
import copy
import json
import struct
from typing import Any

import orjson
import pytest
from fuzz_support import FUZZ
from hypothesis import event, given
from hypothesis import strategies as st
from test_fuzz_protocol import documents, mutated_documents, raw_texts
from test_wire_forms import to_columns

from kvledger.domain.facts import EngineFacts
from kvledger.domain.limits import MAX_BLOCKS, MAX_REQUESTS, MAX_TOKENS
from kvledger.domain.request_table import RequestTable
from kvledger.protocol import reader
from kvledger.protocol.fast_decoder import MEMO_KEYS
from kvledger.protocol.reader import (
    NotJsonError,
    ProtocolError,
    SectionMemo,
    facts_from_document,
    facts_from_json,
    typed_facts,
)


def checked(body: bytes) -> EngineFacts | str:
    """The checked reader alone: orjson, then field by field; an error as its message."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return str(NotJsonError(exc.lineno, exc.colno, exc.msg))
    try:
        return facts_from_document(doc, "e")
    except ProtocolError as exc:
        return str(exc)


def dumps(doc: Any) -> bytes:
    """JSON text of a fuzzed document, as any writer could send it: integers beyond 64 bits
    and lone surrogates as json writes them, a value the fuzzer marks deleted as a string."""
    try:
        return orjson.dumps(doc, default=repr)
    except orjson.JSONEncodeError:
        return json.dumps(doc, default=repr).encode()


def both(body: bytes) -> tuple[EngineFacts | str, EngineFacts | str]:
    try:
        fast: EngineFacts | str = facts_from_json(body, "e")
    except ProtocolError as exc:
        fast = str(exc)
    return fast, checked(body)


def taken_fast(body: bytes) -> bool:
    """True when the typed decode read the body's requests to the end (no fallback)."""
    try:
        return typed_facts(body, "e") is not None
    except ProtocolError:  # rejected for another part of the document, as the checked reader rejects it
        return True


def assert_same(body: bytes) -> EngineFacts | str:
    fast, slow = both(body)
    assert type(fast) is type(slow), (fast, slow)
    if isinstance(fast, str):
        assert fast == slow
    else:
        assert isinstance(fast.requests, RequestTable) and isinstance(slow, EngineFacts)
        assert fast == slow
        assert fast.requests is not None and slow.requests is not None
        assert len(fast.requests) == len(slow.requests)
        for name in ("prompt_tokens", "max_output_tokens", "generated_tokens", "computed_tokens", "contexts",
                     "speculative_slots", "blocks_held"):  # the columns the policy reads
            assert fast.requests.column(name).tolist() == RequestTable.from_requests(slow.requests).column(name).tolist()
        assert fast.requests.held().tolist() == RequestTable.from_requests(slow.requests).held().tolist()
    return fast


# ---------------------------------------------------------------- properties


@FUZZ
@given(documents())
def test_valid_documents_take_the_fast_path_with_the_same_facts(doc: dict[str, Any]) -> None:
    body = orjson.dumps(doc)
    assert taken_fast(body)
    assert isinstance(assert_same(body), EngineFacts)


@FUZZ
@given(mutated_documents())
def test_mutated_documents_read_alike(doc: dict[str, Any]) -> None:
    body = dumps(doc)
    event("fast" if taken_fast(body) else "checked")
    assert_same(body)


@FUZZ
@given(raw_texts())
def test_raw_texts_read_alike(body: bytes) -> None:
    event("fast" if taken_fast(body) else "checked")
    assert_same(body)


_ROW_VALUES = st.one_of(
    st.integers(-2, 3), st.sampled_from([MAX_TOKENS, MAX_TOKENS + 1, MAX_BLOCKS, 2**53, 2**63, 2**64, 1.0, 2.5, True, None]),
    st.sampled_from(["", "r", "running", "cap", "estimate", "0", "\udc80"]), st.lists(st.integers(-1, 3), max_size=3),
)
_ROW_KEYS = ("id", "state", "pool", "tenant", "output_bound", "prompt_tokens", "max_output_tokens", "generated_tokens",
             "computed_tokens", "contexts", "speculative_slots", "blocks_held", "block_ids", "extra")


@FUZZ
@given(st.lists(st.dictionaries(st.sampled_from(_ROW_KEYS), _ROW_VALUES, max_size=6), max_size=4))
def test_fuzzed_rows_read_alike(changes: list[dict[str, Any]]) -> None:
    """Rows of a valid document with fields set to edge values (types, ranges, nulls,
    duplicates, unknown keys, lone surrogates)."""
    doc = _doc(len(changes))
    for row, change in zip(doc["requests"], changes, strict=True):
        row.update(change)
    body = dumps(doc)
    event("fast" if taken_fast(body) else "checked")
    assert_same(body)


# ---------------------------------------------------------------- pinned cases


def _doc(n: int = 3) -> dict[str, Any]:
    return {
        "schema": "kvledger/v1",
        "pools": [{"id": "0", "block_size": 16, "block_bytes": 4096, "num_blocks": 100},
                  {"id": "swa", "block_size": 16, "block_bytes": 4096, "num_blocks": 10}],
        "requests": [{"id": f"r{i}", "state": "running", "prompt_tokens": 40, "max_output_tokens": 100, "blocks_held": 3}
                     for i in range(n)],
    }


def _with(change: Any) -> bytes:
    doc = _doc()
    change(doc)
    return orjson.dumps(doc)


FALLBACKS = {
    "an integral float": lambda d: d["requests"][0].update(prompt_tokens=40.0),
    "a field the schema does not list": lambda d: d["requests"][0].update(note="x"),
    "a top-level key the schema does not list": lambda d: d.update(future={"x": 1}),
    "duplicate request ids": lambda d: d["requests"][1].update(id="r0"),
    "an unknown pool": lambda d: d["requests"][2].update(pool="nope"),
    "more blocks than the pool": lambda d: d["requests"][2].update(pool="swa", blocks_held=11),
    "more block ids than the pool": lambda d: d["requests"][2].update(pool="swa", block_ids=list(range(11)), blocks_held=None),
    "an empty id": lambda d: d["requests"][0].update(id=""),
    "an unknown state": lambda d: d["requests"][0].update(state="done"),
    "a count out of range": lambda d: d["requests"][0].update(contexts=0),
    "a negative block id": lambda d: d["requests"][0].update(block_ids=[-1]),
    "a boolean count": lambda d: d["requests"][0].update(generated_tokens=True),
    "null requests": lambda d: d.update(requests=None),
    "no requests": lambda d: d.pop("requests"),
    "a request that is not an object": lambda d: d["requests"].append([1, 2]),
    "a document that is an array": lambda d: d.clear(),
}


@pytest.mark.parametrize("name", sorted(FALLBACKS))
def test_what_the_fast_path_does_not_take_is_read_the_checked_way(name: str) -> None:
    body = _with(FALLBACKS[name])
    if name == "a document that is an array":
        body = b"[1]"
    assert not taken_fast(body)
    assert_same(body)


@pytest.mark.parametrize("text", [
    b'{"schema": "kvledger/v1", "future": 1e999, "pools": [{"id": "0", "block_size": 16, "block_bytes": 1, "num_blocks": 1}], "requests": []}',
    b'{"schema": "kvledger/v1", "future": "\xff", "pools": [{"id": "0", "block_size": 16, "block_bytes": 1, "num_blocks": 1}], "requests": []}',
    b'{"schema": "kvledger/v1", "pools": [{"id": "0", "block_size": 16, "block_bytes": 1, "num_blocks": 1}], "requests": [{"id": "a", "state": "running", "prompt_tokens": 1, "max_output_tokens": 1, "x": NaN}]}',
    b'{"schema": "kvledger/v1", "pools": [{"id": "0", "block_size": 16, "block_bytes": 1, "num_blocks": 1}], "requests": [{"id": "a", "state": "running", "prompt_tokens": 1, "max_output_tokens": 1, "x": "\xff"}]}',
    b'{"schema": "kvledger/v1", "pools": [{"id": "0", "block_size": 16, "block_bytes": 1, "num_blocks": 1}], "requests": [{"id": "\\ud800", "state": "running", "prompt_tokens": 1, "max_output_tokens": 1}]}',
    b'{"schema": "kvledger/v1", "pools": [], "requests": []} x',
    b'\xef\xbb\xbf{"schema": "kvledger/v1"}',
    # a section the typed way keeps as text (read after the pools) not JSON, and a pool that breaks the protocol
    b'{"schema": "kvledger/v1", "tenants": [{"name": "t", "quota_bytes": 1e999}], "pools": [], "requests": []}',
    b'{"schema": "kvledger/v1", "engine": {"kind": "\xff"}, "pools": [{"id": "0"}], "requests": []}',
])
def test_what_is_not_json_anywhere_is_rejected_as_the_checked_path_rejects_it(text: bytes) -> None:
    fast, slow = both(text)
    assert isinstance(fast, str) and fast == slow


def test_defaults_and_nulls_of_optional_fields() -> None:
    """Absent fields take the protocol's defaults; blocks_held defaults to len(block_ids);
    a null field reads as an absent one (the schema allows null for every optional field)."""
    doc = _doc(6)
    doc["requests"][0] = {"id": "a", "state": "waiting", "prompt_tokens": 5, "max_output_tokens": 7}
    doc["requests"][1] = {"id": "b", "state": "running", "prompt_tokens": 5, "max_output_tokens": 7, "block_ids": [1, 2]}
    doc["requests"][2] = {"id": "c", "state": "running", "prompt_tokens": 5, "max_output_tokens": 7, "block_ids": [1],
                          "blocks_held": 4, "pool": "", "tenant": None, "output_bound": None}
    doc["requests"][4] = {"id": "e", "state": "running", "prompt_tokens": 5, "max_output_tokens": 7, "contexts": None,
                          "generated_tokens": None, "computed_tokens": None, "speculative_slots": None, "blocks_held": None,
                          "block_ids": None, "pool": None}
    doc["requests"][5] = {"id": "f", "state": "running", "prompt_tokens": 5, "max_output_tokens": 7, "blocks_held": None,
                          "block_ids": [3, 4, 5]}
    body = orjson.dumps(doc)
    assert taken_fast(body)
    facts = assert_same(body)
    assert isinstance(facts, EngineFacts) and facts.requests is not None
    a, b, c, d, e, f = facts.requests
    assert (a.contexts, a.generated_tokens, a.blocks_held, a.output_bound, a.pool, a.tenant) == (1, 0, 0, "cap", "0", None)
    assert (b.blocks_held, b.block_ids) == (2, [1, 2])
    assert (c.blocks_held, c.pool, c.output_bound) == (4, "0", "cap")
    assert d.blocks_held == 3
    assert (e.contexts, e.generated_tokens, e.computed_tokens, e.speculative_slots, e.blocks_held, e.block_ids, e.pool) == (
        1, 0, 0, 0, 0, None, "0")
    assert (f.blocks_held, f.block_ids) == (3, [3, 4, 5])


def test_the_vllm_integrations_document_takes_the_fast_path() -> None:
    """The in-engine vLLM integration adds its own ``integration`` key: still the fast path."""
    doc = _doc()
    doc["integration"] = {"name": "kvledger-vllm", "dp_rank": 0, "publications": 12}
    body = orjson.dumps(doc)
    assert taken_fast(body)
    assert_same(body)


def test_too_many_requests_is_named_by_the_checked_path() -> None:
    doc = _doc(0)
    doc["requests"] = [{"id": str(i), "state": "waiting", "prompt_tokens": 0, "max_output_tokens": 0} for i in range(MAX_REQUESTS + 1)]
    body = orjson.dumps(doc)
    fast, slow = both(body)
    assert fast == slow == f"requests: lists {MAX_REQUESTS + 1} requests, more than {MAX_REQUESTS}"


def test_the_document_is_not_changed_by_reading() -> None:
    doc = _doc()
    body = orjson.dumps(doc)
    before = copy.deepcopy(doc)
    facts_from_json(body, "e")
    assert orjson.loads(body) == before


# ---------------------------------------------------------------- the columnar form


@FUZZ
@given(documents(), st.booleans(), st.booleans())
def test_valid_columnar_documents_take_the_fast_path_with_the_same_facts(doc: dict[str, Any], compact: bool, binary: bool) -> None:
    body = orjson.dumps(to_columns(doc, compact, binary))
    assert taken_fast(body)
    fast = assert_same(body)
    assert isinstance(fast, EngineFacts)
    assert fast == facts_from_json(orjson.dumps(doc), "e")  # and the row form's facts


_COLUMN_VALUES = st.one_of(
    _ROW_VALUES, st.lists(_ROW_VALUES, max_size=4), st.just({"int64le": "AAAAAAAAAAA="}), st.just({"int64le": "!"}),
    st.just({"int64le": "AAAAAAAAAAA=", "x": 1}), st.just({}),
)


@FUZZ
@given(documents(), st.booleans(), st.booleans(),
       st.lists(st.tuples(st.sampled_from(_ROW_KEYS), st.one_of(st.none(), st.integers(0, 7)), _COLUMN_VALUES), max_size=3))
def test_mutated_columnar_documents_read_alike(doc: dict[str, Any], compact: bool, binary: bool,
                                               changes: list[tuple[str, int | None, Any]]) -> None:
    """Columns replaced, entries changed, columns given as one value, machine integers
    that are not base64 or of the wrong length, unknown keys."""
    columnar = to_columns(doc, compact, binary)
    cols = columnar["request_columns"]
    for key, index, value in changes:
        column = cols.get(key)
        if index is not None and isinstance(column, list) and index < len(column):
            column[index] = value
        else:
            cols[key] = value
    body = dumps(columnar)
    event("fast" if taken_fast(body) else "checked")
    assert_same(body)


@pytest.mark.parametrize(("key", "value", "fast", "accepted"), [
    ("contexts", [None, 2, 1], True, True),  # a null entry is the default
    ("blocks_held", [None, 2, 1], True, True),
    ("prompt_tokens", [None, 40, 40], False, False),  # a required field: no null entry (request_columns.prompt_tokens[0]: is required)
    ("state", [None, "running", "running"], False, False),
    ("prompt_tokens", [40.0, 40, 40], False, True),  # an integral float: the checked path reads it
    ("note", 1, False, True),  # a field the schema does not list: the same
    # machine integers with excess padding: binascii's strict mode takes them, msgspec does not
    ("prompt_tokens", {"int64le": base64.b64encode(struct.pack("<3q", 40, 40, 40)).decode() + "===="}, False, True),
    ("id", ["r0", "r0", "r2"], False, False),  # the errors: named by the checked path
    ("pool", ["0", "9", "0"], False, False),
    ("blocks_held", [1, 2], False, False),
    ("prompt_tokens", {"int64le": "!"}, False, False),
    ("blocks_held", {"int64le": "AAAAAAAAAAA="}, False, False),
    ("state", "done", False, False),
    ("id", "r0", False, False),
])
def test_columnar_fallbacks_and_edges(key: str, value: Any, fast: bool, accepted: bool) -> None:
    doc = to_columns(_doc(3))
    doc["request_columns"][key] = value
    body = orjson.dumps(doc)
    assert taken_fast(body) is fast
    assert isinstance(assert_same(body), EngineFacts) is accepted


@pytest.mark.parametrize("text", [
    # a key given twice: JSON leaves it open; orjson keeps the last, and so must the fast path
    b'{"schema": "kvledger/v1", "pools": [{"id": "0", "block_size": 16, "block_bytes": 1, "num_blocks": 9}], '
    b'"requests": [{"id": "a", "state": "running", "prompt_tokens": 1, "max_output_tokens": 1}], '
    b'"requests": [{"id": "b", "state": "waiting", "prompt_tokens": 2, "max_output_tokens": 2}]}',
    b'{"schema": "kvledger/v1", "pools": [{"id": "0", "block_size": 16, "block_bytes": 1, "num_blocks": 9}], '
    b'"requests": [{"id": "b", "state": "waiting", "prompt_tokens": 2, "max_output_tokens": 2, "prompt_tokens": 5}]}',
    b'{"schema": "kvledger/v1", "pools": [{"id": "0", "block_size": 16, "block_bytes": 1, "num_blocks": 9}], '
    b'"request_columns": {"id": ["a"], "state": "running", "prompt_tokens": 1, "max_output_tokens": [3], "prompt_tokens": [7]}}',
])
def test_a_key_given_twice_reads_as_the_checked_path_reads_it(text: bytes) -> None:
    assert taken_fast(text)
    assert isinstance(assert_same(text), EngineFacts)


# ---------------------------------------------------------------- the engine's sections as last read


def _read_through(memo: SectionMemo, body: bytes) -> EngineFacts | str:
    try:
        return facts_from_json(body, "e", memo=memo)
    except ProtocolError as exc:
        return str(exc)


@FUZZ
@given(st.lists(st.one_of(documents(), mutated_documents()), min_size=2, max_size=4),
       st.lists(st.sampled_from(sorted(MEMO_KEYS)), max_size=6), st.booleans())
def test_documents_read_through_one_memo_read_as_each_alone(docs: list[dict[str, Any]], shared: list[str],
                                                            columnar: bool) -> None:
    """One engine's documents in turn, some sections the same as the first one's (the memo
    then hands out what it kept), others changed or broken: each reads as it reads alone."""
    first = docs[0]
    for doc in docs[1:]:
        for key in shared:
            if key in first:
                doc[key] = copy.deepcopy(first[key])
            else:
                doc.pop(key, None)
    memo = SectionMemo()
    for doc in docs:
        if columnar and isinstance(doc.get("requests"), list) and all(isinstance(r, dict) for r in doc["requests"]):
            try:
                doc = to_columns(doc)
            except (TypeError, KeyError, ValueError, AttributeError):
                pass
        body = dumps(doc)
        assert _read_through(memo, body) == both(body)[1]


def _with_tenants(quota: int) -> bytes:
    doc = _doc()
    doc["tenants"] = [{"name": "a", "quota_bytes": quota}]
    doc["budgets"] = {"max_num_seqs": 8}
    doc["counters"] = {"preemptions": 2}
    return orjson.dumps(doc)


def test_a_section_unchanged_since_the_last_document_is_not_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    real = reader._tenants
    monkeypatch.setattr(reader, "_tenants", lambda value: calls.append(value) or real(value))
    memo = SectionMemo()
    first = facts_from_json(_with_tenants(5), "e", memo=memo)
    again = facts_from_json(_with_tenants(5), "e", memo=memo)
    assert len(calls) == 1 and again == first
    changed = facts_from_json(_with_tenants(6), "e", memo=memo)
    assert len(calls) == 2 and changed.tenants[0].quota_bytes == 6
    assert changed == facts_from_json(_with_tenants(6), "e")  # what a read alone makes (without a memo: read again)
    assert len(calls) == 3


def test_the_facts_handed_out_again_are_not_shared_with_the_next_read() -> None:
    memo = SectionMemo()
    first = facts_from_json(_with_tenants(5), "e", memo=memo)
    first.budgets.max_num_seqs = 99
    first.counters["preemptions"] = 99.0
    first.tenants.clear()
    first.host.network_queue_depth = 99
    assert facts_from_json(_with_tenants(5), "e", memo=memo) == facts_from_json(_with_tenants(5), "e")


def test_a_section_that_breaks_the_protocol_is_refused_at_every_read() -> None:
    memo = SectionMemo()
    body = _with_tenants(-1)
    for _ in range(2):
        with pytest.raises(ProtocolError, match=r"tenants\[0\]\.quota_bytes: must be >= 0"):
            facts_from_json(body, "e", memo=memo)
    assert facts_from_json(_with_tenants(1), "e", memo=memo).tenants[0].quota_bytes == 1
