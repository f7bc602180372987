"""The ``ledger`` engine kind's registration: its source class, its own configuration keys,
its rules and its page (kvledger.config.engine_kinds). Imported, one line, by
kvledger.collect.sources.kinds."""

from __future__ import annotations

from kvledger.collect.sources.document import LedgerSource
from kvledger.config.engine_kinds import EngineKind, register

register(EngineKind(
    name="ledger",
    source=LedgerSource,
    options=(),
    admission=None,  # the document says; absent means unknown
    overflow=None,
    docs="docs/ledger.md",
    summary="a kvledger/v1 document over HTTP(S) or a Unix socket (exact)",
))
