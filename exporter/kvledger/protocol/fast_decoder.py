"""A kvledger/v1 body decoded by type: the common document read in one C pass.

A busy engine's document is almost all requests, and every request changes at every poll.
Decoding it into dicts (orjson) and then checking every field of every request in Python
cost more than the decode itself. msgspec decodes JSON straight into typed structs,
checking each field's type, range and enumeration while it parses (in C), and does so
faster than orjson builds the dicts. The structs are built here from the one definition
of a request (``wire.REQUEST_FIELDS``: ranges from ``limits.REQUEST_INT_RANGES``,
enumerations from the wire terms), for both forms: ``Row`` for ``requests[]`` and
``Columns`` for ``request_columns``; the requests then become a ``RequestTable`` column by
column.

It reads only what it can take as is. ``decode`` returns None on anything else (a value of
another type or out of range, an integral float such as ``2.0``, a field a request should
not have, a top-level key the protocol does not list, malformed JSON), and
``table_from_rows``/``table_from_columns`` return None when the requests break a rule
across requests (duplicate ids, an unknown pool, more blocks than the pool has, columns
of unequal length); no exception leaves this module. ``protocol.reader`` then reads the
body the checked way, which accepts exactly what the schema accepts and names the field
of the first problem. Everything except the requests (pools, budgets, counters, ...) is decoded by
orjson from the raw JSON of its key and read by the checked reader, so the two ways can
differ only in the requests, which the property tests compare
(tests/test_document_decoder.py).
"""

from __future__ import annotations

import binascii
from itertools import repeat
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import orjson
from msgspec.structs import astuple

from kvledger.domain.limits import MAX_REQUESTS
from kvledger.domain.request_table import INT_COLUMNS, RequestTable
from kvledger.protocol.wire import FIELDS, INTEGER_FIELDS, REQUEST_FIELDS, Field

#: ``blocks_held`` absent from a row (a decoded value is never negative): it defaults to
#: ``len(block_ids)``, else 0
HELD_ABSENT = -1

# types built at run time from the definition: mypy sees them as Any, msgspec checks them
_LITERAL: Any = Literal
_LIST: Any = list


class Int64le(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """An integer column given as machine integers: ``{"int64le": "<base64>"}``, the base64
    decoded by msgspec while it parses (a third of binascii's time; it refuses what
    binascii's strict mode refuses, and excess padding too: the checked reader reads that)."""

    int64le: bytes


def _value_type(f: Field) -> Any:
    """The type of one value of ``f`` (one request's)."""
    if f.json_type == "string":
        return Annotated[str, msgspec.Meta(min_length=f.min_length)] if f.min_length else str
    if f.json_type == "enum":
        return _LITERAL[f.options]
    integer = Annotated[int, msgspec.Meta(ge=f.minimum, le=f.maximum)]
    return integer if f.json_type == "integer" else _LIST[integer]


def _row_field(f: Field) -> tuple[Any, ...]:
    """``f`` in a row: required, or absent (its default) or null (None: read as absent)."""
    if f.required:
        return (f.name, _value_type(f))
    return (f.name, _value_type(f) | None, HELD_ABSENT if f.name == "blocks_held" else f.default)


def _column_field(f: Field) -> tuple[Any, ...]:
    """``f`` in ``request_columns``: an array of values (null entries where optional), or
    one value for every request, or machine integers (integer fields); absent or null
    where optional."""
    value = _value_type(f)
    column = _LIST[value if f.required else value | None]
    if f.one_value:
        column = column | value
    if f.json_type == "integer":
        column = column | Int64le
    return (f.name, column) if f.required else (f.name, column | None, None)


#: one ``requests[]`` entry and ``request_columns``, as ``wire.REQUEST_FIELDS`` defines them.
#: A field they do not list sends the body to the checked reader, as the schema lets a
#: document carry one: msgspec would skip its value without checking that it is JSON
#: (invalid UTF-8, ``1e999``), and orjson checks it there.
Row: Any = msgspec.defstruct("Row", [_row_field(f) for f in REQUEST_FIELDS], kw_only=True, forbid_unknown_fields=True, gc=False)
Columns: Any = msgspec.defstruct(
    "Columns", [_column_field(f) for f in REQUEST_FIELDS], kw_only=True, forbid_unknown_fields=True, gc=False
)


class TypedColumns:
    """The ``request_columns`` of a document decoded as ``Columns`` (see ``decode``)."""

    __slots__ = ("columns",)

    def __init__(self, columns: Any) -> None:
        self.columns = columns


class TypedRows:
    """The ``requests`` of a document decoded as ``Row`` structs (see ``decode``)."""

    __slots__ = ("rows",)

    def __init__(self, rows: list[Any]) -> None:
        self.rows = rows


_ABSENT = msgspec.Raw()


#: the top-level keys of the protocol other than the requests: kept as raw JSON, decoded by orjson
_RAW_KEYS = ("schema", "engine", "published_at", "admission", "overflow", "budgets", "pools", "counters", "memory", "host",
             "tenants", "integration")
#: the top level: ``requests`` (or ``request_columns``) typed, every other key kept as its raw JSON
_Document: Any = msgspec.defstruct(
    "_Document",
    [
        *((key, msgspec.Raw, _ABSENT) for key in _RAW_KEYS),
        ("requests", Annotated[_LIST[Row], msgspec.Meta(max_length=MAX_REQUESTS)] | msgspec.UnsetType, msgspec.UNSET),
        ("request_columns", Columns | msgspec.UnsetType, msgspec.UNSET),
    ],
    forbid_unknown_fields=True,
    gc=False,
)
_DECODER = msgspec.json.Decoder(_Document)


class TypedDocument(dict[str, Any]):
    """A document as ``decode`` reads it; the sections that rarely change from one document
    to the next (``MEMO_KEYS``) are not in it but in ``raws``, as their JSON text, which
    the reader loads unless the engine's last document had the same text
    (``protocol.reader.SectionMemo``). That text is not checked to be JSON yet: msgspec
    skips a value without checking it all (invalid UTF-8, ``1e999``); orjson does when the
    reader loads it."""

    __slots__ = ("raws",)

    def __init__(self) -> None:
        super().__init__()
        self.raws: dict[str, bytes] = {}


#: the sections whose JSON text ``decode`` keeps (``TypedDocument.raws``)
MEMO_KEYS = frozenset(("engine", "budgets", "counters", "memory", "host", "tenants"))


def decode(body: bytes | str) -> TypedDocument | None:
    """The document as ``protocol.reader`` reads it, its ``requests`` as ``TypedRows`` and
    its ``request_columns`` as ``TypedColumns``; None where the checked reader must read it."""
    try:
        doc = _DECODER.decode(body)
        out = TypedDocument()
        for key in _RAW_KEYS:
            raw = getattr(doc, key)
            if not len(raw):
                continue
            if key in MEMO_KEYS:  # loaded by the reader where it differs from the last document's
                out.raws[key] = bytes(memoryview(raw))
            else:
                out[key] = orjson.loads(memoryview(raw))
    except (msgspec.DecodeError, orjson.JSONDecodeError, RecursionError):  # ValidationError is a DecodeError
        return None
    if doc.requests is not msgspec.UNSET:
        out["requests"] = TypedRows(doc.requests)
    if doc.request_columns is not msgspec.UNSET:
        out["request_columns"] = TypedColumns(doc.request_columns)
    return out


_NAMES = tuple(f.name for f in REQUEST_FIELDS)
_INT_DEFAULTS = tuple((name, FIELDS[name].default) for name in INTEGER_FIELDS if name != "blocks_held")


def _int_default(f: Field) -> int:
    return 0 if f.default is None else int(f.default)


#: each integer field with its definition and its default (0 where it has none)
_INT_FIELDS = tuple((name, FIELDS[name], _int_default(FIELDS[name])) for name in INTEGER_FIELDS)


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


def _int_array(values: Any, n: int, default: Any) -> np.ndarray:
    """n integers; a null entry (None) as ``default``."""
    first = values[0] if n else None
    if n and values[-1] is first and values.count(first) == n:  # one value for all (contexts 1, ...): counted in C
        return np.full(n, default if first is None else first, dtype=np.int64)
    try:
        return np.fromiter(values, dtype=np.int64, count=n)
    except TypeError:
        return np.array([default if v is None else v for v in values], dtype=np.int64)


def table_from_rows(rows: list[Any], default_pool: str, capacity: dict[str, int]) -> RequestTable | None:
    """The rows as a ``RequestTable`` when they keep the rules across requests (unique
    ids, known pools, no request holding more blocks than its pool); None otherwise."""
    n = len(rows)
    if n == 0:
        return RequestTable([], [], [], [], [], {key: [] for key, _ in INT_COLUMNS})
    # one C call per row, then a C transposition into one tuple per field
    columns: dict[str, Any] = dict(zip(_NAMES, zip(*map(astuple, rows), strict=True), strict=True))
    ids: list[str] = list(columns["id"])
    if len(set(ids)) != n:
        return None
    known = _known_pools(list(columns["pool"]), default_pool, capacity)
    if known is None:
        return None
    pools, names = known
    bounds: list[str | None] = list(columns["output_bound"])
    if None in set(bounds):  # the Literal's own strings: hashed once, unlike a comparison with None each
        bounds = ["cap" if b is None else b for b in bounds]
    block_ids: list[list[int] | None] | None = list(columns["block_ids"])
    assert block_ids is not None
    if block_ids.count(None) == n:
        block_ids = None
    arrays = {name: _int_array(columns[name], n, default) for name, default in _INT_DEFAULTS}
    held = arrays["blocks_held"] = _int_array(columns["blocks_held"], n, HELD_ABSENT)
    if bool((held == HELD_ABSENT).any()):  # blocks_held defaults to len(block_ids), else 0
        listed = block_ids or repeat(None)
        arrays["blocks_held"] = np.array(
            [(0 if b is None else len(b)) if h == HELD_ABSENT else h for h, b in zip(held.tolist(), listed, strict=False)],
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


def _in_range(arr: np.ndarray, f: Field) -> bool:
    """Every value of the int64 array ``arr`` (not empty) within ``f``'s range; where the
    least is 0, one reduction over the values read unsigned (a negative one reads above
    every maximum) instead of two."""
    if f.minimum == 0:
        return int(arr.view(np.uint64).max()) <= f.maximum
    return int(arr.min()) >= f.minimum and int(arr.max()) <= f.maximum


def _text(value: Any, n: int, default: Any) -> list[Any] | None:
    """A text column as n values: an array as given, one value repeated, None as ``default``."""
    if isinstance(value, list):
        return value if len(value) == n else None
    return [default if value is None else value] * n


def _ints(value: Any, n: int, f: Field, default: int | list[int]) -> np.ndarray | None:
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
        if n and not _in_range(arr, f):
            return None
        return arr
    if len(value) != n:
        return None
    try:
        return np.fromiter(value, dtype=np.int64, count=n)
    except TypeError:  # null entries
        fill = default if isinstance(default, list) else repeat(default)
        return np.array([d if v is None else v for v, d in zip(value, fill, strict=False)], dtype=np.int64)


def table_from_columns(cols: Any, default_pool: str, capacity: dict[str, int]) -> RequestTable | None:
    """``request_columns`` as a ``RequestTable`` when every column has one entry per
    request and the rules across requests hold; None otherwise (the checked reader then
    names the problem)."""
    ids: list[str] = cols.id
    n = len(ids)
    if n > MAX_REQUESTS or len(set(ids)) != n:
        return None
    states = _text(cols.state, n, None)
    pools = _text(cols.pool, n, default_pool)
    tenants = _text(cols.tenant, n, None)
    bounds = _text(cols.output_bound, n, "cap")
    block_ids: list[list[int] | None] | None = cols.block_ids
    if states is None or pools is None or tenants is None or bounds is None or (block_ids is not None and len(block_ids) != n):
        return None
    if isinstance(cols.pool, list):
        known = _known_pools(pools, default_pool, capacity)
        if known is None:
            return None
        pools, names = known
    else:  # one pool for every request (absent or empty: the first pool)
        name = cols.pool or default_pool
        if n and name not in capacity:
            return None
        pools, names = [name] * n, {name} if n else set()
    if isinstance(cols.output_bound, list) and None in set(cols.output_bound):  # a set: the decoded values are
        bounds = ["cap" if b is None else b for b in bounds]  # the Literal's own strings, their hashes kept
    if block_ids is not None and block_ids.count(None) == n:
        block_ids = None
    arrays: dict[str, np.ndarray] = {}
    for name, f, default in _INT_FIELDS:
        fallback: int | list[int] = default
        if name == "blocks_held" and block_ids is not None:  # blocks_held defaults to len(block_ids)
            fallback = [0 if b is None else len(b) for b in block_ids]
        arr = _ints(getattr(cols, name), n, f, fallback)
        if arr is None:
            return None
        arrays[name] = arr
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
    if n and (int(arrays["blocks_held"].max()) > cap if type(cap) is int else bool((arrays["blocks_held"] > cap).any())):
        return None
    if block_ids is not None:
        lengths = np.fromiter((0 if b is None else len(b) for b in block_ids), dtype=np.int64, count=n)
        if bool((lengths > cap).any()):
            return None
    return RequestTable.of_columns(ids, states, pools, tenants, bounds, block_ids, arrays, names)
