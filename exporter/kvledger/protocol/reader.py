"""The kvledger/v1 ledger protocol (docs/design.md §7): document -> EngineFacts.

The JSON Schema in ``schema/kvledger-v1.json`` is the published contract; tests
validate documents against it with ``jsonschema``. Validating a 10,000-request
document with ``jsonschema`` takes seconds, so ``facts_from_document`` checks the same
rules by hand while it converts (and the tests check that both agree on accepted and
rejected documents). ``validate_document`` runs the schema itself, for tools.

Errors are ``ProtocolError`` whose message starts with the JSON path of the field:
``pools[0].num_blocks: expected integer, got "abc"``.

Numeric ranges (``kvledger.model.limits``; the schema states each field's ``minimum`` and
``maximum``): every integer is an integer value (``2.0`` is accepted for an integer field,
as JSON Schema's ``integer`` accepts it, by both the fast and the checked path; ``2.5`` and
``1e308`` are not: the latter exceeds every maximum) within its field's range; every
number is finite (NaN and Infinity are not JSON; ``facts_from_json`` rejects them and
``1e999``) and within 0 .. 2**53 - 1.

Beyond the schema the converter rejects duplicate pool ids, duplicate request ids,
requests that name a pool the document lacks, more than ``MAX_REQUESTS`` requests,
pools whose capacity in bytes (``num_blocks x block_bytes``) or in tokens
(``num_blocks x block_size``) exceeds 2**53 - 1, ``block_refs`` listing more blocks
than ``num_blocks``, and a request holding more blocks (``blocks_held`` or
``len(block_ids)``) than its pool has. It computes no policy numbers: the summary
fields and ``block_refs``/``block_ids`` are carried as given (inconsistent summaries
are counted as invariant violations by the policy).
"""

from __future__ import annotations

import binascii
import json
import math
from array import array
from collections.abc import Mapping
from functools import lru_cache
from importlib import resources
from itertools import repeat
from operator import itemgetter
from typing import Any, TypeVar, cast

import numpy as np
import orjson

from kvledger.model.block_refs import BlockRefArray
from kvledger.model.facts import (
    ADMISSIONS,
    BUDGET_CATEGORIES,
    COUNTER_NAMES,
    LIMIT_KINDS,
    OUTPUT_BOUNDS,
    OVERFLOWS,
    REQUEST_STATES,
    TERM_SOURCES,
    Budgets,
    EngineFacts,
    HostFacts,
    Limit,
    LimitKind,
    MemoryTerm,
    PoolFacts,
    RequestFacts,
    TenantQuota,
)
from kvledger.model.limits import (
    MAX_BLOCKS,
    MAX_LAYER_GROUPS,
    MAX_REF_COUNT,
    MAX_REQUESTS,
    MAX_SAFE_INT,
    MAX_TOKENS,
    REQUEST_INT_RANGES,
)
from kvledger.model.request_table import INT_COLUMNS, RequestTable
from kvledger.protocol.fast_decoder import TypedColumns, TypedRows, int64le_array, table_from_columns, table_from_rows
from kvledger.protocol.fast_decoder import decode as decode_typed

SCHEMA_ID = "kvledger/v1"
#: an integer column of the columnar form given as machine integers: {"int64le": base64}
BINARY_INT_KEY = "int64le"
#: the media type of the columnar form (``request_columns``), which a reader asks for in
#: its Accept header; integration/document_server.py serves it under the same name
COLUMNS_MEDIA_TYPE = "application/vnd.kvledger.v1.columns+json"
#: kind of a limit whose document gives no ``*_limit_kind``: never present a guess as hard
DEFAULT_LIMIT_KIND: LimitKind = "estimate"


class ProtocolError(ValueError):
    """A document that breaks kvledger/v1; ``path`` is the JSON path of the field."""

    def __init__(self, path: str, detail: str) -> None:
        self.path = path or "<document>"
        self.detail = detail
        super().__init__(f"{self.path}: {detail}")


# ---------------------------------------------------------------- the schema


@lru_cache(maxsize=1)
def load_schema() -> dict[str, Any]:
    """The published JSON Schema (draft 2020-12) of kvledger/v1."""
    text = resources.files("kvledger.protocol").joinpath("schema/kvledger-v1.json").read_text()
    return cast(dict[str, Any], json.loads(text))


@lru_cache(maxsize=1)
def _validator() -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(load_schema())


def json_path(parts: Any) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<document>"


def schema_errors(doc: object) -> list[str]:
    """Every violation of the JSON Schema, as ``path: message`` (slow: for tools and tests)."""
    errors = sorted(_validator().iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    out = []
    for err in errors:
        path = json_path(err.absolute_path)
        if err.validator == "required":
            missing = err.message.split("'")[1] if "'" in err.message else "?"
            out.append(f"{json_path([*err.absolute_path, missing])}: is required")
        else:
            out.append(f"{path}: {err.message}")
    return out


def validate_document(doc: object) -> None:
    """Raise ProtocolError naming the first schema violation (uses jsonschema)."""
    errors = schema_errors(doc)
    if errors:
        path, _, detail = errors[0].partition(": ")
        raise ProtocolError(path, detail)


# ---------------------------------------------------------------- scalar checks


def _show(value: object) -> str:
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "an array"
    if type(value) is int and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = json.dumps(value) if isinstance(value, (str, int, float, bool)) or value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(value: object, path: str, minimum: int = 0, maximum: int = MAX_SAFE_INT) -> int:
    """An integer value in [minimum, maximum]; an integral float (2.0) counts as one."""
    if not (type(value) is int or (type(value) is float and math.isfinite(value) and value.is_integer())):
        raise ProtocolError(path, f"expected integer, got {_show(value)}")
    n: int | float = value
    if n < minimum:
        raise ProtocolError(path, f"must be >= {minimum}, got {_show(value)}")
    if n > maximum:
        raise ProtocolError(path, f"must be <= {maximum}, got {_show(value)}")
    return int(n)


def _number(value: object, path: str) -> float:
    """A finite number in [0, 2**53 - 1]."""
    if type(value) is not int and type(value) is not float:
        raise ProtocolError(path, f"expected number, got {_show(value)}")
    x: int | float = value
    if type(x) is float and not math.isfinite(x):
        raise ProtocolError(path, f"must be a finite number, got {_show(x)}")
    if x < 0:
        raise ProtocolError(path, f"must be >= 0, got {_show(x)}")
    if x > MAX_SAFE_INT:
        raise ProtocolError(path, f"must be <= {MAX_SAFE_INT}, got {_show(x)}")
    return x


def _str(value: object, path: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ProtocolError(path, f"expected string, got {_show(value)}")
    if not value and not allow_empty:
        raise ProtocolError(path, "must not be empty")
    return value


L = TypeVar("L", bound=str)


def _enum(value: object, path: str, options: tuple[L, ...]) -> L:
    """value as the member of options it equals (options are the values of a Literal)."""
    if isinstance(value, str):
        for option in options:
            if value == option:
                return option
    raise ProtocolError(path, f"expected one of {', '.join(options)}; got {_show(value)}")


def _obj(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProtocolError(path, f"expected object, got {_show(value)}")
    return value


def _arr(value: object, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise ProtocolError(path, f"expected array, got {_show(value)}")
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _opt(d: Mapping[str, Any], key: str, path: str, conv: Any, *args: Any) -> Any:
    value = d.get(key)
    if value is None:
        return None
    return conv(value, _join(path, key), *args)


def _req(d: Mapping[str, Any], key: str, path: str, conv: Any, *args: Any) -> Any:
    if key not in d:
        raise ProtocolError(_join(path, key), "is required")
    return conv(d[key], _join(path, key), *args)


# ---------------------------------------------------------------- block columns


def _block_refs(value: object, path: str) -> BlockRefArray:
    refs = _arr(value, path)
    # Fast path: C-level checks over whole columns; on any doubt walk item by item.
    try:
        if refs and (set(map(type, refs)) != {list} or set(map(len, refs)) != {3}):
            raise TypeError
        ids = list(map(itemgetter(0), refs))
        counts = list(map(itemgetter(1), refs))
        cached = list(map(itemgetter(2), refs))
        if refs and (set(map(type, ids)) != {int} or set(map(type, counts)) != {int}):
            raise TypeError
        if refs and not set(map(type, cached)) <= {bool}:
            raise TypeError
        # unsigned arrays reject negative numbers (OverflowError) without a separate pass;
        # the maxima are checked over the machine columns (numpy, no Python loop)
        ids_q, counts_q = array("Q", ids), array("Q", counts)
        if refs and (_column_max(ids_q) > MAX_SAFE_INT or _column_max(counts_q) > MAX_REF_COUNT):
            raise TypeError
        return BlockRefArray(ids_q, counts_q, bytes(cached))
    except (TypeError, OverflowError):
        pass
    ids_a, counts_a, cached_b = array("Q"), array("Q"), bytearray()
    for i, item in enumerate(refs):
        where = f"{path}[{i}]"
        if not isinstance(item, list) or len(item) != 3:
            raise ProtocolError(where, f"expected [block_id, ref_count, cached], got {_show(item)}")
        for j, column, maximum in ((0, ids_a, MAX_SAFE_INT), (1, counts_a, MAX_REF_COUNT)):
            column.append(_int(item[j], f"{where}[{j}]", 0, maximum))
        if type(item[2]) is not bool:
            raise ProtocolError(f"{where}[2]", f"expected boolean, got {_show(item[2])}")
        cached_b.append(item[2])
    return BlockRefArray(ids_a, counts_a, bytes(cached_b))


def _block_ids(value: object, path: str) -> list[int]:
    ids = _arr(value, path)
    if not ids:
        return ids
    if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) <= MAX_SAFE_INT:
        return ids
    return [_int(v, f"{path}[{i}]") for i, v in enumerate(ids)]


def _column_max(column: array[int]) -> int:
    return int(np.frombuffer(column, dtype=np.uint64).max())


# ---------------------------------------------------------------- sections


def _pool(raw: object, path: str) -> PoolFacts:
    p = _obj(raw, path)
    blocks = p.get("blocks")
    if blocks is not None:
        blocks = _obj(blocks, f"{path}.blocks")
    else:
        blocks = {}
    refs = p.get("block_refs")
    layer_groups = _opt(p, "layer_groups", path, _int, 1, MAX_LAYER_GROUPS)
    out = PoolFacts(
        id=_req(p, "id", path, _str),
        block_size=_req(p, "block_size", path, _int, 1, MAX_TOKENS),
        num_blocks=_req(p, "num_blocks", path, _int, 1, MAX_BLOCKS),
        block_bytes=_req(p, "block_bytes", path, _int, 1),
        sliding_window=_opt(p, "sliding_window", path, _int, 1, MAX_TOKENS),
        in_use=_opt(blocks, "in_use", f"{path}.blocks", _int, 0, MAX_BLOCKS),
        reclaimable=_opt(blocks, "reclaimable", f"{path}.blocks", _int, 0, MAX_BLOCKS),
        free=_opt(blocks, "free", f"{path}.blocks", _int, 0, MAX_BLOCKS),
        references=_opt(p, "references", path, _int),
        shared=_opt(p, "shared", path, _int, 0, MAX_BLOCKS),
        block_refs=None if refs is None else _block_refs(refs, f"{path}.block_refs"),
        cached_blocks=_opt(p, "cached_blocks", path, _int, 0, MAX_BLOCKS),
        engine_reported_used_blocks=_opt(p, "engine_reported_used_blocks", path, _number),
        layer_groups=1 if layer_groups is None else layer_groups,
    )
    c = out.num_blocks
    for what, per_block in (("block_bytes", out.block_bytes), ("block_size", out.block_size)):
        assert per_block is not None
        if c * per_block > MAX_SAFE_INT:
            raise ProtocolError(
                f"{path}.num_blocks",
                f"num_blocks x {what} = {c} x {per_block} exceeds {MAX_SAFE_INT} (2**53 - 1)",
            )
    if out.block_refs is not None and len(out.block_refs) > c:
        raise ProtocolError(f"{path}.block_refs", f"lists {len(out.block_refs)} blocks, more than num_blocks ({c})")
    return out


_REQUIRED_INTS = ("prompt_tokens", "max_output_tokens")
_OPTIONAL_COUNTS = tuple((key, lo, hi) for key, (lo, hi) in REQUEST_INT_RANGES.items() if key not in _REQUIRED_INTS)
_STATES = frozenset(REQUEST_STATES)
_BOUNDS = frozenset(OUTPUT_BOUNDS)


def _request_fast(r: dict[str, Any], default_pool: str) -> RequestFacts | None:
    """The common, canonical request (every present field of the exact expected type and
    range) without building field paths; None sends anything else to the checked parser,
    which accepts the same documents and names the field of any error."""
    get = r.get
    rid, state, prompt, output = get("id"), get("state"), get("prompt_tokens"), get("max_output_tokens")
    if type(rid) is not str or not rid or type(state) is not str or state not in _STATES:
        return None
    if type(prompt) is not int or not 0 <= prompt <= MAX_TOKENS:
        return None
    if type(output) is not int or not 0 <= output <= MAX_TOKENS:
        return None
    out = RequestFacts(id=rid, state=state, prompt_tokens=prompt, max_output_tokens=output)
    bound = get("output_bound")
    if bound is not None:
        if type(bound) is not str or bound not in _BOUNDS:
            return None
        out.output_bound = bound
    pool = get("pool")
    if pool is not None and type(pool) is not str:
        return None
    out.pool = pool or default_pool
    tenant = get("tenant")
    if tenant is not None:
        if type(tenant) is not str:
            return None
        out.tenant = tenant
    for key, minimum, maximum in _OPTIONAL_COUNTS:
        v = get(key)
        if v is not None:
            if type(v) is not int or not minimum <= v <= maximum:
                return None
            setattr(out, key, v)
    ids = get("block_ids")
    if ids is not None:
        if type(ids) is not list or (ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) > MAX_SAFE_INT)):
            return None
        out.block_ids = ids
        if get("blocks_held") is None:
            out.blocks_held = len(ids)
    return out


def _request(raw: object, path: str, default_pool: str) -> RequestFacts:
    if type(raw) is dict and (fast := _request_fast(raw, default_pool)) is not None:
        return fast
    return _request_checked(raw, path, default_pool)


def _request_checked(raw: object, path: str, default_pool: str) -> RequestFacts:
    r = _obj(raw, path)
    ids = r.get("block_ids")
    out = RequestFacts(
        id=_req(r, "id", path, _str),
        state=_req(r, "state", path, _enum, REQUEST_STATES),
        prompt_tokens=_req(r, "prompt_tokens", path, _int, 0, MAX_TOKENS),
        max_output_tokens=_req(r, "max_output_tokens", path, _int, 0, MAX_TOKENS),
    )
    get = r.get
    if (v := get("output_bound")) is not None:
        out.output_bound = _enum(v, f"{path}.output_bound", OUTPUT_BOUNDS)
    out.pool = _opt(r, "pool", path, _str, True) or default_pool
    if (v := get("tenant")) is not None:
        out.tenant = _str(v, f"{path}.tenant", True)
    for key, minimum, maximum in _OPTIONAL_COUNTS:
        if (v := get(key)) is not None:
            setattr(out, key, _int(v, f"{path}.{key}", minimum, maximum))
    if ids is not None:
        out.block_ids = _block_ids(ids, f"{path}.block_ids")
        if get("blocks_held") is None:
            out.blocks_held = len(out.block_ids)
    return out


_NONE = type(None)
_INT_RANGES = REQUEST_INT_RANGES


def _int_column_fast(values: list[Any], key: str, default: int) -> tuple[list[int], np.ndarray] | None:
    """``values`` (ints, or None for the default) and their array when every one is an int of
    the field's range; None on any doubt (the checked path then names the problem)."""
    if not values:
        return [], np.zeros(0, dtype=np.int64)
    types = set(map(type, values))
    if types == {int}:
        out: list[int] = values
    elif types <= {int, _NONE} and key not in _REQUIRED_INTS:
        out = [default if v is None else v for v in values] if int in types else [default] * len(values)
    else:
        return None
    arr = np.array(out, dtype=np.int64)  # OverflowError beyond int64: caught by the callers
    minimum, maximum = _INT_RANGES[key]
    if len(arr) and (int(arr.min()) < minimum or int(arr.max()) > maximum):
        return None
    return out, arr


def _text_column_fast(values: list[Any], allow_empty: bool) -> bool:
    types = set(map(type, values))
    return types <= {str, _NONE} and (allow_empty or "" not in values)


def _fits_pools(
    pools: list[str], held: np.ndarray, block_ids: list[Any] | None, capacity: dict[str, int]
) -> bool:
    """Every request names a pool of the document and holds at most its capacity."""
    names = set(pools)
    if not names <= capacity.keys():
        return False
    if len(names) == 1:
        cap: int | np.ndarray = capacity[next(iter(names))]
    else:
        cap = np.fromiter(map(capacity.__getitem__, pools), dtype=np.int64, count=len(pools))
    if len(held) and bool((held > cap).any()):
        return False
    if block_ids is not None:
        lens = np.fromiter((0 if b is None else len(b) for b in block_ids), dtype=np.int64, count=len(block_ids))
        if len(lens) and bool((lens > cap).any()):
            return False
    return True


def _block_ids_fast(values: list[Any]) -> list[list[int] | None] | bool | None:
    """The block_ids column: None when no request lists blocks, False on any doubt."""
    if not values or set(map(type, values)) == {_NONE}:
        return None
    for ids in values:
        if ids is None:
            continue
        if type(ids) is not list or (ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) > MAX_SAFE_INT)):
            return False
    return values


def _binary_int_column(value: Mapping[str, Any], path: str, n: int) -> np.ndarray:
    """An integer column given as ``{"int64le": "<base64>"}``: n little-endian signed 64-bit
    integers (ranges are checked with the other columns)."""
    text = value.get(BINARY_INT_KEY)
    if not isinstance(text, str) or set(value) != {BINARY_INT_KEY}:
        raise ProtocolError(path, f'expected array, one value, or {{"{BINARY_INT_KEY}": base64}}, got {_show(value)}')
    arr = int64le_array(text, n)
    if arr is not None:
        return arr
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(f"{path}.{BINARY_INT_KEY}", "is not base64") from None
    raise ProtocolError(f"{path}.{BINARY_INT_KEY}", f"holds {len(raw)} bytes, not 8 for each of {n} requests")


def _table_fast(
    columns: dict[str, list[Any]], n: int, default_pool: str, capacity: dict[str, int], scalars: frozenset[str] = frozenset(),
    binary: dict[str, np.ndarray] | None = None,
) -> RequestTable | None:
    """The requests when every value is canonical (the exact expected type, in range, ids
    unique, pools known, within capacity); None on any doubt. Checks whole columns at C
    speed: no per-request Python work on the common document."""
    if n == 0:
        return RequestTable([], [], [], [], [], {key: [] for key, _ in INT_COLUMNS})
    try:
        ids = columns["id"]
        if set(map(type, ids)) != {str} or "" in ids or len(set(ids)) != n:
            return None
        states = columns["state"]
        if not set(states) <= _STATES:
            return None
        bounds = columns["output_bound"]
        bound_set = set(bounds)
        if not bound_set <= _BOUNDS_OR_NONE:
            return None
        pools = columns["pool"]
        if not _text_column_fast(pools, True):
            return None
        tenants = columns["tenant"]
        if not _text_column_fast(tenants, True):
            return None
        ints: dict[str, list[int]] = {}
        arrays: dict[str, np.ndarray] = {}
        listed: dict[str, list[int]] = {}
        for key, default in INT_COLUMNS:
            if binary is not None and key in binary:  # machine integers: ranges checked on the array
                arr = binary[key]
                minimum, maximum = _INT_RANGES[key]
                if len(arr) and (int(arr.min()) < minimum or int(arr.max()) > maximum):
                    return None
                arrays[key] = arr
                continue
            values = columns[key]
            if key in scalars:  # one value for every request: checked once
                one = _int_column_fast(values[:1], key, default)
                if one is None:
                    return None
                listed[key], arrays[key] = one[0] * n, np.full(n, one[0][0], dtype=np.int64)
                continue
            col = _int_column_fast(values, key, default)
            if col is None:
                return None
            listed[key], arrays[key] = col
        ints.update(listed)
        block_ids = _block_ids_fast(columns["block_ids"])
        if block_ids is False:
            return None
    except (TypeError, OverflowError, ValueError):  # unhashable values, ints beyond int64
        return None
    assert block_ids is not True
    if None in bound_set:
        bounds = ["cap" if b is None else b for b in bounds]
    if None in pools or "" in pools:
        pools = [p or default_pool for p in pools]
    if block_ids is not None and "blocks_held" in ints:
        explicit = columns["blocks_held"]
        if None in explicit:  # blocks_held defaults to len(block_ids)
            held = [len(b) if h is None and b is not None else v
                    for h, b, v in zip(explicit, block_ids, ints["blocks_held"], strict=True)]
            ints["blocks_held"] = held
            arrays["blocks_held"] = np.array(held, dtype=np.int64)
    if not _fits_pools(pools, arrays["blocks_held"], block_ids, capacity):
        return None
    return RequestTable(ids, states, pools, tenants, bounds, ints, block_ids, arrays)


_COLUMN_KEYS = ("id", "state", "pool", "tenant", "output_bound", *(k for k, _ in INT_COLUMNS), "block_ids")
_BOUNDS_OR_NONE = frozenset((*OUTPUT_BOUNDS, None))


def _requests_fast(raw: list[Any], default_pool: str, capacity: dict[str, int]) -> RequestTable | None:
    """The row form (``requests[]``) read column by column; None on any doubt."""
    n = len(raw)
    if n and set(map(type, raw)) != {dict}:
        return None
    columns: dict[str, list[Any]] | None = None
    if n:
        # rows that all have the first row's keys (the usual document): one C call per row
        keys = list(raw[0])
        if set(map(len, raw)) == {len(keys)}:
            try:
                transposed = zip(*map(itemgetter(*keys), raw), strict=True) if len(keys) > 1 else None
            except KeyError:
                transposed = None
            if transposed is not None:
                try:
                    found = dict(zip(keys, map(list, transposed), strict=True))
                except KeyError:
                    found = None
                if found is not None:
                    absent = [None] * n
                    columns = {key: found.get(key, absent) for key in _COLUMN_KEYS}
    if columns is None:
        get = dict.get
        columns = {key: list(map(get, raw, repeat(key))) for key in _COLUMN_KEYS}
    return _table_fast(columns, n, default_pool, capacity)


def _requests_checked(raw: list[Any], default_pool: str, capacity: dict[str, int]) -> RequestTable:
    """The row form request by request, naming the field path of the first problem."""
    requests = [_request(r, f"requests[{i}]", default_pool) for i, r in enumerate(raw)]
    request_ids: set[str] = set()
    for i, req in enumerate(requests):
        if req.pool not in capacity:
            raise ProtocolError(f"requests[{i}].pool", f"no pool with id {json.dumps(req.pool)}")
        cap = capacity[req.pool]
        if req.blocks_held > cap or (req.block_ids is not None and len(req.block_ids) > cap):
            ids_over = req.block_ids is not None and len(req.block_ids) > cap
            held = len(req.block_ids) if ids_over and req.block_ids is not None else req.blocks_held
            raise ProtocolError(
                f"requests[{i}].{'block_ids' if ids_over else 'blocks_held'}",
                f"holds {held} blocks, more than pool {json.dumps(req.pool)} has ({cap})",
            )
        if req.id in request_ids:
            raise ProtocolError(f"requests[{i}].id", f"duplicate request id {json.dumps(req.id)}")
        request_ids.add(req.id)
    return RequestTable.from_requests(requests)


def _request_columns(value: object, default_pool: str, capacity: dict[str, int]) -> RequestTable:
    """The columnar form (``request_columns``, docs/ledger.md): one array per request field,
    entry i of every array describing request i. Same fields, types, ranges and rules as
    ``requests[]``; errors name ``request_columns.<field>[i]``."""
    path = "request_columns"
    cols = _obj(value, path)
    for key in ("id", "state", "prompt_tokens", "max_output_tokens"):
        if cols.get(key) is None:
            raise ProtocolError(f"{path}.{key}", "is required")
    n = len(_arr(cols["id"], f"{path}.id"))
    if n > MAX_REQUESTS:
        raise ProtocolError(f"{path}.id", f"lists {n} requests, more than {MAX_REQUESTS}")
    columns: dict[str, list[Any]] = {}
    scalars: set[str] = set()
    binary: dict[str, np.ndarray] = {}
    for key in _COLUMN_KEYS:
        column = cols.get(key)
        if column is None:
            columns[key] = [None] * n
            continue
        if key in _INT_RANGES and isinstance(column, Mapping):
            binary[key] = _binary_int_column(column, f"{path}.{key}", n)
            columns[key] = []  # listed only if a check needs the entries
            continue
        if key not in _ARRAY_ONLY and not isinstance(column, (list, Mapping)):
            columns[key] = [column] * n  # one value for every request
            scalars.add(key)
            continue
        column = _arr(column, f"{path}.{key}")
        if len(column) != n:
            raise ProtocolError(f"{path}.{key}", f"has {len(column)} entries, {path}.id has {n}")
        columns[key] = column
    fast = _table_fast(columns, n, default_pool, capacity, frozenset(scalars), binary)
    if fast is not None:
        return fast
    for key, arr in binary.items():
        columns[key] = arr.tolist()
    # the checked walk: every entry as requests[] checks it, naming the first problem
    rows = [{key: columns[key][i] for key in _COLUMN_KEYS if columns[key][i] is not None} for i in range(n)]
    try:
        return _requests_checked(rows, default_pool, capacity)
    except ProtocolError as exc:
        raise ProtocolError(_column_path(exc.path, scalars), exc.detail) from None


#: columns that must be arrays; any other may be one value standing for every request
_ARRAY_ONLY = frozenset(("id", "block_ids"))


def _column_path(row_path: str, scalars: set[str]) -> str:
    """``requests[3].prompt_tokens[0]`` -> ``request_columns.prompt_tokens[3][0]``
    (``request_columns.pool`` for a column given as one value)."""
    head, _, rest = row_path.partition("].")
    index = head.removeprefix("requests[")
    key, bracket, tail = rest.partition("[")
    if key in scalars:
        return f"request_columns.{key}"
    return f"request_columns.{key}[{index}]" + (bracket + tail if bracket else "")


def _host(raw: object) -> HostFacts:
    h = _obj(raw, "host")
    out = HostFacts(
        output_buffer_bytes=_opt(h, "output_buffer_bytes", "host", _int),
        network_queue_depth=_opt(h, "network_queue_depth", "host", _int),
        socket_send_queue_bytes=_opt(h, "socket_send_queue_bytes", "host", _int),
        socket_receive_queue_bytes=_opt(h, "socket_receive_queue_bytes", "host", _int),
    )
    for key, attr in (("output_buffer_limit_bytes", "output_buffer_limit"), ("network_queue_limit", "network_queue_limit")):
        kind_key = key.removesuffix("_bytes") + "_kind"
        kind = _opt(h, kind_key, "host", _enum, LIMIT_KINDS)
        value = _opt(h, key, "host", _number)
        if value is not None:
            setattr(out, attr, Limit(float(value), kind or DEFAULT_LIMIT_KIND))
    return out


class _ReadChecked(Exception):
    """Typed rows that break a rule across requests: the body is read the checked way."""


def _typed_table(value: object, default_pool: str, capacity: dict[str, int]) -> RequestTable | None:
    """The requests decoded by type (facts_from_json's fast path) as a table; None when
    ``value`` was decoded as plain JSON; ``_ReadChecked`` when they break a rule."""
    if isinstance(value, TypedRows):
        table = table_from_rows(value.rows, default_pool, capacity)
    elif isinstance(value, TypedColumns):
        table = table_from_columns(value.columns, default_pool, capacity)
    else:
        return None
    if table is None:
        raise _ReadChecked
    return table


def _requests_row_form(value: object, default_pool: str, capacity: dict[str, int]) -> RequestTable:
    raw_requests = _arr(value, "requests")
    if len(raw_requests) > MAX_REQUESTS:
        raise ProtocolError("requests", f"lists {len(raw_requests)} requests, more than {MAX_REQUESTS}")
    fast = _requests_fast(raw_requests, default_pool, capacity)
    return fast if fast is not None else _requests_checked(raw_requests, default_pool, capacity)


def facts_from_document(doc: object, engine_name: str, *, default_kind: str = "ledger") -> EngineFacts:
    """Convert a kvledger/v1 document into the facts of engine ``engine_name``.

    Raises ProtocolError naming the JSON path of the first problem.
    """
    d = _obj(doc, "")
    if "schema" not in d:
        raise ProtocolError("schema", "is required")
    if d["schema"] != SCHEMA_ID:
        raise ProtocolError("schema", f"expected {json.dumps(SCHEMA_ID)}, got {_show(d['schema'])}")
    if "pools" not in d:
        raise ProtocolError("pools", "is required")
    raw_pools = _arr(d["pools"], "pools")
    if not raw_pools:
        raise ProtocolError("pools", "must list at least one pool")
    pools = [_pool(p, f"pools[{i}]") for i, p in enumerate(raw_pools)]
    pool_ids = [p.id for p in pools]
    if len(set(pool_ids)) != len(pool_ids):
        seen: set[str] = set()
        for i, pid in enumerate(pool_ids):
            if pid in seen:
                raise ProtocolError(f"pools[{i}].id", f"duplicate pool id {json.dumps(pid)}")
            seen.add(pid)
    default_pool = pools[0].id
    capacity = {p.id: p.num_blocks for p in pools}
    requests: RequestTable
    if "request_columns" in d:
        if "requests" in d:
            raise ProtocolError("request_columns", "a document carries requests or request_columns, not both")
        typed = _typed_table(d["request_columns"], default_pool, capacity)
        requests = typed if typed is not None else _request_columns(d["request_columns"], default_pool, capacity)
    else:
        if "requests" not in d:
            raise ProtocolError("requests", "is required")
        typed = _typed_table(d["requests"], default_pool, capacity)
        requests = typed if typed is not None else _requests_row_form(d["requests"], default_pool, capacity)

    kind, version = default_kind, None
    if (engine := d.get("engine")) is not None:
        e = _obj(engine, "engine")
        kind = _opt(e, "kind", "engine", _str, True) or default_kind
        version = _opt(e, "version", "engine", _str, True)

    budgets = Budgets()
    if (b := d.get("budgets")) is not None:
        b = _obj(b, "budgets")
        budgets = Budgets(
            max_num_batched_tokens=_opt(b, "max_num_batched_tokens", "budgets", _int, 0, MAX_TOKENS),
            iteration_tokens=_opt(b, "iteration_tokens", "budgets", _int, 0, MAX_TOKENS),
            max_num_seqs=_opt(b, "max_num_seqs", "budgets", _int, 0, MAX_TOKENS),
            max_model_len=_opt(b, "max_model_len", "budgets", _int, 1, MAX_TOKENS),
        )

    counters: dict[str, float] = {}
    if (c := d.get("counters")) is not None:
        c = _obj(c, "counters")
        for name in COUNTER_NAMES:
            value = _opt(c, name, "counters", _number)
            if value is not None:
                counters[name] = value

    memory: list[MemoryTerm] = []
    if (m := d.get("memory")) is not None:
        for i, raw in enumerate(_arr(m, "memory")):
            path = f"memory[{i}]"
            t = _obj(raw, path)
            memory.append(
                MemoryTerm(
                    gpu=_req(t, "gpu", path, _int),
                    category=_req(t, "category", path, _enum, BUDGET_CATEGORIES),
                    bytes=_req(t, "bytes", path, _int),
                    source=_req(t, "source", path, _enum, TERM_SOURCES),
                )
            )

    tenants: list[TenantQuota] = []
    if (raw_tenants := d.get("tenants")) is not None:
        for i, raw in enumerate(_arr(raw_tenants, "tenants")):
            path = f"tenants[{i}]"
            q = _obj(raw, path)
            tenants.append(TenantQuota(_req(q, "name", path, _str), _req(q, "quota_bytes", path, _int)))

    host = _host(d["host"]) if d.get("host") is not None else HostFacts()

    return EngineFacts(
        name=engine_name,
        kind=kind,
        source="ledger",
        version=version,
        admission=_opt(d, "admission", "", _enum, ADMISSIONS),
        overflow=_opt(d, "overflow", "", _enum, OVERFLOWS),
        budgets=budgets,
        pools=pools,
        requests=requests,
        counters=counters,
        memory=memory,
        host=host,
        tenants=tenants,
    )


class NotJsonError(ProtocolError):
    """A body that is not JSON; ``line``, ``column`` and ``reason`` say where and why."""

    def __init__(self, line: int, column: int, reason: str) -> None:
        self.line, self.column, self.reason = line, column, reason
        super().__init__("", f"invalid JSON at line {line}, column {column}: {reason}")


def facts_from_json(data: bytes | str, engine_name: str, *, default_kind: str = "ledger") -> EngineFacts:
    """Decode a kvledger/v1 body and convert it; a body that is not JSON raises
    ``NotJsonError`` (a ProtocolError at ``<document>``).

    The common document is decoded by type (``document_decoder``: requests checked while
    they are parsed); anything that path does not take as is, is read the checked way:
    parsed with orjson, which rejects what is not JSON (NaN, Infinity, numbers that
    overflow a double such as ``1e999``, invalid UTF-8) and nesting deeper than 1024
    levels, then converted field by field, naming the path of the first problem. Both
    paths give the same facts for every document the fast one takes.
    """
    typed = decode_typed(data)
    if typed is not None:
        try:
            return facts_from_document(typed, engine_name, default_kind=default_kind)
        except _ReadChecked:
            pass
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise NotJsonError(exc.lineno, exc.colno, exc.msg) from None
    return facts_from_document(doc, engine_name, default_kind=default_kind)
