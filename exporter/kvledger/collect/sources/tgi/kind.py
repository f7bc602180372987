"""The ``tgi`` engine kind's registration: its source class, its own configuration keys,
its rules and its page (kvledger.config.engine_kinds). Imported, one line, by
kvledger.collect.sources.kinds."""

from __future__ import annotations

from kvledger.collect.sources.tgi.source import TgiSource
from kvledger.config.engine_kinds import EngineKind, Option, register

register(EngineKind(
    name="tgi",
    source=TgiSource,
    options=(
        Option("block_size", "tokens",
               "tokens per KV block of TGI's attention backend (flashinfer 1, the default; paged 16; flashdecoding 256)"),
    ),
    admission="reserve-cap",  # TGI reserves input + max_new_tokens up front and never preempts
    overflow="reject",
    docs="docs/engines/tgi.md",
    summary="TGI's /metrics: the running batch's reservation and the warmed-up token capacity",
))
