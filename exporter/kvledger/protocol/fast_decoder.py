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

import binascii
from itertools import repeat
from typing import Annotated, Any

import msgspec
import numpy as np
import orjson
from msgspec.structs import astuple

from kvledger.model.facts import OutputBound, RequestState
from kvledger.model.limits import MAX_REQUESTS, MAX_SAFE_INT, REQUEST_INT_RANGES
from kvledger.model.request_table import INT_COLUMNS, INT_NAMES, RequestTable


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


class Row(msgspec.Struct, forbid_unknown_fields=True, gc=False, kw_only=True):
    """One ``requests[]`` entry as the schema defines it, absent fields at their defaults
    (``blocks_held`` at ``HELD_ABSENT``: it defaults to ``len(block_ids)``). A null integer
    (the checked path reads null as absent) or a field the schema does not list sends the
    document to the checked path, which accepts both as the schema allows. The fields are
    in the order the writers (the vLLM integration, the reference ledger) put the keys:
    msgspec matches keys in the expected order first."""

    id: Annotated[str, msgspec.Meta(min_length=1)]
    pool: str | None = None
    state: RequestState
    tenant: str | None = None
    prompt_tokens: _Prompt  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    max_output_tokens: _Output  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    output_bound: OutputBound | None = None
    generated_tokens: _Generated = 0  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    computed_tokens: _Computed = 0  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    contexts: _Contexts = 1  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    speculative_slots: _Speculative = 0  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    blocks_held: _Held = HELD_ABSENT  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    block_ids: list[_BlockId] | None = None


class Int64le(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """An integer column given as machine integers: ``{"int64le": "<base64>"}``, the base64
    decoded by msgspec while it parses (a third of binascii's time; it refuses what
    binascii's strict mode refuses, and excess padding too: the checked path reads that)."""

    int64le: bytes


def _column(item: Any) -> Any:
    """A ``request_columns`` field: an array of ``item``, or one value for every request."""
    return list[item] | item


def _int_column(count: Any) -> Any:
    return list[count | None] | count | Int64le


class Columns(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """``request_columns`` as the schema defines it; None where a field or an entry is
    absent or null (the checked path reads both alike). Integral floats, or a field the
    schema does not list, send the document to the checked path."""

    id: list[Annotated[str, msgspec.Meta(min_length=1)]]
    state: _column(RequestState)  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    prompt_tokens: _int_column(_Prompt)  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    max_output_tokens: _int_column(_Output)  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    pool: list[str | None] | str | None = None
    tenant: list[str | None] | str | None = None
    output_bound: list[OutputBound | None] | OutputBound | None = None
    generated_tokens: _int_column(_Generated) | None = None  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    computed_tokens: _int_column(_Computed) | None = None  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    contexts: _int_column(_Contexts) | None = None  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    speculative_slots: _int_column(_Speculative) | None = None  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    blocks_held: _int_column(_Held) | None = None  # type: ignore[valid-type]  # built at run time from the ranges; msgspec checks it
    block_ids: list[list[_BlockId] | None] | None = None


class TypedColumns:
    """The ``request_columns`` of a document decoded as ``Columns`` (see ``decode``)."""

    __slots__ = ("columns",)

    def __init__(self, columns: Columns) -> None:
        self.columns = columns


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
    counters: msgspec.Raw = _ABSENT
    memory: msgspec.Raw = _ABSENT
    host: msgspec.Raw = _ABSENT
    tenants: msgspec.Raw = _ABSENT
    integration: msgspec.Raw = _ABSENT
    requests: Annotated[list[Row], msgspec.Meta(max_length=MAX_REQUESTS)] | msgspec.UnsetType = msgspec.UNSET
    request_columns: Columns | msgspec.UnsetType = msgspec.UNSET


_RAW_KEYS = tuple(name for name in _Document.__struct_fields__ if name not in ("requests", "request_columns"))
_DECODER = msgspec.json.Decoder(_Document)


def decode(body: bytes | str) -> dict[str, Any] | None:
    """The document as ``protocol.facts_from_document`` reads it, its ``requests`` as
    ``TypedRows`` and its ``request_columns`` as ``TypedColumns``; None where the checked
    path must read it."""
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
    if doc.request_columns is not msgspec.UNSET:
        out["request_columns"] = TypedColumns(doc.request_columns)
    return out


_FIELDS = Row.__struct_fields__


def _known_pools(pools: list[Any], default_pool: str, capacity: dict[str, int]) -> tuple[list[str], set[str]] | None:
    """Each request's pool (absent or empty: the first pool) and the set of them; None when
    one is not a pool of the document."""
    names = set(pools)
    if None in names or "" in names:
        pools = [p or default_pool for p in pools]
        names = set(pools)
    if not names <= capacity.keys():
        return None
    return pools, names


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
    known = _known_pools(list(columns["pool"]), default_pool, capacity)
    if known is None:
        return None
    pools, names = known
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
    return _within_capacity(ids, list(columns["state"]), pools, list(columns["tenant"]), bounds, block_ids, arrays, names, capacity)


def int64le_array(text: str, n: int) -> np.ndarray | None:
    """``n`` little-endian signed 64-bit integers from base64 ``text``; None when ``text``
    is not base64 or holds another number of bytes."""
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)  # checked in C (b64decode's validate runs a regex)
    except (binascii.Error, ValueError):
        return None
    if len(raw) != 8 * n:
        return None
    return np.frombuffer(raw, dtype="<i8").astype(np.int64, copy=False)


def _text(value: Any, n: int, default: Any) -> list[Any] | None:
    """A text column as n values: an array as given, one value repeated, None as ``default``."""
    if isinstance(value, list):
        return value if len(value) == n else None
    return [default if value is None else value] * n


def _ints(value: Any, n: int, key: str, default: int | list[int]) -> np.ndarray | None:
    """An integer column as n values: an array (null entries as ``default``, one value or
    one per request), one value repeated, machine integers, None as ``default``."""
    if value is None:
        if isinstance(default, list):
            return np.array(default, dtype=np.int64)
        return np.full(n, default, dtype=np.int64)
    if type(value) is int:
        return np.full(n, value, dtype=np.int64)
    if isinstance(value, Int64le):
        if len(value.int64le) != 8 * n:
            return None
        arr = np.frombuffer(value.int64le, dtype="<i8").astype(np.int64, copy=False)
        lo, hi = REQUEST_INT_RANGES[key]
        if n and (int(arr.min()) < lo or int(arr.max()) > hi):
            return None
        return arr
    if len(value) != n:
        return None
    try:
        return np.fromiter(value, dtype=np.int64, count=n)
    except TypeError:  # null entries
        fill = default if isinstance(default, list) else repeat(default)
        return np.array([d if v is None else v for v, d in zip(value, fill, strict=False)], dtype=np.int64)


def table_from_columns(cols: Columns, default_pool: str, capacity: dict[str, int]) -> RequestTable | None:
    """``request_columns`` as a ``RequestTable`` when every column has one entry per
    request and the rules across requests hold; None otherwise (the checked path then
    names the problem)."""
    ids = cols.id
    n = len(ids)
    if n > MAX_REQUESTS or len(set(ids)) != n:
        return None
    states = _text(cols.state, n, None)
    pools = _text(cols.pool, n, default_pool)
    tenants = _text(cols.tenant, n, None)
    bounds = _text(cols.output_bound, n, "cap")
    block_ids = cols.block_ids
    if states is None or pools is None or tenants is None or bounds is None or (block_ids is not None and len(block_ids) != n):
        return None
    known = _known_pools(pools, default_pool, capacity)
    if known is None:
        return None
    pools, names = known
    if isinstance(cols.output_bound, list) and None in cols.output_bound:
        bounds = ["cap" if b is None else b for b in bounds]
    if block_ids is not None and block_ids.count(None) == n:
        block_ids = None
    arrays: dict[str, np.ndarray] = {}
    for key, default in INT_COLUMNS:
        fallback: int | list[int] = default
        if key == "blocks_held" and block_ids is not None:  # blocks_held defaults to len(block_ids)
            fallback = [0 if b is None else len(b) for b in block_ids]
        arr = _ints(getattr(cols, key), n, key, fallback)
        if arr is None:
            return None
        arrays[key] = arr
    return _within_capacity(ids, states, pools, tenants, bounds, block_ids, arrays, names, capacity)


def _within_capacity(
    ids: list[str], states: list[Any], pools: list[str], tenants: list[Any], bounds: list[Any],
    block_ids: list[list[int] | None] | None, arrays: dict[str, np.ndarray], names: set[str], capacity: dict[str, int],
) -> RequestTable | None:
    """The table, unless a request holds more blocks than its pool has."""
    n = len(ids)
    cap: int | np.ndarray
    if len(names) == 1:
        cap = capacity[next(iter(names))]
    else:
        cap = np.fromiter(map(capacity.__getitem__, pools), dtype=np.int64, count=n)
    if n and bool((arrays["blocks_held"] > cap).any()):
        return None
    if block_ids is not None:
        lengths = np.fromiter((0 if b is None else len(b) for b in block_ids), dtype=np.int64, count=n)
        if bool((lengths > cap).any()):
            return None
    return RequestTable(ids, states, pools, tenants, bounds, {}, block_ids, arrays)
