"""The ``trtllm`` engine kind's registration: its source class, its own configuration keys,
its rules and its page (kvledger.config.engine_kinds). Imported, one line, by
kvledger.collect.sources.kinds."""

from __future__ import annotations

from kvledger.collect.sources.trtllm.source import TrtllmSource
from kvledger.config.engine_kinds import EngineKind, register

register(EngineKind(
    name="trtllm",
    source=TrtllmSource,
    options=(),
    admission="reserve-cap",  # the default GUARANTEED_NO_EVICT scheduler; MAX_UTILIZATION: set admission: dynamic
    overflow="preempt-recompute",  # MAX_UTILIZATION pauses requests (blocks freed, recomputed later)
    docs="docs/engines/trtllm.md",
    summary="trtllm-serve's GET /prometheus/metrics (never the destructive JSON /metrics)",
))
