"""The kvledger/v1 ledger protocol (docs/design.md §7): document -> EngineFacts.

The JSON Schema in ``schema/kvledger-v1.json`` is the published contract; tests
validate documents against it with ``jsonschema``. Validating a 10,000-request
document with ``jsonschema`` takes seconds, so ``facts_from_document`` checks the same
rules by hand while it converts (and the tests check that both agree on accepted and
rejected documents). ``validate_document`` runs the schema itself, for tools.

A body is read in two ways, built from one definition of a request (``wire.REQUEST_FIELDS``,
held to the schema by tests/test_protocol.py): by type (``fast_decoder``: msgspec structs,
every field checked in C while it is parsed), which takes the common document as is and
returns None for anything else, and the checked way (``facts_from_document``: field by
field, naming the path of the first problem), which reads whatever the typed way does not
take. Both give the same facts or the same error (tests/test_document_decoder.py).

Errors are ``ProtocolError`` whose message starts with the JSON path of the field:
``pools[0].num_blocks: expected integer, got "abc"``.

Numeric ranges (``kvledger.domain.limits``; the schema states each field's ``minimum`` and
``maximum``): every integer is an integer value (``2.0`` is accepted for an integer field,
as JSON Schema's ``integer`` accepts it, by the checked reader; the typed one leaves it to
that; ``2.5`` and ``1e308`` are not: the latter exceeds every maximum) within its field's
range; every number is finite (NaN and Infinity are not JSON; ``facts_from_json`` rejects
them and ``1e999``) and within 0 .. 2**53 - 1.

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
from collections.abc import Callable, Mapping
from functools import lru_cache
from importlib import resources
from itertools import repeat
from operator import itemgetter
from typing import Any, NoReturn, TypeVar, cast

import numpy as np
import orjson

from kvledger.domain.block_refs import BlockRefArray
from kvledger.domain.facts import (
    ADMISSIONS,
    BUDGET_CATEGORIES,
    COUNTER_NAMES,
    GROUP_KINDS,
    LIMIT_KINDS,
    OVERFLOWS,
    STATE_GROUP_KINDS,
    TERM_SOURCES,
    WINDOW_GROUP_KINDS,
    AdmissionEstimate,
    Budgets,
    EngineFacts,
    HostFacts,
    KvGroupFacts,
    Limit,
    LimitKind,
    MemoryTerm,
    PoolFacts,
    TenantQuota,
)
from kvledger.domain.limits import (
    MAX_BLOCKS,
    MAX_GROUP_ID,
    MAX_KV_GROUPS,
    MAX_LAYER_GROUPS,
    MAX_REF_COUNT,
    MAX_REQUESTS,
    MAX_SAFE_INT,
    MAX_TOKENS,
)
from kvledger.domain.request_table import RequestTable
from kvledger.protocol.fast_decoder import (
    TypedColumns,
    TypedDocument,
    TypedRows,
    int64le_array,
    table_from_columns,
    table_from_rows,
)
from kvledger.protocol.fast_decoder import decode as decode_typed
from kvledger.protocol.wire import CHECK_ORDER, INTEGER_FIELDS, REQUEST_FIELDS, REQUIRED, Field

SCHEMA_ID = "kvledger/v1"
#: an integer column of the columnar form given as machine integers: {"int64le": base64}
BINARY_INT_KEY = "int64le"
#: the media type of the columnar form (``request_columns``), which a reader asks for in
#: its Accept header; kvledger_engine/document_server.py serves it under the same name
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


def _in_range(value: object, conv: Any, args: tuple[Any, ...]) -> bool:
    """Whether ``conv`` is ``_int`` and would return ``value`` as it is (the common case,
    taken without building the path its errors would name)."""
    return (type(value) is int and conv is _int
            and (args[0] if args else 0) <= value <= (args[1] if len(args) > 1 else MAX_SAFE_INT))


def _opt(d: Mapping[str, Any], key: str, path: str, conv: Any, *args: Any) -> Any:
    value = d.get(key)
    if value is None:
        return None
    if _in_range(value, conv, args):
        return value
    return conv(value, _join(path, key), *args)


def _req(d: Mapping[str, Any], key: str, path: str, conv: Any, *args: Any) -> Any:
    if key not in d:
        raise ProtocolError(_join(path, key), "is required")
    value = d[key]
    if _in_range(value, conv, args):
        return value
    return conv(value, _join(path, key), *args)


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
    groups = _groups(p.get("groups"), f"{path}.groups")
    if layer_groups is None and groups:
        layer_groups = len(groups)
    elif groups and layer_groups != len(groups):
        # token capacity is num_blocks // layer_groups x block_size: a count other than the
        # groups' would state a capacity the groups cannot have
        raise ProtocolError(f"{path}.layer_groups", f"is {layer_groups} but the pool states {len(groups)} group(s) "
                                                     "(layer_groups counts them: give that number or leave it out)")
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
        preempted_tokens=_opt(p, "preempted_tokens", path, _int),
        admission_estimate=_admission_estimate(p.get("admission_estimate"), f"{path}.admission_estimate"),
        layer_groups=1 if layer_groups is None else layer_groups,
        groups=groups,
    )
    c = out.num_blocks
    for what, per_block in (("block_bytes", out.block_bytes), ("block_size", out.block_size)):
        assert per_block is not None
        if c * per_block > MAX_SAFE_INT:
            raise ProtocolError(
                f"{path}.num_blocks",
                f"num_blocks x {what} = {c} x {per_block} exceeds {MAX_SAFE_INT} (2**53 - 1)",
            )
    for i, g in enumerate(groups):
        if g.in_use is not None and g.in_use > c:
            raise ProtocolError(f"{path}.groups[{i}].in_use", f"{g.in_use} blocks in use, more than num_blocks ({c})")
    if out.block_refs is not None and len(out.block_refs) > c:
        raise ProtocolError(f"{path}.block_refs", f"lists {len(out.block_refs)} blocks, more than num_blocks ({c})")
    return out




def _admission_estimate(raw: object, path: str) -> AdmissionEstimate | None:
    """A pool's ``admission_estimate`` (the engine's own bet, SGLang's ``new_token_ratio``)."""
    if raw is None:
        return None
    e = _obj(raw, path)
    ratio = _req(e, "new_token_ratio", path, _number)
    if ratio > 1:  # SGLang clamps it to 1: the estimate never exceeds the caps
        raise ProtocolError(f"{path}.new_token_ratio", f"must be <= 1, got {_show(ratio)}")
    return AdmissionEstimate(new_token_ratio=float(ratio), output_clip=_req(e, "output_clip", path, _int, 1, MAX_TOKENS))


def _groups(raw: object, path: str) -> tuple[KvGroupFacts, ...]:
    """A pool's KV-cache groups (``groups``, hybrid models): ids unique, a window for the
    window kinds, state blocks (default 1) for a state group."""
    if raw is None:
        return ()
    items = _arr(raw, path)
    if len(items) > MAX_KV_GROUPS:
        raise ProtocolError(path, f"lists {len(items)} groups, more than {MAX_KV_GROUPS}")
    out: list[KvGroupFacts] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        where = f"{path}[{i}]"
        g = _obj(item, where)
        gid = _req(g, "id", where, _str)
        if len(gid) > MAX_GROUP_ID:
            raise ProtocolError(f"{where}.id", f"longer than {MAX_GROUP_ID} characters")
        if gid in seen:
            raise ProtocolError(f"{where}.id", f"group {_show(gid)} is listed twice")
        seen.add(gid)
        kind = _req(g, "kind", where, _enum, GROUP_KINDS)
        window = _opt(g, "window", where, _int, 1, MAX_TOKENS)
        if kind in WINDOW_GROUP_KINDS and window is None:
            raise ProtocolError(f"{where}.window", f"is required for a {kind} group")
        state_blocks = _opt(g, "state_blocks", where, _int, 1, MAX_LAYER_GROUPS)
        out.append(
            KvGroupFacts(
                id=gid,
                kind=kind,
                window=window if kind in WINDOW_GROUP_KINDS else None,
                state_blocks=(state_blocks or 1) if kind in STATE_GROUP_KINDS else None,
                in_use=_opt(g, "in_use", where, _int, 0, MAX_BLOCKS),
            )
        )
    return tuple(out)


# ---------------------------------------------------------------- requests, the checked way
#
# Both forms are read as columns, one per field of ``wire.REQUEST_FIELDS`` (the row form
# transposed, one C call per field), each checked by its field's rules. The first problem
# named is the first in request order (a request's fields in ``wire.CHECK_ORDER``), as a
# request-by-request walk would name it.

_BAD = object()
_NONE = type(None)


def _value_check(f: Field) -> Callable[[object], object]:
    """A present, non-null value of ``f``: the value as the facts hold it (an integral float
    as an int), or ``_BAD`` where ``_field_error`` names the problem."""
    lo, hi = f.minimum, f.maximum

    def integer(value: object) -> object:
        if type(value) is int:
            return value if lo <= value <= hi else _BAD
        if type(value) is float and value.is_integer() and lo <= value <= hi:  # 2.0: an integer to JSON Schema
            return int(value)
        return _BAD

    if f.json_type == "integer":
        return integer
    if f.json_type == "string":
        allow_empty = f.allow_empty
        return lambda value: value if isinstance(value, str) and (value or allow_empty) else _BAD
    if f.json_type == "enum":
        members = frozenset(f.options)
        return lambda value: value if isinstance(value, str) and value in members else _BAD

    def integers(value: object) -> object:
        if not isinstance(value, list):
            return _BAD
        if not value or (set(map(type, value)) == {int} and min(value) >= lo and max(value) <= hi):
            return value
        items = list(map(integer, value))
        return _BAD if _BAD in items else items

    return integers


def _field_error(f: Field, value: object, path: str) -> NoReturn:
    """ProtocolError naming what is wrong with ``value`` at ``path`` (a value ``_value_check`` refuses)."""
    if f.json_type == "integer":
        _int(value, path, f.minimum, f.maximum)
    elif f.json_type == "string":
        _str(value, path, f.allow_empty)
    elif f.json_type == "enum":
        _enum(value, path, f.options)
    else:
        for j, v in enumerate(_arr(value, path)):
            _int(v, f"{path}[{j}]", f.minimum, f.maximum)
    raise AssertionError(f"{path}: {_show(value)} refused by the check, read by the reader")


_MEMBERS = {f.name: frozenset((*f.options, None)) for f in REQUEST_FIELDS if f.json_type == "enum"}


def _column_ok(f: Field, values: list[Any] | np.ndarray) -> bool:
    """Every value of the column as it is (the common document), by C-level checks over the
    whole column; False sends the column value by value."""
    if isinstance(values, np.ndarray):  # machine integers (int64le)
        return not len(values) or (int(values.min()) >= f.minimum and int(values.max()) <= f.maximum)
    types = set(map(type, values))
    if types == {_NONE}:
        return not f.required
    if f.json_type == "integer":
        return types == {int} and min(values) >= f.minimum and max(values) <= f.maximum
    if f.json_type == "integers":
        return False
    if not types <= ({str} if f.required else {str, _NONE}):
        return False
    if f.json_type == "string":
        return f.allow_empty or "" not in values
    return set(values) <= _MEMBERS[f.name]


#: each field with its check, in the order a request's fields are checked
_CHECKS = tuple((f, _value_check(f)) for f in CHECK_ORDER)


def _first_problem(columns: dict[str, Any], n: int) -> tuple[int, Field] | None:
    """The first request, and its first field, whose value breaks the field's rules (a
    required one absent or null included); None when every value keeps them. A column is
    a list of values (one value standing for every request: a list of one) or an int64
    array. Integral floats are converted, in copies of the lists (the document is not
    changed)."""
    first, problem = n, None
    for f, check in _CHECKS:
        values = columns[f.name]
        if _column_ok(f, values):
            continue
        if isinstance(values, np.ndarray):
            values = columns[f.name] = values.tolist()
        copied = False
        for i in range(min(first, len(values))):  # a problem after the first one found so far is not named
            value = values[i]
            if value is None:
                if f.required:
                    first, problem = i, f
                    break
                continue
            checked = check(value)
            if checked is _BAD:
                first, problem = i, f
                break
            if checked is not value:
                if not copied:
                    values = columns[f.name] = list(values)
                    copied = True
                values[i] = checked
    return None if problem is None else (first, problem)


def _requests_checked(raw: list[Any], default_pool: str, capacity: dict[str, int]) -> RequestTable:
    """The row form (``requests[]``), naming the field path of the first problem."""
    n = len(raw)
    if set(map(type, raw)) <= {dict}:
        get: Any = dict.get
        rows = raw
    else:  # requests that are mappings, up to the first that is not an object
        n = next((i for i, r in enumerate(raw) if not isinstance(r, Mapping)), n)
        rows = raw[:n]
        get = Mapping.get
    columns = {f.name: list(map(get, rows, repeat(f.name))) for f in REQUEST_FIELDS}
    problem = _first_problem(columns, n)
    if problem is not None:
        i, f = problem
        value, path = columns[f.name][i], f"requests[{i}].{f.name}"
        if value is None and f.name not in rows[i]:
            raise ProtocolError(path, "is required")
        _field_error(f, value, path)
    if n < len(raw):
        _obj(raw[n], f"requests[{n}]")
    return _table(columns, n, default_pool, capacity, lambda i, name: f"requests[{i}].{name}")


#: the defaults of the fields that have one (``pool`` and ``blocks_held`` are derived, in ``_table``)
_DEFAULTS = tuple((f.name, f.default) for f in REQUEST_FIELDS if f.default is not None)


def _table(
    columns: dict[str, Any], n: int, default_pool: str, capacity: dict[str, int], where: Callable[[int, str], str]
) -> RequestTable:
    """Checked columns (lists of n values, integer columns also int64 arrays) as a table:
    defaults applied, then the rules across requests (the pool named, its capacity,
    unique ids), each problem named at ``where(i, field)``."""
    for name, default in _DEFAULTS:
        values = columns[name]
        if type(values) is list and None in values:
            columns[name] = [default if v is None else v for v in values]
    ids, pools, block_ids = columns["id"], columns["pool"], columns["block_ids"]
    if None in pools or "" in pools:
        pools = [p or default_pool for p in pools]
    held = columns["blocks_held"]
    if type(held) is list and None in held:  # blocks_held defaults to len(block_ids), else 0
        held = columns["blocks_held"] = [(0 if b is None else len(b)) if h is None else h for h, b in zip(held, block_ids, strict=True)]
    listed = None if block_ids.count(None) == n else block_ids
    if not (set(pools) <= capacity.keys() and len(set(ids)) == n and _fits(pools, held, listed, capacity)):
        request_ids: set[str] = set()
        for i, (rid, pool, h, b) in enumerate(zip(ids, pools, held, block_ids, strict=True)):
            if pool not in capacity:
                raise ProtocolError(where(i, "pool"), f"no pool with id {json.dumps(pool)}")
            cap = capacity[pool]
            if h > cap or (b is not None and len(b) > cap):
                ids_over = b is not None and len(b) > cap
                raise ProtocolError(
                    where(i, "block_ids" if ids_over else "blocks_held"),
                    f"holds {len(b) if ids_over and b is not None else int(h)} blocks, more than pool {json.dumps(pool)} has ({cap})",
                )
            if rid in request_ids:
                raise ProtocolError(where(i, "id"), f"duplicate request id {json.dumps(rid)}")
            request_ids.add(rid)
    ints = {name: columns[name] for name in INTEGER_FIELDS if type(columns[name]) is list}
    arrays = {name: columns[name] for name in INTEGER_FIELDS if type(columns[name]) is not list}
    return RequestTable(ids, columns["state"], pools, columns["tenant"], columns["output_bound"], ints, listed, arrays)


def _fits(pools: list[str], held: list[int] | np.ndarray, block_ids: list[Any] | None, capacity: dict[str, int]) -> bool:
    """No request holds more blocks than its pool has (every pool named is known)."""
    names = set(pools)
    if len(names) == 1:
        cap = capacity[next(iter(names))]
        most = int(held.max()) if isinstance(held, np.ndarray) else max(held, default=0)
        return most <= cap and (block_ids is None or max(map(len, filter(None, block_ids)), default=0) <= cap)
    caps = np.fromiter(map(capacity.__getitem__, pools), dtype=np.int64, count=len(pools))
    if len(caps) and bool((np.asarray(held, dtype=np.int64) > caps).any()):
        return False
    return block_ids is None or not any(b is not None and len(b) > c for b, c in zip(block_ids, caps.tolist(), strict=True))


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


def _request_columns(value: object, default_pool: str, capacity: dict[str, int]) -> RequestTable:
    """The columnar form (``request_columns``, docs/ledger.md): one array per request field,
    entry i of every array describing request i. Same fields, types, ranges and rules as
    ``requests[]``, read by the same checks; errors name ``request_columns.<field>[i]``
    (``request_columns.<field>`` for a column given as one value)."""
    path = "request_columns"
    cols = _obj(value, path)
    for key in REQUIRED:
        if cols.get(key) is None:
            raise ProtocolError(f"{path}.{key}", "is required")
    n = len(_arr(cols["id"], f"{path}.id"))
    if n > MAX_REQUESTS:
        raise ProtocolError(f"{path}.id", f"lists {n} requests, more than {MAX_REQUESTS}")
    columns: dict[str, Any] = {}
    scalars: set[str] = set()
    for f in CHECK_ORDER:
        key = f.name
        column = cols.get(key)
        if column is None:
            columns[key] = [None] * n
        elif f.json_type == "integer" and isinstance(column, Mapping):
            columns[key] = _binary_int_column(column, f"{path}.{key}", n)  # ranges checked on the array
        elif f.one_value and not isinstance(column, (list, Mapping)):
            columns[key] = [column] if n else []  # one value for every request: checked once
            scalars.add(key)
        else:
            column = _arr(column, f"{path}.{key}")
            if len(column) != n:
                raise ProtocolError(f"{path}.{key}", f"has {len(column)} entries, {path}.id has {n}")
            columns[key] = column

    def where(i: int, key: str) -> str:
        return f"{path}.{key}" if key in scalars else f"{path}.{key}[{i}]"

    problem = _first_problem(columns, n)
    if problem is not None:
        i, f = problem
        entry = columns[f.name][i]
        if entry is None:
            raise ProtocolError(where(i, f.name), "is required")
        _field_error(f, entry, where(i, f.name))
    for key in scalars:
        columns[key] = columns[key] * n
    return _table(columns, n, default_pool, capacity, where)


def _requests(key: str, value: object, default_pool: str, capacity: dict[str, int]) -> RequestTable | None:
    """``requests`` or ``request_columns``: structs the typed decoder made (``TypedRows``,
    ``TypedColumns``) as a table, None where they break a rule across requests (the
    checked reader then names it, from the body's JSON values); JSON values the checked way."""
    if isinstance(value, TypedRows):
        return table_from_rows(value.rows, default_pool, capacity)
    if isinstance(value, TypedColumns):
        return table_from_columns(value.columns, default_pool, capacity)
    if key == "request_columns":
        return _request_columns(value, default_pool, capacity)
    raw = _arr(value, "requests")
    if len(raw) > MAX_REQUESTS:
        raise ProtocolError("requests", f"lists {len(raw)} requests, more than {MAX_REQUESTS}")
    return _requests_checked(raw, default_pool, capacity)


def _tenants(raw: object) -> list[TenantQuota]:
    """``tenants``: the common list (objects, each with a non-empty text ``name`` and an
    integer ``quota_bytes`` in range) taken in one pass; anything else checked entry by
    entry, naming the first problem (the same tenants either way)."""
    entries = _arr(raw, "tenants")
    tenants: list[TenantQuota] = []
    for q in entries:  # building each entry's path for its checks cost more than the checks
        if type(q) is not dict:
            break
        name, quota = q.get("name"), q.get("quota_bytes")
        if type(name) is not str or not name or type(quota) is not int or not 0 <= quota <= MAX_SAFE_INT:
            break
        tenants.append(TenantQuota(name, quota))
    else:
        return tenants
    tenants = []
    for i, item in enumerate(entries):
        path = f"tenants[{i}]"
        q = _obj(item, path)
        tenants.append(TenantQuota(_req(q, "name", path, _str), _req(q, "quota_bytes", path, _int)))
    return tenants


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



class SectionMemo:
    """The sections of one engine's last document that rarely change (``fast_decoder.MEMO_KEYS``:
    engine, budgets, counters, memory, host, tenants) as read, each by its JSON text: the
    next document's section with the same text is not loaded or checked again, its facts
    are copies of the ones read then (nobody shares them). A section that breaks the
    protocol is not kept: it is read, and refused, each time. One per engine, used by one
    read at a time."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[str, tuple[bytes, Any]] = {}

    def read(self, key: str, text: bytes, read: Callable[[object], Any]) -> Any:
        """``read`` of the section's JSON value, or of the last one with the same ``text``;
        raises ``_NotJson`` where ``text`` is not JSON."""
        last = self._last.get(key)
        if last is not None and last[0] == text:
            return last[1]
        result = read(_load_section(text))
        self._last[key] = (text, result)
        return result


class _NotJson(Exception):
    """A section's text that is not JSON (the body is then read the checked way, which names it)."""


def _load_section(text: bytes) -> object:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        raise _NotJson from None


def _engine_section(value: object) -> tuple[str | None, str | None]:
    """``engine``: its kind and version (each None where not given)."""
    e = _obj(value, "engine")
    return _opt(e, "kind", "engine", _str, True) or None, _opt(e, "version", "engine", _str, True)


def _budgets(value: object) -> Budgets:
    b = _obj(value, "budgets")
    return Budgets(
        max_num_batched_tokens=_opt(b, "max_num_batched_tokens", "budgets", _int, 0, MAX_TOKENS),
        iteration_tokens=_opt(b, "iteration_tokens", "budgets", _int, 0, MAX_TOKENS),
        window_scheduled_tokens=_opt(b, "window_scheduled_tokens", "budgets", _int),
        window_iterations=_opt(b, "window_iterations", "budgets", _int),
        max_num_seqs=_opt(b, "max_num_seqs", "budgets", _int, 0, MAX_TOKENS),
        max_model_len=_opt(b, "max_model_len", "budgets", _int, 1, MAX_TOKENS),
    )


def _counters(value: object) -> dict[str, float]:
    c = _obj(value, "counters")
    counters: dict[str, float] = {}
    for name in COUNTER_NAMES:
        number = _opt(c, name, "counters", _number)
        if number is not None:
            counters[name] = number
    return counters


def _memory(value: object) -> list[MemoryTerm]:
    memory: list[MemoryTerm] = []
    for i, raw in enumerate(_arr(value, "memory")):
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
    return memory


def _copy(facts: Any) -> Any:
    """A new one of a slots dataclass with the same fields (a kept section handed out again)."""
    return type(facts)(*map(facts.__getattribute__, facts.__slots__))


#: each section's reader, and how its kept facts are handed out again (a new container;
#: what it holds is frozen)
_SECTIONS: dict[str, tuple[Callable[[object], Any], Callable[[Any], Any]]] = {
    "engine": (_engine_section, lambda kept: kept),
    "budgets": (_budgets, _copy),
    "counters": (_counters, dict),
    "memory": (_memory, list),
    "host": (lambda value: _host(value), _copy),
    "tenants": (lambda value: _tenants(value), list),
}


def _read(doc: object, engine_name: str, default_kind: str, memo: SectionMemo | None = None) -> EngineFacts | None:
    """The facts of a document, checked in order: schema, pools, requests, the rest. None
    where requests the typed decoder made break a rule across requests (see ``_requests``),
    or where a section the typed decoder kept as text is not JSON. A ``TypedDocument``'s
    sections kept as text are read through ``memo`` when given."""
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
    if "request_columns" in d:
        if "requests" in d:
            raise ProtocolError("request_columns", "a document carries requests or request_columns, not both")
        key = "request_columns"
    elif "requests" not in d:
        raise ProtocolError("requests", "is required")
    else:
        key = "requests"
    requests = _requests(key, d[key], default_pool, capacity)
    if requests is None:
        return None

    texts = doc.raws if isinstance(doc, TypedDocument) else None

    def section(key: str) -> Any:
        """The section's facts, None where the document has none."""
        read, again = _SECTIONS[key]
        if texts is None:
            value = d.get(key)
            return None if value is None else read(value)
        text = texts.get(key)
        if text is None:
            return None
        if memo is None:
            value = _load_section(text)
            return None if value is None else read(value)
        kept = memo.read(key, text, lambda value: None if value is None else read(value))
        return None if kept is None else again(kept)

    try:
        engine = section("engine")
        budgets = section("budgets") or Budgets()
        counters = section("counters") or {}
        memory = section("memory") or []
        tenants = section("tenants") or []
        host = section("host") or HostFacts()
    except _NotJson:
        return None
    kind, version = (None, None) if engine is None else engine
    kind = kind or default_kind

    return EngineFacts(
        name=engine_name,
        kind=kind,
        source="ledger",
        version=version,
        published_at=_opt(d, "published_at", "", _number),
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


def facts_from_document(doc: object, engine_name: str, *, default_kind: str = "ledger") -> EngineFacts:
    """Convert a kvledger/v1 document (as JSON decoding gives it: dicts, lists, strings,
    numbers, booleans, None) into the facts of engine ``engine_name``, the checked way:
    field by field, accepting what the schema accepts (with the rules beyond it).

    Raises ProtocolError naming the JSON path of the first problem.
    """
    facts = _read(doc, engine_name, default_kind)
    assert facts is not None  # JSON values: the checked reader returns the requests or raises
    return facts


class NotJsonError(ProtocolError):
    """A body that is not JSON; ``line``, ``column`` and ``reason`` say where and why."""

    def __init__(self, line: int, column: int, reason: str) -> None:
        self.line, self.column, self.reason = line, column, reason
        super().__init__("", f"invalid JSON at line {line}, column {column}: {reason}")


def typed_facts(data: bytes | str, engine_name: str, *, default_kind: str = "ledger",
                memo: SectionMemo | None = None) -> EngineFacts | None:
    """The body read by type alone (``fast_decoder.decode``: the requests checked in C while
    msgspec parses them); None where that does not take it as is (``facts_from_json`` then
    reads it otherwise). Raises ProtocolError as ``facts_from_document`` does for the rest
    of the document, which is read the same way on either path. ``memo``: the engine's
    ``SectionMemo``, for sections unchanged since its last document."""
    doc = decode_typed(data)
    if doc is None or ("requests" not in doc and "request_columns" not in doc):
        return None
    try:
        return _read(doc, engine_name, default_kind, memo)
    except ProtocolError:
        # a body that is not JSON is refused as such, whatever else it breaks: the sections
        # kept as text and not loaded before the error are checked now (the checked way then names it)
        for text in doc.raws.values():
            try:
                orjson.loads(text)
            except orjson.JSONDecodeError:
                return None
        raise


def facts_from_json(data: bytes | str, engine_name: str, *, default_kind: str = "ledger",
                    memo: SectionMemo | None = None) -> EngineFacts:
    """Decode a kvledger/v1 body and convert it; a body that is not JSON raises
    ``NotJsonError`` (a ProtocolError at ``<document>``).

    The common document is read by type (``typed_facts``); anything that way does not
    take as is, is read the checked way: parsed with orjson, which rejects what is not JSON
    (NaN, Infinity, numbers that overflow a double such as ``1e999``, invalid UTF-8) and
    nesting deeper than 1024 levels, then converted field by field, naming the path of the
    first problem (``facts_from_document``). Both give the same facts for every document
    the typed way takes (tests/test_document_decoder.py). ``memo``: the engine's
    ``SectionMemo`` (a reader polling one engine keeps one), for the sections unchanged
    since its last document.
    """
    facts = typed_facts(data, engine_name, default_kind=default_kind, memo=memo)
    if facts is not None:
        return facts
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise NotJsonError(exc.lineno, exc.colno, exc.msg) from None
    return facts_from_document(doc, engine_name, default_kind=default_kind)
