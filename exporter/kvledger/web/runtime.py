"""The web configuration in force: the TLS context, basic auth and extra headers, built
from the web config file and rebuilt when it (or a file it names) changes.

``reload()`` re-reads everything now (wired to SIGHUP by the daemon); ``maybe_reload()``
does so when a file's modification time or size changed, checking at most once a
second, so a rotated certificate is picked up without a signal, as exporter-toolkit
does. A new file that fails to load is logged and the one in force kept.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvledger.config.types import ConfigError
from kvledger.web.basic_auth import BasicAuth
from kvledger.web.tls import server_context
from kvledger.web.web_config import WebConfig, load_web_config

log = logging.getLogger("kvledger.web.server")

CHECK_INTERVAL = 1.0

_Stamp = tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class WebState:
    config: WebConfig
    ssl_context: ssl.SSLContext | None
    auth: BasicAuth | None
    stamp: _Stamp


def _stamp(paths: list[Path]) -> _Stamp:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((str(p), st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((str(p), -1, -1))
    return tuple(out)


def _build(path: Path | None, previous: WebState | None) -> WebState:
    if path is None:
        return WebState(WebConfig(), None, None, ())
    stamp_before = _stamp([path])
    config = load_web_config(path)
    files = [path, *(config.tls.files() if config.tls else ())]
    ctx = server_context(config.tls, str(path)) if config.tls else None
    auth: BasicAuth | None = None
    if config.basic_auth_users:
        old = previous.auth if previous is not None else None
        # same users and hashes: keep the verified-password cache
        auth = old if old is not None and old.users == config.basic_auth_users else BasicAuth(config.basic_auth_users)
    return WebState(config, ctx, auth, stamp_before + _stamp(files[1:]))


class WebRuntime:
    """Holds the current WebState; thread-safe."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self.state = _build(self.path, None)  # ConfigError propagates: a bad file at startup is fatal
        self._checked = time.monotonic()
        self._failed: _Stamp = ()  # the files as they were when a reload last failed

    def reload(self) -> bool:
        """Re-read the web config and the files it names; False (logged, old state kept) on error."""
        with self._lock:
            self._checked = time.monotonic()
            if self.path is None:
                return True
            try:
                self.state = _build(self.path, self.state)
            except ConfigError as exc:
                self._failed = _stamp([Path(p) for p, _, _ in self.state.stamp])
                log.error("web config not reloaded, keeping the one in force: %s", exc)
                return False
            log.info("web config %s loaded", self.path)
            return True

    def maybe_reload(self) -> None:
        """Reload when a watched file changed; stats the files at most once a second."""
        if self.path is None or time.monotonic() - self._checked < CHECK_INTERVAL:
            return
        with self._lock:
            if time.monotonic() - self._checked < CHECK_INTERVAL:
                return
            self._checked = time.monotonic()
            paths = [Path(p) for p, _, _ in self.state.stamp]
            current = _stamp(paths)
            changed = current != self.state.stamp and current != self._failed
        if changed:
            self.reload()
