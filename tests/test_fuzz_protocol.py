"""Fuzzing the kvledger/v1 parser: near-valid documents with extreme values, missing,
extra and mistyped fields, deep nesting, huge strings, and raw-text mutations.

Each case: ``facts_from_document``/``facts_from_json`` raise ProtocolError or return facts
whose every number is within the protocol's ranges, which the published schema also
accepts, and which go through accounting and rendering (tests/fuzz_support.py).
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

import orjson
import pytest
from fuzz_support import EXTREMES, FUZZ, assert_exports_cleanly, assert_facts_in_range
from hypothesis import event, given
from hypothesis import strategies as st

from kvledger.domain.limits import MAX_BLOCKS, MAX_REQUESTS, MAX_SAFE_INT, MAX_TOKENS
from kvledger.protocol.reader import ProtocolError, facts_from_document, facts_from_json, schema_errors, typed_facts

POOL_INTS = ("block_size", "block_bytes", "num_blocks", "sliding_window", "references", "shared", "cached_blocks",
             "engine_reported_used_blocks", "layer_groups")
REQUEST_INTS = ("prompt_tokens", "max_output_tokens", "generated_tokens", "computed_tokens", "contexts",
                "speculative_slots", "blocks_held")


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    """A valid kvledger/v1 document of 1-3 pools and 0-8 requests."""
    pools = []
    for i in range(draw(st.integers(1, 3))):
        c = draw(st.integers(1, 300))
        in_use = draw(st.integers(0, c))
        rec = draw(st.integers(0, c - in_use))
        pool: dict[str, Any] = {"id": str(i), "block_size": draw(st.sampled_from([1, 16, 32])),
                                "block_bytes": draw(st.sampled_from([1, 4096, 2 << 20])), "num_blocks": c,
                                "blocks": {"in_use": in_use, "reclaimable": rec, "free": c - in_use - rec},
                                "references": in_use + draw(st.integers(0, 5)), "shared": draw(st.integers(0, in_use))}
        if draw(st.booleans()):
            n = draw(st.integers(0, min(c, 20)))
            pool["block_refs"] = [[b, draw(st.integers(0, 3)), draw(st.booleans())] for b in range(n)]
        if draw(st.booleans()):
            pool["sliding_window"] = draw(st.sampled_from([64, 4096]))
        if draw(st.booleans()):  # the engine's own admission estimate (the SGLang plugin)
            pool["admission_estimate"] = {"new_token_ratio": draw(st.floats(0, 1)),
                                          "output_clip": draw(st.sampled_from([1, 4096, MAX_TOKENS]))}
            pool["preempted_tokens"] = draw(st.integers(0, 10_000))
        if draw(st.booleans()):  # a hybrid model's KV-cache groups sharing the pool
            kinds = draw(st.lists(st.sampled_from(["full_attention", "sliding_window", "chunked_local_attention", "mamba"]),
                                  min_size=1, max_size=3))  # fmt: skip
            left = in_use
            groups = []
            for g, kind in enumerate(kinds):
                group: dict[str, Any] = {"id": str(g), "kind": kind, "in_use": (share := draw(st.integers(0, left)))}
                left -= share
                if kind in ("sliding_window", "chunked_local_attention"):
                    group["window"] = draw(st.sampled_from([1, 64, 4096]))
                elif kind == "mamba" and draw(st.booleans()):
                    group["state_blocks"] = draw(st.integers(1, 3))
                groups.append(group)
            pool["groups"] = groups
        pools.append(pool)
    requests = []
    for i in range(draw(st.integers(0, 8))):
        pool = draw(st.sampled_from(pools))
        req: dict[str, Any] = {"id": f"r{i}", "pool": pool["id"], "state": draw(st.sampled_from(["running", "waiting", "preempted"])),
                               "prompt_tokens": draw(st.integers(0, 5000)), "max_output_tokens": draw(st.integers(0, 5000)),
                               "output_bound": draw(st.sampled_from(["cap", "estimate"])),
                               "computed_tokens": draw(st.integers(0, 5000)), "contexts": draw(st.integers(1, 4)),
                               "speculative_slots": draw(st.integers(0, 4))}
        if draw(st.booleans()):
            req["blocks_held"] = draw(st.integers(0, pool["num_blocks"]))
        else:
            req["block_ids"] = draw(st.lists(st.integers(0, pool["num_blocks"] - 1), max_size=min(5, pool["num_blocks"]), unique=True))
        requests.append(req)
    return {
        "schema": "kvledger/v1",
        "engine": {"kind": "fuzz", "version": "1"},
        "admission": draw(st.sampled_from(["reserve-cap", "dynamic"])),
        "overflow": "preempt-recompute",
        "budgets": {"max_num_batched_tokens": 8192, "iteration_tokens": 100, "max_num_seqs": 256,
                    "max_model_len": draw(st.sampled_from([None, 1, 2048, MAX_TOKENS]))},
        "pools": pools,
        "requests": requests,
        "counters": {"preemptions": draw(st.integers(0, 10)), "prefix_cache_hit_tokens": 2.5},
        "memory": [{"gpu": 0, "category": "weights", "bytes": 16_000_000_000, "source": "measured"}],
        "host": {"output_buffer_bytes": 1024, "output_buffer_limit_bytes": 65536, "output_buffer_limit_kind": "hard",
                 "network_queue_depth": 3, "network_queue_limit": 100},
        "tenants": [{"name": "team-a", "quota_bytes": 2**30}],
    }


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into the document (object keys and array indices)."""
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    target = doc
    for part in path[:-1]:
        target = target[part]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value


def _nested(depth: int) -> list[Any]:
    out: list[Any] = [1]
    for _ in range(depth):
        out = [out]
    return out


_DELETE = object()
_extremes = st.sampled_from(EXTREMES).map(copy.deepcopy)  # fresh objects: mutations must not leak between examples
_values = st.one_of(_extremes, st.integers(), st.floats(), st.text(max_size=20), st.just(_DELETE),
                    st.integers(1, 60).map(_nested))


@st.composite
def mutated_documents(draw: st.DrawFn) -> dict[str, Any]:
    """A valid document with 1-3 mutations: extreme or mistyped values, deleted fields,
    extra fields, and the pool/request integer fields set to boundary values."""
    doc = draw(documents())
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 3))
        if kind == 0 and isinstance(doc.get("pools"), list) and doc["pools"]:
            pool = draw(st.sampled_from([p for p in doc["pools"] if isinstance(p, dict)] or [{}]))
            pool[draw(st.sampled_from(POOL_INTS))] = draw(_extremes)
        elif kind == 1 and isinstance(doc.get("requests"), list) and doc["requests"]:
            req = draw(st.sampled_from(doc["requests"]))
            if isinstance(req, dict):
                req[draw(st.sampled_from(REQUEST_INTS))] = draw(_extremes)
        elif kind == 2:
            doc[draw(st.sampled_from(["future", "counters", "budgets", "host", "memory", "tenants", "engine"]))] = draw(_values)
        else:
            paths = _paths(doc)
            if paths:
                _set(doc, draw(st.sampled_from(paths)), draw(_values))
    return doc


def _check_accepted(doc: Any, facts: Any) -> None:
    assert_facts_in_range(facts)
    # what the converter accepts the published schema accepts (the converter adds cross-field rules)
    assert schema_errors(doc) == [], schema_errors(doc)
    assert_exports_cleanly(facts)
    assert_exports_cleanly(facts, "reference-aware")


@FUZZ
@given(mutated_documents())
def test_fuzz_documents(doc: dict[str, Any]) -> None:
    try:
        facts = facts_from_document(doc, "fuzz")
    except ProtocolError as exc:
        assert re.match(r"^(<document>|[a-z_]+)", str(exc)), exc  # names a field path
        event("rejected")
        return
    event("accepted")
    _check_accepted(doc, facts)


@FUZZ
@given(documents())
def test_fuzz_valid_documents_are_accepted_and_export(doc: dict[str, Any]) -> None:
    facts = facts_from_document(doc, "fuzz")
    _check_accepted(doc, facts)


_NUMBER = re.compile(rb"(?<=[:\[,])-?[0-9][0-9.eE+-]*")
_RAW_NUMBERS = (b"1e999", b"-1e999", b"NaN", b"Infinity", b"-Infinity", b"1e308", b"-0", b"2.5", b"18446744073709551616",
                b"9223372036854775808", b"9007199254740993", b"9" * 400, b"0.0", b"1E2", b"[1]", b"\"1\"", b"null")


@st.composite
def raw_texts(draw: st.DrawFn) -> bytes:
    """JSON text of a valid document with numbers replaced by out-of-JSON or extreme
    tokens, nesting, truncation or flipped bytes."""
    text = orjson.dumps(draw(documents()))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 4))
        if kind <= 1:
            spans = [m.span() for m in _NUMBER.finditer(text)]
            if spans:
                a, b = draw(st.sampled_from(spans))
                text = text[:a] + draw(st.sampled_from(_RAW_NUMBERS)) + text[b:]
        elif kind == 2:
            depth = draw(st.sampled_from([10, 1023, 1024, 1025, 5000, 100_000]))
            text = text[:-1] + b',"deep":' + b"[" * depth + b"]" * depth + b"}"
        elif kind == 3:
            text = text[: draw(st.integers(0, len(text)))]
        else:
            i = draw(st.integers(0, max(0, len(text) - 1)))
            text = text[:i] + bytes([draw(st.integers(0, 255))]) + text[i + 1 :]
    return text


@FUZZ
@given(raw_texts())
def test_fuzz_json_text(text: bytes) -> None:
    try:
        facts = facts_from_json(text, "fuzz")
    except ProtocolError:
        event("rejected")
        return
    event("accepted")
    _check_accepted(orjson.loads(text), facts)


# ---------------------------------------------------------------- the probe's findings, pinned


def _doc() -> dict[str, Any]:
    return {"schema": "kvledger/v1",
            "pools": [{"id": "0", "block_size": 16, "block_bytes": 4096, "num_blocks": 127}],
            "requests": [{"id": "r", "state": "running", "prompt_tokens": 10, "max_output_tokens": 5}]}


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("requests", 0, "prompt_tokens"), 2**63, "requests[0].prompt_tokens: must be <= 1073741824, got 9223372036854775808"),
        (("requests", 0, "prompt_tokens"), 2.0**64, "requests[0].prompt_tokens: must be <= 1073741824, got 1.8446744073709552e+19"),
        (("requests", 0, "contexts"), 1025, "requests[0].contexts: must be <= 1024, got 1025"),
        (("requests", 0, "blocks_held"), 200, 'requests[0].blocks_held: holds 200 blocks, more than pool "0" has (127)'),
        (("requests", 0, "block_ids"), list(range(128)), 'requests[0].block_ids: holds 128 blocks, more than pool "0" has (127)'),
        (("budgets",), {"max_model_len": 0}, "budgets.max_model_len: must be >= 1, got 0"),
        (("pools", 0, "block_bytes"), 1e308, "pools[0].block_bytes: must be <= 9007199254740991, got 1e+308"),
        (("pools", 0, "block_bytes"), 2**50, "pools[0].num_blocks: num_blocks x block_bytes = 127 x 1125899906842624 exceeds 9007199254740991 (2**53 - 1)"),
        (("pools", 0, "num_blocks"), 0, "pools[0].num_blocks: must be >= 1, got 0"),
        (("pools", 0, "block_refs"), [[0, 2**31, True]], "pools[0].block_refs[0][1]: must be <= 1073741824, got 2147483648"),
        (("pools", 0, "block_refs"), [[2**60, 1, True]], "pools[0].block_refs[0][0]: must be <= 9007199254740991, got 1152921504606846976"),
        (("pools", 0, "block_refs"), [[i, 1, True] for i in range(128)], "pools[0].block_refs: lists 128 blocks, more than num_blocks (127)"),
        (("counters",), {"preemptions": math.nan}, "counters.preemptions: must be a finite number, got NaN"),
        (("counters",), {"preemptions": -math.inf}, "counters.preemptions: must be a finite number, got -Infinity"),
        (("counters",), {"preemptions": 1e300}, "counters.preemptions: must be <= 9007199254740991, got 1e+300"),
        (("host",), {"network_queue_limit": math.inf}, "host.network_queue_limit: must be a finite number, got Infinity"),
        (("pools", 0, "engine_reported_used_blocks"), math.nan, "pools[0].engine_reported_used_blocks: must be a finite number, got NaN"),
        (("pools", 0, "admission_estimate"), {"new_token_ratio": 1.5, "output_clip": 4096},
         "pools[0].admission_estimate.new_token_ratio: must be <= 1, got 1.5"),
        (("pools", 0, "admission_estimate"), {"new_token_ratio": "0.5", "output_clip": 4096},
         'pools[0].admission_estimate.new_token_ratio: expected number, got "0.5"'),
        (("pools", 0, "admission_estimate"), {"new_token_ratio": 0.5, "output_clip": 0},
         "pools[0].admission_estimate.output_clip: must be >= 1, got 0"),
        (("pools", 0, "admission_estimate"), {"new_token_ratio": 0.5}, "pools[0].admission_estimate.output_clip: is required"),
        (("pools", 0, "admission_estimate"), [0.5], "pools[0].admission_estimate: expected object, got an array"),
    ],
)
def test_probe_findings_are_rejected_with_the_field_path(path: tuple[Any, ...], value: Any, message: str) -> None:
    doc = _doc()
    _set(doc, path, value)
    with pytest.raises(ProtocolError) as err:
        facts_from_document(doc, "e")
    assert str(err.value) == message


def test_integral_float_is_accepted_by_both_paths_alike() -> None:
    doc = _doc()
    doc["requests"][0]["prompt_tokens"] = 10.0  # the fast path declines, the checked path converts
    doc["pools"][0]["block_bytes"] = 4096.0
    facts = facts_from_document(doc, "e")
    assert facts.requests is not None and facts.requests[0].prompt_tokens == 10
    assert type(facts.requests[0].prompt_tokens) is int and type(facts.pools[0].block_bytes) is int
    assert schema_errors(doc) == []


def test_too_many_requests() -> None:
    doc = _doc()
    doc["requests"] = [{}] * (MAX_REQUESTS + 1)
    with pytest.raises(ProtocolError, match=r"^requests: lists 1048577 requests, more than 1048576$"):
        facts_from_document(doc, "e")


@pytest.mark.parametrize("text", [b"[" * 100_000, b'{"a":' * 100_000, b'{"schema": "kvledger/v1", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}"])
def test_deep_nesting_is_a_protocol_error(text: bytes) -> None:
    # the stdlib parser raised RecursionError here; orjson stops at depth 1024
    with pytest.raises(ProtocolError, match=r"^<document>: invalid JSON at line 1, column \d+: depth limit exceeded$"):
        facts_from_json(text, "e")


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_json_numbers_are_rejected(token: bytes) -> None:
    text = orjson.dumps(_doc()).replace(b'"prompt_tokens":10', b'"prompt_tokens":' + token)
    with pytest.raises(ProtocolError, match=r"^<document>: invalid JSON"):
        facts_from_json(text, "e")


def test_limits_make_the_worst_document_safe_to_account() -> None:
    """Every field at its maximum: accounting stays in int64 and every export is finite."""
    doc = copy.deepcopy(_doc())
    doc["pools"][0].update(block_size=1, num_blocks=2**32, block_bytes=MAX_SAFE_INT // 2**32)
    doc["requests"] = [{"id": f"r{i}", "state": "running", "prompt_tokens": MAX_TOKENS, "max_output_tokens": MAX_TOKENS,
                        "speculative_slots": MAX_TOKENS, "contexts": 1024, "blocks_held": 2**32, "computed_tokens": MAX_TOKENS}
                       for i in range(64)]
    facts = facts_from_document(doc, "e")
    assert_facts_in_range(facts)
    accounts = assert_exports_cleanly(facts)
    reserved = accounts.engines[0].pools[0].reserved_blocks
    assert reserved is not None and reserved.exact is not None and reserved.exact > 0  # no int64 wrap-around


_request_values = st.one_of(_extremes, st.integers(-3, 2**31), st.sampled_from(["running", "waiting", "cap", "estimate", "0", "r"]),
                            st.lists(st.sampled_from([0, 1, -1, 2**53, 2**53 - 1, 2**64, 1.0, True]), max_size=4))


def _mostly(valid: Any) -> st.SearchStrategy[Any]:
    """The valid value 9 times in 10, else an extreme one."""
    return st.integers(0, 9).flatmap(lambda n: _request_values if n == 0 else st.just(valid))


@FUZZ
@given(st.fixed_dictionaries(
    {"id": _mostly("r"), "state": _mostly("running"), "prompt_tokens": _mostly(1), "max_output_tokens": _mostly(MAX_TOKENS)},
    optional={k: _request_values for k in (*REQUEST_INTS[2:], "output_bound", "pool", "tenant", "block_ids")},
))
def test_fuzz_typed_and_checked_request_readers_agree_on_extremes(raw: dict[str, Any]) -> None:
    doc = {"schema": "kvledger/v1", "pools": [{"id": "0", "block_size": 16, "block_bytes": 1, "num_blocks": MAX_BLOCKS}],
           "requests": [raw]}
    typed = typed_facts(json.dumps(doc).encode(), "e")  # NaN and Infinity as json writes them: not JSON
    fast = None if typed is None or typed.requests is None else typed.requests[0]
    try:
        checked = (facts_from_document(doc, "e").requests or [])[0]
    except ProtocolError:
        assert fast is None, raw  # the typed reader never accepts what the checked reader rejects
        event("rejected")
        return
    event("typed" if fast is not None else "checked")
    assert fast is None or fast == checked
