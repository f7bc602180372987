"""The running daemon on the unmodified pynvml over the fake libnvidia-ml.so.1
(LD_LIBRARY_PATH): GPU and budget families equal the inventory; a GPU lost mid-run
reports up=0 while the others keep reporting; a missing driver marks the source down."""

from __future__ import annotations

import dataclasses
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_nvml import ENV_VAR, GIB, MIB, FakeGpu, Inventory, build_library
from prometheus_client.parser import text_string_to_metric_families

from harness.kvledger_daemon import Daemon, run_serve
from kvledger.sim.demo import demo_profiles
from kvledger.sim.engine import SimEngine
from kvledger_engine.document_server import LedgerServer, serve_http

pytestmark = pytest.mark.e2e
ENGINE_PID = 4_242_424


def samples(daemon: Daemon) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(daemon.url + "/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def get(s: dict, metric: str, **labels: str) -> float | None:  # type: ignore[type-arg]
    return s.get((metric, tuple(sorted(labels.items()))))


def wait(daemon: Daemon, pred, timeout: float = 15.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        s = samples(daemon)
        if pred(s):
            return s
        assert time.monotonic() < deadline, "condition not reached:\n" + "\n".join(
            f"{k} {v}" for k, v in s.items() if "gpu" in k[0] or "source" in k[0])
        time.sleep(0.2)


def inventory(lost: int | None = None) -> Inventory:
    gpus = []
    for i in range(8):
        procs = [(ENGINE_PID, 30 * GIB + i * MIB), (999_001, 2 * GIB)] if i in (0, 1) else []
        gpus.append(FakeGpu(total=141 * GIB, reserved=600 * MIB, used=(35 + i) * GIB, uuid=f"GPU-{i:04d}-test",
                            name="NVIDIA H200", procs=procs, lost=(i == lost)))
    return Inventory(gpus=gpus, driver_version="570.86.15")


@pytest.fixture
def engine() -> Iterator[LedgerServer]:
    profile = dataclasses.replace(demo_profiles()[0], gpus=(0, 1), weights_bytes=16 * GIB)
    sim = SimEngine(profile, seed=3, pid=ENGINE_PID).start()
    server = serve_http(sim.document)
    try:
        yield server
    finally:
        server.stop()
        sim.stop()


def config(tmp_path: Path, url: str, nvml: str = "true") -> Path:
    cfg = tmp_path / "kvledger.yml"
    cfg.write_text(f"""
interval_seconds: 0.25
nvml: {{enabled: {nvml}}}
engines:
  - name: tp2
    kind: ledger
    url: "{url}"
    gpus: [0, 1]
    processes: {{pids: [{ENGINE_PID}]}}
    memory: {{reserve_bytes: {{value: 8GiB, source: configured}}}}
""")
    return cfg


def test_daemon_exports_the_inventory_and_survives_a_lost_gpu(tmp_path: Path, engine: LedgerServer) -> None:
    inv_path = tmp_path / "inventory"
    inventory().write(inv_path)
    env = {"LD_LIBRARY_PATH": str(build_library().parent), ENV_VAR: str(inv_path)}
    with run_serve(tmp_path, config(tmp_path, engine.url), env=env) as daemon:
        s = wait(daemon, lambda s: get(s, "kvledger_gpu_up", gpu="7") == 1.0
                 and get(s, "kvledger_kv_capacity_bytes", engine="tp2", pool="0") is not None)
        for i in range(8):
            g = str(i)
            assert get(s, "kvledger_gpu_memory_total_bytes", gpu=g) == 141 * GIB
            assert get(s, "kvledger_gpu_memory_used_bytes", gpu=g) == (35 + i) * GIB  # memory v2: reserved split out
            assert get(s, "kvledger_gpu_memory_driver_reserved_bytes", gpu=g) == 600 * MIB
            assert get(s, "kvledger_gpu_memory_free_bytes", gpu=g) == 141 * GIB - 600 * MIB - (35 + i) * GIB
            assert get(s, "kvledger_gpu_info", gpu=g, uuid=f"GPU-{i:04d}-test", name="NVIDIA H200",
                       driver_version="570.86.15", mig="false") == 1.0
        # attribution by PID: only the engine's process, not the other one on the GPU
        assert get(s, "kvledger_gpu_process_memory_bytes", gpu="0", engine="tp2") == 30 * GIB
        assert get(s, "kvledger_gpu_process_memory_bytes", gpu="1", engine="tp2") == 30 * GIB + MIB
        # the device budget: the engine's declared terms per GPU, the configured reserve, the KV pool
        assert get(s, "kvledger_gpu_budget_bytes", gpu="0", engine="tp2", category="weights", provenance="measured") == 8 * GIB
        # the engine's own declaration wins over the config's for the same (gpu, category)
        assert get(s, "kvledger_gpu_budget_bytes", gpu="1", engine="tp2", category="reserve", provenance="configured") == 2 * GIB
        kv = get(s, "kvledger_gpu_budget_bytes", gpu="0", engine="tp2", category="kv_pool", provenance="measured")
        assert kv == get(s, "kvledger_kv_capacity_bytes", engine="tp2", pool="0") / 2  # type: ignore[operator]
        declared = sum(v for (name, labels), v in s.items() if name == "kvledger_gpu_budget_bytes"
                       and dict(labels)["gpu"] == "0" and dict(labels)["category"] != "reserve")
        unaccounted = [v for (name, labels), v in s.items() if name == "kvledger_gpu_memory_unaccounted_bytes" and dict(labels)["gpu"] == "0"]
        assert unaccounted == [35 * GIB - declared]
        assert get(s, "kvledger_gpu_memory_unaccounted_bytes", gpu="5", basis="exact") is None  # no engine there
        # the budget inequality on GPU 0: total minus every term, reserve included
        all_terms = sum(v for (name, labels), v in s.items() if name == "kvledger_gpu_budget_bytes" and dict(labels)["gpu"] == "0")
        assert get(s, "kvledger_gpu_budget_slack_bytes", gpu="0") == 141 * GIB - all_terms
        assert get(s, "kvledger_gpu_budget_slack_bytes", gpu="5") is None

        # GPU 3 is lost mid-run: up=0 and no figures for it; the others keep reporting
        inventory(lost=3).write(inv_path)
        s = wait(daemon, lambda s: get(s, "kvledger_gpu_up", gpu="3") == 0.0)
        assert get(s, "kvledger_gpu_memory_used_bytes", gpu="3") is None
        assert all(get(s, "kvledger_gpu_up", gpu=str(i)) == 1.0 for i in range(8) if i != 3)
        assert get(s, "kvledger_gpu_memory_used_bytes", gpu="4") == 39 * GIB
        assert get(s, "kvledger_source_up", engine="", source="nvml") == 1.0
        # and it comes back
        inventory().write(inv_path)
        wait(daemon, lambda s: get(s, "kvledger_gpu_up", gpu="3") == 1.0)


def test_missing_driver_marks_the_source_down_and_the_engine_keeps_reporting(tmp_path: Path, engine: LedgerServer) -> None:
    env = {"LD_LIBRARY_PATH": str(build_library().parent), ENV_VAR: ""}  # the fake without inventory: no driver
    with run_serve(tmp_path, config(tmp_path, engine.url), env=env) as daemon:
        s = wait(daemon, lambda s: (get(s, "kvledger_source_errors_total", engine="", source="nvml", reason="driver") or 0) >= 1)
        assert get(s, "kvledger_source_up", engine="", source="nvml") == 0.0
        assert not any(name == "kvledger_gpu_up" for name, _ in s)
        assert get(s, "kvledger_kv_capacity_blocks", engine="tp2", pool="0") == 1024
