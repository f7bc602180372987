"""A kvledger/v1 body decoded by type: the common document read in one C pass.

A busy engine's document is almost all ``requests[]``, and every request changes at every
poll. Decoding it into dicts (orjson) and then checking every field of every request in
Python cost more than the decode itself. msgspec decodes JSON straight into typed
structs, checking each field's type, range and enumeration while it parses (in C), and
does so faster than orjson builds the dicts; this module declares the request row as such
a struct (the ranges are ``limits.REQUEST_INT_RANGES``, the enumerations ``facts``' own
Literal types) and turns the rows into a ``RequestTable`` column by column.

It is a fast path only. ``decode`` returns None on anything it does not take as is (a
value of another type or out of range, an integral float such as ``2.0``, a field a row
should not have, a top-level key the protocol does not list, malformed JSON), and
``table_from_rows`` returns None when the rows break a rule across requests (duplicate
ids, an unknown pool, more blocks than the pool has); ``protocol.facts_from_json`` then
reads the body the checked way (orjson, field by field), which accepts exactly what the
schema accepts and names the field of the first problem. Everything except the requests
(pools, budgets, counters, ...) is decoded by orjson from the raw JSON of its key, as the
checked path decodes it, so the two paths can differ only in the requests, which the
property tests compare (tests/test_document_decoder.py).
"""

from __future__ import annotations

from itertools import repeat
from typing import Annotated, Any

import msgspec
import numpy as np
import orjson
from msgspec.structs import astuple

from kvledger.facts import OutputBound, RequestState
from kvledger.limits import MAX_REQUESTS, MAX_SAFE_INT, REQUEST_INT_RANGES
from kvledger.requesttable import INT_COLUMNS, INT_NAMES, RequestTable


def _count(name: str) -> Any:
    lo, hi = REQUEST_INT_RANGES[name]
    return Annotated[int, msgspec.Meta(ge=lo, le=hi)]


# mypy cannot follow a type built at run time; the annotations below are checked by msgspec
_Prompt = _count("prompt_tokens")
_Output = _count("max_output_tokens")
_Generated = _count("generated_tokens")
_Computed = _count("computed_tokens")
_Contexts = _count("contexts")
_Speculative = _count("speculative_slots")
_Held = _count("blocks_held")
_BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_SAFE_INT)]
#: ``blocks_held`` absent (a decoded value is never negative)
HELD_ABSENT = -1


class Row(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """One ``requests[]`` entry as the schema defines it, absent fields at their defaults
    (``blocks_held`` at ``HELD_ABSENT``: it defaults to ``len(block_ids)``). A null integer
    (the checked path reads null as absent) or a field the schema does not list sends the
    document to the checked path, which accepts both as the schema allows."""

    id: Annotated[str, msgspec.Meta(min_length=1)]
    state: RequestState
    prompt_tokens: _Prompt  # type: ignore[valid-type]
    max_output_tokens: _Output  # type: ignore[valid-type]
    pool: str | None = None
    tenant: str | None = None
    output_bound: OutputBound | None = None
    generated_tokens: _Generated = 0  # type: ignore[valid-type]
    computed_tokens: _Computed = 0  # type: ignore[valid-type]
    contexts: _Contexts = 1  # type: ignore[valid-type]
    speculative_slots: _Speculative = 0  # type: ignore[valid-type]
    blocks_held: _Held = HELD_ABSENT  # type: ignore[valid-type]
    block_ids: list[_BlockId] | None = None


class TypedRows:
    """The ``requests`` of a document decoded as ``Row`` structs (see ``decode``)."""

    __slots__ = ("rows",)

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows


_ABSENT = msgspec.Raw()


class _Document(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """The top level: ``requests`` typed, every other key kept as its raw JSON."""

    schema: msgspec.Raw = _ABSENT
    engine: msgspec.Raw = _ABSENT
    admission: msgspec.Raw = _ABSENT
    overflow: msgspec.Raw = _ABSENT
    budgets: msgspec.Raw = _ABSENT
    pools: msgspec.Raw = _ABSENT
    request_columns: msgspec.Raw = _ABSENT
    counters: msgspec.Raw = _ABSENT
    memory: msgspec.Raw = _ABSENT
    host: msgspec.Raw = _ABSENT
    tenants: msgspec.Raw = _ABSENT
    integration: msgspec.Raw = _ABSENT
    requests: Annotated[list[Row], msgspec.Meta(max_length=MAX_REQUESTS)] | msgspec.UnsetType = msgspec.UNSET


_RAW_KEYS = tuple(name for name in _Document.__struct_fields__ if name != "requests")
_DECODER = msgspec.json.Decoder(_Document)


def decode(body: bytes | str) -> dict[str, Any] | None:
    """The document as ``protocol.facts_from_document`` reads it, its ``requests`` as
    ``TypedRows``; None where the checked path must read it."""
    try:
        doc = _DECODER.decode(body)
        out: dict[str, Any] = {}
        for key in _RAW_KEYS:
            raw = getattr(doc, key)
            if len(raw):
                out[key] = orjson.loads(memoryview(raw))
    except (msgspec.DecodeError, orjson.JSONDecodeError, RecursionError):  # ValidationError is a DecodeError
        return None
    if doc.requests is not msgspec.UNSET:
        out["requests"] = TypedRows(doc.requests)
    return out


_FIELDS = Row.__struct_fields__


def table_from_rows(rows: list[Row], default_pool: str, capacity: dict[str, int]) -> RequestTable | None:
    """The rows as a ``RequestTable`` when they keep the rules across requests (unique
    ids, known pools, no request holding more blocks than its pool); None otherwise."""
    n = len(rows)
    if n == 0:
        return RequestTable([], [], [], [], [], {key: [] for key, _ in INT_COLUMNS})
    # one C call per row, then a C transposition into one tuple per field
    columns: dict[str, Any] = dict(zip(_FIELDS, zip(*map(astuple, rows), strict=True), strict=True))
    ids: list[str] = list(columns["id"])
    if len(set(ids)) != n:
        return None
    pools: list[str] = list(columns["pool"])
    names = set(pools)
    if None in names or "" in names:
        pools = [p or default_pool for p in pools]
        names = set(pools)
    if not names <= capacity.keys():
        return None
    bounds: list[str | None] = list(columns["output_bound"])
    if None in bounds:
        bounds = ["cap" if b is None else b for b in bounds]
    block_ids: list[list[int] | None] | None = list(columns["block_ids"])
    assert block_ids is not None
    if block_ids.count(None) == n:
        block_ids = None
    arrays = {key: np.fromiter(columns[key], dtype=np.int64, count=n) for key in INT_NAMES}
    held = arrays["blocks_held"]
    if bool((held == HELD_ABSENT).any()):  # blocks_held defaults to len(block_ids), else 0
        listed = block_ids or repeat(None)
        arrays["blocks_held"] = np.array(
            [(0 if b is None else len(b)) if h == HELD_ABSENT else h for h, b in zip(columns["blocks_held"], listed, strict=False)],
            dtype=np.int64,
        )
    cap: int | np.ndarray
    if len(names) == 1:
        cap = capacity[next(iter(names))]
    else:
        cap = np.fromiter(map(capacity.__getitem__, pools), dtype=np.int64, count=n)
    if bool((arrays["blocks_held"] > cap).any()):
        return None
    if block_ids is not None:
        lengths = np.fromiter((0 if b is None else len(b) for b in block_ids), dtype=np.int64, count=n)
        if bool((lengths > cap).any()):
            return None
    states, tenants = list(columns["state"]), list(columns["tenant"])
    return RequestTable(ids, states, pools, tenants, bounds, {}, block_ids, arrays)  # type: ignore[arg-type]
