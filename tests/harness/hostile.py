"""A hostile or broken engine: an HTTP server on a raw socket whose behaviour is switched
at run time. Loopback only; every connection is served by a daemon thread.

Modes (``server.mode``):
- ``"document"``: a 200 answer with ``server.body`` (bytes) and its Content-Length;
- ``"slow_headers"``: the status line and headers one byte every ``drip_seconds``;
- ``"endless"``: a 200 answer without a length whose body never ends (1 MiB writes);
- ``"huge_length"``: a Content-Length of 10 GiB, then a short body;
- ``"redirect"``: ``302`` to ``server.location``.
"""

from __future__ import annotations

import socket
import threading
import time


class HostileEngine:
    def __init__(self, body: bytes = b"{}", mode: str = "document") -> None:
        self.body = body
        self.mode = mode
        self.drip_seconds = 1.0
        self.location = "http://127.0.0.1:1/secret"
        self.requests = 0
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}/ledger"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            buf = b""
            while b"\r\n\r\n" not in buf:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                buf += chunk
            self.requests += 1
            mode = self.mode
            if mode == "document":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             + f"Content-Length: {len(self.body)}\r\n\r\n".encode() + self.body)
            elif mode == "slow_headers":
                head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Padding: " + b"x" * 200 + b"\r\n\r\n{}"
                for byte in head:
                    if self._stop.is_set():
                        return
                    conn.sendall(bytes([byte]))
                    time.sleep(self.drip_seconds)
            elif mode == "endless":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
                chunk = b"[" * (1 << 20)
                while not self._stop.is_set() and self.mode == "endless":
                    conn.sendall(chunk)
            elif mode == "huge_length":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10737418240\r\n\r\n{}")
            elif mode == "redirect":
                conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: " + self.location.encode()
                             + b"\r\nContent-Length: 0\r\n\r\n")
        except OSError:
            pass  # the client gave up: that is the point of most modes
        finally:
            conn.close()
