"""The ``kind: sglang`` source: GET ``cfg.url`` (SGLang's /metrics) and map it with
``sglang_facts``.

SGLang's server information (``/server_info``; ``/get_server_info`` on older builds) states two
settings /metrics does not always carry:

- ``page_size``: used when /metrics does not export ``sglang:page_size`` (builds before the kv_*
  token gauges). With ``server_info_url`` configured it is read once; a failure to read it
  fails the poll with the reason (the block size would be wrong otherwise).
- ``decode_log_interval``: SGLang refreshes its KV and request gauges at prefill batches and
  every ``--decode-log-interval`` decode steps (default 40), so what /metrics shows can lag the
  pool by that many steps. It is exported as ``kvledger_source_refresh_interval_steps``. The
  configuration's ``decode_log_interval`` states it; else it is read from ``server_info_url``
  or, when that is not configured, from ``/server_info`` beside ``url``. That read never fails
  the poll (the series is absent while it is unknown); it is made at the first poll, after any
  failed poll (the engine may have restarted with other flags) and, after a failed read, again
  at most every ``INFO_RETRY_SECONDS``. /server_info passes through SGLang's scheduler, so it is
  never read at every poll.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvledger.collect.sources.base import EngineContribution, Source, SourceError
from kvledger.collect.sources.http_client import HttpClient
from kvledger.collect.sources.prom_text import parse_exposition
from kvledger.collect.sources.sglang.metrics import PAGE_SIZE, sglang_facts
from kvledger.config.model import EngineConfig
from kvledger.model.limits import MAX_TOKENS

#: seconds between two attempts to read the decode-log interval after one failed
INFO_RETRY_SECONDS = 60.0


def _info_doc(body: str, where: str) -> dict[str, Any]:
    try:
        doc: Any = json.loads(body)
    except (ValueError, RecursionError):
        raise SourceError("parse", f"{where}: not a JSON document") from None
    if not isinstance(doc, dict):
        raise SourceError("schema", f"{where}: expected a JSON object, got {type(doc).__name__}")
    return doc


def _whole(doc: dict[str, Any], key: str, where: str) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise SourceError("schema", f"{where}: {key} must be an integer in [1, {MAX_TOKENS}], got {shown}")
    return value


def page_size_from_server_info(body: str, where: str) -> int:
    """``page_size`` of SGLang's /server_info JSON (the server arguments); 1 when absent."""
    return _whole(_info_doc(body, where), "page_size", where) or 1


def decode_log_interval_from_server_info(body: str, where: str) -> int | None:
    """``decode_log_interval`` of SGLang's /server_info JSON; None when the build does not state it."""
    return _whole(_info_doc(body, where), "decode_log_interval", where)


def server_info_beside(metrics_url: str) -> str | None:
    """``/server_info`` on the origin of an http(s) /metrics address (None for other schemes)."""
    parts = urlsplit(metrics_url)
    if parts.scheme not in ("http", "https"):
        return None
    return urlunsplit((parts.scheme, parts.netloc, "/server_info", "", ""))


class SglangSource(Source):
    kind = "sglang"

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg, self.engine = cfg, cfg.name
        self._http = HttpClient(cfg.url, timeout=cfg.timeout_seconds, max_bytes=cfg.max_response_bytes,
                                accept="text/plain;version=0.0.4", auth=cfg.client_auth)
        configured = cfg.option("server_info_url")
        info = configured or server_info_beside(cfg.url)
        self._info_configured = configured is not None
        self._info = HttpClient(info, timeout=cfg.timeout_seconds, max_bytes=cfg.max_response_bytes,
                                accept="application/json", auth=cfg.client_auth) if info else None
        self._page_size: int | None = None
        stated = cfg.option("decode_log_interval")
        self._interval_stated = int(stated) if stated is not None else None
        self._interval: int | None = self._interval_stated
        self._interval_due = 0.0  # monotonic time of the next read of the interval (0: at the next poll)

    def poll(self) -> EngineContribution:
        try:
            exp = parse_exposition(self._http.get_text())
            page_size = None
            if PAGE_SIZE not in exp and self._info is not None and self._info_configured:
                if self._page_size is None:
                    self._page_size = page_size_from_server_info(self._info.get_text(), self._info.where)
                page_size = self._page_size
            facts = sglang_facts(exp, self.cfg, page_size)
        except BaseException:
            # the engine may come back restarted, with other settings: read them again then
            self._page_size = None
            self._interval_due = 0.0
            raise
        self._refresh_interval()
        return EngineContribution(facts)

    def _refresh_interval(self) -> None:
        if self._interval_stated is not None or self._info is None or time.monotonic() < self._interval_due:
            return
        try:
            self._interval = decode_log_interval_from_server_info(self._info.get_text(), self._info.where)
            self._interval_due = float("inf")  # until a poll fails
        except SourceError:
            self._interval = None
            self._interval_due = time.monotonic() + INFO_RETRY_SECONDS

    def refresh_interval_steps(self) -> int | None:
        return self._interval

    def close(self) -> None:
        self._http.abort()
        if self._info is not None:
            self._info.abort()
