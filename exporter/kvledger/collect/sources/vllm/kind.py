"""The ``vllm`` engine kind's registration: its source class, its own configuration keys,
its rules and its page (kvledger.config.engine_kinds). Imported, one line, by
kvledger.collect.sources.kinds."""

from __future__ import annotations

from kvledger.collect.sources.vllm.source import VllmSource
from kvledger.config.engine_kinds import EngineKind, Option, register

register(EngineKind(
    name="vllm",
    source=VllmSource,
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
