"""Every engine kind kvledger reads, one registration each.

A registration names the configuration keys that only this kind accepts, the admission
and overflow rules of the engine when neither the engine nor the configuration says, and
the kind's documentation page. The configuration loader, the merge of configured facts and
the generated docs derive everything from this table; the kind's source class is named, by
reference, in ``kvledger.collect.sources.registry.SOURCES`` (the sources read the
configuration, so the configuration cannot import them). A new engine kind is a new source
folder, one ``register(...)`` here and its class in ``SOURCES`` (docs/adding-an-engine.md).

This module imports nothing but the facts' words: the loader reads it to validate a file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvledger.domain.facts import Admission, Overflow


@dataclass(frozen=True)
class Option:
    """A configuration key only this kind accepts; the loader checks it by ``value``:
    ``address`` (tcp://, ipc://, http(s):// or unix:///absolute/path), ``zmq`` (a ZMQ endpoint:
    tcp://HOST:PORT or ipc:///path), ``path`` (a file),
    ``boolean`` (true or false, kept as the text "true" or "false"), ``tokens`` (a whole
    number of tokens, 1 .. 2**30, kept as its decimal text) or ``steps`` (a whole number of
    engine steps, 1 .. 2**30, kept as its decimal text)."""

    name: str
    value: Literal["address", "zmq", "path", "boolean", "tokens", "steps"]
    help: str


@dataclass(frozen=True)
class EngineKind:
    name: str  # the ``kind:`` value in the configuration
    options: tuple[Option, ...]  # configuration keys that only this kind accepts (cfg.option(name))
    admission: Admission | None  # the engine's rule, when neither it nor the config says
    overflow: Overflow | None
    docs: str  # the kind's page, relative to the repository root
    summary: str  # one line for error messages and the table of kinds (docs/engines/index.md)


KINDS: dict[str, EngineKind] = {}

#: kinds on the roadmap: named in the error for an unknown kind, never accepted
PLANNED: tuple[str, ...] = ()


def register(kind: EngineKind) -> None:
    if kind.name in KINDS:
        raise ValueError(f"engine kind {kind.name!r} is registered twice")
    KINDS[kind.name] = kind


def kind_specific_keys() -> dict[str, tuple[str, ...]]:
    """Each kind-specific configuration key and the kinds that accept it (``ledger``: the
    kinds with an in-engine plugin)."""
    owners: dict[str, tuple[str, ...]] = {}
    for kind in KINDS.values():
        for o in kind.options:
            owners[o.name] = (*owners.get(o.name, ()), kind.name)
    return owners


register(EngineKind(
    name="ledger",
    options=(),
    admission=None,  # the document says; absent means unknown
    overflow=None,
    docs="docs/ledger.md",
    summary="a kvledger/v1 document over HTTP(S) or a Unix socket (exact)",
))

register(EngineKind(
    name="vllm",
    options=(
        Option("kv_events", "zmq", "the ZMQ publisher of KV events (--kv-events-config endpoint)"),
        Option("kv_events_replay", "zmq", "the ZMQ replay endpoint (replay_endpoint)"),
        Option("log_file", "path", "the server's log, for the startup memory profile"),
        Option("ledger", "address", "the in-engine integration's kvledger/v1 address (KVLEDGER_VLLM_LEDGER; {dp_rank} per rank)"),
    ),
    admission="dynamic",  # vLLM admits against free blocks, not a reservation
    overflow="preempt-recompute",
    docs="docs/engines/vllm.md",
    summary="vLLM: /metrics, optional KV events (ZMQ), startup log and in-engine ledger (exact)",
))

register(EngineKind(
    name="sglang",
    options=(
        Option("server_info_url", "address",
               "GET /server_info (older builds: /get_server_info), for page_size on builds whose /metrics has "
               "no sglang:page_size and for --decode-log-interval (default: /server_info beside url)"),
        Option("decode_log_interval", "steps",
               "the server's --decode-log-interval, when /server_info cannot be read (SGLang refreshes its "
               "KV gauges every this many decode steps)"),
        Option("ledger", "address", "the kvledger SGLang plugin's kvledger/v1 address (KVLEDGER_SGLANG_LEDGER; {dp_rank} per rank)"),
    ),
    admission="dynamic",  # SGLang allocates on demand and retracts (recomputes) under pressure
    overflow="preempt-recompute",
    docs="docs/engines/sglang.md",
    summary="SGLang's /metrics (--enable-metrics): KV tokens in pages, sliding-window and mamba pools apart; "
            "with the plugin's ledger, exact",
))

register(EngineKind(
    name="trtllm",
    options=(),
    admission="reserve-cap",  # the default GUARANTEED_NO_EVICT scheduler; MAX_UTILIZATION: set admission: dynamic
    overflow="preempt-recompute",  # MAX_UTILIZATION pauses requests (blocks freed, recomputed later)
    docs="docs/engines/trtllm.md",
    summary="trtllm-serve's GET /prometheus/metrics (never the destructive JSON /metrics)",
))

register(EngineKind(
    name="triton-trtllm",
    options=(),
    admission="reserve-cap",  # the backend's default batch_scheduler_policy guaranteed_no_evict
    overflow="preempt-recompute",
    docs="docs/engines/triton-trtllm.md",
    summary="Triton's /metrics (port 8002) with the TensorRT-LLM backend's nv_trt_llm_* families",
))

register(EngineKind(
    name="tgi",
    options=(
        Option("block_size", "tokens",
               "tokens per KV block of TGI's attention backend (flashinfer 1, the default; paged 16; flashdecoding 256)"),
    ),
    admission="reserve-cap",  # TGI reserves input + max_new_tokens up front and never preempts
    overflow="reject",
    docs="docs/engines/tgi.md",
    summary="TGI's /metrics: the running batch's reservation and the warmed-up token capacity",
))

register(EngineKind(
    name="llamacpp",
    options=(
        Option("slots_url", "address", "GET /slots, when not the server's base URL + /slots"),
        Option("props_url", "address", "GET /props, when not the server's base URL + /props"),
        Option("kv_unified", "boolean", "true when the slots share one KV buffer (--kv-unified, or -np unset)"),
        Option("kv_size", "tokens", "the KV buffer in tokens, when the slots' n_ctx do not add up to it"),
    ),
    admission="reserve-cap",  # each busy slot holds its whole context (kv_unified: dynamic)
    overflow="reject",  # a prompt over the slot context is refused; generation stops at it
    docs="docs/engines/llamacpp.md",
    summary="a stock llama.cpp server: /slots, /props and /metrics (--metrics)",
))
