"""A webhook receiver that prints Alertmanager's notifications, one line per alert.

It stands in for the pager and ticket bridges that deploy/alertmanager/alertmanager.yml
names (compose gives it their host names), so the compose stack shows where each alert
was routed:

    pager   FIRING   KVLedgerQuotaExceedsCapacity severity=critical engine=sim-tgi pool=0: A reserve-cap engine ...

Standard library only (it runs on the kvledger image's Python):
``python3 alert-sink.py --listen 0.0.0.0:8080``.
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 1 << 20
SHOWN_LABELS = ("severity", "engine", "pool", "gpu", "tenant", "instance")


def lines(payload: dict[str, Any]) -> list[str]:
    """One line per alert of an Alertmanager webhook payload (version 4)."""
    receiver = str(payload.get("receiver", "?"))
    out = []
    for alert in payload.get("alerts", []):
        labels = alert.get("labels", {})
        shown = " ".join(f"{k}={labels[k]}" for k in SHOWN_LABELS if k in labels)
        summary = alert.get("annotations", {}).get("summary", "")
        out.append(f"{receiver:7s} {str(alert.get('status', '?')).upper():8s} {labels.get('alertname', '?')} {shown}: {summary}")
    return out


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY:
            self.send_error(413 if length else 411)
            return
        try:
            payload = json.loads(self.rfile.read(length))
        except ValueError:
            self.send_error(400, "not JSON")
            return
        for line in lines(payload if isinstance(payload, dict) else {}):
            print(line, flush=True)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # the notifications are the output
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", default="0.0.0.0:8080", help="HOST:PORT (default 0.0.0.0:8080)")
    args = ap.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    server = ThreadingHTTPServer((host, int(port)), Handler)
    print(f"alert-sink: listening on {args.listen}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
