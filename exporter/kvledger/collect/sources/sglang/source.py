"""The ``kind: sglang`` source: GET ``cfg.url`` (SGLang's /metrics) and map it with
``sglang_facts``. With ``server_info_url`` (GET /get_server_info), the server's
``page_size`` is read once and used when /metrics does not export ``sglang:page_size``
(builds before the kv_* token gauges); a failure to read it fails the poll with the reason.
"""

from __future__ import annotations

import json
from typing import Any

from kvledger.collect.sources.base import EngineContribution, Source, SourceError
from kvledger.collect.sources.http_client import HttpClient
from kvledger.collect.sources.prom_text import parse_exposition
from kvledger.collect.sources.sglang.metrics import PAGE_SIZE, sglang_facts
from kvledger.config.model import EngineConfig
from kvledger.model.limits import MAX_TOKENS


def page_size_from_server_info(body: str, where: str) -> int:
    """``page_size`` of SGLang's /get_server_info JSON (the server arguments)."""
    try:
        doc: Any = json.loads(body)
    except (ValueError, RecursionError):
        raise SourceError("parse", f"{where}: not a JSON document") from None
    if not isinstance(doc, dict):
        raise SourceError("schema", f"{where}: expected a JSON object, got {type(doc).__name__}")
    value = doc.get("page_size")
    if value is None:  # SGLang's default (--page-size 1)
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise SourceError("schema", f"{where}: page_size must be an integer in [1, {MAX_TOKENS}], got {shown}")
    return value


class SglangSource(Source):
    kind = "sglang"

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg, self.engine = cfg, cfg.name
        self._http = HttpClient(cfg.url, timeout=cfg.timeout_seconds, max_bytes=cfg.max_response_bytes, max_lines=cfg.max_response_lines,
                                accept="text/plain;version=0.0.4", auth=cfg.client_auth)
        info = cfg.option("server_info_url")
        self._info = HttpClient(info, timeout=cfg.timeout_seconds, max_bytes=cfg.max_response_bytes, max_lines=cfg.max_response_lines,
                                accept="application/json", auth=cfg.client_auth) if info else None
        self._page_size: int | None = None

    def poll(self) -> EngineContribution:
        exp = parse_exposition(self._http.get_text())
        page_size = None
        if PAGE_SIZE not in exp and self._info is not None:
            if self._page_size is None:
                self._page_size = page_size_from_server_info(self._info.get_text(), self._info.where)
            page_size = self._page_size
        return EngineContribution(sglang_facts(exp, self.cfg, page_size))

    def close(self) -> None:
        self._http.abort()
        if self._info is not None:
            self._info.abort()
