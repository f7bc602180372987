"""A minimal fake ``vllm`` (tests only) and a driver that runs realistic workloads on it.

``vllm/`` mimics exactly what ``kvledger_engine.vllm.internals`` reads of vLLM 0.32
(module paths, class and attribute names, the block pool's semantics as in
vllm/v1/core/block_pool.py); the scheduling policy is a small FCFS version of vLLM's
(running requests first, preemption of the last running request when the pool is full,
prefix-cache hits for waiting requests, chunked prefill). It is our own implementation,
written from vLLM's behaviour, not a copy.

``installed()`` puts it on ``sys.path`` for the duration of a ``with`` block and removes
every ``vllm`` module afterwards, so that nothing of it leaks into other tests.
``driver`` (imported inside ``installed()``) builds engines and recounts their state by
brute force, independently of kvledger.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent
_OURS = ("vllm", "fake_vllm.driver")


def _ours(name: str) -> bool:
    return any(name == n or name.startswith(n + ".") for n in _OURS)


@contextmanager
def installed() -> Iterator[ModuleType]:
    """The fake ``vllm`` importable inside the block; yields ``fake_vllm.driver``."""
    leftovers = [name for name in sys.modules if _ours(name)]
    assert not leftovers, f"a vllm module is already imported: {leftovers}"
    sys.path.insert(0, str(ROOT))
    importlib.invalidate_caches()
    try:
        driver = importlib.import_module("fake_vllm.driver")
        assert Path(importlib.import_module("vllm").__file__ or "").is_relative_to(ROOT), "not the fake vllm"
        yield driver
    finally:
        sys.path.remove(str(ROOT))
        for name in [name for name in sys.modules if _ours(name)]:
            del sys.modules[name]
