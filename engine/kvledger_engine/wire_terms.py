"""The words of the kvledger/v1 document: every enumeration a producer may write and the
daemon reads (its ``domain.facts`` takes them from here, so both sides spell them once), and
the numeric ranges of a request's fields (``domain.limits`` takes them from here).

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
#: how a KV-cache group holds blocks, which decides its reservation (the daemon's
#: ``policy.reservations``, one formula each): ``tokens``, a block per block_size tokens of
#: the context (every block); ``window``, at most the blocks its ``window`` of tokens spans;
#: ``state``, ``state_blocks`` per context whatever its length
GroupHolding = Literal["tokens", "window", "state"]
GROUP_HOLDINGS: tuple[GroupHolding, ...] = ("tokens", "window", "state")
#: the layer types of a KV-cache group sharing a pool (vLLM's KV-cache specs, by what they hold)
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
MAMBA = "mamba"
#: every group kind and how it holds blocks: a new group kind is one entry here (the reader,
#: the policy, the label vocabulary and the exposition take it from this table;
#: tests/test_wire_once.py adds one)
GROUPS: dict[str, GroupHolding] = {
    FULL_ATTENTION: "tokens",
    SLIDING_WINDOW: "window",
    CHUNKED_LOCAL_ATTENTION: "window",
    MAMBA: "state",
}
GROUP_KINDS: tuple[str, ...] = tuple(GROUPS)
#: the group kinds that hold a span of tokens (a group's ``window``, required) rather than every block
WINDOW_GROUP_KINDS: tuple[str, ...] = tuple(k for k, holding in GROUPS.items() if holding == "window")
#: the group kinds that hold a state per context (a group's ``state_blocks``, default 1)
STATE_GROUP_KINDS: tuple[str, ...] = tuple(k for k, holding in GROUPS.items() if holding == "state")
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

#: the largest integer a double holds exactly: every count on the wire stays within it
MAX_SAFE_INT = 2**53 - 1
#: token counts and budgets (P + O + k stays small)
MAX_TOKENS = 2**30
#: blocks of one pool
MAX_BLOCKS = 2**32
#: contexts (n) of one request
MAX_CONTEXTS = 1024

#: the integer fields of a request (kvledger/v1 ``requests[]`` and ``request_columns``):
#: name -> (minimum, maximum); ``prompt_tokens`` and ``max_output_tokens`` are required
REQUEST_INT_RANGES: dict[str, tuple[int, int]] = {
    "prompt_tokens": (0, MAX_TOKENS),
    "max_output_tokens": (0, MAX_TOKENS),
    "generated_tokens": (0, MAX_TOKENS),
    "computed_tokens": (0, MAX_TOKENS),
    "contexts": (1, MAX_CONTEXTS),
    "speculative_slots": (0, MAX_TOKENS),
    "blocks_held": (0, MAX_BLOCKS),
}
