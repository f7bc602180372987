"""OTLP push: a real OTLP/HTTP receiver in the test decodes what kvledger sends."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from accounting_support import accounts_of
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from test_exposition import rich_snapshot

from kvledger.output.otlp import OtlpOutput


def test_otlp_push_carries_the_catalogue() -> None:
    received: list[ExportMetricsServiceRequest] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            req = ExportMetricsServiceRequest()
            req.ParseFromString(body)
            received.append(req)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    accounts = accounts_of(rich_snapshot())
    out = OtlpOutput(f"http://127.0.0.1:{server.server_address[1]}", lambda: accounts, interval_seconds=3600)
    try:
        out.flush()
    finally:
        out.stop()
        server.shutdown()
    metrics = {m.name: m for r in received for rm in r.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    reserved = metrics["kvledger_kv_reserved_bytes"]
    points = {tuple(sorted((a.key, a.value.string_value) for a in p.attributes)): p.as_double for p in reserved.gauge.data_points}
    assert points[(("basis", "upper_bound"), ("engine", "vllm"), ("pool", "0"))] == 32 * 16384  # 1 running x ceil(1024/32) blocks
    assert reserved.unit == "By"
    assert metrics["kvledger_preemptions_total"].sum.is_monotonic
