"""A simulated LLM engine driven by the reference Ledger.

Each ``step()`` is one scheduler iteration over simulated time: Poisson arrivals with
log-normal prompt and output lengths, shared system-prompt prefixes (prefix blocks
hit in the cache are shared by reference count; finished requests leave them
reclaimable for later hits), parallel sampling (contexts > 1), speculative lookahead
slots, output bounds that are estimates (and sometimes overflow), bound raises that
are re-checked, preemption under dynamic admission when blocks run out, tenant
quotas, a host output buffer and a network queue with limits, and an iteration
token budget. Everything random comes from one seeded ``random.Random``: the same
seed and number of steps give the same ledger.

``fault`` makes the engine misbehave in a way the exporter must expose:

- ``none``
- ``reserve-overcommit``: a reserve-cap engine admits against physical free memory
  instead of its quota (reserved > capacity). That only shows when demand exceeds the
  quota, so the faulty engine also gets ``FAULT_LOAD`` times its arrival rate: the healthy
  demo's engines are not saturated (tests/test_demo_quiet.py).
- ``per-request-used``: the engine's own used-blocks claim
  (``pools[].engine_reported_used_blocks``) counts references, not unique blocks.
- ``leak``: some releases are lost; the ledger's periodic sweep counts the leaks.
- ``overflow``: output estimates are exceeded most of the time.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvledger_engine.reference_ledger import Ledger, OutOfBlocks, PoolSpec

FAULTS = ("none", "reserve-overcommit", "per-request-used", "leak", "overflow")
#: arrival-rate factor of a faulty engine: the load that exposes the fault
FAULT_LOAD = {"reserve-overcommit": 1.5}
GiB = 2**30


@dataclass(frozen=True)
class SimProfile:
    """The shape and workload of one simulated engine."""

    name: str
    engine_kind: str = "vllm"
    engine_version: str = "sim"
    admission: str = "dynamic"
    overflow: str = "preempt-recompute"
    pools: tuple[PoolSpec, ...] = (PoolSpec("0", 16, 2 * 2**20, 2048),)
    max_model_len: int = 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    step_seconds: float = 0.075
    decode_tokens_per_step: int = 4  # one step stands for a few decode iterations
    arrival_rate: float = 8.0  # requests per simulated second
    prompt_log_mean: float = 5.5  # log-normal user prompt length
    prompt_log_sigma: float = 0.8
    output_log_mean: float = 4.5
    output_log_sigma: float = 0.8
    system_prompts: tuple[int, ...] = ()  # token lengths of shared system prompts
    system_prompt_prob: float = 0.0
    parallel_prob: float = 0.0  # share of requests with n > 1 samples
    max_contexts: int = 4
    speculative_slots: int = 0
    estimate_prob: float = 0.0  # share of requests whose bound is an estimate
    # the output an estimated bound stands for: the bound times uniform(0.5, this); above 1
    # some estimates overflow (the ``overflow`` fault overflows most of them)
    estimate_stretch_max: float = 1.25
    raise_bound_prob: float = 0.01  # per running request per step
    tenants: tuple[tuple[str, int | None], ...] = ()  # (name, quota bytes or None)
    gpus: tuple[int, ...] = (0,)
    weights_bytes: int = 16 * GiB
    workspace_bytes: int = 2 * GiB
    runtime_buffers_bytes: int = GiB
    reserve_bytes: int = 2 * GiB
    output_buffer_limit_bytes: int = 64 * 2**20
    network_queue_limit: int = 256
    include_blocks: bool = True
    leak_sweep_steps: int = 20
    # "ledger": a kvledger/v1 document; "vllm": stock vLLM's /metrics and KV events; a kind of
    # kvledger.sim.engine_frontends.FRONTENDS: that engine's /metrics
    served_as: str = "ledger"


@dataclass
class _SimRequest:
    id: str
    pool: str
    prompt_tokens: int
    target_output: int
    prefix_hashes: list[tuple[Any, ...]]
    order: int
    prefilled: bool = False


def _poisson(rng: random.Random, mean: float) -> int:
    if mean <= 0:
        return 0
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


class SimEngine:
    """A simulated engine; ``document()`` is its kvledger/v1 ledger (thread-safe)."""

    def __init__(self, profile: SimProfile, *, seed: int = 0, fault: str = "none", pid: int | None = None) -> None:
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {', '.join(FAULTS)}, got {fault!r}")
        self.profile = profile
        self.fault = fault
        self.pid = pid
        self.rng = random.Random(seed)
        quotas = {name: quota for name, quota in profile.tenants if quota is not None}
        self.ledger = Ledger(
            profile.pools,
            admission=profile.admission,
            overflow=profile.overflow,
            max_model_len=profile.max_model_len,
            max_num_seqs=profile.max_num_seqs,
            max_num_batched_tokens=profile.max_num_batched_tokens,
            engine_kind=profile.engine_kind,
            engine_version=profile.engine_version,
            tenant_quotas=quotas,
        )
        self.memory_terms = self._memory_terms()
        self.ledger.set_memory(self.memory_terms)
        self.steps = 0
        self._next_id = 0
        self._order = 0
        self._requests: dict[str, _SimRequest] = {}
        self._waiting: list[str] = []
        self._buffer_bytes = 0
        self._queue_depth = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._step_lock = threading.Lock()
        # prefix-cache lookups of admitted requests, in tokens (vLLM's prefix_cache_queries/hits)
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        #: called at the end of every step, under the step lock (the ledger is between steps)
        self.step_listeners: list[Callable[[], object]] = []  # called after each step; results ignored

    # ------------------------------------------------------------ setup

    def _memory_terms(self) -> list[tuple[int, str, int, str]]:
        p = self.profile
        ranks = max(1, len(p.gpus))
        kv_bytes = sum(s.num_blocks * s.block_bytes for s in p.pools) // ranks
        terms = []
        for gpu in p.gpus:
            terms += [
                (gpu, "weights", p.weights_bytes // ranks, "measured"),
                (gpu, "workspace", p.workspace_bytes, "measured"),
                (gpu, "runtime_buffers", p.runtime_buffers_bytes, "estimate"),
                (gpu, "kv_pool", kv_bytes, "measured"),
                (gpu, "reserve", p.reserve_bytes, "configured"),
            ]
        return terms

    # ------------------------------------------------------------ workload

    def _new_request(self) -> None:
        p, rng = self.profile, self.rng
        rid = f"{p.name}-{self._next_id}"
        self._next_id += 1
        pool = p.pools[self._next_id % len(p.pools)]
        user = max(1, int(rng.lognormvariate(p.prompt_log_mean, p.prompt_log_sigma)))
        prefix_hashes: list[tuple[Any, ...]] = []
        prefix = 0
        if p.system_prompts and rng.random() < p.system_prompt_prob:
            which = rng.randrange(len(p.system_prompts))
            prefix = p.system_prompts[which]
            prefix_hashes = [("system", which, i) for i in range(prefix // pool.block_size)]
        prompt = min(prefix + user, p.max_model_len // 2)
        prefix_hashes = prefix_hashes[: prompt // pool.block_size]
        wanted = max(1, int(rng.lognormvariate(p.output_log_mean, p.output_log_sigma)))
        room = p.max_model_len - prompt - p.speculative_slots
        estimate = rng.random() < (0.8 if self.fault == "overflow" else p.estimate_prob)
        if estimate:
            bound = max(1, min(wanted, room))
            stretch = rng.uniform(1.1, 2.5) if self.fault == "overflow" else rng.uniform(0.5, p.estimate_stretch_max)
            target = max(1, min(int(bound * stretch), room))
        else:
            bound = max(1, min(int(wanted * rng.uniform(1.0, 2.0)), room))
            target = max(1, min(wanted, bound))
        contexts = rng.randint(2, p.max_contexts) if rng.random() < p.parallel_prob else 1
        tenant = None
        if p.tenants and rng.random() < 0.8:
            tenant = p.tenants[rng.randrange(len(p.tenants))][0]
        self.ledger.submit(
            rid, prompt, bound, output_bound="estimate" if estimate else "cap", tenant=tenant,
            contexts=contexts, speculative_slots=p.speculative_slots, pool=pool.id,
        )
        self._requests[rid] = _SimRequest(rid, pool.id, prompt, target, prefix_hashes, 0)
        self._waiting.append(rid)

    # ------------------------------------------------------------ scheduling

    def _running(self) -> list[str]:
        return sorted(
            (rid for rid in self.ledger.request_ids("running") if rid in self._requests),
            key=lambda r: self._requests[r].order,
        )

    def _preempt_for(self, rid: str) -> bool:
        """Free blocks for ``rid`` by preempting the newest other running request (or itself)."""
        running = self._running()
        victims = [r for r in running if r != rid]
        victim = victims[-1] if victims else rid
        self.ledger.preempt(victim)
        return victim != rid

    def _advance(self, rid: str, tokens: int) -> bool:
        """Advance, preempting under dynamic admission when blocks run out; False when rid stalled."""
        while True:
            try:
                self.ledger.advance(rid, tokens)
                return True
            except OutOfBlocks:
                if self.profile.admission != "dynamic":
                    return False  # a reserve-cap engine never preempts: the request stalls
                if not self._preempt_for(rid):
                    return False

    def _cache_prompt(self, req: _SimRequest) -> None:
        spec = next(s for s in self.profile.pools if s.id == req.pool)
        if spec.sliding_window is not None:
            return
        blocks = self.ledger.request_blocks(req.id)
        full = req.prompt_tokens // spec.block_size
        hashes = [
            req.prefix_hashes[i] if i < len(req.prefix_hashes) else ("request", req.id, i)
            for i in range(min(full, len(blocks)))
        ]
        self.ledger.cache(blocks[: len(hashes)], hashes, pool=req.pool)

    def _finish(self, rid: str, generated: int) -> None:
        if self.fault == "leak" and self.rng.random() < 0.3:
            self.ledger.forget(rid)
        else:
            self.ledger.release(rid)
        del self._requests[rid]
        self._buffer_bytes += generated * 1500
        self._queue_depth += 1

    def step(self) -> None:
        """One scheduler iteration."""
        with self._step_lock:
            self._step()
            for listener in self.step_listeners:
                listener()

    @contextmanager
    def between_steps(self) -> Iterator[None]:
        """Hold the engine between two steps (a consistent view of the ledger)."""
        with self._step_lock:
            yield

    def _step(self) -> None:
        p, rng, ledger = self.profile, self.rng, self.ledger
        for _ in range(_poisson(rng, p.arrival_rate * FAULT_LOAD.get(self.fault, 1.0) * p.step_seconds)):
            self._new_request()
        budget = p.max_num_batched_tokens
        docs = {r["id"]: r for r in ledger.to_document(include_blocks=False)["requests"]}

        # 1. running requests: decode (or continue prefill) within the token budget
        for rid in self._running():
            if ledger.state(rid) != "running":
                continue  # preempted earlier in this step
            req, doc = self._requests[rid], docs.get(rid)
            if doc is None:
                continue
            known = doc["prompt_tokens"] + doc["generated_tokens"]
            remaining_prefill = known - doc["computed_tokens"]
            if remaining_prefill > 0:
                tokens = min(remaining_prefill, budget)
            else:
                left = req.target_output - doc["generated_tokens"]
                tokens = min(p.decode_tokens_per_step, left, budget)
                if doc["output_bound"] == "cap":
                    tokens = min(tokens, doc["max_output_tokens"] - doc["generated_tokens"])
            if tokens <= 0:
                capped = doc["generated_tokens"] >= doc["max_output_tokens"] and doc["output_bound"] == "cap"
                if doc["generated_tokens"] >= req.target_output or capped:
                    self._finish(rid, doc["generated_tokens"])
                continue
            if not self._advance(rid, tokens):
                continue
            budget -= tokens
            if not req.prefilled and doc["computed_tokens"] + tokens >= doc["prompt_tokens"]:
                req.prefilled = True
                self._cache_prompt(req)
            if rng.random() < p.raise_bound_prob:
                ledger.raise_bound(rid, int(doc["max_output_tokens"] * rng.uniform(1.2, 2.0)) + 1)

        # 2. resume preempted requests when the pool has room again
        preempted = sorted(ledger.request_ids("preempted"), key=lambda r: self._requests[r].order)
        for rid in preempted:
            req = self._requests[rid]
            stats = ledger.pool_stats(req.pool)
            need = -(-(req.prompt_tokens + docs[rid]["generated_tokens"]) // self._block_size(req.pool))
            if stats["free"] + stats["reclaimable"] < need + self._capacity(req.pool) // 10:
                break  # oldest first: wait for room
            ledger.resume(rid)
        preempted_left = bool(ledger.request_ids("preempted"))

        # 3. admit waiting requests (FIFO), within max_num_seqs and the remaining budget
        admitted = len(ledger.request_ids("running")) + len(ledger.request_ids("preempted"))
        still_waiting = []
        for rid in self._waiting:
            req = self._requests[rid]
            if preempted_left or admitted >= p.max_num_seqs or budget <= 0 or not self._admit(req):
                still_waiting.append(rid)
                continue
            admitted += 1
            hits = ledger.lookup(req.prefix_hashes, pool=req.pool)
            self.prefix_queried_tokens += req.prompt_tokens
            self.prefix_hit_tokens += len(hits) * self._block_size(req.pool)
            ledger.count_prefix_lookup(req.prompt_tokens, len(hits) * self._block_size(req.pool))
            if hits:
                ledger.share(rid, hits)
                self._advance(rid, len(hits) * self._block_size(req.pool))
            budget -= min(budget, req.prompt_tokens)
        # a full queue turns new arrivals away (cancelled before admission)
        while len(still_waiting) > 4 * p.max_num_seqs:
            rid = still_waiting.pop()
            ledger.release(rid)
            del self._requests[rid]
        self._waiting = still_waiting

        # 4. figures
        ledger.set_iteration_tokens(p.max_num_batched_tokens - budget)
        self._buffer_bytes = max(0, int(self._buffer_bytes * 0.7) - rng.randrange(2048))
        self._buffer_bytes += sum(1 for _ in ledger.request_ids("running")) * p.decode_tokens_per_step * 1500
        self._queue_depth = max(0, self._queue_depth - rng.randint(0, 3)) + _poisson(rng, 0.5)
        ledger.set_host(
            output_buffer_bytes=self._buffer_bytes,
            output_buffer_limit_bytes=p.output_buffer_limit_bytes,
            output_buffer_limit_kind="hard",
            network_queue_depth=self._queue_depth + len(self._waiting),
            network_queue_limit=p.network_queue_limit,
            network_queue_limit_kind="estimate",
        )
        for spec in p.pools:
            stats = ledger.pool_stats(spec.id)
            claim = stats["references"] if self.fault == "per-request-used" else stats["in_use"]
            ledger.set_reported_used_blocks(claim, pool=spec.id)
        self.steps += 1
        if self.steps % p.leak_sweep_steps == 0:
            ledger.sweep_leaks()

    def _capacity(self, pool: str) -> int:
        return next(s.num_blocks for s in self.profile.pools if s.id == pool)

    def _block_size(self, pool: str) -> int:
        return next(s.block_size for s in self.profile.pools if s.id == pool)

    def _admit(self, req: _SimRequest) -> bool:
        ledger, p = self.ledger, self.profile
        stats = ledger.pool_stats(req.pool)
        physical = stats["free"] + stats["reclaimable"]
        prompt_blocks = -(-req.prompt_tokens // self._block_size(req.pool))
        if p.admission == "dynamic":
            # allocate on demand: admit when the prompt fits physically now
            if physical < prompt_blocks:
                return False
            return ledger.admit(req.id)
        if self.fault == "reserve-overcommit":
            # the broken engine: checks physical free memory, not its reservation quota
            if physical < prompt_blocks:
                return False
            return ledger.admit(req.id, check=False)
        return ledger.admit(req.id)

    # ------------------------------------------------------------ serving

    def document(self) -> dict[str, Any]:
        return self.ledger.to_document(include_blocks=self.profile.include_blocks)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def start(self) -> SimEngine:
        """Step every ``step_seconds`` of wall time in a background thread."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name=f"sim-engine {self.profile.name}", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.profile.step_seconds):
            self.step()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
