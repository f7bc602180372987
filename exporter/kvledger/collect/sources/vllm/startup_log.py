"""vLLM's startup log: the memory profile as measured budget terms.

Lines understood (0.10.2 and current formats; the log prefix before them is ignored):
- "Model loading took 14.99 GiB and 5.4 seconds" / "... took 15.0 GiB memory and 5.4 seconds"
- "Available KV cache memory: 56.21 GiB"
- "GPU KV cache size: 460,496 tokens"
- "Maximum concurrency for 131,072 tokens per request: 3.51x"
- "Graph capturing finished in 5 secs, took 0.67 GiB"
- "Actual usage is W GiB for weight, A GiB for peak activation, N GiB for non-torch
  memory, and C GiB for CUDAGraph memory" and the later form "Actual usage is X GiB for
  consumed memory (weights + non-torch), A GiB for peak activation, and C GiB for
  CUDAGraph memory" (non-torch = consumed - weights when "Model loading took" is known)
- "Current kv cache memory in use is X GiB" / "... is N bytes" (KV pool when the
  "Available" line is absent)

The LAST occurrence of each wins: a restarted server appends a new startup to the log.
Unknown lines are ignored. The file is read incrementally (new bytes since the last read,
bounded per call); a file that shrank (rotated or truncated) is read again from its start.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, fields

from kvledger.config.files import open_regular
from kvledger.domain.facts import MemoryTerm
from kvledger.domain.limits import MAX_SAFE_INT

GIB = 1 << 30
_INT_FIELDS = ("kv_cache_tokens", "concurrency_tokens")
_NUM = r"(-?[0-9][0-9,]*(?:\.[0-9]+)?)"

_PATTERNS: list[tuple[re.Pattern[str], tuple[str, ...]]] = [
    (re.compile(rf"Model loading took {_NUM} ?GiB"), ("weights_gib",)),
    (re.compile(rf"Available KV cache memory: {_NUM} ?GiB"), ("kv_cache_gib",)),
    (re.compile(rf"GPU KV cache size: {_NUM} tokens"), ("kv_cache_tokens",)),
    (re.compile(rf"Maximum concurrency for {_NUM} tokens per request: {_NUM}x?"),
     ("concurrency_tokens", "max_concurrency")),
    (re.compile(rf"Graph capturing finished in {_NUM} secs?, took {_NUM} ?GiB"), ("_graph_secs", "cuda_graph_gib")),
    (re.compile(rf"Actual usage is {_NUM} ?GiB for weights?, {_NUM} ?GiB for peak activation, {_NUM} ?GiB for "
                rf"non-torch memory, and {_NUM} ?GiB for CUDAGraph memory"),
     ("weights_gib", "activation_gib", "non_torch_gib", "cuda_graph_gib")),
    (re.compile(rf"Actual usage is {_NUM} ?GiB for consumed memory \(weights \+ non-torch\), {_NUM} ?GiB for peak "
                rf"activation, and {_NUM} ?GiB for CUDAGraph memory"),
     ("consumed_gib", "activation_gib", "cuda_graph_gib")),
    (re.compile(rf"Current kv cache memory in use is {_NUM} ?GiB"), ("kv_in_use_gib",)),
    (re.compile(rf"Current kv cache memory in use is {_NUM} bytes"), ("kv_in_use_bytes",)),
]


@dataclass(frozen=True, slots=True)
class VllmLogFacts:
    weights_gib: float | None = None
    activation_gib: float | None = None
    non_torch_gib: float | None = None
    consumed_gib: float | None = None  # weights + non-torch (later format)
    cuda_graph_gib: float | None = None
    kv_cache_gib: float | None = None
    kv_in_use_gib: float | None = None
    kv_in_use_bytes: float | None = None
    kv_cache_tokens: int | None = None
    concurrency_tokens: int | None = None
    max_concurrency: float | None = None


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _plausible(name: str, value: float) -> bool:
    """Whether a logged figure stays within what the exporter carries exactly (2**53 - 1
    bytes once a GiB figure is converted, 2**53 - 1 tokens or bytes otherwise)."""
    scale = GIB if name.endswith("_gib") else 1
    return math.isfinite(value) and 0 <= value * scale <= MAX_SAFE_INT


def parse_vllm_log(text: str, base: VllmLogFacts | None = None) -> VllmLogFacts:
    """Facts from log text, over ``base`` (facts of earlier text); later lines win."""
    state = {f.name: getattr(base or VllmLogFacts(), f.name) for f in fields(VllmLogFacts)}
    for line in text.splitlines():
        if "GiB" not in line and "tokens" not in line and "bytes" not in line:
            continue
        for pattern, names in _PATTERNS:
            m = pattern.search(line)
            if not m:
                continue
            values = {name: _number(raw) for name, raw in zip(names, m.groups(), strict=True) if not name.startswith("_")}
            if not all(_plausible(name, v) for name, v in values.items()):
                continue  # a figure no engine logs (beyond 2**53 - 1 bytes or tokens): the line is not read
            for name, number in values.items():
                state[name] = int(number) if name in _INT_FIELDS else number
            # The two "Actual usage" forms exclude each other: the newest one decides.
            if "consumed_gib" in names:
                state["non_torch_gib"] = None
            elif "non_torch_gib" in names:
                state["consumed_gib"] = None
    return VllmLogFacts(**state)


def _bytes(gib: float | None) -> int | None:
    return None if gib is None else max(0, round(gib * GIB))


def memory_terms(facts: VllmLogFacts, gpus: list[int] | tuple[int, ...]) -> list[MemoryTerm]:
    """weights, workspace (peak activation), runtime_buffers (non-torch + CUDA graphs), kv_pool per GPU.

    runtime_buffers sums the components the log measured (the CUDA graph alone in
    0.10.2, which does not log non-torch memory).
    """
    weights = facts.weights_gib
    non_torch = facts.non_torch_gib
    if non_torch is None and facts.consumed_gib is not None and weights is not None:
        non_torch = max(0.0, facts.consumed_gib - weights)
    parts = [v for v in (non_torch, facts.cuda_graph_gib) if v is not None]
    runtime = sum(parts) if parts else None
    kv = facts.kv_cache_gib
    kv_bytes = _bytes(kv) if kv is not None else _bytes(facts.kv_in_use_gib)
    if kv_bytes is None and facts.kv_in_use_bytes is not None:
        kv_bytes = int(facts.kv_in_use_bytes)
    by_category = {
        "weights": _bytes(weights),
        "workspace": _bytes(facts.activation_gib),
        "runtime_buffers": _bytes(runtime),
        "kv_pool": kv_bytes,
    }
    return [
        MemoryTerm(gpu, category, value, "measured")
        for gpu in (gpus or [0])
        for category, value in by_category.items()
        if value is not None
    ]


class VllmLogReader:
    """Incremental reader of a log file; ``read()`` returns the facts so far."""

    def __init__(self, path: str, max_bytes_per_read: int = 16 << 20) -> None:
        self.path = path
        self.max_bytes_per_read = max_bytes_per_read
        self._offset = 0
        self._partial = b""
        self._identity: tuple[int, int] | None = None
        self.facts = VllmLogFacts()

    def unread_reason(self) -> str:
        """Why there are no facts before the first read: the file cannot be found (or
        opened), or it is there and simply not read yet (it is read after each answer of
        the engine's /metrics)."""
        try:
            os.stat(self.path)
        except OSError as exc:
            return f"{self.path}: {exc.strerror or exc}"
        return f"{self.path}: not read yet (it is read after the engine's /metrics answers)"

    def read(self) -> VllmLogFacts:
        """Raises OSError when the file cannot be read (or is no regular file: a FIFO is
        refused, never waited on)."""
        fd = open_regular(self.path)
        try:
            st = os.fstat(fd)
            identity = (st.st_dev, st.st_ino)
            if identity != self._identity or st.st_size < self._offset:
                self._offset, self._partial, self.facts = 0, b"", VllmLogFacts()
                self._identity = identity
            if st.st_size == self._offset:
                return self.facts
            chunk = os.pread(fd, self.max_bytes_per_read, self._offset)
        finally:
            os.close(fd)
        self._offset += len(chunk)
        data = self._partial + chunk
        complete, sep, rest = data.rpartition(b"\n")
        if not sep:
            complete, rest = b"", data
        self._partial = rest[-65536:]  # a line longer than this is not one we parse
        if complete:
            self.facts = parse_vllm_log(complete.decode("utf-8", "replace"), self.facts)
        return self.facts
