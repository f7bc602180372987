"""What the SGLang plugin reads of SGLang's scheduler: every SGLang name it touches is here.

Read (never written), on the scheduler's thread, at a publication:

- the requests: ``scheduler.running_batch``, ``cur_batch``, ``last_batch`` (each a
  ``ScheduleBatch`` with ``reqs``), the batch a hook saw, ``chunked_req`` (a prompt
  prefilled in chunks) and ``waiting_queue`` (a retracted request waits here again, holding
  nothing); a request is admitted while it holds a row of the request-to-token pool
  (``req_pool_idx``) and has not ``finished()``;
- of each ``Req``: ``rid``, ``origin_input_ids`` (the prompt), ``output_ids`` (output so
  far), ``sampling_params.max_new_tokens`` (its cap), ``finished()``, ``priority``, and of its
  KV record ``req.kv`` (``ReqKvInfo`` in 0.5.23; the request itself on builds before it):
  ``req_pool_idx`` (its row of the request-to-token pool: it holds KV), ``kv_allocated_len``
  (tokens it holds in the pool, its cached prefix included), ``kv_committed_len`` (of those,
  computed), ``cache_protected_len`` (of those, owned by the radix cache);
- ``scheduler.token_to_kv_pool_allocator``: ``page_size``, ``size`` (tokens of the pool),
  ``available_size()`` (free tokens), ``get_kvcache().get_kv_size_bytes()`` (the pool's bytes);
- ``scheduler.tree_cache`` (the radix cache: ``UnifiedRadixCache`` with the full-attention
  component alone in 0.5.23, ``RadixCache`` before it, ``ChunkCache`` with the radix cache
  off): ``evictable_size()`` (cached tokens no request holds: reclaimable),
  ``protected_size()`` (cached tokens running requests hold);
- the admission estimate: the scheduler's ``new_token_ratio`` (``new_token_ratio_tracker.current``
  on builds that keep it in a tracker) and ``CLIP_MAX_NEW_TOKENS`` of
  ``sglang.srt.managers.schedule_policy`` (the clip of each request's remaining output in
  that estimate);
- budgets: ``max_running_requests``, ``chunked_prefill_size`` (server args), ``model_config.context_len``.

A missing name raises ``Unsupported`` at attach time (the plugin then stays off, SGLang
runs unchanged).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvledger_engine.vllm.published import PoolStatic, RequestRow
from kvledger_engine.vllm.tracker import PoolSummary

#: SGLang release series this module was read against (SGLang 0.5.23's scheduler)
SUPPORTED_SERIES: tuple[str, ...] = ("0.5",)
#: SGLang's default clip of one request's remaining output in its admission estimate
#: (``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION``), used where the module constant is not found
DEFAULT_CLIP = 4096


class Unsupported(Exception):
    """This SGLang (version, configuration or internals) cannot be read exactly."""


def sglang_version() -> str:
    import importlib

    return str(importlib.import_module("sglang.version").__version__)


def check_version(version: str, allow_untested: bool) -> None:
    series = ".".join(version.split("+", 1)[0].split(".")[:2])
    if series not in SUPPORTED_SERIES and not allow_untested:
        raise Unsupported(
            f"SGLang {version} is not a release series the plugin was tested with ({', '.join(SUPPORTED_SERIES)}); "
            "KVLEDGER_SGLANG_UNTESTED=1 tries it anyway"
        )


def _require(obj: Any, name: str, what: str) -> Any:
    value = getattr(obj, name, None)
    if value is None:
        raise Unsupported(f"{what} has no {name!r}: this SGLang's internals differ from the ones the plugin reads")
    return value


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The scheduler's state at one publication (taken on its thread)."""

    rows: dict[str, RequestRow]
    summary: PoolSummary
    budgets: dict[str, int]
    new_token_ratio: float | None
    radix_protected_tokens: int


#: prefix caches of hybrid pools or host tiers (SGLang 0.5.23's class names)
REFUSED_CACHES = ("SWARadixCache", "PureSWARadixCache", "MambaRadixCache", "HiRadixCache", "HiMambaRadixCache",
                  "LMCacheUnifiedRadixCache", "LMCRadixCache")


def _refused_cache(scheduler: Any, tree: Any) -> str | None:
    """Why the scheduler's pool is not one full-attention token pool (None when it is):
    a hybrid model (``is_hybrid_swa``, ``is_hybrid_ssm``), a unified radix tree with a
    sliding-window or Mamba component, a cache with a host tier (``cache_controller``:
    HiCache), or a cache class of those kinds."""
    name = type(tree).__name__
    if getattr(scheduler, "is_hybrid_swa", False) or getattr(scheduler, "is_hybrid_ssm", False):
        return f"a hybrid model's pools ({name})"
    if getattr(tree, "is_swa_enabled", False) or getattr(tree, "is_mamba_enabled", False):
        return f"{name} with sliding-window or Mamba components"
    if getattr(tree, "cache_controller", None) is not None:
        return f"{name} with a host tier (HiCache)"
    if name in REFUSED_CACHES:
        return name
    return None


class SchedulerView:
    """SGLang's scheduler as the plugin reads it."""

    def __init__(self, scheduler: Any, tenant_mode: str = "", ranks: dict[str, Any] | None = None) -> None:
        """``ranks``: the scheduler's ``tp_rank``, ``pp_rank`` and ``dp_rank`` as SGLang built it
        (its constructor's arguments); else the scheduler's attributes of those names."""
        self.scheduler = scheduler
        ranks = ranks or {}

        def rank(name: str) -> int:
            value = ranks.get(name, getattr(scheduler, name, None))
            return int(value) if isinstance(value, int) else 0

        self.tenant_mode = tenant_mode
        alloc = _require(scheduler, "token_to_kv_pool_allocator", "the scheduler")
        self.allocator = alloc
        self.tree = _require(scheduler, "tree_cache", "the scheduler")
        for name in ("evictable_size", "protected_size"):
            _require(self.tree, name, "the radix cache")
        _require(alloc, "available_size", "the token pool's allocator")
        self.page_size = int(getattr(alloc, "page_size", 1) or 1)
        size = int(_require(alloc, "size", "the token pool's allocator"))
        if size < self.page_size:
            raise Unsupported(f"a token pool of {size} tokens holds no page of {self.page_size}")
        self.num_pages = size // self.page_size
        refused = _refused_cache(scheduler, self.tree)
        if refused:
            raise Unsupported(f"{refused}: the plugin states one full-attention token pool only "
                              "(hybrid SWA/Mamba pools and HiCache tiers are refused)")
        self.dp_rank = rank("dp_rank")
        args = getattr(scheduler, "server_args", None)
        self.dp_size = int(getattr(args, "dp_size", 1) or 1)
        self.serving_rank = rank("tp_rank") == 0 and rank("pp_rank") == 0
        self.static = PoolStatic(
            id=str(self.dp_rank), block_size=self.page_size, block_bytes=self._page_bytes(size),
            num_blocks=self.num_pages, sliding_window=None, speculative_slots=0,
        )
        self.max_running_requests = int(getattr(scheduler, "max_running_requests", 0) or 0) or None
        model_config = getattr(scheduler, "model_config", None)
        self.context_len = int(getattr(model_config, "context_len", 0) or 0) or None
        self.chunked_prefill_size = int(getattr(args, "chunked_prefill_size", 0) or 0) or None
        self.clip = self._clip()

    def _page_bytes(self, size: int) -> int:
        """Bytes of one page over all layers (K and V); the pool's buffers hold ``size``
        tokens plus one padding page, which is no capacity."""
        kv = self.allocator.get_kvcache() if hasattr(self.allocator, "get_kvcache") else None
        sizes = getattr(kv, "get_kv_size_bytes", None)
        if sizes is None:
            raise Unsupported("the token pool states no size in bytes (get_kvcache().get_kv_size_bytes())")
        k_bytes, v_bytes = sizes()
        slots = size + self.page_size
        per_token = (int(k_bytes) + int(v_bytes)) // slots
        if per_token <= 0:
            raise Unsupported(f"the token pool's bytes ({k_bytes} + {v_bytes}) give no bytes per token")
        return per_token * self.page_size

    @staticmethod
    def _clip() -> int:
        policy = sys.modules.get("sglang.srt.managers.schedule_policy")
        clip = getattr(policy, "CLIP_MAX_NEW_TOKENS", None)
        if isinstance(clip, int) and clip > 0:
            return clip
        raw = os.environ.get("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", "")
        return int(raw) if raw.isdigit() and int(raw) > 0 else DEFAULT_CLIP

    # ---------------------------------------------------------------- requests
    def requests(self, in_flight: tuple[Any, ...] = ()) -> Iterator[tuple[Any, str]]:
        """(req, state) of every request the scheduler holds: running ones first.

        Admitted (running): every request of the running batch, of the batches in flight
        (``in_flight``: the batches the hook saw: the plan ``get_next_batch_to_run`` returned,
        whose running batch the scheduler takes only after the hook), of ``last_batch`` (a
        prefilled batch joins the running batch only when the scheduler next looks for
        work) and the chunked request, that still holds its row of the request-to-token pool
        and has not finished (a finished request stays in its batch until the next filter,
        its pages already given back). Waiting: ``waiting_queue``."""
        s = self.scheduler
        seen = set()
        batches = (*in_flight, getattr(s, "running_batch", None), getattr(s, "last_batch", None))
        chunked = getattr(s, "chunked_req", None)
        for reqs in (*(getattr(b, "reqs", None) or () for b in batches), () if chunked is None else (chunked,)):
            for req in reqs:
                if id(req) in seen or getattr(getattr(req, "kv", req), "req_pool_idx", None) is None or req.finished():
                    continue
                seen.add(id(req))
                yield req, "running"
        for req in getattr(s, "waiting_queue", None) or ():
            if id(req) not in seen:
                seen.add(id(req))
                yield req, "waiting"

    def row(self, req: Any, state: str) -> RequestRow:
        if state == "running":
            kv = getattr(req, "kv", req)
            held, computed = kv.kv_allocated_len or 0, kv.kv_committed_len or 0
            if computed > held:
                computed = held
        else:
            held = computed = 0
        tenant = None
        if self.tenant_mode == "priority":
            priority = getattr(req, "priority", None)
            tenant = None if priority is None else str(priority)
        return RequestRow(str(req.rid), state, len(req.origin_input_ids), int(req.sampling_params.max_new_tokens),
                          len(req.output_ids), int(computed), -(-int(held) // self.page_size), tenant)

    def new_token_ratio(self) -> float | None:
        s = self.scheduler
        tracker = getattr(s, "new_token_ratio_tracker", None)
        value = getattr(tracker, "current", None) if tracker is not None else getattr(s, "new_token_ratio", None)
        return float(value) if isinstance(value, (int, float)) else None

    def snapshot(self, iteration_tokens: int | None = None, in_flight: tuple[Any, ...] = ()) -> Snapshot:
        page = self.page_size
        rows: dict[str, RequestRow] = {}
        references = 0
        row = self.row
        for req, state in self.requests(in_flight):
            r = row(req, state)
            rows[r.id] = r
            references += r.blocks_held
        free = self.allocator.available_size() // page
        reclaimable = self.tree.evictable_size() // page
        summary = PoolSummary(
            in_use=self.num_pages - free - reclaimable, reclaimable=reclaimable, free=free,
            references=references, shared=None,
        )
        budgets = {}
        if self.max_running_requests is not None:
            budgets["max_num_seqs"] = self.max_running_requests
        if self.context_len is not None:
            budgets["max_model_len"] = self.context_len
        if self.chunked_prefill_size is not None:
            budgets["max_num_batched_tokens"] = self.chunked_prefill_size
        if iteration_tokens is not None:
            budgets["iteration_tokens"] = iteration_tokens
        return Snapshot(rows, summary, budgets, self.new_token_ratio(), int(self.tree.protected_size()))

    def fingerprint(self, in_flight: tuple[Any, ...] = ()) -> tuple[int, ...]:
        """Cheap figures that change whenever the state a publication shows does: the step
        count, the queues' lengths and the pool's free and evictable tokens."""
        s = self.scheduler
        running = getattr(getattr(s, "running_batch", None), "reqs", None) or ()
        return (int(getattr(s, "forward_ct", 0) or 0), len(running), len(getattr(s, "waiting_queue", None) or ()),
                sum(len(getattr(b, "reqs", None) or ()) for b in in_flight), int(self.allocator.available_size()),
                int(self.tree.evictable_size()), 0 if getattr(s, "chunked_req", None) is None else 1)

    @staticmethod
    def retraction(req: Any) -> int:
        """Computed tokens a retraction of ``req`` throws away now: what it computed, less
        the prefix the radix cache keeps (a later admission finds that again)."""
        kv = getattr(req, "kv", req)
        committed = int(getattr(kv, "kv_committed_len", 0) or 0)
        kept = int(getattr(kv, "cache_protected_len", 0) or 0)
        return max(0, committed - kept)
