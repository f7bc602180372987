"""Simulated engines seen the way SGLang, trtllm-serve, Triton's TensorRT-LLM backend and TGI
show themselves: their /metrics exposition, computed at each scrape from the reference
ledger's true state, with each engine's names, labels, units and blind spots (the sources in
``kvledger.collect.sources`` read them as they read the real engines; docs/engines/<kind>.md):

- ``SglangFrontend``: token counts (pages x page size) of the kv_* triple (available =
  free, evictable = reclaimable, used = in-use), ``page_size``, ``num_pages``, ``context_len``,
  retractions (the ledger's preemptions), ``realtime_tokens_total{mode}`` from the engine's
  prefix lookups, and a HiCache host tier: every block evicted from the GPU pool is offloaded
  (``evicted_tokens_total``) and loaded back (``load_back_tokens_total``) when its data is
  cached again while still held by the host tier;
- ``TrtllmFrontend`` (served on ``/prometheus/metrics``): ``trtllm_kv_cache_*`` blocks, free
  counting reclaimable (reusable) blocks as TensorRT-LLM does, active requests including
  paused (preempted) ones, and the runtime's memory counters;
- ``TritonTrtllmFrontend``: the backend's ``nv_trt_llm_*_metrics`` families for one model;
- ``TgiFrontend``: ``tgi_batch_max_total_tokens`` (capacity) and
  ``tgi_batch_current_max_tokens`` (the admitted requests' reservations) in tokens, the batch
  size and queue.

``Frontend(engine).start()`` serves on 127.0.0.1 (an ephemeral port); ``url`` is what a user
would configure; ``stop()`` closes it. One full-attention pool per engine.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvledger.sim.engine import GiB, SimEngine

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass(frozen=True)
class _State:
    """One consistent read of the engine, between two steps."""

    stats: dict[str, int]
    running: int  # running requests (sequences, as the engines count them)
    preempted: int
    waiting: int
    preemptions: int
    queried: int
    hit: int


class Frontend:
    """Serves a SimEngine as one engine kind's /metrics; subclasses write the series."""

    kind: ClassVar[str] = ""
    path: ClassVar[str] = "/metrics"

    def __init__(self, engine: SimEngine) -> None:
        p = engine.profile
        if len(p.pools) != 1 or p.pools[0].sliding_window is not None:
            raise ValueError(f"{p.name}: a {self.kind} frontend serves one full-attention pool")
        self.engine = engine
        self.spec = p.pools[0]
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self._http: Any = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    def start(self) -> Frontend:
        if self._http is None:
            self._http, _ = start_http_server(0, addr="127.0.0.1", registry=self.registry)
            self.port = self._http.server_port
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def state(self) -> _State:
        engine, ledger = self.engine, self.engine.ledger
        with engine.between_steps():
            stats = ledger.pool_stats(self.spec.id)
            requests = ledger.to_document(include_blocks=False)["requests"]
            preemptions = ledger.counters["preemptions"]
            queried, hit = engine.prefix_queried_tokens, engine.prefix_hit_tokens
        return _State(
            stats=stats,
            running=sum(r["contexts"] for r in requests if r["state"] == "running"),
            preempted=sum(r["contexts"] for r in requests if r["state"] == "preempted"),
            waiting=sum(r["contexts"] for r in requests if r["state"] == "waiting"),
            preemptions=preemptions,
            queried=queried,
            hit=hit,
        )

    def metrics(self, s: _State) -> Iterator[Metric]:
        raise NotImplementedError

    def options(self) -> tuple[tuple[str, str], ...]:
        """The kind's own configuration keys a user would write for this engine."""
        return ()


class _Collector:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    def collect(self) -> Iterator[Metric]:
        yield from self.frontend.metrics(self.frontend.state())


def _gauge(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    g.add_metric(list(labels.values()), float(value))
    return g


def _counter(name: str, doc: str, labels: dict[str, str], value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=list(labels))
    c.add_metric(list(labels.values()), float(value))
    return c


class SglangFrontend(Frontend):
    kind = "sglang"

    def __init__(self, engine: SimEngine, host_tier_pages: int = 4096) -> None:
        super().__init__(engine)
        self._lock = threading.Lock()
        self._host: OrderedDict[Hashable, None] = OrderedDict()  # keys of blocks held by the host tier
        self._host_pages = host_tier_pages
        self.offloaded_tokens = 0
        self.loaded_tokens = 0
        engine.ledger.add_cache_listener(self._on_cache)

    def _on_cache(self, event: str, pool: str, block: int, key: Hashable | None) -> None:
        if key is None:
            return
        page = self.spec.block_size
        with self._lock:
            if event == "evicted":
                self.offloaded_tokens += page
                self._host[key] = None
                while len(self._host) > self._host_pages:
                    self._host.popitem(last=False)
            elif event == "cached" and key in self._host:
                del self._host[key]
                self.loaded_tokens += page

    def options(self) -> tuple[tuple[str, str], ...]:
        # the simulated SGLang computes its gauges at every scrape: as a real one run with
        # --decode-log-interval 1 (it serves no /server_info to read the interval from)
        return (("decode_log_interval", "1"),)

    def metrics(self, s: _State) -> Iterator[Metric]:
        p, page, pages = self.engine.profile, self.spec.block_size, self.spec.num_blocks
        labels = {"model_name": MODEL, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        st = s.stats
        used, avail, evict = st["in_use"] * page, st["free"] * page, st["reclaimable"] * page
        capacity = pages * page
        with self._lock:
            offloaded, loaded, host_used = self.offloaded_tokens, self.loaded_tokens, len(self._host) * page
        yield _gauge("sglang:num_running_reqs", "The number of running requests.", labels, s.running)
        yield _gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", labels, s.waiting + s.preempted)
        yield _gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", labels, 0.0)  # zeroed at decode logs
        yield _gauge("sglang:token_usage", "The token usage.", labels, round(used / capacity, 2))
        yield _gauge("sglang:full_token_usage", "The token usage for full attention layers.", labels, used / capacity)
        yield _gauge("sglang:num_used_tokens", "The number of used tokens.", labels, used)
        yield _gauge("sglang:kv_available_tokens", "Number of free token slots in the KV cache pool.", labels, avail)
        yield _gauge("sglang:kv_evictable_tokens", "Number of evictable (radix-cached) token slots in the KV cache pool.",
                     labels, evict)
        yield _gauge("sglang:kv_used_tokens", "Number of actively used token slots in the KV cache pool.", labels, used)
        for pool in ("swa", "mamba"):  # a plain model: the hybrid gauges stay at zero
            for part in ("available", "evictable", "used"):
                yield _gauge(f"sglang:{pool}_{part}_tokens", f"{part} slots of the {pool} pool.", labels, 0)
        yield _gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", labels, capacity)
        yield _gauge("sglang:page_size", "KV cache page size in tokens.", labels, page)
        yield _gauge("sglang:num_pages", "Number of KV cache pages.", labels, pages)
        yield _gauge("sglang:context_len", "Maximum context length.", labels, p.max_model_len)
        yield _gauge("sglang:hicache_host_used_tokens", "Number of tokens currently used in the host KV cache.", labels, host_used)
        yield _gauge("sglang:hicache_host_total_tokens", "Total tokens of the host KV cache.", labels,
                     self._host_pages * page)
        yield _counter("sglang:num_retracted_requests", "Total number of retracted requests.", labels, s.preemptions)
        yield _counter("sglang:evicted_tokens", "The number of tokens evicted from GPU to CPU.", labels, offloaded)
        yield _counter("sglang:load_back_tokens", "The number of tokens loaded from CPU to GPU.", labels, loaded)
        c = CounterMetricFamily("sglang:realtime_tokens", "Total number of tokens processed (updated on each log "
                                "interval). mode: prefill_compute, prefill_cache, decode.", labels=[*labels, "mode"])
        c.add_metric([*labels.values(), "prefill_compute"], float(s.queried - s.hit))
        c.add_metric([*labels.values(), "prefill_cache"], float(s.hit))
        yield c


class TrtllmFrontend(Frontend):
    kind = "trtllm"
    path = "/prometheus/metrics"
    RUNTIME_GPU_BYTES = GiB  # the runtime's buffers beside the KV pool
    CPU_BYTES = 2 * GiB
    PINNED_BYTES = GiB // 2

    def metrics(self, s: _State) -> Iterator[Metric]:
        p, st = self.engine.profile, s.stats
        labels = {"model_name": MODEL, "engine_type": "trtllm"}
        c = self.spec.num_blocks
        yield _gauge("trtllm_kv_cache_max_blocks", "Maximum number of KV cache blocks", labels, c)
        yield _gauge("trtllm_kv_cache_free_blocks", "Number of free KV cache blocks", labels, st["free"] + st["reclaimable"])
        yield _gauge("trtllm_kv_cache_used_blocks", "Number of used KV cache blocks", labels, st["in_use"])
        yield _gauge("trtllm_kv_cache_tokens_per_block", "Number of tokens per KV cache block", labels, self.spec.block_size)
        yield _gauge("trtllm_kv_cache_utilization", "KV cache utilization", labels, st["in_use"] / c)
        yield _gauge("trtllm_kv_cache_hit_rate", "KV cache hit rate", labels, s.hit / s.queried if s.queried else 0.0)
        yield _gauge("trtllm_num_requests_running", "Number of active requests", labels, s.running + s.preempted)
        yield _gauge("trtllm_num_requests_waiting", "Number of queued requests", labels, s.waiting)
        yield _gauge("trtllm_num_paused_requests", "Number of paused requests", labels, s.preempted)
        yield _gauge("trtllm_max_num_active_requests", "Maximum number of active requests", labels, p.max_num_seqs)
        yield _gauge("trtllm_max_num_tokens_runtime", "Runtime maximum number of tokens", labels, p.max_num_batched_tokens)
        yield _gauge("trtllm_gpu_memory_usage_bytes", "GPU memory usage in bytes", labels,
                     c * self.spec.block_bytes + self.RUNTIME_GPU_BYTES)
        yield _gauge("trtllm_cpu_memory_usage_bytes", "CPU memory usage in bytes", labels, self.CPU_BYTES)
        yield _gauge("trtllm_pinned_memory_usage_bytes", "Pinned memory usage in bytes", labels, self.PINNED_BYTES)


class TritonTrtllmFrontend(Frontend):
    kind = "triton-trtllm"

    def metrics(self, s: _State) -> Iterator[Metric]:
        p, st = self.engine.profile, s.stats
        model = {"model": "tensorrt_llm", "version": "1"}

        def family(name: str, doc: str, category: str, values: dict[str, float]) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=[*model, category])
            for key, value in values.items():
                g.add_metric([*model.values(), key], float(value))
            return g

        yield family("nv_trt_llm_request_metrics", "TRT LLM request metrics", "request_type", {
            "active": s.running + s.preempted, "max": p.max_num_seqs, "scheduled": s.running, "context": 0,
            "waiting": s.waiting})
        yield family("nv_trt_llm_runtime_memory_metrics", "TRT LLM runtime memory metrics", "memory_type", {
            "cpu": TrtllmFrontend.CPU_BYTES, "gpu": self.spec.num_blocks * self.spec.block_bytes + TrtllmFrontend.RUNTIME_GPU_BYTES,
            "pinned": TrtllmFrontend.PINNED_BYTES})
        yield family("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics", "kv_cache_block_type", {
            "max": self.spec.num_blocks, "free": st["free"] + st["reclaimable"], "used": st["in_use"],
            "tokens_per": self.spec.block_size, "reused": s.hit // self.spec.block_size,
            "fraction": st["in_use"] / self.spec.num_blocks})
        yield family("nv_trt_llm_inflight_batcher_metrics", "TRT LLM inflight_batcher-specific metrics",
                     "inflight_batcher_specific_metric", {"total_context_tokens": 0, "generation_requests": s.running,
                                                          "micro_batch_id": 0, "paused_requests": s.preempted})


class TgiFrontend(Frontend):
    kind = "tgi"

    def options(self) -> tuple[tuple[str, str], ...]:
        return (("block_size", str(self.spec.block_size)),)  # TGI does not export its attention backend's block size

    def metrics(self, s: _State) -> Iterator[Metric]:
        b = self.spec.block_size
        yield GaugeMetricFamily("tgi_batch_max_total_tokens", "tgi_batch_max_total_tokens", value=self.spec.num_blocks * b)
        # the admitted requests' reservations, as TGI allots them up front (0 when no batch runs)
        yield GaugeMetricFamily("tgi_batch_current_max_tokens", "tgi_batch_current_max_tokens",
                                value=s.stats["reserved"] * b)
        yield GaugeMetricFamily("tgi_batch_current_size", "tgi_batch_current_size", value=s.running)
        yield GaugeMetricFamily("tgi_queue_size", "tgi_queue_size", value=s.waiting)


FRONTENDS: dict[str, type[Frontend]] = {
    f.kind: f for f in (SglangFrontend, TrtllmFrontend, TritonTrtllmFrontend, TgiFrontend)
}
