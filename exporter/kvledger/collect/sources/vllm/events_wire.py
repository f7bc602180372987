"""vLLM's KV-event wire format, decoded: a msgpack payload -> ``EventBatch``.

Multipart ``[topic, seq (8-byte big-endian), payload]`` on a PUB socket (vLLM 0.10 to
current); payload = msgpack ``[ts, [events...], dp_rank]`` (``dp_rank`` absent -> 0).
Events are arrays tagged by their first element in 0.10-0.12
(``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]``, trailing
fields optional) and maps with a ``"type"`` key in current releases; unknown fields are
ignored, hashes are ints or bytes.

Untrusted input is bounded: a payload over ``MAX_PAYLOAD_BYTES``, an array over
``MAX_ARRAY_LEN`` items (hashes, token ids), a map over ``MAX_MAP_LEN`` keys, a hash
nested deeper than one array, or a dp_rank above ``MAX_DP_RANK`` is a decode error.
Decoding raises only ``EventDecodeError``.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import msgpack

KNOWN_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
GPU_MEDIA = (None, "GPU", "gpu", "cuda")
#: bounds on untrusted payloads (vLLM's batches per scheduler step are far smaller)
MAX_PAYLOAD_BYTES = 4 << 20
MAX_ARRAY_LEN = 1 << 20
MAX_MAP_LEN = 1 << 10
MAX_DP_RANK = 1023
#: a spec kind longer than this is not one of vLLM's (ignored); a window outside [1, 2**30] too
MAX_SPEC_KIND_CHARS = 64
MAX_WINDOW = 1 << 30

_brief = reprlib.Repr()
_brief.maxlevel, _brief.maxstring, _brief.maxother, _brief.maxlist, _brief.maxdict = 3, 40, 40, 6, 4


class EventDecodeError(ValueError):
    """A KV-event payload that does not decode; the message says what was wrong."""



@dataclass(frozen=True, slots=True)
class KvEvent:
    type: str
    hashes: tuple[Hashable, ...] = ()
    medium: str | None = None
    group: int = 0
    # the KV-cache spec of the group, as current releases' BlockStored events state it
    # (``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``); None when not stated
    spec_kind: str | None = None
    spec_window: int | None = None


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float | None
    events: tuple[KvEvent, ...]
    dp_rank: int


def _scalar_hash(h: Any) -> Hashable:
    if isinstance(h, (int, bytes, str)) and not isinstance(h, bool):
        return h
    raise EventDecodeError(f"block hash of unexpected type {type(h).__name__}: {_brief.repr(h)}")


def _hashable(h: Any) -> Hashable:
    if isinstance(h, list):  # some builds encode composite hashes as (flat) arrays
        return tuple(_scalar_hash(x) for x in h)
    return _scalar_hash(h)


def _hash_list(raw: Any, what: str) -> tuple[Hashable, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise EventDecodeError(f"{what}: block_hashes is {type(raw).__name__}, expected an array")
    kinds = set(map(type, raw))
    if kinds == {int} or kinds == {bytes}:  # the usual batch, checked at C speed
        return tuple(raw)
    return tuple(_hashable(h) for h in raw)


def _opt_str(v: Any) -> str | None:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return v if isinstance(v, str) else None


def _group(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _spec_kind(v: Any) -> str | None:
    kind = _opt_str(v)
    return kind if kind is not None and len(kind) <= MAX_SPEC_KIND_CHARS else None


def _window(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_WINDOW else None


def decode_event(raw: Any) -> KvEvent:
    """One event, array-tagged (0.10-0.12) or a map with "type" (current)."""
    if isinstance(raw, dict):
        kind = _opt_str(raw.get("type"))
        if kind is None:
            raise EventDecodeError(f"event map without a 'type' key: keys {sorted(map(str, raw))}")
        if kind == "BlockStored":
            return KvEvent(kind, _hash_list(raw.get("block_hashes"), kind), _opt_str(raw.get("medium")),
                           _group(raw.get("group_idx")), _spec_kind(raw.get("kv_cache_spec_kind")),
                           _window(raw.get("kv_cache_spec_sliding_window")))  # fmt: skip
        if kind == "BlockRemoved":
            return KvEvent(kind, _hash_list(raw.get("block_hashes"), kind), _opt_str(raw.get("medium")),
                           _group(raw.get("group_idx")))
        return KvEvent(kind, (), _opt_str(raw.get("medium")))
    if isinstance(raw, list) and raw:
        kind = _opt_str(raw[0])
        if kind is None:
            raise EventDecodeError(f"event array whose first element is not a type name: {_brief.repr(raw[0])}")
        if kind == "BlockStored":
            # [tag, hashes, parent, token_ids, block_size, lora_id?, medium?, ...]
            medium = _opt_str(raw[6]) if len(raw) > 6 else None
            return KvEvent(kind, _hash_list(raw[1] if len(raw) > 1 else None, kind), medium)
        if kind == "BlockRemoved":
            # [tag, hashes, medium?, ...]
            medium = _opt_str(raw[2]) if len(raw) > 2 else None
            return KvEvent(kind, _hash_list(raw[1] if len(raw) > 1 else None, kind), medium)
        return KvEvent(kind)
    raise EventDecodeError(f"event is neither a tagged array nor a map: {_brief.repr(raw)}")


def decode_batch(payload: bytes) -> EventBatch:
    """A msgpack batch ``[ts, [events], dp_rank?]`` (a map with ts/events/data_parallel_rank also accepted)."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise EventDecodeError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        raw = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=False,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
        )
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise EventDecodeError(f"payload is not msgpack: {str(exc)[:200] or type(exc).__name__}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise EventDecodeError(f"batch is not [ts, [events], dp_rank]: {_brief.repr(raw)}")
    if not isinstance(events, list):
        raise EventDecodeError(f"batch events is {type(events).__name__}, expected an array")
    if rank is None:
        rank = 0
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= MAX_DP_RANK:
        raise EventDecodeError(f"batch dp_rank is not an integer in [0, {MAX_DP_RANK}]: {_brief.repr(rank)}")
    stamp = float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else None
    return EventBatch(stamp if stamp is not None and math.isfinite(stamp) else None,
                      tuple(decode_event(e) for e in events), rank)
