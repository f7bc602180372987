"""`kvledger serve` as a process reading one fake engine of each kind it speaks through an
exposition (sglang, trtllm, triton-trtllm, tgi; tests/harness/engine_fakes.py: the fixtures,
their values changing every second), scraped by a real Prometheus. Asserted through
Prometheus' API: each kind exports the catalogue families its engine supports with the right
basis and moving values; an engine that returns garbage, serves a poisoned value or
disappears marks its own source down with the reason while the others stay up and fresh;
each recovers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.engine_fakes import KINDS as FAKES
from harness.engine_fakes import FakeEngine
from harness.httpjson import wait_until
from harness.kvledger_daemon import Daemon, run_serve
from harness.prometheus import PrometheusServer, start_prometheus
from kvledger.config.engine_kinds import KINDS

pytestmark = pytest.mark.e2e

NAMES = {"sglang": "sgl", "trtllm": "trt", "triton-trtllm": "triton", "tgi": "tgi"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, FakeEngine], Daemon, PrometheusServer]]:
    work = tmp_path_factory.mktemp("engine-kinds-e2e")
    engines = {kind: FakeEngine(kind, auto_advance=1.0) for kind in NAMES}
    lines = [f'  - {{name: {NAMES[k]}, kind: {k}, url: "{e.url}", timeout_seconds: 0.5, max_model_len: 8192, '
             f"block_bytes: 1MiB}}" for k, e in engines.items()]
    cfg = work / "kvledger.yml"
    cfg.write_text("interval_seconds: 0.25\nnvml: {enabled: false}\nengines:\n" + "\n".join(lines) + "\n")
    try:
        with run_serve(work, cfg) as daemon, start_prometheus(work / "prom", targets=[daemon.target]) as prom:
            prom.wait_for_target_up()
            wait_until(lambda: len(prom.query("kvledger_source_up == 1")) == 4, 20, what="all four sources up")
            yield engines, daemon, prom
    finally:
        for e in engines.values():
            e.stop()


def values(prom: PrometheusServer, expr: str, label: str) -> set[str]:
    return {r["metric"][label] for r in prom.query(expr)}


def test_each_kind_exports_its_families_with_the_right_basis(stack) -> None:  # type: ignore[no-untyped-def]
    _, _, prom = stack
    # SGLang (kv_* gauges): the exact partition of the pool
    assert values(prom, 'kvledger_kv_blocks{engine="sgl"}', "state") == {"in_use", "reclaimable", "free"}
    assert values(prom, 'kvledger_kv_reclaimable_bytes{engine="sgl"}', "basis") == {"exact"}
    assert prom.query('kvledger_kv_host_offloaded_tokens_total{engine="sgl"} > 0')
    assert prom.query('kvledger_prefix_cache_hit_tokens_total{engine="sgl"} > 0')
    # TensorRT-LLM, both ways: in-use exact, free and reclaimable bounded by the free blocks
    for name in ("trt", "triton"):
        sel = f'engine="{name}"'
        assert values(prom, f"kvledger_kv_blocks{{{sel}}}", "state") == {"in_use"}
        assert values(prom, f"kvledger_kv_reclaimable_bytes{{{sel}}}", "basis") == {"upper_bound"}
        assert values(prom, f"kvledger_kv_free_bytes{{{sel}}}", "basis") == {"upper_bound"}
        assert values(prom, f'kvledger_kv_headroom_bytes{{{sel},view="physical"}}', "basis") == {"exact"}
        assert values(prom, f"kvledger_engine_reported_memory_bytes{{{sel}}}", "memory_type") == {"gpu", "cpu", "pinned"}
        assert values(prom, f"kvledger_kv_reserved_bytes{{{sel}}}", "basis") == {"upper_bound"}
    # TGI: the reservation exact, nothing physical
    assert values(prom, 'kvledger_kv_reserved_bytes{engine="tgi"}', "basis") == {"exact"}
    for family in ("kvledger_kv_blocks", "kvledger_kv_allocated_bytes", "kvledger_kv_reclaimable_bytes",
                   "kvledger_kv_in_use_bytes", "kvledger_engine_reported_kv_used_blocks"):
        assert prom.query(f'{family}{{engine="tgi"}}') == [], family
    admission = {r["metric"]["engine"]: r["metric"]["admission"] for r in prom.query("kvledger_policy_info")}
    assert admission == {"sgl": "dynamic", "trt": "reserve-cap", "triton": "reserve-cap", "tgi": "reserve-cap"}
    kinds = {r["metric"]["engine"]: r["metric"]["kind"] for r in prom.query("kvledger_engine_info")}
    assert kinds == {"sgl": "sglang", "trt": "trtllm", "triton": "triton-trtllm", "tgi": "tgi"}
    # physical headroom is free + reclaimable wherever both are exact
    assert prom.query('abs(kvledger_kv_headroom_bytes{view="physical"} - ignoring (view) '
                      "(kvledger_kv_free_bytes + kvledger_kv_reclaimable_bytes)) > 0") == []
    assert prom.query("kvledger_ledger_invariant_violations_total > 0") == []


def test_values_move_with_the_engines(stack) -> None:  # type: ignore[no-untyped-def]
    _, _, prom = stack
    # waited for by the queries themselves: each series changes within a 6 s window
    for name in ("sgl", "trt", "triton"):
        wait_until(lambda name=name: prom.query(f'changes(kvledger_kv_blocks{{engine="{name}",state="in_use"}}[6s]) > 0'),
                   30, what=f"{name}'s in-use blocks changing")
    wait_until(lambda: prom.query('changes(kvledger_kv_reserved_bytes{engine="tgi"}[6s]) > 0'), 30, what="tgi's reservation changing")


def test_a_broken_engine_marks_only_its_source_down(stack) -> None:  # type: ignore[no-untyped-def]
    engines, _, prom = stack

    def down_with(name: str, source: str, reason: str) -> bool:
        return bool(prom.query(f'kvledger_source_up{{engine="{name}",source="{source}"}} == 0')) and bool(
            prom.query(f'kvledger_source_errors_total{{engine="{name}",source="{source}",reason="{reason}"}} > 0'))

    engines["sglang"].mode = "garbage"
    engines["tgi"].disappear()
    engines["triton-trtllm"].mode = "poison"
    wait_until(lambda: down_with("sgl", "sglang", "parse") and down_with("tgi", "tgi", "connect")
               and down_with("triton", "triton-trtllm", "parse"), 20, what="three sources down with their reasons")
    # their pool series are gone (unknown), never stale; the healthy engine keeps moving
    assert prom.query('kvledger_kv_capacity_blocks{engine=~"sgl|tgi|triton"}') == []
    assert prom.query('kvledger_source_up{engine="trt"} == 1')
    before = float(prom.query('kvledger_source_last_success_timestamp_seconds{engine="trt"}')[0]["value"][1])
    wait_until(lambda: float(prom.query('kvledger_source_last_success_timestamp_seconds{engine="trt"}')[0]["value"][1])
               > before + 1, 10, what="trt still fresh")
    assert prom.query('kvledger_kv_capacity_blocks{engine="trt"} == 8192')
    # recovery
    engines["sglang"].mode = "ok"
    engines["triton-trtllm"].mode = "ok"
    engines["tgi"].reappear()
    wait_until(lambda: len(prom.query("kvledger_source_up == 1")) == 4, 20, what="all four sources back")
    wait_until(lambda: prom.query('kvledger_kv_capacity_blocks{engine="tgi"} == 252608'), 10, what="tgi pool back")


def test_check_accepts_every_kind_and_reports_a_failing_one(stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from harness.kvledger_daemon import ROOT, _env

    engines, _, _ = stack
    cfg = tmp_path / "k.yml"
    cfg.write_text("nvml: {enabled: false}\nengines:\n" + "\n".join(
        f'  - {{name: {NAMES[k]}, kind: {k}, url: "{e.url}"}}' for k, e in engines.items()) + "\n")
    run = subprocess.run([sys.executable, "-m", "kvledger.cli", "check", "--config", str(cfg)],
                         capture_output=True, text=True, env=_env(None), cwd=ROOT, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    for k in NAMES:
        assert f"ok    {NAMES[k]}/{k}" in run.stdout
    engines["tgi"].mode = "status"
    try:
        run = subprocess.run([sys.executable, "-m", "kvledger.cli", "check", "--config", str(cfg)],
                             capture_output=True, text=True, env=_env(None), cwd=ROOT, timeout=60)
    finally:
        engines["tgi"].mode = "ok"
    assert run.returncode == 1 and "FAIL  tgi/tgi: http_status" in run.stdout


def test_every_registered_kind_with_a_fake_engine_is_read() -> None:
    """The kinds above are every registered kind (config/engine_kinds.py) that a fake engine serves."""
    assert sorted(NAMES) == sorted(k for k in KINDS if k in FAKES)
