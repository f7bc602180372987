"""Drive a real llama.cpp server (``llama-server``, built by setup_env.sh) from the tests.

Only the standard library is used. ``LlamaServer`` starts the binary on a free port with
the tiny GGUF model, waits for /health, sends completions (``complete``, ``burst``), and
reads /slots, /props and /metrics. ``FreezingProxy`` stands between kvledger and the
server: in ``live`` mode it forwards GETs; ``freeze()`` fetches /props, /slots and /metrics
of the server at one moment and serves exactly those answers until ``thaw()``, so the
daemon's exported numbers can be compared with the very answers it read (the server keeps
running: its one process serves HTTP from the same loop that decodes, so it cannot be
paused the way the vLLM suite pauses vLLM's engine core with SIGSTOP).
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SETUP_SCRIPT = HERE / "setup_env.sh"

# -c 8192 -np 4: four slots of 2,048 tokens, each its own KV stream (split)
CTX_SIZE = 8192
SLOTS = 4
SLOT_CTX = CTX_SIZE // SLOTS
# the tiny model (make_tiny_model.py): 2 layers x 2 KV heads x 16 dims, K and V in f16
BYTES_PER_TOKEN = 2 * 2 * 16 * 2 * 2
TRAIN_CTX = 4096  # its context_length: the server caps every slot's n_ctx at it
SERVE_FLAGS: tuple[str, ...] = (
    "--ctx-size", str(CTX_SIZE), "--parallel", str(SLOTS), "--metrics", "--slots",
    "--threads", "2", "--threads-http", "4", "--no-warmup", "--alias", "tiny-llama",
    "-lv", "4",  # the llama_kv_cache size line is logged at verbosity 4
)  # fmt: skip


class LlamaStartError(RuntimeError):
    """The server did not become healthy; the message ends with its log tail."""


def llamacpp_home() -> Path:
    configured = os.environ.get("LLAMACPP_HOME")
    return Path(configured) if configured else REPO_ROOT / ".cache" / "llamacpp"


def ensure_llamacpp() -> tuple[Path, Path]:
    """Run the idempotent setup script; (the server binary, the tiny model)."""
    subprocess.run(["bash", str(SETUP_SCRIPT)], check=True)
    home = llamacpp_home()
    return home / "bin" / "llama-server", home / "tiny-llama.gguf"


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post(url: str, payload: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


@dataclass
class LlamaServer:
    binary: Path
    model: Path
    log_path: Path
    port: int = field(default_factory=free_tcp_port)
    extra_flags: Sequence[str] = ()
    process: subprocess.Popen[bytes] | None = None
    start_history: list[float] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)
    failures: list[OSError] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        started = time.monotonic()
        argv = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                *SERVE_FLAGS, *self.extra_flags]
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {' '.join(argv)}\n".encode())
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LlamaStartError(f"llama-server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                status, _ = http_get(self.url + "/health", timeout=2)
                if status == 200:
                    self.start_history.append(time.monotonic() - started)
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise LlamaStartError(f"llama-server not healthy within {timeout:g}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------ the server's own answers

    def get_json(self, path: str) -> Any:
        status, body = http_get(self.url + path)
        if status != 200:
            raise AssertionError(f"GET {path}: HTTP {status}")
        return json.loads(body)

    def metrics_text(self) -> str:
        status, body = http_get(self.url + "/metrics")
        assert status == 200, status
        return body.decode()

    def tokenize(self, text: str) -> list[int]:
        tokens: list[int] = http_post(self.url + "/tokenize", {"content": text})["tokens"]
        return tokens

    def complete(self, prompt: str, n_predict: int, **extra: Any) -> dict[str, Any]:
        payload = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "temperature": 0.0,
                   "cache_prompt": True, **extra}
        return http_post(self.url + "/completion", payload)

    def burst(self, prompts: Sequence[str], n_predict: int) -> list[threading.Thread]:
        """Start one completion per prompt, concurrently; the threads, already started.
        Answers go to ``self.answers``, failures (a stopped server) to ``self.failures``."""

        def run(prompt: str) -> None:
            try:
                self.answers.append(self.complete(prompt, n_predict))
            except OSError as exc:
                self.failures.append(exc)

        threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in prompts]
        for t in threads:
            t.start()
        return threads

    def wait_idle(self, timeout: float = 120.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            slots: list[dict[str, Any]] = self.get_json("/slots")
            if not any(s["is_processing"] for s in slots):
                return slots
            time.sleep(0.05)
        raise AssertionError(f"slots still busy after {timeout:g}s")


# ---------------------------------------------------------------- the freezing proxy


class FreezingProxy:
    """GET /props, /slots, /metrics: forwarded to ``upstream`` (live) or the frozen answers."""

    PATHS = ("/props", "/slots", "/metrics")

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.frozen: dict[str, tuple[int, bytes]] | None = None
        self.served: dict[str, int] = {}
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                frozen = proxy.frozen
                if frozen is not None and path in frozen:
                    status, body = frozen[path]
                else:
                    try:
                        status, body = http_get(proxy.upstream + path, timeout=5)
                    except OSError:
                        status, body = 502, b'{"error": "upstream unreachable"}'
                proxy.served[path] = proxy.served.get(path, 0) + 1
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def freeze(self) -> dict[str, Any]:
        """Fetch the three answers of the server now (in the source's order) and serve only
        those from now on; returns them parsed: {"props", "slots", "metrics" (text)}."""
        answers = {path: http_get(self.upstream + path) for path in self.PATHS}
        for path, (status, _) in answers.items():
            assert status == 200, f"GET {path}: HTTP {status}"
        self.frozen = answers
        self.served = {}
        return {"props": json.loads(answers["/props"][1]), "slots": json.loads(answers["/slots"][1]),
                "metrics": answers["/metrics"][1].decode()}

    def thaw(self) -> None:
        self.frozen = None

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
