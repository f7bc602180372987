"""A test-only SGLang general plugin: a brute-force recount of the scheduler's KV state.

Installed into the real-SGLang venv by ``tests/sglang_real/setup_env.sh`` (entry point group
``sglang.srt.plugins``, name ``kvledger_test_recount``); it does nothing unless
``KVLEDGER_TEST_RECOUNT`` names a Unix socket path. Then, in the scheduler process, once the
``Scheduler`` is built, a thread answers every connection on that socket with one JSON object
counted slot by slot from SGLang's own objects, independently of SGLang's gauges (never
``available_size()``, ``evictable_size()`` or the metrics collector):

- ``free``: the distinct token slots in the allocator's free lists (``free_pages`` and
  ``release_pages``, times the page size when pages hold more than one token);
- ``request_slots``: the distinct slots in every live request's ``req_to_token`` row up to its
  ``kv_allocated_len`` (running batch, the last batch not yet merged, the chunked request and
  waiting requests that still hold a row);
- ``evictable`` / ``protected``: the distinct slots the radix tree holds on the device (its
  values, ``all_values_flatten()``: SGLang 0.5.23's default tree core is in Rust, its nodes are
  not walkable from Python), split by whether a live request's row holds them (a request locks
  the path of its cached prefix, which is the head of its row; nothing else locks a node here);
- ``in_use``: the union of the request slots and the protected tree slots (what no eviction can
  take), and ``unaccounted``: slots in none of free, tree or requests (a leak; 0 expected);
- ``running`` / ``waiting``, per-request rows, and the retractions seen by a hook on
  ``ScheduleBatch.retract_decode`` (requests and the tokens they held when retracted);
- ``running_batch``: every request in SGLang's running batch, finished ones included (those
  that finished in the last step stay there until the next batch is formed; SGLang's
  ``num_running_reqs`` counts them).

Read it while the engine is paused (``POST /pause_generation {"mode": "in_place"}`` followed by
a request that goes through the scheduler, e.g. ``GET /server_info``). Standard library only
(torch tensors are read through their own ``tolist()``); never imported by the test process.
Checked against SGLang 0.5.23.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from typing import Any

ENV = "KVLEDGER_TEST_RECOUNT"
SCHEDULER_INIT = "sglang.srt.managers.scheduler.Scheduler.__init__"
RETRACT = "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode"

#: retractions seen by the hook (the scheduler thread appends, the socket thread reads)
_retractions: list[dict[str, Any]] = []
_lock = threading.Lock()


def register() -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        threading.Thread(target=_serve, args=(scheduler, path), daemon=True, name="kvledger-test-recount").start()

    def after_retract(result: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
        retracted = result[0] if isinstance(result, tuple) and result else []
        with _lock:
            for req in retracted:
                _retractions.append({
                    "rid": str(req.rid),
                    "input_tokens": len(req.origin_input_ids),
                    "output_tokens": len(req.output_ids),
                })

    HookRegistry.register(SCHEDULER_INIT, after_init, HookType.AFTER)
    HookRegistry.register(RETRACT, after_retract, HookType.AFTER)


def _slots(tensor: Any, page_size: int) -> set[int]:
    """Token slots of a free list: page ids times the page size (pages of one token: the ids)."""
    ids = [int(x) for x in tensor.tolist()]
    if page_size == 1:
        return set(ids)
    return {p * page_size + i for p in ids for i in range(page_size)}


def _live_requests(scheduler: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """(running, waiting, every request holding a req_to_token row), deduplicated."""
    running = [r for r in scheduler.running_batch.reqs if not r.finished()]
    waiting = list(scheduler.waiting_queue)
    seen: dict[int, Any] = {}
    last = getattr(scheduler, "last_batch", None)
    chunked = getattr(scheduler, "chunked_req", None)
    for req in [*running, *(last.reqs if last is not None else []), *([chunked] if chunked else []), *waiting]:
        if req.kv.holds_kv and not req.finished():
            seen.setdefault(id(req), req)
    return running, waiting, list(seen.values())


def recount(scheduler: Any) -> dict[str, Any]:
    allocator = scheduler.token_to_kv_pool_allocator
    page_size = int(getattr(allocator, "page_size", 1))
    capacity = int(scheduler.max_total_num_tokens)
    free = _slots(allocator.free_pages, page_size) | _slots(allocator.release_pages, page_size)
    tree_values = [int(x) for x in scheduler.tree_cache.all_values_flatten().tolist()]
    tree = set(tree_values)
    req_to_token = scheduler.req_to_token_pool.req_to_token
    running, waiting, holders = _live_requests(scheduler)
    request_slots: set[int] = set()
    rows = {}
    for req in holders:
        kv = req.kv
        held = {int(x) for x in req_to_token[kv.req_pool_idx, : kv.kv_allocated_len].tolist()}
        request_slots |= held
        rows[str(req.rid)] = {
            "state": "running" if req in running else "waiting",
            "prompt_tokens": len(req.origin_input_ids),
            "output_tokens": len(req.output_ids),
            "max_new_tokens": req.sampling_params.max_new_tokens,
            "allocated": int(kv.kv_allocated_len),
            "cache_protected": int(kv.cache_protected_len),
            "held": len(held),
            "private": len(held - tree),
        }
    protected = tree & request_slots
    evictable = tree - request_slots
    in_use = request_slots | protected
    every = set(range(1, capacity + 1))  # slot 0 is SGLang's padding slot, never allocated
    with _lock:
        retractions = list(_retractions)
    return {
        "capacity": capacity,
        "page_size": page_size,
        "free": len(free),
        "evictable": len(evictable),
        "protected": len(protected),
        "tree_duplicates": len(tree_values) - len(tree),
        "request_slots": len(request_slots),
        "in_use": len(in_use),
        "unaccounted": len(every - free - tree - request_slots),
        "overlaps": {
            "free_and_tree": len(free & tree),
            "free_and_requests": len(free & request_slots),
            "evictable_and_requests": len(evictable & request_slots),
            "outside_the_pool": len((free | tree | request_slots) - every),
        },
        "running": len(running),
        "running_batch": len(scheduler.running_batch.reqs),
        "waiting": len(waiting),
        "rows_in_use": int(scheduler.req_to_token_pool.size) - len(scheduler.req_to_token_pool.free_slots),
        "requests": rows,
        "retractions": retractions,
        "paused": bool(getattr(scheduler, "_engine_paused", False)),
        "forward_ct_decode": int(getattr(scheduler.metrics_reporter, "forward_ct_decode", -1)),
        # SGLang's own counters, for a diagnosis when the counts differ (the tests never compare with them)
        "sglang_says": {
            "available_size": int(allocator.available_size()),
            "evictable_size": int(scheduler.tree_cache.evictable_size()),
            "protected_size": int(scheduler.tree_cache.protected_size()),
        },
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
