"""The ``kind: llamacpp`` source: GET /props, /metrics and /slots of a llama.cpp server.

``url`` is the server's /metrics (``http://host:8080/metrics``) or its base URL
(``http://host:8080``); /slots and /props are the base URL's unless ``slots_url`` or
``props_url`` say otherwise. One poll makes up to three GETs, in this order, all within
one deadline of ``timeout_seconds`` (each GET gets what is left of it):

1. /props: the version, and whether the server sleeps (``--sleep-idle-seconds``): then
   /slots is not read, since reading it reloads the model;
2. /metrics: optional (``--metrics``), given at most half of what is left. Its failure
   (off: HTTP 501, garbage, a hang, text no parser reads, even an error of ours while
   reading it) never fails the poll: the facts go without its figures and the ``metrics``
   sub-source reports down with the reason;
3. /slots: required; any failure fails the poll with its reason. Skipped when /metrics
   shows a server with nothing to do whose counters have not moved since the last /slots
   answer, which had no busy slot either (``metrics.idle_key``): the slots are then those
   of that answer. Every GET of /slots restarts the server's idle timer (a /metrics read
   does not), so reading it at every poll would keep a server from ever falling asleep.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvledger.collect.sources.base import EngineContribution, Source, SourceError, SubsourceReport
from kvledger.collect.sources.http_client import HttpClient
from kvledger.collect.sources.llamacpp.documents import Slot, parse_props, parse_slots
from kvledger.collect.sources.llamacpp.mapping import llamacpp_facts
from kvledger.collect.sources.llamacpp.metrics import ServerMetrics, idle_key, parse_metrics
from kvledger.collect.sources.model_config import ModelConfig
from kvledger.config.types import EngineConfig

log = logging.getLogger(__name__)

#: the share of timeout_seconds the GETs may use; the rest is left for parsing, so that the
#: collector never sees the poll itself run past its timeout
_GET_SHARE = 0.9
#: the share of what is left that /metrics (optional) may use: a hang there leaves /slots
#: (required) the rest
_METRICS_SHARE = 0.5


def endpoints(url: str) -> tuple[str, str]:
    """(base URL, /metrics URL) of ``url``: a /metrics URL or the server's base URL."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if path.endswith("/metrics"):
        base_path = path[: -len("/metrics")]
        return urlunsplit(parts._replace(path=base_path, query="", fragment="")), url
    base = urlunsplit(parts._replace(path=path, query="", fragment=""))
    return base, urlunsplit(parts._replace(path=path + "/metrics", fragment=""))


class LlamacppSource(Source):
    kind = "llamacpp"

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.engine = cfg.name
        base, metrics_url = endpoints(cfg.url)
        common: dict[str, Any] = {"timeout": cfg.timeout_seconds, "max_bytes": cfg.max_response_bytes,
                                  "max_lines": cfg.max_response_lines, "auth": cfg.client_auth}
        self._props = HttpClient(cfg.option("props_url") or base + "/props", accept="application/json", **common)
        self._slots = HttpClient(cfg.option("slots_url") or base + "/slots", accept="application/json", **common)
        self._metrics = HttpClient(metrics_url, accept="text/plain;version=0.0.4", **common)
        self._metrics_error: str | None = "not read yet"
        self._model_config = ModelConfig(cfg)
        # the last /slots answer without a busy slot, with the idle key of the /metrics read
        # just before it
        self._idle_slots: tuple[tuple[float | None, ...], list[Slot]] | None = None

    def _get(self, client: HttpClient, deadline: float, share: float = 1.0) -> bytes:
        """GET within ``share`` of what is left before ``deadline``."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise SourceError("timeout", f"{client.where}: no time left of the poll's {self.cfg.timeout_seconds:g}s")
        client.timeout = left * share
        return client.get()

    def poll(self) -> EngineContribution:
        deadline = time.monotonic() + self.cfg.timeout_seconds * _GET_SHARE
        props = parse_props(self._get(self._props, deadline), self._props.where)
        metrics = self._read_metrics(deadline)
        slots = None if props.sleeping else self._read_slots(deadline, metrics)
        return EngineContribution(llamacpp_facts(slots, props, metrics, self.cfg, self._model_config.load()))

    def _read_slots(self, deadline: float, metrics: ServerMetrics | None) -> list[Slot]:
        key = None if metrics is None else idle_key(metrics)
        if key is not None and self._idle_slots is not None and self._idle_slots[0] == key:
            return self._idle_slots[1]  # nothing happened since that answer
        slots = parse_slots(self._get(self._slots, deadline), self._slots.where)
        idle = key is not None and not any(s.processing for s in slots)
        self._idle_slots = (key, slots) if key is not None and idle else None
        return slots

    def _read_metrics(self, deadline: float) -> ServerMetrics | None:
        try:
            body = self._get(self._metrics, deadline, _METRICS_SHARE)
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SourceError("parse", f"{self._metrics.where}: body is not UTF-8 (byte {exc.start})") from None
            metrics = parse_metrics(text, deadline)
        except SourceError as exc:
            self._metrics_error = f"{exc.reason}: {exc.message}"
            return None
        except Exception as exc:  # /metrics is optional: not even a bug of ours in reading it fails the poll
            log.debug("engine %s: reading /metrics failed", self.engine, exc_info=True)
            self._metrics_error = f"internal: {type(exc).__name__}: {exc}"
            return None
        self._metrics_error = None
        return metrics

    def subsource_health(self) -> list[SubsourceReport]:
        """``metrics``: /metrics read and parsed at the last poll (it is optional)."""
        return [SubsourceReport("metrics", self._metrics_error is None, self._metrics_error)]

    def close(self) -> None:
        for client in (self._props, self._slots, self._metrics):
            client.abort()
