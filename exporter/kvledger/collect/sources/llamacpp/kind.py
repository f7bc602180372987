"""The ``llamacpp`` engine kind's registration: its source class, its own configuration keys,
its rules and its page (kvledger.config.engine_kinds). Imported, one line, by
kvledger.collect.sources.kinds."""

from __future__ import annotations

from kvledger.collect.sources.llamacpp.source import LlamacppSource
from kvledger.config.engine_kinds import EngineKind, Option, register

register(EngineKind(
    name="llamacpp",
    source=LlamacppSource,
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
