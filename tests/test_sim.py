import dataclasses

import pytest
from jsonschema import Draft202012Validator
from ledger_checks import assert_consistent, design_reservation

from kvledger.collect.sources.document import LedgerSource
from kvledger.protocol.reader import load_schema
from kvledger.sim.demo import demo_profiles, start_demo
from kvledger.sim.engine import SimEngine, SimProfile
from kvledger.sim.gpu import SimGpuSource

VALIDATOR = Draft202012Validator(load_schema())
PROFILES = {p.name: p for p in demo_profiles()}


def run(name, steps, fault="none", seed=7, check_every=10, leaks_possible=False, **changes):
    engine = SimEngine(dataclasses.replace(PROFILES[name], **changes), seed=seed, fault=fault)
    docs = []
    for i in range(steps):
        engine.step()
        if i % check_every == check_every - 1:
            doc = engine.document()
            assert not list(VALIDATOR.iter_errors(doc))
            assert_consistent(doc, leaks_possible=leaks_possible)
            docs.append(doc)
    return engine, docs


def reserved_blocks(doc):
    """Sum of R(r) over admitted requests, from docs/design.md §2 written in the tests (the
    simulator's admission uses the policy's reservation_blocks)."""
    budgets = doc["budgets"]
    pool = doc["pools"][0]
    return sum(
        design_reservation(r["prompt_tokens"], r["max_output_tokens"], pool["block_size"],
                           max_model_len=budgets["max_model_len"], n=max(1, r["contexts"]),
                           k=r["speculative_slots"], window=pool["sliding_window"])
        for r in doc["requests"] if r["state"] != "waiting"
    )


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_simulator_documents_validate_and_agree_with_block_refs(name):
    _engine, docs = run(name, 150)
    last = docs[-1]
    states = {r["state"] for d in docs for r in d["requests"]}
    assert "running" in states
    assert any(d["pools"][0]["blocks"]["in_use"] > 0 for d in docs)
    if PROFILES[name].admission == "reserve-cap":
        assert all(reserved_blocks(d) <= d["pools"][0]["num_blocks"] for d in docs)
    assert last["budgets"]["iteration_tokens"] is not None


def test_same_seed_same_ledger():
    a, _ = run("sim-vllm", 60, check_every=60)
    b, _ = run("sim-vllm", 60, check_every=60)
    # the same state; only when it was published (the wall clock) differs
    assert {**a.document(), "published_at": None} == {**b.document(), "published_at": None}


def test_dynamic_engine_shares_prefixes_preempts_and_moves_counters():
    # busier than the demo's healthy 2.5 requests/s (tests/test_demo_quiet.py): a pool that runs
    # out of blocks within 150 steps, so the engine preempts
    _, docs = run("sim-vllm", 150, arrival_rate=14.0)
    last = docs[-1]
    assert any(d["pools"][0]["shared"] > 0 for d in docs)  # system-prompt prefix blocks shared
    assert any(d["pools"][0]["blocks"]["reclaimable"] > 0 for d in docs)
    c = last["counters"]
    assert c["preemptions"] > 0 and c["admission_rechecks_accepted"] > 0
    assert any(r["state"] == "preempted" for d in docs for r in d["requests"])
    assert any(r["contexts"] > 1 for d in docs for r in d["requests"])
    assert any(r.get("tenant") for d in docs for r in d["requests"])
    assert reserved_blocks(last) > 0


def test_reserve_cap_engine_rejects_rechecks_when_full():
    _, docs = run("sim-tgi", 150, arrival_rate=9.0)  # busier than the demo's 6/s: full within 150 steps
    assert docs[-1]["counters"]["admission_rechecks_rejected"] > 0
    assert docs[-1]["counters"]["preemptions"] == 0
    assert any(r["state"] == "waiting" for d in docs for r in d["requests"])


def test_fault_reserve_overcommit_breaks_the_promise():
    # busy, so that 150 steps fill the quota (in the demo it fires within minutes: tests/test_demo_quiet.py)
    _, docs = run("sim-tgi", 150, fault="reserve-overcommit", arrival_rate=9.0)
    assert any(reserved_blocks(d) > d["pools"][0]["num_blocks"] for d in docs)


def test_fault_per_request_used_reports_references():
    _, docs = run("sim-vllm", 100, fault="per-request-used")
    assert all(d["pools"][0]["engine_reported_used_blocks"] == d["pools"][0]["references"] for d in docs)
    assert any(d["pools"][0]["references"] > d["pools"][0]["blocks"]["in_use"] for d in docs)
    _, normal = run("sim-vllm", 30, check_every=30)
    assert normal[-1]["pools"][0]["engine_reported_used_blocks"] == normal[-1]["pools"][0]["blocks"]["in_use"]


def test_fault_leak_counts_leaks_and_holds_orphaned_blocks():
    _, docs = run("sim-tgi", 150, fault="leak", check_every=5, leaks_possible=True)
    assert docs[-1]["counters"]["reservation_leaks"] > 0
    orphaned = [
        d for d in docs
        if d["pools"][0]["references"] > sum(r["blocks_held"] for r in d["requests"])
    ]
    assert orphaned  # between sweeps the lost releases still hold blocks no request names
    _, clean = run("sim-tgi", 60, check_every=60)
    assert clean[-1]["counters"]["reservation_leaks"] == 0


def test_fault_overflow_exceeds_estimates_often():
    _, normal = run("sim-vllm", 120, check_every=120)
    _, faulty = run("sim-vllm", 120, fault="overflow", check_every=120)
    assert faulty[-1]["counters"]["reservation_overflows"] > 2 * max(1, normal[-1]["counters"]["reservation_overflows"])


def test_sliding_window_holds_at_most_the_window():
    _engine, docs = run("sim-swa", 120)
    window_blocks = -(-1024 // 16) + 1
    for d in docs:
        for r in d["requests"]:
            assert r["blocks_held"] <= r["contexts"] * window_blocks


@pytest.mark.parametrize("unix", [False, True])
def test_demo_serves_engines_and_gpus(unix):
    profiles = [dataclasses.replace(p, step_seconds=0.01) for p in demo_profiles()]
    with start_demo(seed=3, unix_sockets=unix, profiles=profiles) as demo:
        assert [(c.name, c.kind) for c in demo.engine_configs] == [
            ("sim-vllm", "ledger"), ("sim-tgi", "ledger"), ("sim-swa", "ledger"), ("sim-stock-vllm", "vllm"),
            ("sim-stock-sglang", "sglang"), ("sim-stock-trtllm", "trtllm"), ("sim-stock-triton", "triton-trtllm"),
            ("sim-stock-tgi", "tgi"), ("sim-llamacpp", "llamacpp")]
        for cfg in demo.engine_configs[4:]:  # stock engines serve their /metrics over HTTP
            assert cfg.url.startswith("http://127.0.0.1:") and cfg.gpus == ()
        assert demo.engine_configs[3].url.startswith("http://127.0.0.1:")  # a stock vLLM serves HTTP
        for cfg in demo.engine_configs[:3]:
            assert cfg.url.startswith("unix://" if unix else "http://127.0.0.1:")
            facts = LedgerSource(cfg).poll().facts
            assert facts.name == cfg.name and facts.pools[0].num_blocks > 0
            assert {t.category for t in facts.memory} == {"weights", "workspace", "runtime_buffers", "kv_pool", "reserve"}
            assert sorted({t.gpu for t in facts.memory}) == list(cfg.gpus)  # the document names its GPUs
        vllm = LedgerSource(demo.engine_configs[0]).poll().facts
        assert {t.name for t in vllm.tenants} == {"team-a", "team-b"}
        gpus = demo.gpu_source.poll().gpus
    assert [g.index for g in gpus] == [0, 1]
    for g in gpus:
        on_gpu = [e for e in demo.engines if g.index in e.profile.gpus]
        # Summed by hand from each profile's declared figures (weights and KV pool split over
        # the engine's GPUs; workspace and runtime buffers per GPU; the reserve is headroom),
        # not from the simulator's own memory_terms.
        declared = {e.pid: profile_allocations(e.profile) for e in on_gpu}
        assert {(pr.pid, pr.used_bytes) for pr in g.processes} == set(declared.items())
        assert g.used_bytes >= sum(declared.values()) + SIM_DRIFT_MIN  # unaccounted drift on top


MiB = 2**20
GiB = 2**30
SIM_DRIFT_MIN = 64 * MiB  # kvledger.sim.gpu: drift = 256 MiB + 192 MiB x sin(...) + a walk >= 0


def profile_allocations(profile: SimProfile) -> int:
    """What one simulated engine allocates on each of its GPUs, from its profile by hand."""
    ranks = len(profile.gpus)
    kv = sum(pool.num_blocks * pool.block_bytes for pool in profile.pools)
    return profile.weights_bytes // ranks + profile.workspace_bytes + profile.runtime_buffers_bytes + kv // ranks


class _Engine:
    """Just what SimGpuSource reads of an engine: its declared terms and its pid."""

    def __init__(self, pid: int, terms: list[tuple[int, str, int, str]]) -> None:
        self.pid = pid
        self.memory_terms = terms


class _NoWalk:
    """The drift's random walk held at zero, so the drift at t = 0 is 256 MiB exactly."""

    def gauss(self, mu: float, sigma: float) -> float:
        return 0.0


def _gpu_source(engines: list[_Engine], **kw: int) -> SimGpuSource:
    src = SimGpuSource(engines, clock=lambda: 0.0, **kw)  # type: ignore[arg-type]
    src._rng = _NoWalk()  # type: ignore[assignment]
    return src


def test_sim_gpu_memory_is_the_declared_allocations_plus_the_drift() -> None:
    a = _Engine(101, [(0, "weights", 10 * GiB, "measured"), (0, "workspace", GiB, "measured"),
                      (0, "runtime_buffers", 512 * MiB, "estimate"), (0, "kv_pool", 20 * GiB, "measured"),
                      (0, "reserve", 2 * GiB, "configured")])
    b = _Engine(102, [(0, "weights", 3 * GiB, "measured"), (0, "kv_pool", GiB, "measured"),
                      (1, "weights", 7 * GiB, "measured")])
    (gpu,) = _gpu_source([a, b], count=1, total_bytes=40 * GiB, driver_reserved_bytes=300 * MiB).poll().gpus
    allocated_a = 10 * GiB + GiB + 512 * MiB + 20 * GiB  # the reserve is headroom, not an allocation
    allocated_b = 3 * GiB + GiB  # its GPU-1 weights are not on GPU 0
    used = allocated_a + allocated_b + 256 * MiB
    assert (gpu.total_bytes, gpu.driver_reserved_bytes) == (40 * GiB, 300 * MiB)
    assert gpu.used_bytes == used
    assert gpu.free_bytes == 40 * GiB - 300 * MiB - used
    assert [(pr.pid, pr.used_bytes) for pr in gpu.processes] == [(101, allocated_a), (102, allocated_b)]


def test_sim_gpu_used_memory_stops_at_the_device() -> None:
    big = _Engine(7, [(0, "weights", 15 * GiB, "measured"), (0, "kv_pool", 2 * GiB, "measured")])
    (gpu,) = _gpu_source([big], count=1, total_bytes=16 * GiB, driver_reserved_bytes=512 * MiB).poll().gpus
    assert gpu.used_bytes == 16 * GiB - 512 * MiB
    assert gpu.free_bytes == 0


def test_sim_gpu_drift_moves():
    ticks = iter(range(0, 1000, 5))
    engine = SimEngine(PROFILES["sim-vllm"], seed=1)
    src = SimGpuSource([engine], seed=1, clock=lambda: next(ticks))
    used = {src.poll().gpus[0].used_bytes for _ in range(5)}
    assert len(used) > 1
