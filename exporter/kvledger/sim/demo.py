"""The demo: simulated engines served as kvledger/v1 ledgers, as a stock vLLM, or as stock
SGLang, trtllm-serve, Triton (TensorRT-LLM backend) and TGI expositions, and a stock
llama.cpp server, plus a simulated GPU source.

``start_demo()`` starts the engines, each stepping in its own thread. A ``served_as="ledger"``
engine is served by ``ledger_server`` on 127.0.0.1 with an ephemeral port (or on Unix
sockets) and read with ``kind: ledger``; a ``served_as="vllm"`` engine is served by a
``VllmFrontend`` (vLLM's /metrics, ZMQ KV events with replay, startup log) and read with
``kind: vllm``, the way a user with an unmodified vLLM reads it; a ``served_as`` of
``sglang``, ``trtllm``, ``triton-trtllm`` or ``tgi`` is served by that engine's frontend
(``kvledger.sim.engine_frontends``: its /metrics only) and read with that kind's source;
a simulated llama.cpp server (``SimLlamacpp``: /slots, /props, /metrics) is read with
``kind: llamacpp``. ``start_demo()`` returns
a ``Demo`` holding the ``EngineConfig`` list that points at them and the ``SimGpuSource``;
a collector built from those exports live, moving numbers.

``start_demo(stepping=False)`` starts the same servers but no stepping thread: the demo
then runs on its own simulated clock, ``Demo.advance(seconds)`` stepping every engine (and
the llama.cpp server) as many times as that much simulated time holds, and ``Demo.clock``
(the simulated seconds so far) drives the simulated GPUs. Minutes of the demo's behaviour
then take seconds (tests/test_demo_quiet.py evaluates the production alert rules over it).
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import kvledger.collect.sources.kinds  # noqa: F401  (every kind's registration: fills KINDS)
from kvledger.config.engine_kinds import KINDS
from kvledger.config.types import EngineConfig, HostConfig, LimitConfig, MemoryConfig, ProcessMatch, TenantConfig
from kvledger.sim.engine import GiB, SimEngine, SimProfile
from kvledger.sim.engine_frontends import FRONTENDS, Frontend
from kvledger.sim.gpu import SimGpuSource
from kvledger.sim.llamacpp_server import SimLlamacpp, SimLlamacppProfile
from kvledger.sim.vllm_frontend import VllmFrontend
from kvledger_engine.document_server import LedgerServer, serve_http, serve_unix
from kvledger_engine.reference_ledger import PoolSpec

MiB = 2**20


def _stock(kind: str, **profile: Any) -> SimProfile:
    """A stock engine of ``kind``, served as that engine shows itself and admitting and
    overflowing by the rules its registration gives (``kvledger.config.engine_kinds``)."""
    rules = KINDS[kind]
    if rules.admission is None or rules.overflow is None:
        raise ValueError(f"kind {kind!r} states no admission or overflow rule of its own: not a stock engine")
    return SimProfile(engine_kind=kind, served_as=kind, admission=rules.admission, overflow=rules.overflow, **profile)


def demo_profiles() -> list[SimProfile]:
    """A vLLM-like dynamic engine with prefix sharing and tenants, a TGI-like reserve-cap
    engine, a sliding-window engine split over two GPUs (all three with an in-engine
    ledger), a stock vLLM read through its /metrics and KV events only, and a stock SGLang,
    trtllm-serve, Triton TensorRT-LLM backend and TGI read through their /metrics only."""
    return [
        SimProfile(
            name="sim-vllm",
            engine_kind="vllm",
            admission="dynamic",
            overflow="preempt-recompute",
            pools=(PoolSpec("0", 16, 2 * MiB, 1024),),  # llama-8B fp16: 2 MiB per 16-token block
            max_model_len=8192,
            max_num_seqs=64,
            max_num_batched_tokens=4096,
            # rare preemptions: from about 3.5 requests/s on its pool runs out and it thrashes
            # (KVLedgerPreemptionStorm, KVLedgerOvercommitHigh, its queue at the limit)
            arrival_rate=2.5,
            output_log_mean=5.0,
            system_prompts=(512, 1024, 256, 2048, 768, 384),
            system_prompt_prob=0.7,
            parallel_prob=0.1,
            estimate_prob=0.15,
            estimate_stretch_max=1.0,  # healthy estimates hold (KVLedgerEstimateOverflowing: --fault overflow)
            raise_bound_prob=0.01,
            # quotas within the 2 GiB pool (1.5 GiB in all): quotas that add up to more than the
            # capacity cannot all be honoured at once (KVLedgerTenantQuotasOversubscribed)
            tenants=(("team-a", 512 * MiB), ("team-b", 1 * GiB), ("batch", None)),
            gpus=(0,),
        ),
        SimProfile(
            name="sim-tgi",
            engine_kind="tgi",
            admission="reserve-cap",
            overflow="reject",
            pools=(PoolSpec("0", 16, 1 * MiB, 1536),),
            max_model_len=4096,
            max_num_seqs=64,
            max_num_batched_tokens=8192,
            # below saturation: at 6/s its quota binds while the queue grows for minutes on end
            # (KVLedgerBoundByOneConstraint pending most of 10 minutes); --fault
            # reserve-overcommit adds the load that exposes it (kvledger.sim.engine.FAULT_LOAD)
            arrival_rate=5.0,
            output_log_mean=5.0,
            speculative_slots=2,
            parallel_prob=0.05,
            raise_bound_prob=0.02,
            gpus=(1,),
            weights_bytes=14 * GiB,
        ),
        SimProfile(
            name="sim-swa",
            engine_kind="custom",
            admission="dynamic",
            overflow="preempt-recompute",
            pools=(PoolSpec("0", 16, 512 * 1024, 1024, sliding_window=1024),),
            max_model_len=16384,
            max_num_seqs=32,
            max_num_batched_tokens=4096,
            arrival_rate=3.0,
            prompt_log_mean=6.8,
            prompt_log_sigma=0.7,
            output_log_mean=3.5,  # short answers to long documents
            estimate_prob=0.3,
            estimate_stretch_max=1.0,
            gpus=(0, 1),
            weights_bytes=24 * GiB,
        ),
        _stock(
            "vllm",
            name="sim-stock-vllm",
            # 511 usable blocks; vLLM reports num_gpu_blocks=512 (with its null block), 1 GiB
            pools=(PoolSpec("0", 16, 2 * MiB, 511),),
            max_model_len=4096,
            max_num_seqs=32,
            max_num_batched_tokens=2048,
            arrival_rate=3.5,
            prompt_log_mean=5.0,
            output_log_mean=4.5,
            system_prompts=(512, 256, 1024),
            system_prompt_prob=0.8,
            parallel_prob=0.05,
            raise_bound_prob=0.0,
            gpus=(1,),
            weights_bytes=15 * GiB,
            workspace_bytes=3 * GiB // 2,
            runtime_buffers_bytes=GiB // 2,
        ),
        # Stock engines of the other kinds, read through their /metrics only (kvledger.collect.sources):
        # no GPUs of their own in the simulated budget, light workloads (the demo starts fast).
        _stock(
            "sglang",
            name="sim-stock-sglang",
            pools=(PoolSpec("0", 16, 2 * MiB, 384),),  # pages of 16 tokens
            max_model_len=4096,
            max_num_seqs=32,
            max_num_batched_tokens=2048,
            step_seconds=0.1,
            arrival_rate=2.0,
            prompt_log_mean=5.0,
            output_log_mean=4.5,
            system_prompts=(512, 256, 1024),
            system_prompt_prob=0.8,
            raise_bound_prob=0.0,
            gpus=(),
        ),
        _stock(
            "trtllm",  # reserve-cap: GUARANTEED_NO_EVICT, trtllm-serve's default scheduler
            name="sim-stock-trtllm",
            pools=(PoolSpec("0", 32, 4 * MiB, 256),),
            max_model_len=4096,
            max_num_seqs=32,
            max_num_batched_tokens=4096,
            step_seconds=0.1,
            arrival_rate=3.0,
            prompt_log_mean=5.5,
            output_log_mean=4.0,
            system_prompts=(1024, 512),
            system_prompt_prob=0.6,
            raise_bound_prob=0.0,
            gpus=(),
        ),
        _stock(
            "triton-trtllm",
            name="sim-stock-triton",
            pools=(PoolSpec("0", 64, 8 * MiB, 256),),
            max_model_len=4096,
            max_num_seqs=16,
            max_num_batched_tokens=4096,
            step_seconds=0.1,
            arrival_rate=2.0,
            prompt_log_mean=5.5,
            output_log_mean=4.0,
            system_prompts=(1024,),
            system_prompt_prob=0.5,
            raise_bound_prob=0.0,
            gpus=(),
        ),
        _stock(
            "tgi",
            name="sim-stock-tgi",
            pools=(PoolSpec("0", 16, 1 * MiB, 1024),),  # paged attention: blocks of 16 tokens
            max_model_len=4096,
            max_num_seqs=32,
            max_num_batched_tokens=4096,
            step_seconds=0.1,
            arrival_rate=3.0,
            output_log_mean=4.5,
            raise_bound_prob=0.0,
            gpus=(),
        ),
    ]


class SimClock:
    """Simulated seconds since the demo started; only ``Demo.advance`` moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Demo:
    engine_configs: list[EngineConfig]
    gpu_source: SimGpuSource
    engines: list[SimEngine]
    servers: list[LedgerServer] = field(default_factory=list)
    socket_dir: str | None = None
    frontends: list[VllmFrontend] = field(default_factory=list)
    exposition_frontends: list[Frontend] = field(default_factory=list)
    llamacpp: list[SimLlamacpp] = field(default_factory=list)
    #: the simulated clock of a demo started with ``stepping=False`` (None: wall time, own threads)
    clock: SimClock | None = None
    _due: dict[int, float] = field(default_factory=dict)  # id(engine) -> simulated time of its next step

    def advance(self, seconds: float) -> None:
        """Run ``seconds`` of simulated time (a demo started with ``stepping=False``): every
        engine steps once per its ``step_seconds``, in time order, as its thread would."""
        if self.clock is None:
            raise RuntimeError("advance() drives a demo started with stepping=False")
        end = self.clock.now + seconds
        steppers: list[tuple[object, float, Callable[[], None]]] = [
            (e, e.profile.step_seconds, e.step) for e in self.engines
        ]
        for llama in self.llamacpp:
            dt = llama.profile.step_seconds
            steppers.append((llama, dt, functools.partial(llama.step, dt)))
        while True:
            due = [(self._due.get(id(obj), period), id(obj), period, step) for obj, period, step in steppers]
            at, key, period, step = min(due, key=lambda d: (d[0], d[1]))
            if at > end + 1e-9:
                break
            self.clock.now = max(self.clock.now, at)
            step()
            self._due[key] = at + period
        self.clock.now = end

    def stop(self) -> None:
        for llama in self.llamacpp:
            llama.stop()
        for engine in self.engines:
            engine.stop()
        for server in self.servers:
            server.stop()
        for frontend in self.frontends:
            frontend.stop()
        for exposition in self.exposition_frontends:
            exposition.stop()
        if self.socket_dir is not None:
            try:
                os.rmdir(self.socket_dir)
            except OSError:
                pass

    def __enter__(self) -> Demo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def engine_config(engine: SimEngine, url: str) -> EngineConfig:
    """The EngineConfig a user would write for a simulated engine served at ``url``."""
    p = engine.profile
    return EngineConfig(
        name=p.name,
        kind="ledger",
        url=url,
        timeout_seconds=2.0,
        gpus=p.gpus,
        processes=ProcessMatch(pids=(engine.pid,)) if engine.pid is not None else None,
        memory=MemoryConfig(),
        host=HostConfig(
            # the simulated engine's serving port is its ledger server: real kernel socket queues
            port=urlsplit(url).port if url.startswith("http") else None,
            output_buffer_limit_bytes=LimitConfig(p.output_buffer_limit_bytes, "hard"),
            network_queue_limit=LimitConfig(p.network_queue_limit, "estimate"),
        ),
        tenants=tuple(TenantConfig(name, quota) for name, quota in p.tenants if quota is not None),
    )


def vllm_engine_config(engine: SimEngine, frontend: VllmFrontend) -> EngineConfig:
    """The EngineConfig a user would write for a stock vLLM: its /metrics, KV events and log."""
    p = engine.profile
    return EngineConfig(
        name=p.name,
        kind="vllm",
        url=frontend.metrics_url,
        timeout_seconds=2.0,
        options=(
            ("kv_events", frontend.kv_events),
            ("kv_events_replay", frontend.kv_events_replay),
            ("log_file", frontend.log_file),
        ),
        max_model_len=p.max_model_len,
        max_num_seqs=p.max_num_seqs,
        max_num_batched_tokens=p.max_num_batched_tokens,
        gpus=p.gpus,
        processes=ProcessMatch(pids=(engine.pid,)) if engine.pid is not None else None,
        host=HostConfig(port=frontend.port),  # vLLM serves /metrics on its API port
    )


def exposition_engine_config(engine: SimEngine, frontend: Frontend) -> EngineConfig:
    """The EngineConfig a user would write for a stock engine of ``frontend.kind``: its
    /metrics URL and what the engine does not export (token budgets, bytes per block; TGI's
    block size)."""
    p = engine.profile
    return EngineConfig(
        name=p.name,
        kind=frontend.kind,
        url=frontend.url,
        timeout_seconds=2.0,
        options=frontend.options(),
        block_bytes=frontend.spec.block_bytes,
        max_model_len=p.max_model_len,
        max_num_seqs=p.max_num_seqs,
        max_num_batched_tokens=p.max_num_batched_tokens,
        processes=ProcessMatch(pids=(engine.pid,)) if engine.pid is not None else None,
        host=HostConfig(port=frontend.port),  # these engines serve /metrics on their API port
    )


def llamacpp_engine_config(server: SimLlamacpp) -> EngineConfig:
    """The EngineConfig a user would write for a stock llama.cpp server (a CPU build: no GPU)."""
    return EngineConfig(
        name=server.profile.name,
        kind="llamacpp",
        url=server.url + "/metrics",
        timeout_seconds=2.0,
        block_bytes=server.profile.block_bytes,
        host=HostConfig(port=server.port),
    )


def start_demo(
    *,
    seed: int = 0,
    faults: dict[str, str] | None = None,
    unix_sockets: bool = False,
    step_seconds: float | None = None,
    profiles: list[SimProfile] | None = None,
    llamacpp: list[SimLlamacppProfile] | None = None,
    stepping: bool = True,
) -> Demo:
    """Start the simulated engines and their ledger servers; ``Demo.stop()`` ends them.

    ``faults`` maps an engine name to a fault mode (see kvledger.sim.engine.FAULTS).
    ``llamacpp``: simulated llama.cpp servers read with ``kind: llamacpp`` (default: one).
    ``stepping=False``: no engine steps on its own; ``Demo.advance`` runs simulated time.
    """
    faults = dict(faults or {})
    profiles = demo_profiles() if profiles is None else profiles
    names = {p.name for p in profiles}
    unknown = set(faults) - names
    if unknown:
        raise ValueError(f"faults name unknown engine(s): {', '.join(sorted(unknown))}")
    socket_dir = tempfile.mkdtemp(prefix="kvledger-demo-") if unix_sockets else None
    engines: list[SimEngine] = []
    servers: list[LedgerServer] = []
    frontends: list[VllmFrontend] = []
    expositions: list[Frontend] = []
    configs: list[EngineConfig] = []
    llamas: list[SimLlamacpp] = []
    try:
        for i, profile in enumerate(profiles):
            if step_seconds is not None:
                from dataclasses import replace

                profile = replace(profile, step_seconds=step_seconds)
            engine = SimEngine(profile, seed=seed + i, fault=faults.get(profile.name, "none"), pid=4_000_001 + i)
            if profile.served_as == "vllm":
                frontend = VllmFrontend(engine)
                frontends.append(frontend)
                frontend.start()
                engines.append(engine.start() if stepping else engine)
                configs.append(vllm_engine_config(engine, frontend))
                continue
            if profile.served_as in FRONTENDS:
                exposition = FRONTENDS[profile.served_as](engine)
                expositions.append(exposition)
                exposition.start()
                engines.append(engine.start() if stepping else engine)
                configs.append(exposition_engine_config(engine, exposition))
                continue
            if profile.served_as != "ledger":
                raise ValueError(f"{profile.name}: served_as must be ledger, vllm or one of {', '.join(FRONTENDS)}, "
                                 f"got {profile.served_as!r}")
            if socket_dir is not None:
                server = serve_unix(engine.document, os.path.join(socket_dir, f"{profile.name}.sock"))
            else:
                server = serve_http(engine.document)
            servers.append(server)
            engines.append(engine.start() if stepping else engine)
            configs.append(engine_config(engine, server.url))
        for i, llama_profile in enumerate([SimLlamacppProfile()] if llamacpp is None else llamacpp):
            llama = SimLlamacpp(llama_profile, seed=seed + 100 + i).start(stepping=stepping)
            llamas.append(llama)
            configs.append(llamacpp_engine_config(llama))
    except BaseException:
        Demo(configs, SimGpuSource(engines, seed=seed), engines, servers, socket_dir, frontends, expositions,
             llamas).stop()
        raise
    if stepping:
        return Demo(configs, SimGpuSource(engines, seed=seed), engines, servers, socket_dir, frontends, expositions,
                    llamas)
    clock = SimClock()
    return Demo(configs, SimGpuSource(engines, seed=seed, clock=clock), engines, servers, socket_dir, frontends,
                expositions, llamas, clock)
