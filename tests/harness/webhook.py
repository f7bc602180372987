"""An in-process receiver for Alertmanager webhook notifications.

    with WebhookReceiver() as hook:
        hook.url                      # give it to Alertmanager's webhook_configs
        n = hook.wait_for(lambda p: p["status"] == "firing", timeout=30)

Each POST body (Alertmanager's JSON payload: version, status, receiver, groupLabels,
commonLabels, alerts[...]) is parsed and kept in order.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Payload = dict[str, Any]


class WebhookReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, path: str = "/alerts") -> None:
        self.path = path
        self._payloads: list[Payload] = []
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                try:
                    payload = json.loads(body)
                except json.JSONDecodeError:
                    self.send_response(400)
                    self.end_headers()
                    return
                with receiver._cond:
                    receiver._payloads.append({"_path": self.path, **payload})
                    receiver._cond.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}{self.path}"

    def start(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> WebhookReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def payloads(self) -> list[Payload]:
        with self._cond:
            return list(self._payloads)

    def wait_for(self, match: Callable[[Payload], bool], timeout: float = 30.0) -> Payload:
        """The first payload (received so far or later) for which ``match`` is true;
        TimeoutError listing what arrived after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for p in self._payloads:
                    if match(p):
                        return p
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no matching webhook payload in {timeout}s; received: "
                                       f"{json.dumps(self._payloads)[:3000]}")
                self._cond.wait(left)
