"""`kvledger serve` as a process reading two llama.cpp servers, scraped by a real Prometheus:
a simulated llama.cpp (moving slots, kvledger.sim.llamacpp_server) and a fake one serving
the captures of tests/fixtures/llamacpp/ that the test changes over time, then turns into
garbage, takes away and brings back. Every assertion goes through Prometheus' API: the
fake's figures follow its captures with their bases, and its failures mark its own
source down with the reason while the simulated engine stays fresh."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.httpjson import wait_until
from harness.kvledger_daemon import Daemon, run_serve
from harness.llamacpp import FakeLlamacpp
from harness.prometheus import PrometheusServer, start_prometheus
from kvledger.sim.llamacpp_server import SimLlamacpp, SimLlamacppProfile

pytestmark = pytest.mark.e2e

FIXTURES = Path(__file__).parent / "fixtures" / "llamacpp"
BUSY, OLD = "llamacpp-b11434-split-busy", "llamacpp-pre13660"


def bodies(case: str) -> dict[str, bytes]:
    return {f"/{what}": (FIXTURES / f"{case}-{what}.{ext}").read_bytes()
            for what, ext in (("slots", "json"), ("props", "json"), ("metrics", "txt"))}


def capacity(case: str) -> int:
    return sum(s["n_ctx"] for s in json.loads((FIXTURES / f"{case}-slots.json").read_text()))


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimLlamacpp, FakeLlamacpp, Daemon, PrometheusServer]]:
    work = tmp_path_factory.mktemp("llamacpp-e2e")
    sim = SimLlamacpp(SimLlamacppProfile(name="llama-sim", step_seconds=0.01, arrival_rate=1.5, unlimited_prob=0.0), seed=7).start()
    fake = FakeLlamacpp(bodies(BUSY))
    cfg = work / "kvledger.yml"
    cfg.write_text(f"""
interval_seconds: 0.25
nvml: {{enabled: false}}
engines:
  - {{name: llama-sim, kind: llamacpp, url: "{sim.url}/metrics", block_bytes: 32KiB, timeout_seconds: 1}}
  - {{name: llama-fake, kind: llamacpp, url: "{fake.url}", block_bytes: 256, timeout_seconds: 1}}
""")
    try:
        with run_serve(work / "daemon", cfg) as daemon, start_prometheus(work / "prom", targets=[daemon.target]) as prom:
            prom.wait_for_target_up()
            yield sim, fake, daemon, prom
    finally:
        fake.stop()
        sim.stop()


def value(prom: PrometheusServer, expr: str) -> float | None:
    return prom.query_value(expr)


def until(prom: PrometheusServer, expr: str, what: str, timeout: float = 20.0) -> list[dict[str, object]]:
    """Wait until the instant query ``expr`` returns a non-empty vector."""
    return wait_until(lambda: prom.query(expr), timeout, what=what)


def fresh(prom: PrometheusServer, engine: str) -> bool:
    """The engine's source succeeded within the last 3 s of Prometheus' latest sample."""
    return bool(prom.query(f'time() - kvledger_source_last_success_timestamp_seconds{{engine="{engine}",source="llamacpp"}} < 3'))


def test_fake_server_follows_its_captures_with_bases(running) -> None:
    _, fake, _, prom = running
    fake.bodies = bodies(BUSY)
    sel = 'engine="llama-fake",pool="0"'
    until(prom, f"kvledger_kv_capacity_blocks{{{sel}}} == {capacity(BUSY)}", "the busy capture's capacity")
    slots = json.loads(fake.bodies["/slots"])
    busy = [s for s in slots if s["is_processing"]]
    in_use = sum(s.get("n_prompt_tokens", 0) for s in busy)
    idle = sum(s.get("n_prompt_tokens", 0) for s in slots if not s["is_processing"])
    assert value(prom, f'kvledger_kv_blocks{{{sel},state="in_use"}}') == in_use
    assert value(prom, f'kvledger_kv_blocks{{{sel},state="reclaimable"}}') == idle
    assert value(prom, f'kvledger_kv_blocks{{{sel},state="free"}}') == capacity(BUSY) - in_use - idle
    assert value(prom, f'kvledger_kv_reserved_blocks{{{sel},basis="exact"}}') == sum(s["n_ctx"] for s in busy)
    assert value(prom, f'kvledger_kv_capacity_bytes{{{sel}}}') == capacity(BUSY) * 256
    info = prom.query('kvledger_policy_info{engine="llama-fake"}')[0]["metric"]
    assert (info["admission"], info["overflow"]) == ("reserve-cap", "reject")
    assert prom.query('kvledger_engine_info{engine="llama-fake",kind="llamacpp",version="b11434-b11434"}')

    # the server changes: an older build (the KV gauges, no token counts per slot)
    fake.bodies = bodies(OLD)
    until(prom, f"kvledger_kv_capacity_blocks{{{sel}}} == {capacity(OLD)}", "the old capture's capacity")
    until(prom, f"absent(kvledger_kv_blocks{{{sel}}})", "no physical split from the old build")
    assert value(prom, f"kvledger_engine_reported_kv_used_blocks{{{sel}}}") == pytest.approx(0.389038 * 8192)
    assert prom.query('kvledger_engine_info{engine="llama-fake",version="b0-unknown"}')
    fake.bodies = bodies(BUSY)


def test_the_simulated_server_moves_with_exact_bases(running) -> None:
    _, _, _, prom = running
    sel = 'engine="llama-sim",pool="0"'
    until(prom, f'max_over_time(kvledger_kv_blocks{{{sel},state="reclaimable"}}[30s]) > 0', "idle slots keep cached tokens")
    until(prom, f'changes(kvledger_kv_blocks{{{sel},state="in_use"}}[10s]) > 0', "in-use tokens move")
    assert {r["metric"]["basis"] for r in prom.query(f"kvledger_kv_free_bytes{{{sel}}}")} == {"exact"}
    assert {r["metric"]["basis"] for r in prom.query(f"kvledger_kv_reserved_bytes{{{sel}}}")} == {"exact"}
    # the partition sums to capacity, and the reservation is whole slots
    assert prom.query(f"sum(kvledger_kv_blocks{{{sel}}}) != 4 * 2048") == []
    assert prom.query(f'kvledger_kv_reserved_blocks{{{sel}}} % 2048 != 0') == []
    assert prom.query('kvledger_ledger_invariant_violations_total{engine="llama-sim"} > 0') == []


@pytest.mark.parametrize(("mode", "reason"), [("garbage", "parse"), ("gone", "connect")])
def test_a_broken_server_marks_only_its_source_down(running, mode: str, reason: str) -> None:
    _, fake, _, prom = running
    fake.mode = "ok"
    until(prom, 'kvledger_source_up{engine="llama-fake",source="llamacpp"} == 1', "the fake up")
    errors = f'kvledger_source_errors_total{{engine="llama-fake",source="llamacpp",reason="{reason}"}}'
    before = value(prom, errors) or 0.0
    fake.mode = mode
    try:
        until(prom, 'kvledger_source_up{engine="llama-fake",source="llamacpp"} == 0', f"{mode}: the fake down")
        until(prom, f"{errors} > {before}", f"{mode}: counted as {reason}")
        until(prom, 'absent(kvledger_kv_capacity_blocks{engine="llama-fake"})', f"{mode}: its pool series gone")
        # the other engine stays up and fresh, its series complete
        assert prom.query('kvledger_source_up{engine="llama-sim",source="llamacpp"} == 1')
        wait_until(lambda: fresh(prom, "llama-sim"), 10, what="the simulated engine fresh")
        assert value(prom, 'kvledger_kv_capacity_blocks{engine="llama-sim",pool="0"}') == 4 * 2048
    finally:
        fake.mode = "ok"
    until(prom, 'kvledger_source_up{engine="llama-fake",source="llamacpp"} == 1', f"{mode}: the fake back")


def test_metrics_failure_downs_only_the_metrics_part(running) -> None:
    _, fake, _, prom = running
    fake.mode = "ok"
    good = fake.bodies["/metrics"]
    fake.bodies["/metrics"] = b"<html>not metrics</html>\n"
    try:
        until(prom, 'kvledger_source_up{engine="llama-fake",source="metrics"} == 0', "the metrics part down")
        assert prom.query('kvledger_source_up{engine="llama-fake",source="llamacpp"} == 1')
        until(prom, 'absent(kvledger_requests{engine="llama-fake",state="waiting"})', "waiting unknown, not zero")
        assert value(prom, 'kvledger_requests{engine="llama-fake",state="running"}') is not None
    finally:
        fake.bodies["/metrics"] = good
    until(prom, 'kvledger_source_up{engine="llama-fake",source="metrics"} == 1', "the metrics part back")
