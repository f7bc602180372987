"""`kvledger serve` as a process beside a hostile or broken engine and a healthy one:
poisoned documents fail the poisoned engine alone while the healthy one keeps moving; an
endless body leaves the daemon's memory bounded and back near its baseline afterwards;
headers dripped a byte at a time mark the source down within its timeout and do not
delay SIGTERM. Every hostile engine of the second probe at once (issue 25): a timestamp of
312 digits (vLLM, and llama.cpp's optional /metrics), sums beyond 2**53 - 1, 11 MB of
100,000 series, a KV-event sequence jump to 2**63 - 1, with the first probe's endless body,
beside the healthy engine, which stays fresh; /metrics passes promtool and the daemon's
peak RSS stays under 200 MB."""

from __future__ import annotations

import copy
import json
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_serve_e2e import scrape, value
from vllm_publisher import FakeVllmPublisher, stored_array

from harness.hostile import HostileEngine
from harness.kvledger_daemon import Daemon, run_serve
from harness.llamacpp import FakeLlamacpp
from kvledger.sim.demo import demo_profiles
from kvledger.sim.engine import SimEngine
from kvledger_engine.document_server import LedgerServer, serve_http

pytestmark = pytest.mark.e2e

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def engines() -> Iterator[tuple[LedgerServer, HostileEngine, SimEngine]]:
    sim = SimEngine(demo_profiles()[0], seed=3).start()
    good = serve_http(sim.document)
    hostile = HostileEngine(json.dumps(sim.document()).encode())
    try:
        yield good, hostile, sim
    finally:
        for x in (good, hostile, sim):
            x.stop()


def config(tmp_path: Path, good: LedgerServer, hostile: HostileEngine | None, extra: str = "") -> Path:
    """kvledger.yml for the healthy engine and, unless None, the hostile one."""
    second = "" if hostile is None else f'  - {{name: hostile, kind: ledger, url: "{hostile.url}", timeout_seconds: 1{extra}}}\n'
    cfg = tmp_path / "kvledger.yml"
    cfg.write_text(f"""
interval_seconds: 0.25
nvml: {{enabled: false}}
engines:
  - {{name: good, kind: ledger, url: "{good.url}", timeout_seconds: 1}}
{second}""")
    return cfg


def until(daemon: Daemon, what: str, predicate: Callable[[Samples], bool], timeout: float = 15.0) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        samples, _ = scrape(daemon)
        if predicate(samples):
            return samples
        if time.monotonic() > deadline:
            shown = "\n".join(f"{k} {v}" for k, v in samples.items() if "source" in k[0])
            raise AssertionError(f"{what}: not reached; last scrape:\n{shown}")
        time.sleep(0.1)


def up(s: Samples, engine: str) -> float | None:
    return value(s, "kvledger_source_up", engine=engine, source="ledger")


def errors(s: Samples, engine: str, reason: str) -> float:
    return value(s, "kvledger_source_errors_total", engine=engine, source="ledger", reason=reason) or 0.0


def success(s: Samples, engine: str) -> float:
    """When the engine's source last succeeded (the daemon's clock): polls are counted by it."""
    return value(s, "kvledger_source_last_success_timestamp_seconds", engine=engine, source="ledger") or 0.0


def good_success(s: Samples) -> float:
    return value(s, "kvledger_source_last_success_timestamp_seconds", engine="good", source="ledger") or 0.0


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """The process's resident set (``VmHWM``: its peak so far), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def _poison(doc: dict[str, Any], path: str, new: Any) -> bytes:
    d = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node: Any = d
    for p in parents:
        node = node[int(p)] if p.isdigit() else node.setdefault(p, {})
    node[int(last) if last.isdigit() else last] = new
    return json.dumps(d).encode()


def test_poisoned_documents_fail_the_poisoned_engine_alone(
    tmp_path: Path, engines: tuple[LedgerServer, HostileEngine, SimEngine]
) -> None:
    good, hostile, sim = engines
    deadline = time.monotonic() + 10
    while not (doc := sim.document())["requests"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert doc["requests"], "the simulated engine has requests in flight"
    poisons = {
        "prompt_tokens 2^63": _poison(doc, "requests.0.prompt_tokens", 2**63),
        "max_model_len 0": _poison(doc, "budgets.max_model_len", 0),
        "block_bytes 1e308": _poison(doc, "pools.0.block_bytes", 1e308),
        "counter -5": _poison(doc, "counters.preemptions", -5),
        "num_blocks 1e999": json.dumps(doc).replace(f'"num_blocks": {doc["pools"][0]["num_blocks"]}', '"num_blocks": 1e999', 1).encode(),
    }
    with run_serve(tmp_path, config(tmp_path, good, hostile)) as daemon:
        until(daemon, "both up", lambda s: up(s, "good") == 1 and up(s, "hostile") == 1)
        for name, body in poisons.items():
            samples, _ = scrape(daemon)
            before = good_success(samples)
            rejected = sum(errors(samples, "hostile", r) for r in ("schema", "parse", "invalid"))
            hostile.body = body
            samples = until(daemon, f"{name}: hostile down",
                            lambda s, rejected=rejected: up(s, "hostile") == 0
                            and sum(errors(s, "hostile", r) for r in ("schema", "parse", "invalid")) > rejected)
            # its pool series are gone; the healthy engine is fresh and complete
            assert value(samples, "kvledger_kv_capacity_blocks", engine="hostile", pool="0") is None, name
            samples = until(daemon, f"{name}: good keeps moving", lambda s, before=before: good_success(s) > before + 0.5)
            assert up(samples, "good") == 1
            assert value(samples, "kvledger_kv_capacity_blocks", engine="good", pool="0") == doc["pools"][0]["num_blocks"]
            hostile.body = json.dumps(sim.document()).encode()
            until(daemon, f"{name}: hostile recovers", lambda s: up(s, "hostile") == 1)


def test_cardinality_from_engine_data_is_bounded(
    tmp_path: Path, engines: tuple[LedgerServer, HostileEngine, SimEngine]
) -> None:
    good, hostile, sim = engines
    doc = sim.document()
    doc["tenants"] = [{"name": f"tenant-{i}", "quota_bytes": 1 << 30} for i in range(100_000)]
    doc["engine"] = {"kind": "ledger", "version": "v" * (1 << 20)}
    hostile.body = json.dumps(doc).encode()
    with run_serve(tmp_path, config(tmp_path, good, hostile)) as daemon:
        samples = until(daemon, "hostile up", lambda s: up(s, "hostile") == 1 and up(s, "good") == 1)
        tenants = {dict(k[1])["tenant"] for k in samples if k[0] == "kvledger_tenant_quota_bytes"
                   and dict(k[1])["engine"] == "hostile"}
        assert len(tenants) == 100  # limits.tenants_per_engine
        dropped = value(samples, "kvledger_label_values_limited_total", engine="hostile", label="tenant", action="dropped")
        assert dropped is not None and dropped >= 99_900
        versions = [dict(k[1])["version"] for k in samples if k[0] == "kvledger_engine_info"
                    and dict(k[1])["engine"] == "hostile"]
        assert len(versions) == 1 and len(versions[0]) == 128
        assert len(samples) < 5000


def test_endless_body_keeps_memory_bounded(
    tmp_path: Path, engines: tuple[LedgerServer, HostileEngine, SimEngine]
) -> None:
    good, hostile, sim = engines
    with run_serve(tmp_path, config(tmp_path, good, hostile, ", max_response_bytes: 8MiB")) as daemon:
        samples = until(daemon, "both up", lambda s: up(s, "hostile") == 1)
        pid = daemon.process.pid
        settled = success(samples, "hostile") + 1.0  # a second of polls of both before the baseline
        until(daemon, "a second of polls", lambda s: success(s, "hostile") >= settled)
        baseline = rss_bytes(pid)
        hostile.mode = "endless"
        samples = until(daemon, "too_large", lambda s: errors(s, "hostile", "too_large") >= 3)
        peak = baseline
        endless_polls = errors(samples, "hostile", "too_large") + 16
        deadline = time.monotonic() + 30
        while errors(samples, "hostile", "too_large") < endless_polls:  # 16 more polls of an endless body
            assert time.monotonic() < deadline, "16 polls of the endless body not seen"
            peak = max(peak, rss_bytes(pid))  # sampled between scrapes
            samples, _ = scrape(daemon)
        assert up(samples, "good") == 1
        hostile.mode = "document"
        hostile.body = json.dumps(sim.document()).encode()
        samples = until(daemon, "recovered", lambda s: up(s, "hostile") == 1)
        settled = success(samples, "hostile") + 1.0  # a second of good polls, then what is left
        until(daemon, "a second of polls after recovery", lambda s: success(s, "hostile") >= settled)
        after = rss_bytes(pid)
        mib = 1 << 20
        # the limit is 8 MiB: a fetch holds at most the limit, and the memory comes back
        assert peak - baseline < 48 * mib, f"peak {peak / mib:.0f} MiB over a baseline of {baseline / mib:.0f} MiB"
        assert after - baseline < 16 * mib, f"after {after / mib:.0f} MiB, baseline {baseline / mib:.0f} MiB"


def test_slow_headers_are_down_within_the_timeout_and_sigterm_is_prompt(
    tmp_path: Path, engines: tuple[LedgerServer, HostileEngine, SimEngine]
) -> None:
    good, hostile, _ = engines
    hostile.drip_seconds = 0.2  # every byte far inside a per-read timeout
    with run_serve(tmp_path, config(tmp_path, good, hostile)) as daemon:
        until(daemon, "both up", lambda s: up(s, "hostile") == 1)
        hostile.mode = "slow_headers"
        # down for a timeout: the headers drip for over 40 s (200+ bytes at 0.2 s), the poll's
        # deadline (timeout_seconds 1) ends it; the reason says which, no clock is read
        until(daemon, "timeout", lambda s: errors(s, "hostile", "timeout") >= 1)
        hostile.mode = "document"
        until(daemon, "recovered", lambda s: up(s, "hostile") == 1, timeout=10)
        hostile.mode = "slow_headers"
        until(daemon, "timeout again", lambda s: errors(s, "hostile", "timeout") >= 2)
        proc = daemon.process.proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0  # prompt: the poll in flight (a 40 s drip) is not waited for


def test_sighup_reloads_the_configuration_and_keeps_it_when_bad(
    tmp_path: Path, engines: tuple[LedgerServer, HostileEngine, SimEngine]
) -> None:
    good, hostile, _ = engines
    cfg = config(tmp_path, good, None)
    with run_serve(tmp_path, cfg) as daemon:
        until(daemon, "good up", lambda s: up(s, "good") == 1 and up(s, "hostile") is None)
        samples, _ = scrape(daemon)
        first_success = good_success(samples)
        assert value(samples, "kvledger_config_last_reload_successful") == 1
        loaded_at = value(samples, "kvledger_config_last_reload_success_timestamp_seconds")
        assert loaded_at is not None and loaded_at > 0
        config(tmp_path, good, hostile)  # adds the second engine, same file
        daemon.process.proc.send_signal(signal.SIGHUP)
        samples = until(daemon, "second engine", lambda s: up(s, "hostile") == 1)
        assert up(samples, "good") == 1
        assert daemon.process.running()
        assert "configuration reloaded: 2 engine(s)" in daemon.process.log_tail()
        # the unchanged engine kept its source: it never went back to "not polled yet"
        assert errors(samples, "good", "not polled yet") == 0 and good_success(samples) > first_success
        cfg.write_text(cfg.read_text().replace("timeout_seconds: 1}", "timout_seconds: 1}", 1))
        daemon.process.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reload failed" not in daemon.process.log_tail() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "reload failed, the running configuration is kept" in daemon.process.log_tail()
        assert "unknown key(s): timout_seconds" in daemon.process.log_tail()
        # the failure is visible (kvledger_config_last_reload_successful 0, as Prometheus exports
        # its own), and the last success stays the reload that added the second engine
        samples = until(daemon, "reload failure exported", lambda s: value(s, "kvledger_config_last_reload_successful") == 0)
        reloaded_at = value(samples, "kvledger_config_last_reload_success_timestamp_seconds")
        assert reloaded_at is not None and reloaded_at > loaded_at
        before = good_success(samples)
        samples = until(daemon, "still polling both", lambda s: good_success(s) > before and up(s, "hostile") == 1)
        assert daemon.process.running()


# ---------------------------------------------------------------- the second probe, every engine at once

FIXTURES = Path(__file__).parent / "fixtures"
VLLM = (FIXTURES / "vllm" / "vllm-0.32-like.txt").read_text()
STAMP = "9" * 312  # prometheus_client's int / 1000 overflows: OverflowError


def _dp_ranks(n: int, running: int) -> bytes:
    """vLLM's /metrics of ``n`` data-parallel ranks, each running ``running`` requests (in range):
    their sum is not (the probe: 9,007,199,254,740,995)."""
    lines = []
    for r in range(n):
        labels = f'engine="{r}",model_name="m"'
        lines += [f"vllm:num_requests_running{{{labels}}} {running}.0", f"vllm:num_requests_waiting{{{labels}}} 0.0",
                  f"vllm:kv_cache_usage_perc{{{labels}}} 0.0", f"vllm:prefix_cache_hits_total{{{labels}}} 3.7e15",
                  f'vllm:cache_config_info{{block_size="16",{labels},num_gpu_blocks="{n * 1025}"}} 1.0']
    return ("\n".join(lines) + "\n").encode()


def _series(n: int) -> bytes:
    """11 MB of vLLM text: ``n`` series of one gauge, each with its own label value."""
    head = VLLM.encode()
    return head + b"".join(b'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="r%030d"} 0.0\n' % i
                           for i in range(n))


def _promtool_check(body: bytes) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool not on PATH: apt-get install prometheus"
    out = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert out.returncode == 0, (out.stdout + out.stderr).decode()[:2000]


def test_every_hostile_engine_of_the_probe_at_once(
    tmp_path: Path, engines: tuple[LedgerServer, HostileEngine, SimEngine]
) -> None:
    good, endless, _ = engines
    endless.mode = "endless"  # the first probe's, at the default limit of 16 MiB
    stamp = HostileEngine(VLLM.encode() + f'vllm:num_requests_running{{engine="0",model_name="tiny"}} 3.0 {STAMP}\n'.encode())
    summed = HostileEngine(_dp_ranks(2, 2**52 + 2))
    huge = HostileEngine(_series(100_000))
    assert len(huge.body) > 11_000_000
    events_metrics = HostileEngine(VLLM.encode())
    llama_files = FIXTURES / "llamacpp"
    llama = FakeLlamacpp({
        "/props": (llama_files / "llamacpp-b11434-split-busy-props.json").read_bytes(),
        "/slots": (llama_files / "llamacpp-b11434-split-busy-slots.json").read_bytes(),
        "/metrics": (llama_files / "llamacpp-b11434-split-busy-metrics.txt").read_bytes()
        + f"llamacpp:requests_processing 1 {STAMP}\n".encode(),
    })
    pub = FakeVllmPublisher(replay=False)
    cfg = tmp_path / "kvledger.yml"
    cfg.write_text(f"""
interval_seconds: 0.25
nvml: {{enabled: false}}
engines:
  - {{name: good, kind: ledger, url: "{good.url}", timeout_seconds: 1}}
  - {{name: stamp, kind: vllm, url: "{stamp.url}", timeout_seconds: 1}}
  - {{name: summed, kind: vllm, url: "{summed.url}", timeout_seconds: 1}}
  - {{name: huge, kind: vllm, url: "{huge.url}", timeout_seconds: 2}}
  - {{name: events, kind: vllm, url: "{events_metrics.url}", timeout_seconds: 1, kv_events: "{pub.endpoint}"}}
  - {{name: llama, kind: llamacpp, url: "{llama.url}", timeout_seconds: 1, block_bytes: 4096}}
  - {{name: endless, kind: ledger, url: "{endless.url}", timeout_seconds: 1}}
""")
    try:
        with run_serve(tmp_path, cfg) as daemon:
            pid = daemon.process.pid

            def source(s: Samples, engine: str, kind: str = "vllm") -> float | None:
                return value(s, "kvledger_source_up", engine=engine, source=kind)

            def errs(s: Samples, engine: str, reason: str, kind: str = "vllm") -> float:
                return value(s, "kvledger_source_errors_total", engine=engine, source=kind, reason=reason) or 0.0

            until(daemon, "first polls", lambda s: good_success(s) > 0 and errs(s, "huge", "too_large") >= 1
                  and source(s, "llama", "llamacpp") == 1 and source(s, "events") == 1, timeout=30)
            pub.wait_subscribed()
            pub.publish([stored_array([1, 2])])  # seq 0
            pub.seq = 2**63 - 1  # the jump: kv_events_lost_total was 9.2e18, for good
            pub.publish([stored_array([3])])
            samples = until(daemon, "the jump counted", lambda s: (value(s, "kvledger_kv_events_total", engine="events",
                                                                            type="BlockStored") or 0) >= 2)
            start = good_success(samples)
            # 20 polls of every engine (interval 0.25 s): waited for by the counts the checks below read
            samples = until(daemon, "20 polls of every engine", lambda s: good_success(s) > start + 3
                            and errs(s, "stamp", "parse") >= 15 and errs(s, "summed", "invalid") >= 15
                            and errs(s, "huge", "too_large") >= 10 and errs(s, "endless", "too_large", "ledger") >= 10,
                            timeout=60)
            body = urllib.request.urlopen(daemon.url + "/metrics", timeout=5).read()
            hwm = rss_bytes(pid, "VmHWM")
            log = daemon.process.log_path.read_text(errors="replace")

        # the healthy engine stays fresh
        assert source(samples, "good", "ledger") == 1 and good_success(samples) > start + 3
        # timestamp: a parse error of its engine at every poll, never internal, logged once
        assert source(samples, "stamp") == 0 and errs(samples, "stamp", "parse") >= 15
        assert errs(samples, "stamp", "internal") == 0
        assert len(re.findall(r"source stamp/vllm down", log)) == 1 and "Traceback" not in log
        # llama.cpp: the bad optional /metrics leaves the engine up, its sub-source down
        assert source(samples, "llama", "llamacpp") == 1 and source(samples, "llama", "metrics") == 0
        assert value(samples, "kvledger_kv_capacity_blocks", engine="llama", pool="0") is not None
        # sums beyond 2**53 - 1: the engine is invalid, nothing of it exported rounded
        assert source(samples, "summed") == 0 and errs(samples, "summed", "invalid") >= 15
        assert len(re.findall(r"source summed/vllm down", log)) == 1
        # 11 MB of 100,000 series: refused while streaming at every poll, never up, never a timeout
        huge_polls = errs(samples, "huge", "too_large")
        assert source(samples, "huge") == 0 and huge_polls >= 10
        assert errs(samples, "huge", "timeout") == 0 and errs(samples, "huge", "parse") == 0
        assert source(samples, "endless", "ledger") == 0 and errs(samples, "endless", "too_large", "ledger") >= 10
        # the jump: one lost batch, the engine up
        assert value(samples, "kvledger_kv_events_lost_total", engine="events") == 1
        assert source(samples, "events") == 1 and source(samples, "events", "kv_events") == 0
        # /metrics: valid for promtool, every number exact in a double
        _promtool_check(body)
        for line in body.decode().splitlines():
            if line and not line.startswith("#") and not line.startswith("process_"):
                assert abs(float(line.rsplit(" ", 1)[1])) <= 2**53 - 1, line
        mib = 1 << 20
        print(f"\npeak RSS (VmHWM) {hwm / mib:.1f} MiB; 11 MB engine: up 0 of {huge_polls:.0f} polls (too_large)")
        assert hwm < 200 * mib, f"peak RSS {hwm / mib:.0f} MiB"
    finally:
        for x in (stamp, summed, huge, events_metrics, llama):
            x.stop()
        pub.close()


# ---------------------------------------------------------------- round three (issue 31): the server and the fleet


def _get(url: str, headers: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _proc_status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def test_round_three_pages_accept_memory_and_a_fleet(
    tmp_path: Path, engines: tuple[LedgerServer, HostileEngine, SimEngine]
) -> None:
    """Every class of the third probe that the server and the collector answer, at once:
    - a flood of distinct lab runs and JSON views beside scrapes: every scrape answered 200,
      lab runs 200 or 503 (at most ``lab_queue`` at a time, in a worker process);
    - Accept ``version=`` of 5,000 digits: answered (text format), no traceback in the log;
    - a 3 MiB answer over a 16 MiB memory budget beside answers in flight: refused naming
      the budget, the healthy engine fresh;
    - 120 engines polled by a bounded number of threads (before: one thread each), their
      connections counted in the descriptors the daemon announced."""
    from concurrent.futures import ThreadPoolExecutor

    good, hostile, sim = engines
    hostile.body = json.dumps(sim.document()).encode() + b" " * (3 << 20)  # 3 MiB: x8 for its parse, 24 MiB
    fleet = "".join(f'  - {{name: f{i}, kind: ledger, url: "{good.url}", timeout_seconds: 2}}\n' for i in range(120))
    cfg = tmp_path / "kvledger.yml"
    cfg.write_text(f"""
interval_seconds: 1
json_view: true
nvml: {{enabled: false}}
limits: {{memory_budget_bytes: 16MiB}}
engines:
  - {{name: good, kind: ledger, url: "{good.url}", timeout_seconds: 2}}
  - {{name: hostile, kind: ledger, url: "{hostile.url}", timeout_seconds: 2}}
{fleet}""")
    with run_serve(tmp_path, cfg) as daemon:
        samples = until(daemon, "hostile refused by the memory budget, good up",
                        lambda s: up(s, "good") == 1 and errors(s, "hostile", "too_large") >= 1, timeout=60)
        assert up(samples, "hostile") == 0
        status, body = _get(daemon.url + "/api/v1/accounts")
        assert status == 200
        hostile_health = [h for h in json.loads(body)["sources"] if h["engine"] == "hostile"]
        assert hostile_health and "memory budget" in json.dumps(hostile_health)
        until(daemon, "the fleet up", lambda s: all(up(s, f"f{i}") == 1 for i in range(120)), timeout=60)
        threads = _proc_status(daemon.process.pid, "Threads")
        assert threads < 60, f"{threads} threads for 122 engines"

        # a flood of lab runs and JSON views beside scrapes
        lab = [f"/lab/run.json?capacity={c}&working_set={c + 90}" for c in range(2, 34)]
        with ThreadPoolExecutor(24) as pool:
            floods = [pool.submit(_get, daemon.url + q) for q in lab]
            floods += [pool.submit(_get, daemon.url + "/ui/ledger.json") for _ in range(32)]
            scrapes = [_get(daemon.url + "/metrics", {"Accept-Encoding": "gzip"}) for _ in range(10)]
            results = [f.result(timeout=120) for f in floods]
        assert {s for s, _ in scrapes} == {200}
        assert {s for s, _ in results[:len(lab)]} <= {200, 503} and any(s == 200 for s, _ in results[:len(lab)])
        assert {s for s, _ in results[len(lab):]} <= {200, 503}

        # an Accept version of thousands of digits
        for media in ("text/plain", "application/openmetrics-text"):
            status, body = _get(daemon.url + "/metrics", {"Accept": f"{media};version={'9' * 5000}"})
            assert status == 200 and b"kvledger_source_up" in body
        log = daemon.process.log_tail(200_000)
        assert "never retrieved" not in log and "Traceback" not in log
