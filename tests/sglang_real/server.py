"""Drive a real SGLang server (0.5.23, CPU) from the project's tests.

Only the standard library is used here: the server runs with the interpreter of the separate
venv made by ``tests/sglang_real/setup_env.sh`` (``$KVLEDGER_CACHE/sglang-venv``), never inside
the test process. One server per shape, started once and shared (``conftest.py``).

    server = SglangServer(model_dir, free_tcp_port(), decode_log_interval=1, recount=True)
    server.start()                      # returns once GET /health answers 200
    with server.frozen() as info:       # POST /pause_generation in_place, then GET /server_info
        counts = server.recount()       # the test-only plugin's count inside the scheduler
    server.generate(ids, max_new_tokens=64)

Facts this harness relies on (docs/engines/sglang.md, "The real-engine suite"):

- ``SGLANG_USE_CPU_ENGINE=1`` and the test-only ``sgl_kernel`` stand-in (``stand_in/``) first on
  PYTHONPATH let SGLang serve a dense model on a CPU without AMX (``--device cpu
  --attention-backend torch_native``);
- ``POST /pause_generation {"mode": "in_place"}`` takes effect when the step in progress ends;
  a request that goes through the scheduler made after it (``GET /server_info``) returns only
  once the scheduler handled it, so what is read after that is frozen until
  ``POST /continue_generation``;
- general plugins load in the scheduler process from the entry-point group
  ``sglang.srt.plugins``; ``SGLANG_PLUGINS`` restricts which (the harness always sets it, so a
  plugin installed in the venv runs only where a test asks for it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.engine_server import EngineServer, EngineStartError

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SETUP_SCRIPT = HERE / "setup_env.sh"
STAND_IN = HERE / "stand_in"  # the test-only sgl_kernel (stand_in/sgl_kernel)
#: the tiny models' recipes are shared with the real-vLLM suite (one vocabulary, one script)
MODEL_SCRIPT = REPO_ROOT / "tests" / "vllm_real" / "make_tiny_model.py"

SGLANG_VERSION = "0.5.23"
SERVED_MODEL_NAME = "tiny"
#: the plugin names of the entry-point group sglang.srt.plugins
RECOUNT_PLUGIN = "kvledger_test_recount"

# Word ``wN`` of the tiny tokenizer is token id N (tests/vllm_real/make_tiny_model.py).
FIRST_WORD_ID = 3
VOCAB_SIZE = 1000

#: what every server of the suite runs with (the CPU route of docs/engines/sglang.md)
BASE_FLAGS: tuple[str, ...] = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-overlap-schedule",
    "--enable-metrics",
    "--sleep-on-idle",
    "--served-model-name", SERVED_MODEL_NAME,
    "--log-level", "info",
)  # fmt: skip


#: the model modules of sglang/srt/models/ the suite's models need (the tiny Llama and Qwen3);
#: SGLang imports every other module of that folder at startup to fill its registry (255 of
#: them in 0.5.23, most of the startup on a loaded 2-core machine) unless
#: SGLANG_DISABLED_MODEL_ARCHS names it
MODEL_MODULES: tuple[str, ...] = ("llama", "qwen3")


def disabled_model_modules(keep: Sequence[str] = MODEL_MODULES) -> list[str]:
    """Every model module of the venv's SGLang except ``keep`` (their names, no .py)."""
    found = sorted(p.stem for p in sglang_venv().glob("lib/python3*/site-packages/sglang/srt/models/*.py"))
    return [name for name in found if name not in keep and name != "__init__"]


class SglangStartError(EngineStartError):
    """The SGLang server did not become healthy; the message ends with its log tail."""


def cache_root() -> Path:
    configured = os.environ.get("KVLEDGER_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "kvledger"


def sglang_venv() -> Path:
    """The separate SGLang venv (``$SGLANG_VENV`` or ``$KVLEDGER_CACHE/sglang-venv``)."""
    configured = os.environ.get("SGLANG_VENV")
    return Path(configured) if configured else cache_root() / "sglang-venv"


def sglang_python() -> Path:
    return sglang_venv() / "bin" / "python"


def ensure_sglang_env() -> None:
    """Run the idempotent setup script (a no-op once the venv matches its pins)."""
    subprocess.run(["bash", str(SETUP_SCRIPT)], check=True)


def make_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0) -> Path:
    """A tiny random model (``make_tiny_model.py --arch ARCH``) made with the SGLang venv's python."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    subprocess.run([str(sglang_python()), str(MODEL_SCRIPT), str(out_dir), "--arch", arch, "--seed", str(seed)],
                   check=True, env=env, capture_output=True)
    return out_dir


def kvledger_venv(repo_root: Path = REPO_ROOT) -> Path:
    """The per-checkout venv kvledger's SGLang plugin runs in: ``<repo>/.cache/sglang-kvledger-venv``
    (git-ignored), made from the shared SGLang venv's interpreter, with that venv's
    site-packages under its own (a ``.pth``) and this checkout's ``kvledger-engine`` installed
    in its own, from a wheel the shared venv's pip builds (so the shared venv never holds a
    checkout's code; ci-speed's rule 2). Rebuilt at every call: a few seconds."""
    base = sglang_venv()
    venv = repo_root / ".cache" / "sglang-kvledger-venv"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([str(sglang_python()), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    base_site = base / "lib" / site.parent.name / "site-packages"
    if not site.is_dir() or not base_site.is_dir():  # the interpreters' versions differ: find the real folders
        site = next((venv / "lib").glob("python3*/site-packages"))
        base_site = next((base / "lib").glob("python3*/site-packages"))
    (site / "_kvledger_sglang_base.pth").write_text(f"import site; site.addsitedir({str(base_site)!r})\n")
    with tempfile.TemporaryDirectory() as wheels:
        subprocess.run([str(sglang_python()), "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                        "-w", wheels, str(repo_root / "engine")], check=True, capture_output=True)
        (wheel,) = Path(wheels).glob("kvledger_engine-*.whl")
        subprocess.run([str(sglang_python()), "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                        "--quiet", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True)
    return venv


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prefix_ids(length: int, offset: int = 100) -> list[int]:
    """Deterministic token ids of a shared prefix (different ``offset``: a different prefix)."""
    span = VOCAB_SIZE - FIRST_WORD_ID
    return [FIRST_WORD_ID + (offset + i) % span for i in range(length)]


def suffix_ids(index: int, length: int) -> list[int]:
    """Deterministic token ids that make request ``index`` distinct (no EOS, no special id)."""
    span = VOCAB_SIZE - FIRST_WORD_ID
    return [FIRST_WORD_ID + (7919 * (index + 1) + 31 * i * i + i) % span for i in range(length)]


def http_get(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def http_post_json(url: str, body: object | None, timeout: float = 300.0) -> tuple[int, str]:
    """POST ``body`` as JSON; return (status, response text), errors included."""
    data = json.dumps(body if body is not None else {}).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def samples(metrics_text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples called ``name`` in a Prometheus text: (labels, value)."""
    out = []
    for line in metrics_text.splitlines():
        if not line.startswith((name + "{", name + " ")):
            continue
        head, _, value = line.rpartition(" ")
        labels: dict[str, str] = {}
        if "{" in head:
            body = head[head.index("{") + 1 : head.rindex("}")]
            for part in body.split('",'):
                if "=" in part:
                    key, _, val = part.partition("=")
                    labels[key.strip()] = val.strip().strip('"')
        out.append((labels, float(value)))
    return out


def gauge(metrics_text: str, name: str, **labels: str) -> float:
    """The one value of ``name`` whose labels include ``labels`` (KeyError if none)."""
    found = [v for lab, v in samples(metrics_text, name) if labels.items() <= lab.items()]
    if not found:
        raise KeyError(f"no sample of {name} {labels or ''} in /metrics")
    return sum(found)


@dataclass(frozen=True)
class Generation:
    index: int
    status: int
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    finish: str | None
    body: str


@dataclass
class Burst:
    """Concurrent /generate requests running in threads; ``join()`` gives their results."""

    threads: list[threading.Thread]
    results: list[Generation | None] = field(default_factory=list)

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def join(self, timeout: float = 300.0) -> list[Generation]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        missing = [i for i, r in enumerate(self.results) if r is None]
        if missing:
            raise TimeoutError(f"requests {missing} did not finish within {timeout} s")
        return [r for r in self.results if r is not None]


class SglangServer(EngineServer):
    """A real SGLang server on this machine, as a subprocess of the SGLang venv, in its own
    process group (``stop()`` ends the scheduler and detokenizer too)."""

    ENGINE = "SGLang"
    START_ERROR = SglangStartError
    WORK_PREFIX = "kvledger-sglang-"
    LOG_NAME = "sglang.log"
    HEALTH_PROBE_TIMEOUT = 5.0

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        port: int,
        *,
        max_total_tokens: int = 4096,
        decode_log_interval: int | None = 1,
        recount: bool = True,
        plugins: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        extra_env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout: float = 600.0,
        host: str = "127.0.0.1",
        venv: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(port, host=host, startup_timeout=startup_timeout, log_path=log_path, extra_env=extra_env)
        self.model_dir = Path(model_dir)
        # the venv the server runs in: the shared SGLang venv, or a per-checkout one layered on
        # it (kvledger_venv: this checkout's kvledger-engine beside SGLang)
        self.venv = Path(venv) if venv is not None else None
        self.ledger_url: str | None = None  # kvledger's plugin's address, when the server runs it
        self.max_total_tokens = max_total_tokens
        self.decode_log_interval = decode_log_interval  # None: SGLang's default (40)
        self.extra_args = tuple(extra_args)
        self.recount_socket: Path | None = self._work_dir / "recount.sock" if recount else None
        # the plugins of sglang.srt.plugins this server loads (SGLANG_PLUGINS): the recount, and
        # whatever a test adds (e.g. kvledger's own SGLang plugin)
        self.plugins = tuple(plugins) + ((RECOUNT_PLUGIN,) if recount else ())

    # -- addresses ---------------------------------------------------------------
    @property
    def server_info_url(self) -> str:
        return f"{self.base_url}/get_server_info"

    def command(self) -> list[str]:
        interval = () if self.decode_log_interval is None else ("--decode-log-interval", str(self.decode_log_interval))
        return [
            str(self.venv / "bin" / "python" if self.venv is not None else sglang_python()), "-m", "sglang.launch_server",
            "--model-path", str(self.model_dir),
            "--host", self.host, "--port", str(self.port),
            *BASE_FLAGS,
            "--max-total-tokens", str(self.max_total_tokens),
            *interval,
            *self.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        for name in ("PYTHONPATH", "VIRTUAL_ENV", "SGLANG_PLUGINS", "KVLEDGER_TEST_RECOUNT"):
            env.pop(name, None)
        env.update(
            SGLANG_USE_CPU_ENGINE="1",
            PYTHONPATH=str(STAND_IN),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            # a name no plugin has: SGLang loads every installed plugin when this is empty
            SGLANG_PLUGINS=",".join(self.plugins) or "none",
            PYTHONUNBUFFERED="1",
            TRITON_CACHE_DIR=str(self._work_dir / "triton"),
            OUTLINES_CACHE_DIR=str(self._work_dir / "outlines"),
            SGLANG_DISABLED_MODEL_ARCHS=",".join(disabled_model_modules()),
        )
        if self.recount_socket is not None:
            env["KVLEDGER_TEST_RECOUNT"] = str(self.recount_socket)
        env.update(self.extra_env)
        return env

    def missing_env(self) -> str | None:
        return None if sglang_python().exists() else f"no SGLang venv at {sglang_venv()}: run tests/sglang_real/setup_env.sh"

    # -- reading ---------------------------------------------------------------
    def metrics_text(self) -> str:
        return http_get(self.metrics_url)

    def server_info(self) -> dict[str, Any]:
        """GET /get_server_info (goes through the scheduler: answered once it handled it)."""
        doc: dict[str, Any] = json.loads(http_get(self.server_info_url, timeout=120))
        return doc

    def recount(self, timeout: float = 30.0) -> dict[str, Any]:
        """The test-only recount plugin's JSON count, made inside the scheduler process."""
        if self.recount_socket is None:
            raise RuntimeError("this server runs without the recount plugin")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(self.recount_socket))
            data = b""
            while chunk := sock.recv(1 << 16):
                data += chunk
        doc: dict[str, Any] = json.loads(data)
        if "error" in doc:
            raise RuntimeError(f"recount: {doc['error']}")
        return doc

    def decoded_tokens(self) -> float:
        """``sglang:realtime_tokens_total{mode="decode"}``: moves at every decode step."""
        try:
            return gauge(self.metrics_text(), "sglang:realtime_tokens_total", mode="decode")
        except KeyError:
            return 0.0

    # -- control ---------------------------------------------------------------
    def pause(self) -> dict[str, Any]:
        """POST /pause_generation in place, then GET /server_info: once it answers, the
        scheduler has handled the pause and every later read sees a frozen engine. Returns
        the server info read inside the pause."""
        status, text = http_post_json(f"{self.base_url}/pause_generation", {"mode": "in_place"}, timeout=120)
        if status != 200:
            raise RuntimeError(f"POST /pause_generation answered {status}: {text[:500]}")
        return self.server_info()

    def resume(self) -> None:
        status, text = http_post_json(f"{self.base_url}/continue_generation", {}, timeout=120)
        if status != 200:
            raise RuntimeError(f"POST /continue_generation answered {status}: {text[:500]}")

    @contextmanager
    def frozen(self) -> Iterator[dict[str, Any]]:
        """Paused in place for the block (resumed after, whatever happens)."""
        try:
            yield self.pause()
        finally:
            self.resume()

    def flush_cache(self) -> None:
        """POST /flush_cache: empty the radix cache (refused while requests run)."""
        status, text = http_post_json(f"{self.base_url}/flush_cache", None, timeout=60)
        if status != 200:
            raise RuntimeError(f"POST /flush_cache answered {status}: {text[:500]}")

    def wait_idle(self, timeout: float = 120.0) -> dict[str, Any]:
        """Wait until the scheduler runs and queues nothing (the recount's view, or /metrics's)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.recount_socket is not None:
                doc = self.recount()
                busy = doc["running"] + doc["waiting"]
            else:
                text = self.metrics_text()
                doc = {"metrics": text}
                busy = int(gauge(text, "sglang:num_running_reqs") + gauge(text, "sglang:num_queue_reqs"))
            if busy == 0:
                return doc
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang still has {busy} requests after {timeout} s")
            time.sleep(0.1)

    def wait_decoded(self, since: float, tokens: int, stall: float = 180.0,
                     stop: Callable[[], bool] = lambda: False) -> float:
        """Wait until ``sglang:realtime_tokens_total{mode="decode"}`` is ``tokens`` past ``since``,
        or ``stop()``; return its value. Only a counter that does not move for ``stall`` seconds
        while requests run is an error (no rate is assumed: a loaded machine decodes slowly)."""
        last, moved = since, time.monotonic()
        while True:
            now = self.decoded_tokens()
            if now >= since + tokens or stop():
                return now
            if now != last:
                last, moved = now, time.monotonic()
            elif time.monotonic() - moved > stall:
                raise TimeoutError(f"decode tokens stayed at {now:g} (< {since + tokens:g}) for {stall:g} s")
            time.sleep(0.02)

    def generate(self, input_ids: Sequence[int], max_new_tokens: int, *, ignore_eos: bool = True,
                 index: int = 0, timeout: float = 300.0) -> Generation:
        """POST /generate with token ids (greedy; ``ignore_eos``: always ``max_new_tokens`` long)."""
        body = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos, "temperature": 0.0},
        }
        status, text = http_post_json(f"{self.base_url}/generate", body, timeout=timeout)
        prompt = completion = cached = None
        finish = None
        if status == 200:
            meta = json.loads(text).get("meta_info") or {}
            prompt, completion, cached = meta.get("prompt_tokens"), meta.get("completion_tokens"), meta.get("cached_tokens")
            reason = meta.get("finish_reason")
            finish = reason.get("type") if isinstance(reason, dict) else reason
        return Generation(index, status, prompt, completion, cached, finish, text)

    def burst(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, ignore_eos: bool = True) -> Burst:
        """Start one /generate per prompt, concurrently; returns at once (``Burst.join()``)."""
        burst = Burst(threads=[], results=[None] * len(prompts))

        def one(i: int) -> None:
            burst.results[i] = self.generate(prompts[i], max_new_tokens, ignore_eos=ignore_eos, index=i)

        burst.threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
        for t in burst.threads:
            t.start()
        return burst

