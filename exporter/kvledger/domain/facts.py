"""The Snapshot: normalized facts gathered from the sources.

Sources fill these dataclasses and never compute policy numbers; the policy module
(``kvledger.policy``) turns a Snapshot into Accounts. A field left as ``None`` is *unknown*:
it produces no series, never a zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

# the words of the wire format are the engine-side library's (one spelling for producers and the reader)
from kvledger_engine.wire_terms import (
    ADMISSIONS as ADMISSIONS,
)
from kvledger_engine.wire_terms import (
    BUDGET_CATEGORIES as BUDGET_CATEGORIES,
)
from kvledger_engine.wire_terms import (
    CHUNKED_LOCAL_ATTENTION as CHUNKED_LOCAL_ATTENTION,
)
from kvledger_engine.wire_terms import (
    COUNTER_NAMES as COUNTER_NAMES,
)
from kvledger_engine.wire_terms import (
    FULL_ATTENTION as FULL_ATTENTION,
)
from kvledger_engine.wire_terms import (
    GROUP_HOLDINGS as GROUP_HOLDINGS,
)
from kvledger_engine.wire_terms import (
    GROUP_KINDS as GROUP_KINDS,
)
from kvledger_engine.wire_terms import (
    GROUPS as GROUPS,
)
from kvledger_engine.wire_terms import (
    LIMIT_KINDS as LIMIT_KINDS,
)
from kvledger_engine.wire_terms import (
    MAMBA as MAMBA,
)
from kvledger_engine.wire_terms import (
    OUTPUT_BOUNDS as OUTPUT_BOUNDS,
)
from kvledger_engine.wire_terms import (
    OVERFLOWS as OVERFLOWS,
)
from kvledger_engine.wire_terms import (
    REQUEST_STATES as REQUEST_STATES,
)
from kvledger_engine.wire_terms import (
    SLIDING_WINDOW as SLIDING_WINDOW,
)
from kvledger_engine.wire_terms import (
    STATE_GROUP_KINDS as STATE_GROUP_KINDS,
)
from kvledger_engine.wire_terms import (
    TERM_SOURCES as TERM_SOURCES,
)
from kvledger_engine.wire_terms import (
    WINDOW_GROUP_KINDS as WINDOW_GROUP_KINDS,
)
from kvledger_engine.wire_terms import (
    Admission as Admission,
)
from kvledger_engine.wire_terms import (
    GroupHolding as GroupHolding,
)
from kvledger_engine.wire_terms import (
    LimitKind as LimitKind,
)
from kvledger_engine.wire_terms import (
    OutputBound as OutputBound,
)
from kvledger_engine.wire_terms import (
    Overflow as Overflow,
)
from kvledger_engine.wire_terms import (
    RequestState as RequestState,
)
from kvledger_engine.wire_terms import (
    TermSource as TermSource,
)

Sharing = Literal["per-request", "reference-aware"]
NvmlEnabled = Literal["auto", "true", "false"]

# The value tuples below spell out their Literal (tests/test_type_gate.py checks they agree).

SHARINGS: tuple[Sharing, ...] = ("per-request", "reference-aware")
NVML_ENABLED: tuple[NvmlEnabled, ...] = ("auto", "true", "false")


@dataclass(frozen=True, slots=True)
class BlockRef:
    """One physical block: its id, reference count and whether it holds cached (hashed) data."""

    block_id: int
    ref_count: int
    cached: bool




@dataclass(frozen=True, slots=True)
class KvGroupFacts:
    """One KV-cache group sharing a pool (a hybrid model's layers of one type): a block of
    the pool belongs to one group at a time, and every request holds blocks in every group.

    ``window``: tokens a sliding window or a local-attention chunk spans (None for full
    attention and state groups); ``state_blocks``: blocks one context's state takes in a
    state (Mamba, linear-attention) group; ``in_use``: distinct blocks the group's requests
    reference now, when the engine states it."""

    id: str
    kind: str  # one of GROUP_KINDS
    window: int | None = None
    state_blocks: int | None = None
    in_use: int | None = None


@dataclass(frozen=True, slots=True)
class AdmissionEstimate:
    """The engine's own bet on what its running requests will still take (SGLang admits
    against ``new_token_ratio`` x each running request's remaining output, that remainder
    clipped at ``output_clip`` tokens): stated beside the declared policy, never in it."""

    new_token_ratio: float
    output_clip: int


@dataclass(slots=True)
class PoolFacts:
    """One KV pool of an engine. Capacity fields are required; the rest may be unknown."""

    id: str
    block_size: int  # tokens per block (B)
    num_blocks: int  # capacity in blocks (C)
    block_bytes: int | None = None  # bytes of one block over all layers and TP ranks
    sliding_window: int | None = None  # tokens, or None
    # Physical state as the source reports it (exact when given).
    in_use: int | None = None
    # Bounds (lower, upper) on in_use when the engine's reading gives no exact count (a
    # ratio that is no whole number of blocks): used only while in_use is unknown.
    in_use_bounds: tuple[int, int] | None = None
    reclaimable: int | None = None
    free: int | None = None
    references: int | None = None
    shared: int | None = None
    # Per-block detail; when present the policy derives the physical state from it.
    block_refs: Sequence[BlockRef] | None = None  # a BlockRefArray for large ledgers
    # Blocks holding cached (hashed) data, referenced or not (e.g. from KV events).
    cached_blocks: int | None = None
    # Blocks no request references, free and reclaimable together, as an engine states
    # them when its "free" count includes reusable cached blocks (TensorRT-LLM's free
    # blocks): the policy takes free + reclaimable = this exactly and bounds each by it.
    unreferenced_blocks: int | None = None
    # Blocks the engine states it has reserved for its admitted requests when individual
    # requests are unknown, each request counted alone (TGI's tgi_batch_current_max_tokens
    # / block size; llama.cpp's busy slots x their n_ctx with split slots): the per-request
    # reservation exactly; under reference-aware sharing exact when no block is shared
    # (shared == 0), else an upper bound. It takes precedence over the running-count bound.
    reserved_blocks: int | None = None
    # The engine's own claim of used blocks (for the consistency alert).
    engine_reported_used_blocks: float | None = None
    # Admitted requests known only as a count (when individual requests are unknown):
    # the policy bounds reservations with it.
    running_requests: int | None = None
    # Computed tokens the engine threw away by preempting requests of this pool (cumulative:
    # they must be recomputed); None: unknown.
    preempted_tokens: int | None = None
    # The engine's admission estimate (SGLang's new_token_ratio), when it states one.
    admission_estimate: AdmissionEstimate | None = None
    # Number of layer groups sharing this pool (hybrid models); token capacity = C // groups * B.
    layer_groups: int = 1
    # The KV-cache groups sharing this pool, when the engine states them (hybrid models):
    # R(r) is then the sum of every group's reservation (docs/design.md, "Hybrid models").
    groups: tuple[KvGroupFacts, ...] = ()
    # Blocks one request at max_model_len takes, as the engine itself sizes it (vLLM:
    # num_gpu_blocks / kv_cache_max_concurrency, summed over its KV-cache groups): the
    # reservation bound from a count of running requests takes at least this per request.
    engine_request_blocks: int | None = None
    # Checks the source found violated by this poll's raw values, which it therefore left
    # unknown (e.g. vLLM's KV usage outside [0, 1]); the policy counts them as invariant
    # violations like its own.
    source_violations: tuple[str, ...] = ()


@dataclass(slots=True)
class RequestFacts:
    id: str
    state: RequestState
    prompt_tokens: int
    max_output_tokens: int
    output_bound: OutputBound = "cap"
    pool: str = "0"
    tenant: str | None = None
    generated_tokens: int = 0
    computed_tokens: int = 0
    contexts: int = 1
    speculative_slots: int = 0
    blocks_held: int = 0
    block_ids: list[int] | None = None


@dataclass(slots=True)
class RequestCounts:
    """Request counts when individual requests are not known (e.g. from /metrics)."""

    running: int | None = None
    waiting: int | None = None
    preempted: int | None = None


@dataclass(slots=True)
class Budgets:
    max_num_batched_tokens: int | None = None
    iteration_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    # tokens scheduled over the engine's recent iterations and how many (its short window;
    # the token_budget saturation is their mean over max_num_batched_tokens)
    window_scheduled_tokens: int | None = None
    window_iterations: int | None = None


@dataclass(frozen=True, slots=True)
class MemoryTerm:
    """One term of a GPU's memory budget declared by an engine (or its config)."""

    gpu: int
    category: str  # one of BUDGET_CATEGORIES
    bytes: int
    source: TermSource


@dataclass(frozen=True, slots=True)
class Limit:
    value: float
    kind: LimitKind


@dataclass(slots=True)
class HostFacts:
    output_buffer_bytes: int | None = None
    output_buffer_limit: Limit | None = None
    network_queue_depth: int | None = None
    network_queue_limit: Limit | None = None
    socket_send_queue_bytes: int | None = None
    socket_receive_queue_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class TenantQuota:
    name: str
    quota_bytes: int


@dataclass(slots=True)
class EngineFacts:
    """Everything known about one engine instance (one `engine` label)."""

    name: str
    kind: str
    source: str  # the primary source kind ("ledger", "vllm", ...)
    version: str | None = None
    # when the writer last published the state its kvledger/v1 document shows (Unix time, the
    # writer's clock): a document whose age grows while requests run is no longer exact
    published_at: float | None = None
    admission: Admission | None = None
    overflow: Overflow | None = None
    budgets: Budgets = field(default_factory=Budgets)
    pools: list[PoolFacts] = field(default_factory=list)
    # Individual requests when the source knows them (exact accounting); None = unknown.
    # (a RequestTable, columns, when read from a kvledger/v1 document)
    requests: Sequence[RequestFacts] | None = None
    # Counts when only aggregate numbers are known (used when `requests` is None).
    request_counts: RequestCounts | None = None
    # Cumulative counters reported by the engine, keyed by COUNTER_NAMES; absent = unknown.
    counters: dict[str, float] = field(default_factory=dict)
    memory: list[MemoryTerm] = field(default_factory=list)
    # Memory the engine's runtime reports holding, by kind (gpu, cpu, pinned: TensorRT-LLM's
    # memory counters), in bytes as the engine counts it: shown beside the device budget,
    # never added to it.
    reported_memory: dict[str, int] = field(default_factory=dict)
    host: HostFacts = field(default_factory=HostFacts)
    tenants: list[TenantQuota] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # engine processes, for NVML attribution
    # Exporter-side cumulative counts, maintained by sources (not by the engine).
    kv_events: dict[str, int] = field(default_factory=dict)  # by event type
    kv_events_lost: int | None = None


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    used_bytes: int | None  # None: NVML could not tell


@dataclass(slots=True)
class GpuFacts:
    index: int
    up: bool
    uuid: str | None = None
    name: str | None = None
    mig: bool = False
    total_bytes: int | None = None
    used_bytes: int | None = None
    free_bytes: int | None = None
    driver_reserved_bytes: int | None = None
    processes: list[GpuProcess] | None = None  # None: unknown (e.g. NotSupported)


@dataclass(slots=True)
class SourceHealth:
    engine: str  # engine name, or "" for node-wide sources (nvml)
    source: str  # source kind
    up: bool
    reason: str | None = None  # why it is down, human-readable
    last_success: float | None = None  # unix seconds
    duration_seconds: float | None = None
    errors: dict[str, int] = field(default_factory=dict)  # cumulative, by reason class
    # a kvledger/v1 document's age at its latest read (published_at against the server's clock)
    document_age_seconds: float | None = None
    # engine steps between the engine's own refreshes of the figures this source reads (SGLang's
    # --decode-log-interval); None: every read is current, or unknown
    refresh_interval_steps: int | None = None


@dataclass(slots=True)
class Snapshot:
    engines: list[EngineFacts] = field(default_factory=list)
    gpus: list[GpuFacts] = field(default_factory=list)
    driver_version: str | None = None
    health: list[SourceHealth] = field(default_factory=list)
    sharing: Sharing = "per-request"
    taken_at: float = 0.0
