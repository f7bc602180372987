"""The ``triton-trtllm`` engine kind's registration: its source class, its own configuration keys,
its rules and its page (kvledger.config.engine_kinds). Imported, one line, by
kvledger.collect.sources.kinds."""

from __future__ import annotations

from kvledger.collect.sources.triton_trtllm.source import TritonTrtllmSource
from kvledger.config.engine_kinds import EngineKind, register

register(EngineKind(
    name="triton-trtllm",
    source=TritonTrtllmSource,
    options=(),
    admission="reserve-cap",  # the backend's default batch_scheduler_policy guaranteed_no_evict
    overflow="preempt-recompute",
    docs="docs/engines/triton-trtllm.md",
    summary="Triton's /metrics (port 8002) with the TensorRT-LLM backend's nv_trt_llm_* families",
))
