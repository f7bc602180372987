"""The ``kind: trtllm`` source: GET ``cfg.url`` (trtllm-serve's /prometheus/metrics) through the HTTP client and map
it with ``trtllm_facts``; every failure is a SourceError with its reason."""

from __future__ import annotations

import time

from kvledger.collect.sources.base import EngineContribution, Source, SourceError
from kvledger.collect.sources.http_client import HttpClient, redact_url
from kvledger.collect.sources.prom_text import parse_exposition
from kvledger.collect.sources.trtllm.metrics import trtllm_facts
from kvledger.config.types import EngineConfig


class TrtllmSource(Source):
    kind = "trtllm"

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg, self.engine = cfg, cfg.name
        if cfg.url.rstrip("/").endswith("/metrics") and not cfg.url.rstrip("/").endswith("/prometheus/metrics"):
            # trtllm-serve's JSON /metrics hands out its iteration statistics once: a poll would
            # take them from whoever else reads them. Only GET /prometheus/metrics is read.
            raise SourceError("config", f"engine {cfg.name!r}: url {redact_url(cfg.url)} is trtllm-serve's JSON /metrics, "
                                        "which removes what it returns; use GET /prometheus/metrics")
        self._http = HttpClient(cfg.url, timeout=cfg.timeout_seconds, max_bytes=cfg.max_response_bytes, max_lines=cfg.max_response_lines,
                                accept="text/plain;version=0.0.4", auth=cfg.client_auth)

    def poll(self) -> EngineContribution:
        deadline = time.monotonic() + self.cfg.timeout_seconds  # the collector's, for the parse too
        return EngineContribution(trtllm_facts(parse_exposition(self._http.get_text(), deadline), self.cfg))

    def close(self) -> None:
        self._http.abort()
