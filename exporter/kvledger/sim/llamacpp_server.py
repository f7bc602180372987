"""A simulated llama.cpp server, seen the way a stock ``llama-server --metrics`` shows itself.

``SimLlamacpp(profile).start()`` runs a slot scheduler in a thread and serves, over HTTP on
127.0.0.1 (an ephemeral port), the three endpoints ``kind: llamacpp`` reads, in the JSON
and text formats of llama.cpp b11434 (the real capture
tests/fixtures/llamacpp/llamacpp-b11434-slots-busy.json and its siblings):

- ``/slots``: one object per slot: ``id``, ``n_ctx``, ``is_processing``, and once the slot
  has served a task ``id_task``, ``n_prompt_tokens`` (the tokens its KV sequence holds),
  ``n_prompt_tokens_processed``, ``n_prompt_tokens_cache``, ``params`` and ``next_token``;
- ``/props``: ``default_generation_settings.n_ctx``, ``total_slots``, ``build_info``,
  ``is_sleeping`` (false);
- ``/metrics``: the ``llamacpp:`` counters and gauges, values printed like the server's
  C++ stream (6 significant digits).

What is simulated is llama.cpp's slot discipline with split KV streams (``-np N``): a
request takes an idle slot (the one whose cached tokens share the longest prefix with the
prompt, else the least recently used) or waits (deferred); the slot keeps the common
prefix and evaluates the rest of the prompt ``n_batch`` tokens per step, then generates
one token per step until ``n_predict`` or its context is full; an idle slot keeps its
tokens for the next prompt. A prompt that does not fit the slot context is refused.
Prompts are segments of token ids (shared system prompts, then a unique part), so a
prefix match is a comparison of segments.
"""

from __future__ import annotations

import http.server
import json
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

Segment = tuple[str, int]  # (identity, tokens): a run of tokens no other segment shares


@dataclass(frozen=True)
class SimLlamacppProfile:
    name: str = "sim-llamacpp"
    slots: int = 4
    n_ctx: int = 2048  # per slot
    n_batch: int = 256  # prompt tokens evaluated per step
    step_seconds: float = 0.02
    arrival_rate: float = 0.9  # requests per second (about half the slots' throughput)
    max_deferred: int = 64  # arrivals beyond this many waiting requests give up
    system_prompts: tuple[int, ...] = (384, 768, 1024)
    system_prompt_prob: float = 0.75
    user_tokens: tuple[int, int] = (40, 600)
    n_predict: tuple[int, int] = (16, 200)
    unlimited_prob: float = 0.03  # requests without n_predict: they stop at the context
    block_bytes: int = 32 * 1024  # bytes per token: a 1B Llama, 16 layers x 8 KV heads x 64 x 2 x f16
    build_info: str = "b11434-sim"


@dataclass
class _Task:
    id: int
    prompt: list[Segment]
    n_predict: int  # -1: no limit

    @property
    def prompt_tokens(self) -> int:
        return sum(n for _, n in self.prompt)


@dataclass
class _Slot:
    id: int
    n_ctx: int
    tokens: list[Segment] = field(default_factory=list)  # what the slot's KV sequence holds
    task: _Task | None = None
    last_task: _Task | None = None
    state: str = "idle"  # idle | prompt | generating
    prompt_done: int = 0  # prompt tokens in the cache so far
    processed: int = 0  # evaluated (not taken from the cache)
    cached: int = 0
    decoded: int = 0
    last_used: float = 0.0

    @property
    def n_tokens(self) -> int:
        return sum(n for _, n in self.tokens)


def _common_prefix(a: list[Segment], b: list[Segment]) -> int:
    n = 0
    for (ida, na), (idb, nb) in zip(a, b, strict=False):
        if ida != idb:
            break
        n += min(na, nb)
        if na != nb:
            break
    return n


def _keep_first(tokens: list[Segment], n: int) -> list[Segment]:
    out: list[Segment] = []
    for ident, count in tokens:
        if n <= 0:
            break
        out.append((ident, min(count, n)))
        n -= count
    return out


def _cpp(value: float) -> str:
    """A number as llama.cpp's std::stringstream prints it (default precision: 6 digits)."""
    if float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))
    text = f"{value:.6g}"
    if "e" in text:
        mantissa, exp = text.split("e")
        return f"{mantissa}e{exp[0]}{int(exp[1:]):02d}"
    return text


class SimLlamacpp:
    """Serves a simulated llama.cpp server's /slots, /props and /metrics (see the module doc)."""

    def __init__(self, profile: SimLlamacppProfile | None = None, *, seed: int = 0) -> None:
        self.profile = profile or SimLlamacppProfile()
        p = self.profile
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.slots = [_Slot(i, p.n_ctx) for i in range(p.slots)]
        self.deferred: deque[_Task] = deque()
        self._next_task = 0
        self._next_segment = 0
        self.started_at = time.time()
        # cumulative, as llama.cpp's server_metrics
        self.prompt_tokens_total = 0  # evaluated, cache hits excluded
        self.prompt_tokens_cached_total = 0
        self.tokens_predicted_total = 0
        self.n_decode_total = 0
        self.n_busy_slots_total = 0
        self.n_tokens_max = 0
        self.rejected = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self.url = ""
        self.port: int | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self, *, stepping: bool = True) -> SimLlamacpp:
        """Serve; ``stepping=False``: the server does not step on its own (the caller calls ``step``)."""
        if self._thread is not None or self._httpd is not None:
            return self
        handler = type("Handler", (_Handler,), {"sim": self})
        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._http_thread = threading.Thread(target=self._httpd.serve_forever, name=f"sim-llamacpp-http {self.profile.name}",
                                             daemon=True)
        self._http_thread.start()
        if not stepping:
            return self
        self._thread = threading.Thread(target=self._run, name=f"sim-llamacpp {self.profile.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> SimLlamacpp:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        step = self.profile.step_seconds
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.step(step)
            next_at += step
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    # ------------------------------------------------------------ the scheduler

    def _segment(self, prefix: str) -> str:
        self._next_segment += 1
        return f"{prefix}{self._next_segment}"

    def submit(self, prompt: list[Segment], n_predict: int) -> _Task | None:
        """Queue a request; None when its prompt does not fit a slot (llama.cpp refuses it)."""
        with self._lock:
            return self._submit(prompt, n_predict)

    def _submit(self, prompt: list[Segment], n_predict: int) -> _Task | None:
        task = _Task(self._next_task, prompt, n_predict)
        self._next_task += 1
        if task.prompt_tokens >= self.profile.n_ctx or len(self.deferred) >= self.profile.max_deferred:
            self.rejected += 1
            return None
        self.deferred.append(task)
        return task

    def _arrivals(self, dt: float) -> None:
        p, rng = self.profile, self._rng
        lam = p.arrival_rate * dt
        n, threshold, prod = 0, math.exp(-lam), rng.random()
        while prod > threshold:
            n += 1
            prod *= rng.random()
        for _ in range(n):
            prompt: list[Segment] = []
            if p.system_prompts and rng.random() < p.system_prompt_prob:
                i = rng.randrange(len(p.system_prompts))
                prompt.append((f"system{i}", p.system_prompts[i]))
            prompt.append((self._segment("user"), rng.randint(*p.user_tokens)))
            n_predict = -1 if rng.random() < p.unlimited_prob else rng.randint(*p.n_predict)
            self._submit(prompt, n_predict)

    def _launch(self, now: float) -> None:
        """Deferred tasks take idle slots: the best prefix match, else the least recently used."""
        while self.deferred:
            idle = [s for s in self.slots if s.task is None]
            if not idle:
                return
            task = self.deferred.popleft()
            slot = max(idle, key=lambda s: (_common_prefix(s.tokens, task.prompt), -s.last_used))
            # at least one prompt token is always evaluated
            keep = min(_common_prefix(slot.tokens, task.prompt), task.prompt_tokens - 1)
            slot.tokens = _keep_first(slot.tokens, keep)
            slot.task, slot.last_task, slot.state = task, task, "prompt"
            slot.prompt_done, slot.cached, slot.processed, slot.decoded = keep, keep, 0, 0
            self.prompt_tokens_cached_total += keep

    def step(self, dt: float) -> None:
        """One server loop iteration: arrivals, launches, one decode over the busy slots."""
        with self._lock:
            now = time.monotonic()
            self._arrivals(dt)
            self._launch(now)
            busy = [s for s in self.slots if s.task is not None]
            if busy:
                self.n_decode_total += 1
                self.n_busy_slots_total += len(busy)
            for slot in busy:
                task = slot.task
                assert task is not None
                if slot.state == "prompt":
                    n = min(self.profile.n_batch, task.prompt_tokens - slot.prompt_done)
                    slot.prompt_done += n
                    slot.processed += n
                    slot.tokens = _keep_first(task.prompt, slot.prompt_done)
                    if slot.prompt_done == task.prompt_tokens:
                        slot.state = "generating"
                        self.prompt_tokens_total += slot.processed
                else:
                    ident = f"gen{task.id}"  # the task's generated tokens: one segment that grows
                    if slot.tokens and slot.tokens[-1][0] == ident:
                        slot.tokens[-1] = (ident, slot.tokens[-1][1] + 1)
                    else:
                        slot.tokens.append((ident, 1))
                    slot.decoded += 1
                    full = slot.n_tokens >= slot.n_ctx
                    if full or (task.n_predict >= 0 and slot.decoded >= task.n_predict):
                        self.tokens_predicted_total += slot.decoded
                        slot.task, slot.state, slot.last_used = None, "idle", now
                self.n_tokens_max = max(self.n_tokens_max, slot.n_tokens)
            self._launch(now)

    # ------------------------------------------------------------ the endpoints

    def slots_json(self) -> list[dict[str, Any]]:
        with self._lock:
            out = []
            for s in self.slots:
                item: dict[str, Any] = {"id": s.id, "n_ctx": s.n_ctx, "speculative": False, "is_processing": s.task is not None}
                task = s.task or s.last_task
                if task is not None:
                    remain = -1 if task.n_predict < 0 else task.n_predict - s.decoded
                    item.update({
                        "id_task": task.id,
                        "n_prompt_tokens": s.n_tokens,
                        "n_prompt_tokens_processed": s.processed,
                        "n_prompt_tokens_cache": s.cached,
                        "params": {"max_tokens": task.n_predict, "n_predict": task.n_predict, "n_keep": 0,
                                   "stream": True, "temperature": 0.8},
                        "next_token": [{"has_next_token": s.task is not None, "has_new_line": False,
                                        "n_remain": remain, "n_decoded": s.decoded}],
                    })
                out.append(item)
            return out

    def props_json(self) -> dict[str, Any]:
        p = self.profile
        return {
            "default_generation_settings": {"params": {"n_predict": -1, "temperature": 0.8}, "n_ctx": p.n_ctx},
            "total_slots": p.slots,
            "model_alias": "sim-llama-1b",
            "model_path": "/models/sim-llama-1b.gguf",
            "endpoint_slots": True,
            "endpoint_props": False,
            "endpoint_metrics": True,
            "build_info": p.build_info,
            "is_sleeping": False,
        }

    def metrics_text(self) -> str:
        with self._lock:
            busy = sum(1 for s in self.slots if s.task is not None)
            counters = [
                ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
                 self.prompt_tokens_total),
                ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
                 self.prompt_tokens_cached_total),
                ("tokens_predicted_total", "Number of generation tokens processed", self.tokens_predicted_total),
                ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding and "
                                   "multimodal decoding", self.n_decode_total),
                ("n_tokens_max", "Largest observed sequence length (prompt + generation)", self.n_tokens_max),
            ]
            gauges = [
                ("requests_processing", "Number of requests processing", busy),
                ("requests_deferred", "Number of requests deferred", len(self.deferred)),
                ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
                 self.n_busy_slots_total / max(1, self.n_decode_total)),
            ]
        lines = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, help_text, value in items:
                lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                          f"llamacpp:{name} {_cpp(value)}"]
        return "\n".join(lines) + "\n"


class _Handler(http.server.BaseHTTPRequestHandler):
    sim: SimLlamacpp

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/slots":
            body, ctype = json.dumps(self.sim.slots_json()).encode(), "application/json; charset=utf-8"
        elif path == "/props":
            body, ctype = json.dumps(self.sim.props_json()).encode(), "application/json; charset=utf-8"
        elif path == "/metrics":
            body, ctype = self.sim.metrics_text().encode(), "text/plain; version=0.0.4"
        elif path == "/health":
            body, ctype = b'{"status":"ok"}', "application/json; charset=utf-8"
        else:
            body, ctype = b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}', "application/json"
            self.send_response(404)
            self._finish(body, ctype)
            return
        self.send_response(200)
        self._finish(body, ctype)

    def _finish(self, body: bytes, ctype: str) -> None:
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass
