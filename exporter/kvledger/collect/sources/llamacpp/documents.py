"""llama.cpp's JSON endpoints, validated: GET /slots and GET /props (pure: bytes in, values out).

/slots (on by default; ``--no-slots`` turns it off) is an array with one object per slot.
Fields read (tools/server/server-context.cpp, ``server_slot::to_json``):

- ``id``, ``n_ctx`` (the slot's context in tokens), ``is_processing``;
- current builds, once the slot has served a task: ``id_task``, ``n_prompt_tokens`` (the
  size of the slot's token list: the tokens its KV sequence holds, prompt and generated,
  kept after the task ends for prompt reuse), ``n_prompt_tokens_processed``,
  ``n_prompt_tokens_cache``, and ``next_token`` (an array of one object) with ``n_decoded``
  and ``n_remain`` (-1: no limit);
- older builds (before the KV gauges left /metrics, May 2025): ``id_task`` on every slot
  (-1 before its first task), ``next_token`` an object, and no token counts.

/props (always served, also while the server sleeps): ``total_slots``,
``default_generation_settings.n_ctx`` (the slot context), ``build_info`` (``b<N>-<commit>``)
and, in current builds, ``is_sleeping`` (``--sleep-idle-seconds``: the model is unloaded).

Every value read is checked: integers are JSON integers in the ranges of
``kvledger.domain.limits``; a wrong type, a value out of range, a duplicate slot id or a body
that is not JSON raises ``SourceError`` naming the endpoint and the field (reasons:
``parse`` for what is not JSON, ``schema`` for JSON of the wrong shape). Unknown fields
are ignored. Messages never quote the body, only the type or number found.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from kvledger.collect.sources.base import SourceError
from kvledger.domain.limits import MAX_TOKENS

#: more slots than this is not a llama.cpp server (its -np is an int32, but every slot
#: holds a context: 65,536 slots of one token each would already be absurd)
MAX_SLOTS = 1 << 16
#: the longest build_info kept (label values are bounded again by the label limits)
MAX_BUILD_INFO = 256


@dataclass(frozen=True, slots=True)
class Slot:
    """One slot of /slots, validated. ``tokens`` is None when the server does not say."""

    id: int
    n_ctx: int  # the slot's context, tokens
    processing: bool
    task: int | None  # id of the current or last task; None: the slot never ran one
    tokens: int | None  # n_prompt_tokens: tokens in the slot's KV sequence
    prompt_processed: int | None  # n_prompt_tokens_processed (evaluated, not from cache)
    prompt_cached: int | None  # n_prompt_tokens_cache (reused from the slot's cache)
    decoded: int | None  # next_token.n_decoded
    remaining: int | None  # next_token.n_remain; -1 = no limit


@dataclass(frozen=True, slots=True)
class Props:
    total_slots: int | None
    slot_n_ctx: int | None  # default_generation_settings.n_ctx
    build_info: str | None
    sleeping: bool  # is_sleeping (absent before --sleep-idle-seconds existed: False)


def _load(body: bytes | str, where: str) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:  # also invalid UTF-8, NaN, 1e999, nesting over 1024
        raise SourceError("parse", f"{where}: not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return f"the integer {value}" if -(10**18) < value < 10**18 else "an integer of more than 18 digits"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _int(obj: Mapping[str, Any], key: str, where: str, lo: int, hi: int, required: bool = False) -> int | None:
    """obj[key] as an integer in [lo, hi]; None when absent (or JSON null) and not required."""
    value = obj.get(key)
    if value is None:
        if required:
            raise SourceError("schema", f"{where}.{key}: missing (expected an integer in [{lo}, {hi}])")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SourceError("schema", f"{where}.{key}: expected an integer in [{lo}, {hi}], got {_kind(value)}")
    if not lo <= value <= hi:
        raise SourceError("schema", f"{where}.{key}: expected an integer in [{lo}, {hi}], got {_kind(value)}")
    return value


def _bool(obj: Mapping[str, Any], key: str, where: str, default: bool | None = None) -> bool:
    value = obj.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, bool):
        raise SourceError("schema", f"{where}.{key}: expected true or false, got {_kind(value)}")
    return value


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise SourceError("schema", f"{where}: expected an object, got {_kind(value)}")
    return value


def _next_token(raw: Any, where: str) -> Mapping[str, Any] | None:
    """Current builds: an array of one object; older builds: the object itself."""
    if raw is None:
        return None
    if isinstance(raw, list):
        if not raw:
            return None
        return _object(raw[0], f"{where}[0]")
    return _object(raw, where)


def parse_slots(body: bytes | str, where: str = "/slots") -> list[Slot]:
    """The slots of a GET /slots answer, validated (see the module doc)."""
    doc = _load(body, where)
    if not isinstance(doc, list):
        raise SourceError("schema", f"{where}: expected an array of slots, got {_kind(doc)}")
    if not doc:
        raise SourceError("schema", f"{where}: the server lists no slot")
    if len(doc) > MAX_SLOTS:
        raise SourceError("schema", f"{where}: {len(doc)} slots, more than {MAX_SLOTS}")
    slots: list[Slot] = []
    seen: set[int] = set()
    for i, raw in enumerate(doc):
        at = f"{where}[{i}]"
        obj = _object(raw, at)
        slot_id = _int(obj, "id", at, 0, MAX_SLOTS - 1, required=True)
        assert slot_id is not None
        if slot_id in seen:
            raise SourceError("schema", f"{at}.id: slot {slot_id} is listed twice")
        seen.add(slot_id)
        n_ctx = _int(obj, "n_ctx", at, 1, MAX_TOKENS, required=True)
        assert n_ctx is not None
        task = _int(obj, "id_task", at, -1, 2**62)
        nxt = _next_token(obj.get("next_token"), f"{at}.next_token")
        slots.append(
            Slot(
                id=slot_id,
                n_ctx=n_ctx,
                processing=_bool(obj, "is_processing", at),
                task=None if task is None or task < 0 else task,
                tokens=_int(obj, "n_prompt_tokens", at, 0, MAX_TOKENS),
                prompt_processed=_int(obj, "n_prompt_tokens_processed", at, 0, MAX_TOKENS),
                prompt_cached=_int(obj, "n_prompt_tokens_cache", at, 0, MAX_TOKENS),
                decoded=None if nxt is None else _int(nxt, "n_decoded", f"{at}.next_token", 0, MAX_TOKENS),
                remaining=None if nxt is None else _int(nxt, "n_remain", f"{at}.next_token", -1, MAX_TOKENS),
            )
        )
    return slots


def parse_props(body: bytes | str, where: str = "/props") -> Props:
    """The fields of a GET /props answer this source reads, validated."""
    doc = _object(_load(body, where), where)
    settings = doc.get("default_generation_settings")
    slot_n_ctx = None
    if settings is not None:
        slot_n_ctx = _int(_object(settings, f"{where}.default_generation_settings"), "n_ctx",
                          f"{where}.default_generation_settings", 1, MAX_TOKENS)
    build = doc.get("build_info")
    if build is not None and not isinstance(build, str):
        raise SourceError("schema", f"{where}.build_info: expected a string, got {_kind(build)}")
    if build is not None:
        build = "".join(c for c in build[:MAX_BUILD_INFO] if c.isprintable()) or None
    return Props(
        total_slots=_int(doc, "total_slots", where, 1, MAX_SLOTS),
        slot_n_ctx=slot_n_ctx,
        build_info=build,
        sleeping=_bool(doc, "is_sleeping", where, default=False),
    )
