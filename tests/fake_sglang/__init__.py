"""A minimal fake ``sglang`` (tests only) and a driver that runs workloads on it.

``sglang/`` mimics what ``kvledger_engine.sglang`` reads of SGLang 0.5.23 (module paths,
class, method and attribute names: ``Scheduler``, ``ScheduleBatch.retract_decode``, ``Req``'s
``kv_allocated_len``/``kv_committed_len``/``cache_protected_len``, the token pool's
allocator, the radix cache's evictable and protected sizes, the plugin framework's entry
point group and ``HookRegistry``); the scheduling is a small version of SGLang's own
(admission against free plus evictable tokens less ``new_token_ratio`` times the running
requests' remaining output, pages taken from the radix cache's prefix match, decode
retraction when a step cannot get its pages, finished requests' full pages inserted into
the radix cache). It is our own implementation, written from SGLang's behaviour, not a copy.

``installed()`` puts it on ``sys.path`` for the duration of a ``with`` block and removes
every ``sglang`` module afterwards. ``driver`` builds schedulers and recounts their state
page by page, independently of kvledger.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent
_OURS = ("sglang", "fake_sglang.driver", "kvledger_engine.sglang")


def _ours(name: str) -> bool:
    return any(name == n or name.startswith(n + ".") for n in _OURS)


@contextmanager
def installed() -> Iterator[ModuleType]:
    """The fake ``sglang`` importable inside the block; yields ``fake_sglang.driver``."""
    leftovers = [name for name in sys.modules if _ours(name) and name.split(".")[0] == "sglang"]
    assert not leftovers, f"an sglang module is already imported: {leftovers}"
    sys.path.insert(0, str(ROOT))
    importlib.invalidate_caches()
    try:
        driver = importlib.import_module("fake_sglang.driver")
        assert Path(importlib.import_module("sglang").__file__ or "").is_relative_to(ROOT), "not the fake sglang"
        yield driver
    finally:
        sys.path.remove(str(ROOT))
        for name in [name for name in sys.modules if _ours(name)]:
            del sys.modules[name]
