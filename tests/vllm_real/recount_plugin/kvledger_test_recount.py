"""A test-only vLLM general plugin: a brute-force recount of the scheduler's KV state.

The real-engine tests put this folder on the server's PYTHONPATH (vLLM finds the entry point
in ``kvledger_test_recount-0.0.dist-info``) and set ``KVLEDGER_TEST_RECOUNT`` to a Unix
socket path. In the EngineCore process, once the scheduler is built, a thread answers every
connection on that socket with one JSON object counted block by block from vLLM's own
objects, independently of kvledger: the pool's blocks with a reference count, the cached
unreferenced ones, and for every KV-cache group manager the distinct blocks its requests'
block tables hold. Read it while the engine is paused (``POST /pause?mode=keep``).
Standard library only; never imported by the test process.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from typing import Any

ENV = "KVLEDGER_TEST_RECOUNT"


def register() -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    from vllm.v1.core.sched import scheduler as sched_module

    cls = sched_module.Scheduler
    if getattr(cls.__init__, "_recount_wrapped", False):
        return
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        threading.Thread(target=_serve, args=(self, path), daemon=True, name="kvledger-test-recount").start()

    __init__._recount_wrapped = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def recount(scheduler: Any) -> dict[str, Any]:
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    null = pool.null_block
    usable = [b for b in pool.blocks if b is not null]
    groups = []
    for m in manager.coordinator.single_type_managers:
        ids = {b.block_id for blocks in list(m.req_to_blocks.values()) for b in blocks if b is not null and b.ref_cnt > 0}
        groups.append({"manager": type(m).__name__, "in_use": len(ids)})
    requests = {}
    for rid, r in list(scheduler.requests.items()):
        tables = [m.req_to_blocks.get(rid) or [] for m in manager.coordinator.single_type_managers]
        requests[str(rid)] = {
            "status": str(r.status.name),
            "prompt_tokens": int(r.num_prompt_tokens),
            "num_computed_tokens": int(r.num_computed_tokens),
            "held": sum(1 for t in tables for b in t if b is not null),
            "tables": [{"entries": len(t), "null": sum(1 for b in t if b is null)} for t in tables],
        }
    return {
        "in_use": sum(1 for b in usable if b.ref_cnt > 0),
        "reclaimable": sum(1 for b in usable if b.ref_cnt == 0 and b.block_hash is not None),
        "references": sum(b.ref_cnt for b in usable),
        "num_free": int(pool.get_num_free_blocks()),
        "groups": groups,
        "requests": requests,
    }


def _serve(scheduler: Any, path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    while True:
        conn, _ = server.accept()
        with conn:
            try:
                body = json.dumps(recount(scheduler)).encode()
            except Exception as exc:  # the engine moved under the count: say so, the test retries
                body = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
            conn.sendall(body)
