"""The kvledger/v1 ledger protocol (DESIGN §7): document -> EngineFacts.

The JSON Schema in ``schema/kvledger-v1.json`` is the published contract; tests
validate documents against it with ``jsonschema``. Validating a 10,000-request
document with ``jsonschema`` takes seconds, so ``facts_from_document`` checks the same
rules by hand while it converts (and the tests check that both agree on accepted and
rejected documents). ``validate_document`` runs the schema itself, for tools.

Errors are ``ProtocolError`` whose message starts with the JSON path of the field:
``pools[0].num_blocks: expected integer, got "abc"``.

Beyond the schema the converter rejects duplicate pool ids, duplicate request ids
and requests that name a pool the document lacks. It computes no policy numbers: the
summary fields and ``block_refs``/``block_ids`` are carried as given.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping
from functools import lru_cache
from importlib import resources
from operator import itemgetter
from typing import Any

from kvledger.blockrefs import BlockRefArray
from kvledger.model import (
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
    MemoryTerm,
    PoolFacts,
    RequestFacts,
    TenantQuota,
)

SCHEMA_ID = "kvledger/v1"
#: kind of a limit whose document gives no ``*_limit_kind``: never present a guess as hard
DEFAULT_LIMIT_KIND = "estimate"


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
    text = resources.files("kvledger").joinpath("schema/kvledger-v1.json").read_text()
    return json.loads(text)


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
    text = json.dumps(value) if isinstance(value, (str, int, float, bool)) or value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(value: object, path: str, minimum: int = 0) -> int:
    if type(value) is not int:
        if type(value) is float and value.is_integer():
            value = int(value)
        else:
            raise ProtocolError(path, f"expected integer, got {_show(value)}")
    if value < minimum:
        raise ProtocolError(path, f"must be >= {minimum}, got {value}")
    return value


def _number(value: object, path: str) -> float:
    if type(value) not in (int, float):
        raise ProtocolError(path, f"expected number, got {_show(value)}")
    if value < 0:  # type: ignore[operator]
        raise ProtocolError(path, f"must be >= 0, got {value}")
    return value  # type: ignore[return-value]


def _str(value: object, path: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ProtocolError(path, f"expected string, got {_show(value)}")
    if not value and not allow_empty:
        raise ProtocolError(path, "must not be empty")
    return value


def _enum(value: object, path: str, options: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in options:
        raise ProtocolError(path, f"expected one of {', '.join(options)}; got {_show(value)}")
    return value


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
        # unsigned arrays reject negative numbers (OverflowError) without a separate pass
        return BlockRefArray(array("Q", ids), array("Q", counts), bytes(cached))
    except (TypeError, OverflowError):
        pass
    ids_a, counts_a, cached_b = array("Q"), array("Q"), bytearray()
    for i, item in enumerate(refs):
        where = f"{path}[{i}]"
        if not isinstance(item, list) or len(item) != 3:
            raise ProtocolError(where, f"expected [block_id, ref_count, cached], got {_show(item)}")
        for j, column in ((0, ids_a), (1, counts_a)):
            try:
                column.append(_int(item[j], f"{where}[{j}]"))
            except OverflowError:
                raise ProtocolError(f"{where}[{j}]", f"out of range: {item[j]}") from None
        if type(item[2]) is not bool:
            raise ProtocolError(f"{where}[2]", f"expected boolean, got {_show(item[2])}")
        cached_b.append(item[2])
    return BlockRefArray(ids_a, counts_a, bytes(cached_b))


def _block_ids(value: object, path: str) -> list[int]:
    ids = _arr(value, path)
    if not ids:
        return ids
    if set(map(type, ids)) == {int} and min(ids) >= 0:
        return ids
    return [_int(v, f"{path}[{i}]") for i, v in enumerate(ids)]


# ---------------------------------------------------------------- sections


def _pool(raw: object, path: str) -> PoolFacts:
    p = _obj(raw, path)
    blocks = p.get("blocks")
    if blocks is not None:
        blocks = _obj(blocks, f"{path}.blocks")
    else:
        blocks = {}
    refs = p.get("block_refs")
    layer_groups = _opt(p, "layer_groups", path, _int, 1)
    return PoolFacts(
        id=_req(p, "id", path, _str),
        block_size=_req(p, "block_size", path, _int, 1),
        num_blocks=_req(p, "num_blocks", path, _int),
        block_bytes=_req(p, "block_bytes", path, _int, 1),
        sliding_window=_opt(p, "sliding_window", path, _int, 1),
        in_use=_opt(blocks, "in_use", f"{path}.blocks", _int),
        reclaimable=_opt(blocks, "reclaimable", f"{path}.blocks", _int),
        free=_opt(blocks, "free", f"{path}.blocks", _int),
        references=_opt(p, "references", path, _int),
        shared=_opt(p, "shared", path, _int),
        block_refs=None if refs is None else _block_refs(refs, f"{path}.block_refs"),  # type: ignore[arg-type]
        cached_blocks=_opt(p, "cached_blocks", path, _int),
        engine_reported_used_blocks=_opt(p, "engine_reported_used_blocks", path, _number),
        layer_groups=1 if layer_groups is None else layer_groups,
    )


_OPTIONAL_COUNTS = (("generated_tokens", 0), ("computed_tokens", 0), ("contexts", 1), ("speculative_slots", 0), ("blocks_held", 0))
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
    if type(prompt) is not int or prompt < 0 or type(output) is not int or output < 0:
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
    for key, minimum in _OPTIONAL_COUNTS:
        v = get(key)
        if v is not None:
            if type(v) is not int or v < minimum:
                return None
            setattr(out, key, v)
    ids = get("block_ids")
    if ids is not None:
        if type(ids) is not list or (ids and (set(map(type, ids)) != {int} or min(ids) < 0)):
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
        state=_req(r, "state", path, _enum, REQUEST_STATES),  # type: ignore[arg-type]
        prompt_tokens=_req(r, "prompt_tokens", path, _int),
        max_output_tokens=_req(r, "max_output_tokens", path, _int),
    )
    get = r.get
    if (v := get("output_bound")) is not None:
        out.output_bound = _enum(v, f"{path}.output_bound", OUTPUT_BOUNDS)  # type: ignore[assignment]
    out.pool = _opt(r, "pool", path, _str, True) or default_pool
    if (v := get("tenant")) is not None:
        out.tenant = _str(v, f"{path}.tenant", True)
    if (v := get("generated_tokens")) is not None:
        out.generated_tokens = _int(v, f"{path}.generated_tokens")
    if (v := get("computed_tokens")) is not None:
        out.computed_tokens = _int(v, f"{path}.computed_tokens")
    if (v := get("contexts")) is not None:
        out.contexts = _int(v, f"{path}.contexts", 1)
    if (v := get("speculative_slots")) is not None:
        out.speculative_slots = _int(v, f"{path}.speculative_slots")
    if (v := get("blocks_held")) is not None:
        out.blocks_held = _int(v, f"{path}.blocks_held")
    if ids is not None:
        out.block_ids = _block_ids(ids, f"{path}.block_ids")
        if get("blocks_held") is None:
            out.blocks_held = len(out.block_ids)
    return out


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
            setattr(out, attr, Limit(float(value), kind or DEFAULT_LIMIT_KIND))  # type: ignore[arg-type]
    return out


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
    if "requests" not in d:
        raise ProtocolError("requests", "is required")
    raw_requests = _arr(d["requests"], "requests")
    default_pool = pools[0].id
    requests = [_request(r, f"requests[{i}]", default_pool) for i, r in enumerate(raw_requests)]
    known = set(pool_ids)
    request_ids: set[str] = set()
    for i, req in enumerate(requests):
        if req.pool not in known:
            raise ProtocolError(f"requests[{i}].pool", f"no pool with id {json.dumps(req.pool)}")
        if req.id in request_ids:
            raise ProtocolError(f"requests[{i}].id", f"duplicate request id {json.dumps(req.id)}")
        request_ids.add(req.id)

    kind, version = default_kind, None
    if (engine := d.get("engine")) is not None:
        e = _obj(engine, "engine")
        kind = _opt(e, "kind", "engine", _str, True) or default_kind
        version = _opt(e, "version", "engine", _str, True)

    budgets = Budgets()
    if (b := d.get("budgets")) is not None:
        b = _obj(b, "budgets")
        budgets = Budgets(
            max_num_batched_tokens=_opt(b, "max_num_batched_tokens", "budgets", _int),
            iteration_tokens=_opt(b, "iteration_tokens", "budgets", _int),
            max_num_seqs=_opt(b, "max_num_seqs", "budgets", _int),
            max_model_len=_opt(b, "max_model_len", "budgets", _int),
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
    if (t := d.get("tenants")) is not None:
        for i, raw in enumerate(_arr(t, "tenants")):
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


def facts_from_json(data: bytes | str, engine_name: str, *, default_kind: str = "ledger") -> EngineFacts:
    """Parse JSON text then convert; invalid JSON is a ProtocolError at ``<document>``."""
    try:
        doc = json.loads(data)
    except UnicodeDecodeError as exc:
        raise ProtocolError("", f"not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except json.JSONDecodeError as exc:
        raise ProtocolError("", f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    return facts_from_document(doc, engine_name, default_kind=default_kind)
