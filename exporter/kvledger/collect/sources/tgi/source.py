"""The ``kind: tgi`` source: GET ``cfg.url`` (TGI's /metrics) through the HTTP client and map
it with ``tgi_facts``; every failure is a SourceError with its reason."""

from __future__ import annotations

import time

from kvledger.collect.sources.base import EngineContribution, Source
from kvledger.collect.sources.http_client import HttpClient
from kvledger.collect.sources.prom_text import parse_exposition
from kvledger.collect.sources.tgi.metrics import tgi_facts
from kvledger.config.types import EngineConfig


class TgiSource(Source):
    kind = "tgi"

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg, self.engine = cfg, cfg.name
        self._http = HttpClient(cfg.url, timeout=cfg.timeout_seconds, max_bytes=cfg.max_response_bytes, max_lines=cfg.max_response_lines,
                                accept="text/plain;version=0.0.4", auth=cfg.client_auth)

    def poll(self) -> EngineContribution:
        deadline = time.monotonic() + self.cfg.timeout_seconds  # the collector's, for the parse too
        return EngineContribution(tgi_facts(parse_exposition(self._http.get_text(), deadline), self.cfg))

    def close(self) -> None:
        self._http.abort()
