import copy
import json

import pytest
from jsonschema import Draft202012Validator

from kvledger.domain.block_refs import BlockRefArray
from kvledger.domain.facts import BlockRef, Limit, MemoryTerm, TenantQuota
from kvledger.protocol.reader import ProtocolError, facts_from_document, facts_from_json, load_schema, validate_document

EXAMPLE = {
    "schema": "kvledger/v1",
    "engine": {"kind": "vllm", "version": "0.10.2"},
    "admission": "dynamic",
    "overflow": "preempt-recompute",
    "budgets": {"max_num_batched_tokens": 8192, "iteration_tokens": 3100, "max_num_seqs": 256, "max_model_len": 8192},
    "pools": [{
        "id": "0", "block_size": 16, "block_bytes": 2097152, "num_blocks": 1000,
        "sliding_window": None,
        "blocks": {"in_use": 300, "reclaimable": 100, "free": 600},
        "references": 420, "shared": 50,
        "block_refs": [[17, 2, True], [18, 0, True]],
    }],
    "requests": [{
        "id": "r1", "tenant": "team-a", "pool": "0", "state": "running",
        "prompt_tokens": 1000, "max_output_tokens": 256, "output_bound": "cap",
        "generated_tokens": 10, "computed_tokens": 1010, "contexts": 1, "speculative_slots": 0,
        "blocks_held": 64, "block_ids": [17, 18],
    }],
    "counters": {"preemptions": 3, "reservation_overflows": 0, "admission_rechecks_accepted": 1,
                 "admission_rechecks_rejected": 0, "reservation_leaks": 0},
    "memory": [{"gpu": 0, "category": "weights", "bytes": 16000000000, "source": "measured"}],
    "host": {"output_buffer_bytes": 1048576, "output_buffer_limit_bytes": 67108864,
             "output_buffer_limit_kind": "hard", "network_queue_depth": 5, "network_queue_limit": 1024,
             "network_queue_limit_kind": "estimate"},
}


def schema_ok(doc):
    return not list(Draft202012Validator(load_schema()).iter_errors(doc))


def test_schema_is_valid_draft_2020_12_and_accepts_the_design_example():
    Draft202012Validator.check_schema(load_schema())
    assert schema_ok(EXAMPLE)


def test_design_example_converts_to_facts():
    f = facts_from_document(EXAMPLE, "llama")
    assert (f.name, f.kind, f.version, f.source) == ("llama", "vllm", "0.10.2", "ledger")
    assert (f.admission, f.overflow) == ("dynamic", "preempt-recompute")
    assert f.budgets.iteration_tokens == 3100 and f.budgets.max_model_len == 8192
    p = f.pools[0]
    assert (p.id, p.block_size, p.block_bytes, p.num_blocks, p.sliding_window) == ("0", 16, 2097152, 1000, None)
    assert (p.in_use, p.reclaimable, p.free, p.references, p.shared) == (300, 100, 600, 420, 50)
    assert list(p.block_refs) == [BlockRef(17, 2, True), BlockRef(18, 0, True)]
    r = f.requests[0]
    assert (r.id, r.tenant, r.state, r.prompt_tokens, r.max_output_tokens, r.blocks_held) == (
        "r1", "team-a", "running", 1000, 256, 64)
    assert r.block_ids == [17, 18]
    assert f.counters["preemptions"] == 3 and set(f.counters) == {
        "preemptions", "reservation_overflows", "admission_rechecks_accepted",
        "admission_rechecks_rejected", "reservation_leaks"}
    assert f.memory == [MemoryTerm(0, "weights", 16000000000, "measured")]
    assert f.host.output_buffer_limit == Limit(67108864.0, "hard")
    assert f.host.network_queue_limit == Limit(1024.0, "estimate")
    assert f.host.network_queue_depth == 5


def test_minimal_document_leaves_everything_else_unknown():
    doc = {"schema": "kvledger/v1", "pools": [{"id": "a", "block_size": 16, "block_bytes": 10, "num_blocks": 5}],
           "requests": [{"id": "x", "state": "waiting", "prompt_tokens": 3, "max_output_tokens": 4}]}
    assert schema_ok(doc)
    f = facts_from_document(doc, "e")
    assert f.kind == "ledger" and f.admission is None and f.counters == {} and f.memory == []
    assert f.pools[0].in_use is None and f.pools[0].block_refs is None
    assert f.requests[0].pool == "a"  # the only pool
    assert f.host.output_buffer_bytes is None and f.budgets.max_model_len is None


def test_extension_fields():
    doc = copy.deepcopy(EXAMPLE)
    doc["pools"][0].update(engine_reported_used_blocks=420, cached_blocks=150, layer_groups=2)
    doc["tenants"] = [{"name": "team-a", "quota_bytes": 1000}]
    doc["some_future_field"] = {"anything": [1, 2]}
    doc["pools"][0]["future"] = "ignored"
    assert schema_ok(doc)
    f = facts_from_document(doc, "e")
    assert f.pools[0].engine_reported_used_blocks == 420
    assert f.pools[0].cached_blocks == 150 and f.pools[0].layer_groups == 2
    assert f.tenants == [TenantQuota("team-a", 1000)]


def mutate(path, value):
    doc = copy.deepcopy(EXAMPLE)
    target = doc
    for key in path[:-1]:
        target = target[key]
    if value is DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


DELETE = object()

BAD = [
    (("pools", 0, "num_blocks"), "abc", 'pools[0].num_blocks: expected integer, got "abc"'),
    (("pools", 0, "num_blocks"), DELETE, "pools[0].num_blocks: is required"),
    (("pools", 0, "block_size"), 0, "pools[0].block_size: must be >= 1, got 0"),
    (("pools", 0, "block_bytes"), 1.5, "pools[0].block_bytes: expected integer, got 1.5"),
    (("pools", 0, "id"), 7, "pools[0].id: expected string, got 7"),
    (("pools", 0, "blocks", "free"), -1, "pools[0].blocks.free: must be >= 0, got -1"),
    (("pools", 0, "block_refs", 1), [18, 0], "pools[0].block_refs[1]: expected [block_id, ref_count, cached], got an array"),
    (("pools", 0, "block_refs", 1), [18, "0", True], 'pools[0].block_refs[1][1]: expected integer, got "0"'),
    (("pools", 0, "block_refs", 0), [17, 2, 1], "pools[0].block_refs[0][2]: expected boolean, got 1"),
    (("pools", 0, "block_refs", 0), [-1, 2, True], "pools[0].block_refs[0][0]: must be >= 0, got -1"),
    (("pools",), {}, "pools: expected array, got an object"),
    (("pools",), [], "pools: must list at least one pool"),
    (("pools",), DELETE, "pools: is required"),
    (("requests",), DELETE, "requests: is required"),
    (("schema",), "kvledger/v2", 'schema: expected "kvledger/v1", got "kvledger/v2"'),
    (("schema",), DELETE, "schema: is required"),
    (("requests", 0, "state"), "done", 'requests[0].state: expected one of running, waiting, preempted; got "done"'),
    (("requests", 0, "prompt_tokens"), True, "requests[0].prompt_tokens: expected integer, got true"),
    (("requests", 0, "id"), DELETE, "requests[0].id: is required"),
    (("requests", 0, "contexts"), 0, "requests[0].contexts: must be >= 1, got 0"),
    (("requests", 0, "output_bound"), "guess", 'requests[0].output_bound: expected one of cap, estimate; got "guess"'),
    (("requests", 0, "block_ids", 1), "18", 'requests[0].block_ids[1]: expected integer, got "18"'),
    (("requests", 0), "r1", 'requests[0]: expected object, got "r1"'),
    (("admission",), "eager", 'admission: expected one of reserve-cap, dynamic; got "eager"'),
    (("overflow",), 3, "overflow: expected one of preempt-recompute, reject, swap, unknown; got 3"),
    (("budgets", "max_num_seqs"), "256", 'budgets.max_num_seqs: expected integer, got "256"'),
    (("budgets",), [], "budgets: expected object, got an array"),
    (("counters", "preemptions"), "3", 'counters.preemptions: expected number, got "3"'),
    (("memory", 0, "category"), "kv", 'memory[0].category: expected one of weights, workspace, runtime_buffers, reserve, kv_pool; got "kv"'),
    (("memory", 0, "source"), DELETE, "memory[0].source: is required"),
    (("host", "network_queue_limit_kind"), "soft", 'host.network_queue_limit_kind: expected one of hard, estimate; got "soft"'),
    (("host", "output_buffer_bytes"), -5, "host.output_buffer_bytes: must be >= 0, got -5"),
    (("engine",), "vllm", 'engine: expected object, got "vllm"'),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD, ids=[m.split(":")[0] + "-" + str(i) for i, (_, _, m) in enumerate(BAD)])
def test_malformed_documents_name_the_field_path(path, value, message):
    doc = mutate(path, value)
    with pytest.raises(ProtocolError) as err:
        facts_from_document(doc, "e")
    assert str(err.value) == message
    # the published schema rejects the same document
    assert not schema_ok(doc)
    with pytest.raises(ProtocolError):
        validate_document(doc)


GOOD_VARIANTS = [
    (("pools", 0, "num_blocks"), 1000.0),  # JSON Schema: 1000.0 is an integer
    (("pools", 0, "sliding_window"), 4096),
    (("pools", 0, "block_refs"), []),
    (("pools", 0, "block_refs", 0), [17, 2.0, True]),
    (("pools", 0, "blocks"), None),
    (("requests",), []),
    (("requests", 0, "tenant"), None),
    (("requests", 0, "block_ids"), None),
    (("counters", "preemptions"), 2.5),
    (("host", "output_buffer_limit_kind"), None),
    (("engine",), None),
    (("memory",), []),
]


@pytest.mark.parametrize(("path", "value"), GOOD_VARIANTS)
def test_valid_variants_accepted_by_both(path, value):
    doc = mutate(path, value)
    assert schema_ok(doc)
    facts_from_document(doc, "e")


def test_integral_floats_are_converted():
    f = facts_from_document(mutate(("pools", 0, "block_refs", 0), [17, 2.0, True]), "e")
    assert next(iter(f.pools[0].block_refs)) == BlockRef(17, 2, True)
    assert type(f.pools[0].block_refs.ref_counts[0]) is int


def test_semantic_errors_beyond_the_schema():
    doc = copy.deepcopy(EXAMPLE)
    doc["pools"].append(dict(doc["pools"][0], block_refs=None))
    with pytest.raises(ProtocolError, match=r'^pools\[1\].id: duplicate pool id "0"$'):
        facts_from_document(doc, "e")
    doc = mutate(("requests", 0, "pool"), "9")
    with pytest.raises(ProtocolError, match=r'^requests\[0\].pool: no pool with id "9"$'):
        facts_from_document(doc, "e")
    doc = copy.deepcopy(EXAMPLE)
    doc["requests"].append(doc["requests"][0])
    with pytest.raises(ProtocolError, match=r'^requests\[1\].id: duplicate request id "r1"$'):
        facts_from_document(doc, "e")


def test_limit_without_kind_is_an_estimate():
    f = facts_from_document(mutate(("host", "output_buffer_limit_kind"), DELETE), "e")
    assert f.host.output_buffer_limit == Limit(67108864.0, "estimate")


def test_json_text_errors():
    with pytest.raises(ProtocolError, match=r"^<document>: invalid JSON at line 1, column 2"):
        facts_from_json(b"{nope", "e")
    with pytest.raises(ProtocolError, match=r"^<document>: expected object, got an array"):
        facts_from_json(b"[]", "e")
    assert facts_from_json(json.dumps(EXAMPLE), "e").pools[0].num_blocks == 1000


def test_block_ref_array_behaves_as_a_sequence():
    a = BlockRefArray.from_refs([(1, 0, False), BlockRef(2, 3, True)])
    assert len(a) == 2 and a[1] == BlockRef(2, 3, True) and a[-1].block_id == 2
    assert list(a[:1]) == [BlockRef(1, 0, False)]
    assert a == [BlockRef(1, 0, False), BlockRef(2, 3, True)]
    assert len(a) - a.ref_counts.count(0) == 1


# The typed reading of a request must agree with the checked reader everywhere.
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvledger.domain.facts import RequestFacts  # noqa: E402
from kvledger.domain.limits import MAX_BLOCKS  # noqa: E402
from kvledger.protocol.reader import typed_facts  # noqa: E402


def _one_request(raw: dict) -> dict:  # type: ignore[type-arg]
    pools = [{"id": pid, "block_size": 16, "block_bytes": 1, "num_blocks": MAX_BLOCKS} for pid in ("0", "1")]
    return {"schema": "kvledger/v1", "pools": pools, "requests": [raw]}


def typed_request(raw: dict) -> RequestFacts | None:  # type: ignore[type-arg]
    """One request read by type (its document as JSON text); None where that does not take it as is."""
    facts = typed_facts(json.dumps(_one_request(raw)).encode(), "e")
    return None if facts is None or facts.requests is None else facts.requests[0]


def checked_request(raw: dict) -> RequestFacts:  # type: ignore[type-arg]
    """One request read by the checked reader (ProtocolError naming the field)."""
    requests = facts_from_document(_one_request(raw), "e").requests
    assert requests is not None
    return requests[0]


_values = st.one_of(st.none(), st.integers(-3, 5000), st.floats(-2, 100, allow_nan=False), st.text(max_size=3),
                    st.booleans(), st.lists(st.integers(-1, 50), max_size=4), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                    st.sampled_from(["running", "waiting", "preempted", "cap", "estimate", "0"]))
_fields = st.fixed_dictionaries(
    {},
    optional={k: _values for k in ("id", "state", "prompt_tokens", "max_output_tokens", "output_bound", "pool", "tenant",
                                   "generated_tokens", "computed_tokens", "contexts", "speculative_slots", "blocks_held",
                                   "block_ids", "future_field")},
)
_valid = st.fixed_dictionaries(
    {"id": st.text(min_size=1, max_size=4), "state": st.sampled_from(["running", "waiting", "preempted"]),
     "prompt_tokens": st.integers(0, 9000), "max_output_tokens": st.integers(0, 9000)},
    optional={"output_bound": st.sampled_from(["cap", "estimate"]), "pool": st.sampled_from(["0", "1"]),
              "tenant": st.text(max_size=3), "computed_tokens": st.integers(0, 9000), "contexts": st.integers(1, 4),
              "speculative_slots": st.integers(0, 5), "blocks_held": st.integers(0, 50),
              "block_ids": st.lists(st.integers(0, 100), max_size=5)},
)


@settings(max_examples=2000, deadline=None)
@given(st.one_of(_fields, _valid))
def test_typed_request_agrees_with_checked_reader(raw: dict) -> None:  # type: ignore[type-arg]
    fast = typed_request(raw)
    try:
        checked = checked_request(raw)
    except ProtocolError:
        assert fast is None  # anything the checked reader rejects is left to it
        return
    assert fast is None or fast == checked


@settings(max_examples=200, deadline=None)
@given(_valid)
def test_canonical_requests_are_read_by_type(raw: dict) -> None:  # type: ignore[type-arg]
    fast = typed_request(raw)
    assert fast is not None and fast == checked_request(raw)


# ---------------------------------------------------------------- one definition, held to the schema

from kvledger.domain.facts import OUTPUT_BOUNDS, REQUEST_STATES  # noqa: E402
from kvledger.domain.limits import MAX_REQUESTS, REQUEST_INT_RANGES  # noqa: E402
from kvledger.domain.request_table import INT_COLUMNS  # noqa: E402
from kvledger.protocol import fast_decoder  # noqa: E402
from kvledger.protocol.wire import FIELDS, REQUEST_FIELDS, REQUIRED, Field  # noqa: E402


def _resolve(node: object, schema: dict) -> object:  # type: ignore[type-arg]
    """``node`` with every ``$ref`` into ``$defs`` replaced by what it names (its siblings kept)."""
    if isinstance(node, list):
        return [_resolve(v, schema) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _resolve(v, schema) for k, v in node.items() if k != "$ref"}
    if "$ref" in node:
        target = _resolve(schema["$defs"][node["$ref"].removeprefix("#/$defs/")], schema)
        assert isinstance(target, dict)
        out = {**target, **out}
    return out


def _types(node: dict) -> set[str]:  # type: ignore[type-arg]
    t = node.get("type", [])
    return {t} if isinstance(t, str) else set(t)


def _value_in_schema(node: dict, nullable: bool) -> tuple[object, ...]:  # type: ignore[type-arg]
    """What the schema says of one request's value: (JSON type, minimum, maximum, enumeration,
    minLength, item minimum, item maximum), ``null`` allowed exactly where ``nullable``."""
    if "enum" in node:
        options = node["enum"]
        assert (None in options) is nullable, node
        return ("enum", None, None, tuple(o for o in options if o is not None), None, None, None)
    types = _types(node)
    assert ("null" in types) is nullable, node
    types.discard("null")
    if types == {"string"}:
        return ("string", None, None, (), node.get("minLength", 0), None, None)
    if types == {"integer"}:
        return ("integer", node["minimum"], node["maximum"], (), None, None, None)
    assert types == {"array"}, node
    items = node["items"]
    assert _types(items) == {"integer"}, node
    return ("integers", None, None, (), None, items["minimum"], items["maximum"])


def _value_in_definition(f: Field) -> tuple[object, ...]:
    if f.json_type == "enum":
        return ("enum", None, None, f.options, None, None, None)
    if f.json_type == "string":
        return ("string", None, None, (), f.min_length, None, None)
    if f.json_type == "integer":
        return ("integer", f.minimum, f.maximum, (), None, None, None)
    return ("integers", None, None, (), None, f.minimum, f.maximum)


def _column_in_schema(node: dict, f: Field) -> tuple[object, ...]:  # type: ignore[type-arg]
    """What the schema says of ``request_columns.<name>``, checked to be the column of one
    request's value: an array of values (entries null where the field is optional), also
    one value for every request where ``one_value``, also machine integers for an integer
    field; the column itself null (absent) where the field is optional."""
    nullable = not f.required
    variants = node["anyOf"] if "anyOf" in node else [node]
    int64le = [v for v in variants if v.get("required") == ["int64le"]]
    assert len(int64le) == (f.json_type == "integer"), f.name
    arrays, ones = [], []
    for v in (v for v in variants if v not in int64le):
        types = _types(v)
        if "array" not in types:
            ones.append(v)
            continue
        arrays.append(v)
        if types - {"array", "null"}:  # one node for the array and the one value: the range on both levels
            ones.append({**{k: x for k, x in v.items() if k not in ("items", "maxItems")}, "type": sorted(types - {"array"})})
    column_null = any("null" in _types(v) or None in v.get("enum", []) for v in variants)
    assert column_null is nullable, f.name
    assert len(arrays) == 1, f.name
    entry = _value_in_schema(arrays[0]["items"], nullable)
    assert bool(ones) is f.one_value, f.name
    for one in ones:
        assert _value_in_schema(one, nullable) == entry, f.name
    if f.name == "id":
        assert arrays[0]["maxItems"] == MAX_REQUESTS
    return entry


def test_the_definition_of_a_request_is_the_schemas() -> None:
    """Every property of ``requests[]`` items and of ``request_columns`` in the published
    schema is a field of ``wire.REQUEST_FIELDS`` with the same type, range, enumeration and
    requiredness, and every field of the definition is a property of both."""
    schema = load_schema()
    row = _resolve(schema["$defs"]["request"], schema)
    columns = _resolve(schema["properties"]["request_columns"], schema)
    assert isinstance(row, dict) and isinstance(columns, dict)
    assert set(row["properties"]) == set(FIELDS) == set(columns["properties"])
    assert set(row["required"]) == set(REQUIRED) == set(columns["required"])
    for f in REQUEST_FIELDS:
        assert _value_in_schema(row["properties"][f.name], not f.required) == _value_in_definition(f), f.name
        assert _column_in_schema(columns["properties"][f.name], f) == _value_in_definition(f), f.name
    assert schema["properties"]["requests"]["maxItems"] == MAX_REQUESTS


def test_the_definition_takes_its_ranges_enumerations_and_defaults_from_the_model() -> None:
    ints = {f.name: (f.minimum, f.maximum) for f in REQUEST_FIELDS if f.json_type == "integer"}
    assert ints == REQUEST_INT_RANGES
    assert FIELDS["state"].options == REQUEST_STATES and FIELDS["output_bound"].options == OUTPUT_BOUNDS
    facts = RequestFacts("r", "running", 0, 0)
    for f in REQUEST_FIELDS:
        if not f.required and f.default is not None:
            assert getattr(facts, f.name) == f.default, f.name
    assert {name: default for name, default in INT_COLUMNS if name in ints and FIELDS[name].default is not None} == {
        f.name: f.default for f in REQUEST_FIELDS if f.json_type == "integer" and f.default is not None}
    # the typed decoder's structs are built from it, field for field
    assert fast_decoder.Row.__struct_fields__ == fast_decoder.Columns.__struct_fields__ == tuple(FIELDS)
