"""The ``sglang`` engine kind's registration: its source class, its own configuration keys,
its rules and its page (kvledger.config.engine_kinds). Imported, one line, by
kvledger.collect.sources.kinds."""

from __future__ import annotations

from kvledger.collect.sources.sglang.source import SglangSource
from kvledger.config.engine_kinds import EngineKind, Option, register

register(EngineKind(
    name="sglang",
    source=SglangSource,
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
