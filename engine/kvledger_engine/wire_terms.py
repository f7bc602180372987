"""The words of the kvledger/v1 document: every enumeration a producer may write and the
daemon reads (its ``model.facts`` takes them from here, so both sides spell them once).

The value tuples spell out their Literal (tests/test_type_gate.py checks they agree).
"""

from __future__ import annotations

from typing import Literal

SCHEMA_ID = "kvledger/v1"
#: the media type of the columnar form (``request_columns``), which a reader asks for in
#: its Accept header and ``document_server`` answers with
COLUMNS_MEDIA_TYPE = "application/vnd.kvledger.v1.columns+json"

RequestState = Literal["running", "waiting", "preempted"]
OutputBound = Literal["cap", "estimate"]
Admission = Literal["reserve-cap", "dynamic"]
Overflow = Literal["preempt-recompute", "reject", "swap", "unknown"]
TermSource = Literal["measured", "configured", "estimate"]
LimitKind = Literal["hard", "estimate"]

ADMISSIONS: tuple[Admission, ...] = ("reserve-cap", "dynamic")
OVERFLOWS: tuple[Overflow, ...] = ("preempt-recompute", "reject", "swap", "unknown")
REQUEST_STATES: tuple[RequestState, ...] = ("running", "waiting", "preempted")
OUTPUT_BOUNDS: tuple[OutputBound, ...] = ("cap", "estimate")
BUDGET_CATEGORIES: tuple[str, ...] = ("weights", "workspace", "runtime_buffers", "reserve", "kv_pool")
TERM_SOURCES: tuple[TermSource, ...] = ("measured", "configured", "estimate")
LIMIT_KINDS: tuple[LimitKind, ...] = ("hard", "estimate")
COUNTER_NAMES: tuple[str, ...] = (
    "preemptions",
    "reservation_overflows",
    "admission_rechecks_accepted",
    "admission_rechecks_rejected",
    "reservation_leaks",
    "prefix_cache_queried_tokens",  # prompt tokens looked up in the prefix cache
    "prefix_cache_hit_tokens",  # of those, tokens found cached
    "host_offloaded_tokens",  # tokens moved from the GPU pool to a host (CPU) tier (SGLang HiCache)
    "host_loaded_tokens",  # tokens loaded back from the host tier into the GPU pool
)
