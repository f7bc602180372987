"""A fake llama.cpp server for end-to-end tests: /slots, /props and /metrics served from
bodies the test sets (the captures in tests/fixtures/llamacpp/, changed over time), with
switchable faults. Loopback only.

Modes (``server.mode``):
- ``"ok"``: each path answers 200 with ``server.bodies[path]`` (404 for others);
- ``"garbage"``: every path answers 200 with an HTML page;
- ``"gone"``: the listening socket is closed (connections are refused) until the mode
  changes, when the server listens on the same port again.
"""

from __future__ import annotations

import http.server
import threading


class FakeLlamacpp:
    def __init__(self, bodies: dict[str, bytes]) -> None:
        self.bodies = dict(bodies)
        self._mode = "ok"
        self.requests: list[str] = []
        self._lock = threading.Lock()
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self.port = 0
        self._listen()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        with self._lock:
            if mode == self._mode:
                return
            if mode == "gone":
                self._close()
            elif self._mode == "gone":
                self._listen()
            self._mode = mode

    def _listen(self) -> None:
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                fake.requests.append(path)
                if fake.mode == "garbage":
                    status, body = 200, b"<html><body>502 Bad Gateway</body></html>\n"
                elif path in fake.bodies:
                    status, body = 200, fake.bodies[path]
                else:
                    status, body = 404, b'{"error":{"code":404,"message":"File Not Found"}}'
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def _close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def stop(self) -> None:
        with self._lock:
            self._close()
