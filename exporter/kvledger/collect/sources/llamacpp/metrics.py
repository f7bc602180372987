"""llama.cpp's /metrics (``--metrics``): Prometheus text, prefix ``llamacpp:``, no labels.

Series read (tools/server/server-task.cpp, ``server_task_result_metrics::to_metrics``):

- counters ``llamacpp:prompt_tokens_total`` (prompt tokens evaluated, cached ones
  excluded) and, in current builds, ``llamacpp:prompt_tokens_cached_total`` (prompt tokens
  reused from a slot's cache);
- gauges ``llamacpp:requests_processing`` (busy slots) and ``llamacpp:requests_deferred``
  (requests queued for a free slot);
- counters ``llamacpp:tokens_predicted_total`` and ``llamacpp:n_decode_total``, only to
  tell that nothing happened since the last read of /slots (``idle_key``);
- builds before May 2025 only (removed by ggml-org/llama.cpp#13660):
  ``llamacpp:kv_cache_usage_ratio`` (used KV cells / the ``-c`` context) and
  ``llamacpp:kv_cache_tokens``.

Everything else (throughput gauges, timing counters,
``n_tokens_max``, speculative decoding counters) is ignored. A missing series is unknown,
never zero. Values must be finite; counters and counts non-negative and at most
2**53 - 1, counts whole; anything else is ``SourceError("parse")`` naming the series. A
ratio outside [0, 1] is no parse error: the mapping leaves the claim unknown and reports
the violated check.

The server prints every value with C++'s default stream precision (6 significant digits):
a counter past 999,999 reads ``1.23457e+06``. Such values are taken as printed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.prom_text import Exposition, parse_exposition
from kvledger.domain.limits import MAX_SAFE_INT

PREFIX = "llamacpp:"
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
PROMPT_TOKENS_CACHED = PREFIX + "prompt_tokens_cached_total"
PREDICTED = PREFIX + "tokens_predicted_total"
DECODES = PREFIX + "n_decode_total"
PROCESSING = PREFIX + "requests_processing"
DEFERRED = PREFIX + "requests_deferred"
KV_USAGE_RATIO = PREFIX + "kv_cache_usage_ratio"  # builds before #13660
KV_TOKENS = PREFIX + "kv_cache_tokens"  # builds before #13660


@dataclass(frozen=True, slots=True)
class ServerMetrics:
    prompt_tokens: float | None = None
    prompt_tokens_cached: float | None = None
    tokens_predicted: float | None = None
    decodes: float | None = None  # n_decode_total
    processing: int | None = None
    deferred: int | None = None
    kv_usage_ratio: float | None = None  # old builds
    kv_tokens: int | None = None  # old builds


def idle_key(m: ServerMetrics) -> tuple[float | None, ...] | None:
    """What /metrics says of a server with nothing to do: no busy slot, nothing deferred, and
    the counters that any prompt, decode or generated token moves; None when it is busy or
    does not say. Two equal keys mean the slots did not change in between (a prompt or a
    token moves a counter), save for slot actions (erase, restore) that decode nothing."""
    if m.processing != 0 or m.deferred != 0 or None in (m.prompt_tokens, m.tokens_predicted, m.decodes):
        return None
    return (m.prompt_tokens, m.prompt_tokens_cached, m.tokens_predicted, m.decodes)


def _one(exp: Exposition, name: str, kind: str) -> float | None:
    """The value of an unlabelled series: ``counter`` (>= 0), ``count`` (whole, >= 0) or
    ``ratio`` (finite); None when absent. Repeated samples: SourceError."""
    found = exp.get(name)
    if not found:
        return None
    if len(found) > 1:
        raise SourceError("parse", f"{name}: {len(found)} samples, expected one")
    v = found[0].value
    if not math.isfinite(v):
        problem = "is not finite"
    elif kind == "ratio":
        return v
    elif v < 0:
        problem = "is negative"
    elif v > MAX_SAFE_INT:
        problem = f"exceeds {MAX_SAFE_INT}"
    elif kind == "count" and not v.is_integer():
        problem = "is not a whole number"
    else:
        return v
    raise SourceError("parse", f"{name}: value {v!r} {problem}")


def _count(exp: Exposition, name: str) -> int | None:
    v = _one(exp, name, "count")
    return None if v is None else int(v)


def parse_metrics(text: str, deadline: float | None = None) -> ServerMetrics:
    """The series of llama.cpp's /metrics this source reads (see the module doc); the parse
    stops at ``deadline`` (time.monotonic()) with SourceError("timeout")."""
    exp = parse_exposition(text, deadline)
    return ServerMetrics(
        prompt_tokens=_one(exp, PROMPT_TOKENS, "counter"),
        prompt_tokens_cached=_one(exp, PROMPT_TOKENS_CACHED, "counter"),
        tokens_predicted=_one(exp, PREDICTED, "counter"),
        decodes=_one(exp, DECODES, "counter"),
        processing=_count(exp, PROCESSING),
        deferred=_count(exp, DEFERRED),
        kv_usage_ratio=_one(exp, KV_USAGE_RATIO, "ratio"),
        kv_tokens=_count(exp, KV_TOKENS),
    )
