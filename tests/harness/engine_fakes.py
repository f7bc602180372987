"""Fake engines that serve an engine's /metrics exposition (the fixtures of
tests/fixtures/<kind>/) and change it over time, for source and end-to-end tests.

    with FakeEngine("sglang") as engine:   # http://127.0.0.1:PORT/metrics
        engine.url
        engine.scene = 1                   # or advance(): the next consistent set of values
        engine.mode = "garbage"            # "ok" | "garbage" | "status" | "hang" | "poison"
        engine.disappear(); engine.reappear()   # the port refuses connections, then serves again

Each kind has a fixture and scenes: consistent values of its KV and request series (the
kv_* triple of SGLang adds up to the pool, TensorRT-LLM's used plus free blocks to the
capacity, ...) applied to every series of the named metric. ``auto_advance`` (seconds)
moves to the next scene on its own, so the numbers an exporter reads keep moving.
"""

from __future__ import annotations

import http.server
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@dataclass(frozen=True)
class FakeKind:
    fixture: str  # tests/fixtures/<kind>/<fixture>
    path: str  # the URL path the engine serves its exposition on
    scenes: tuple[dict[str, str], ...]  # metric name -> value, applied to all of its series
    poison: tuple[str, str]  # (metric, value) that makes the exposition invalid for the adapter


KINDS: dict[str, FakeKind] = {
    "sglang": FakeKind(
        "sglang/sglang-kv-gauges-metrics.txt", "/metrics",
        (
            {"sglang:kv_available_tokens": "131072.0", "sglang:kv_evictable_tokens": "81920.0",
             "sglang:kv_used_tokens": "49152.0", "sglang:num_running_reqs": "21.0"},
            {"sglang:kv_available_tokens": "98304.0", "sglang:kv_evictable_tokens": "65536.0",
             "sglang:kv_used_tokens": "98304.0", "sglang:num_running_reqs": "30.0"},
            {"sglang:kv_available_tokens": "163840.0", "sglang:kv_evictable_tokens": "90112.0",
             "sglang:kv_used_tokens": "8192.0", "sglang:num_running_reqs": "4.0"},
        ),
        ("sglang:kv_used_tokens", "NaN"),
    ),
    "trtllm": FakeKind(
        "trtllm/trtllm-serve-block-gauges-metrics.txt", "/prometheus/metrics",
        (
            {"trtllm_kv_cache_free_blocks": "6144.0", "trtllm_kv_cache_used_blocks": "2048.0",
             "trtllm_num_requests_running": "14.0"},
            {"trtllm_kv_cache_free_blocks": "4096.0", "trtllm_kv_cache_used_blocks": "4096.0",
             "trtllm_num_requests_running": "20.0"},
            {"trtllm_kv_cache_free_blocks": "7680.0", "trtllm_kv_cache_used_blocks": "512.0",
             "trtllm_num_requests_running": "3.0"},
        ),
        ("trtllm_kv_cache_max_blocks", "-1.0"),
    ),
    "triton-trtllm": FakeKind(
        "triton-trtllm/triton-trtllm-metrics-names-metrics.txt", "/metrics",
        (
            {'nv_trt_llm_kv_cache_block_metrics{model="tensorrt_llm",version="1",kv_cache_block_type="free"}': "2560",
             'nv_trt_llm_kv_cache_block_metrics{model="tensorrt_llm",version="1",kv_cache_block_type="used"}': "1536",
             'nv_trt_llm_request_metrics{model="tensorrt_llm",version="1",request_type="active"}': "9"},
            {'nv_trt_llm_kv_cache_block_metrics{model="tensorrt_llm",version="1",kv_cache_block_type="free"}': "1024",
             'nv_trt_llm_kv_cache_block_metrics{model="tensorrt_llm",version="1",kv_cache_block_type="used"}': "3072",
             'nv_trt_llm_request_metrics{model="tensorrt_llm",version="1",request_type="active"}': "17"},
            {'nv_trt_llm_kv_cache_block_metrics{model="tensorrt_llm",version="1",kv_cache_block_type="free"}': "3584",
             'nv_trt_llm_kv_cache_block_metrics{model="tensorrt_llm",version="1",kv_cache_block_type="used"}': "512",
             'nv_trt_llm_request_metrics{model="tensorrt_llm",version="1",request_type="active"}': "2"},
        ),
        ('nv_trt_llm_kv_cache_block_metrics{model="tensorrt_llm",version="1",kv_cache_block_type="max"}', "0"),
    ),
    "tgi": FakeKind(
        "tgi/tgi-3-flashinfer-metrics.txt", "/metrics",
        (
            {"tgi_batch_current_max_tokens": "61877", "tgi_batch_current_size": "9"},
            {"tgi_batch_current_max_tokens": "120000", "tgi_batch_current_size": "15"},
            {"tgi_batch_current_max_tokens": "20480", "tgi_batch_current_size": "3"},
        ),
        ("tgi_batch_max_total_tokens", "+Inf"),
    ),
}


def apply(text: str, values: dict[str, str]) -> str:
    """``text`` with every series of each metric (or the one exact series) set to its value."""
    for series, value in values.items():
        if "{" in series:
            pattern = rf"^({re.escape(series)}) \S+$"
        else:
            pattern = rf"^({re.escape(series)}(?:\{{[^}}]*\}})?) \S+$"
        text, n = re.subn(pattern, rf"\g<1> {value}", text, flags=re.MULTILINE)
        assert n, f"no series {series} in the fixture"
    return text


class FakeEngine:
    """An engine of ``kind`` serving its exposition on 127.0.0.1 (a fixed port once started)."""

    def __init__(self, kind: str, auto_advance: float | None = None) -> None:
        self.kind = kind
        self.spec = KINDS[kind]
        self.base = (FIXTURES / self.spec.fixture).read_text()
        self.scene = 0
        self.mode = "ok"
        self.auto_advance = auto_advance
        self.requests = 0
        self._started = time.monotonic()
        self._release = threading.Event()
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self.port = 0
        self._serve()

    # ------------------------------------------------------------ what is served

    def body(self) -> bytes:
        scene = self.scene
        if self.auto_advance:
            scene += int((time.monotonic() - self._started) / self.auto_advance)
        text = apply(self.base, self.spec.scenes[scene % len(self.spec.scenes)])
        if self.mode == "poison":
            text = apply(text, {self.spec.poison[0]: self.spec.poison[1]})
        return text.encode()

    def advance(self) -> None:
        self.scene += 1

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.spec.path}"

    # ------------------------------------------------------------ serving

    def _serve(self) -> None:
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                engine.requests += 1
                mode = engine.mode
                if mode == "hang":
                    engine._release.wait(30)
                    return
                if self.path != engine.spec.path:
                    status, body = 404, b"not found\n"
                elif mode == "status":
                    status, body = 503, b"busy\n"
                elif mode == "garbage":
                    status, body = 200, b"<html><body>502 Bad Gateway</body></html>\n"
                else:
                    status, body = 200, engine.body()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        httpd.daemon_threads = True
        self.port = httpd.server_address[1]
        threading.Thread(target=httpd.serve_forever, name=f"fake {self.kind}", daemon=True).start()
        self._httpd = httpd

    def disappear(self) -> None:
        """Stop listening: connections to the port are refused."""
        self._release.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def reappear(self) -> None:
        """Serve again on the same port."""
        if self._httpd is None:
            self._release = threading.Event()
            self._serve()

    def stop(self) -> None:
        self.disappear()

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
