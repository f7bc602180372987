"""`kvledger serve` as a process against real ledger servers: a source returning garbage,
an error status or hanging is marked down with its reason while the daemon keeps serving
and the other engine is unaffected; `snapshot` and `check` report the same; SIGTERM stops
it cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.kvledger_daemon import ROOT, Daemon, _env, run_serve
from kvledger.sim.demo import demo_profiles
from kvledger.sim.engine import SimEngine
from kvledger_engine.document_server import LedgerServer, serve_http, serve_unix

pytestmark = pytest.mark.e2e


def scrape(daemon: Daemon) -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float], float]:
    start = time.monotonic()
    text = urllib.request.urlopen(daemon.url + "/metrics", timeout=5).read().decode()
    elapsed = time.monotonic() - start
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return samples, elapsed


def value(samples: dict, name: str, **labels: str) -> float | None:  # type: ignore[type-arg]
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def ledgers(tmp_path: Path) -> Iterator[tuple[LedgerServer, LedgerServer]]:
    good_engine = SimEngine(demo_profiles()[0], seed=1).start()
    bad_engine = SimEngine(demo_profiles()[1], seed=2).start()
    good = serve_unix(good_engine.document, str(tmp_path / "good.sock"))
    bad = serve_http(bad_engine.document)
    bad.hang_seconds = 5.0
    try:
        yield good, bad
    finally:
        for x in (good, bad, good_engine, bad_engine):
            x.stop()


def write_config(tmp_path: Path, good: LedgerServer, bad: LedgerServer) -> Path:
    cfg = tmp_path / "kvledger.yml"
    cfg.write_text(f"""
interval_seconds: 0.25
nvml: {{enabled: false}}
engines:
  - {{name: good, kind: ledger, url: "{good.url}", timeout_seconds: 1}}
  - {{name: bad, kind: ledger, url: "{bad.url}", timeout_seconds: 0.5}}
""")
    return cfg


def wait_for(daemon: Daemon, predicate, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        samples, elapsed = scrape(daemon)
        if predicate(samples):
            return samples, elapsed
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached; last scrape:\n" + "\n".join(
                f"{k} {v}" for k, v in samples.items() if "source" in k[0]))
        time.sleep(0.2)


@pytest.mark.parametrize(("fault", "reason"), [("garbage", "parse"), ("status", "http_status"), ("hang", "timeout")])
def test_faulty_source_marked_down_others_unaffected(
    tmp_path: Path, ledgers: tuple[LedgerServer, LedgerServer], fault: str, reason: str
) -> None:
    good, bad = ledgers
    with run_serve(tmp_path, write_config(tmp_path, good, bad)) as daemon:
        wait_for(daemon, lambda s: value(s, "kvledger_source_up", engine="bad", source="ledger") == 1.0)
        bad.fault = fault
        samples, _ = wait_for(daemon, lambda s: value(s, "kvledger_source_up", engine="bad", source="ledger") == 0.0)
        samples, _ = wait_for(daemon, lambda s: (value(s, "kvledger_source_errors_total", engine="bad", source="ledger", reason=reason) or 0) >= 1)
        # its pool series are gone (unknown), the engine itself is still declared
        assert value(samples, "kvledger_kv_capacity_blocks", engine="bad", pool="0") is None
        assert value(samples, "kvledger_engine_info", engine="bad", kind="ledger", version="", source="ledger") == 1.0
        # the other engine keeps reporting while a source fails or hangs: its polls still succeed
        # (a scrape never waits on an engine: tests/test_collector.py serves scrapes while a
        # source hangs; how long a scrape takes is measured in bench/, not asserted here)
        before = value(samples, "kvledger_source_last_success_timestamp_seconds", engine="good", source="ledger")
        samples, _ = wait_for(daemon, lambda s: (value(s, "kvledger_source_last_success_timestamp_seconds",
                                                       engine="good", source="ledger") or 0) > (before or 0))
        assert value(samples, "kvledger_source_up", engine="good", source="ledger") == 1.0
        assert value(samples, "kvledger_kv_capacity_blocks", engine="good", pool="0") == 1024
        assert value(samples, "kvledger_source_up", engine="bad", source="ledger") == 0.0
        # the fault clears: the source comes back
        bad.fault = None
        wait_for(daemon, lambda s: value(s, "kvledger_kv_capacity_blocks", engine="bad", pool="0") == 1536)


def test_snapshot_and_check_report_failures(tmp_path: Path, ledgers: tuple[LedgerServer, LedgerServer]) -> None:
    good, bad = ledgers
    cfg = write_config(tmp_path, good, bad)
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvledger.cli", *a], capture_output=True, text=True, env=_env(None), cwd=ROOT, timeout=60)
    ok = run("snapshot", "--config", str(cfg), "--json")
    assert ok.returncode == 0, ok.stderr
    assert '"kvledger_kv_capacity_blocks"' in ok.stdout
    bad.fault = "status"
    failed = run("snapshot", "--config", str(cfg))
    assert failed.returncode == 1
    assert any(ln.split()[:4] == ["bad", "ledger", "DOWN", "(http_status):"] for ln in failed.stdout.splitlines()), failed.stdout
    assert failed.stderr == "kvledger: 1 of 2 source(s) down (see above)\n"  # the failure itself once, in the table
    assert 'kvledger_kv_capacity_blocks{engine="good",pool="0"} 1024' in failed.stdout
    checked = run("check", "--config", str(cfg))
    assert checked.returncode == 1 and "FAIL  bad/ledger: http_status" in checked.stdout and "ok    good/ledger" in checked.stdout
    bad.fault = None
    assert run("check", "--config", str(cfg)).returncode == 0
    broken = tmp_path / "broken.yml"
    broken.write_text("engines:\n  - {name: x, kind: ledger, url: 'http://127.0.0.1:1/', timout_seconds: 1}\n")
    res = run("check", "--config", str(broken))
    assert res.returncode == 2 and "engines[0]: unknown key(s): timout_seconds" in res.stderr


def test_sigterm_stops_cleanly(tmp_path: Path, ledgers: tuple[LedgerServer, LedgerServer]) -> None:
    good, bad = ledgers
    with run_serve(tmp_path, write_config(tmp_path, good, bad)) as daemon:
        proc = daemon.process.proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "stopped" in daemon.process.log_tail()
