"""The shipped autoscaling queries on a real Prometheus scraping the real daemon.

One engine, ``llama-8b`` (the engine the sidecar configuration names and the examples
select), served by a reference ledger that the test swaps between three states; Prometheus
scrapes the daemon as the prometheus-operator would label it (``job="kvledger"``,
``namespace="default"``) and evaluates the rule file. KEDA's trigger query and the
prometheus-adapter's external-rule query are read from deploy/kubernetes/autoscaling and
evaluated as written (tests/autoscaling_queries.py); the thresholds are the files' too.

1. bound by sequences: running at max_num_seqs, the queue growing, KV in use around 30 %:
   both queries exceed the threshold, the binding record names ``sequences``, the engine's
   own usage ratio stays low, and KVLedgerBoundByOneConstraint fires for ``sequences``;
2. idle with a full prefix cache (the engine's own gauge counts cached blocks: 100 %): both
   queries stay below the threshold;
3. a reserve-cap engine whose reservations fill its pool: both queries exceed the threshold
   and the binding record names ``kv_quota``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from autoscaling_queries import adapter_query, keda_query, keda_threshold

from alerts import generate
from harness.kvledger_daemon import run_serve
from harness.prometheus import PrometheusServer, prometheus_config, start_prometheus_with_config
from kvledger_engine.document_server import serve_http
from kvledger_engine.reference_ledger import Ledger, PoolSpec

pytestmark = pytest.mark.e2e

ENGINE = "llama-8b"
NAMESPACE = "default"
B = 16
BLOCKS = 100
MAX_NUM_SEQS = 4


def bound_by_sequences() -> Ledger:
    ledger = Ledger([PoolSpec("0", B, 1024, BLOCKS)], admission="dynamic", max_model_len=4096,
                    max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=2048)
    for i in range(MAX_NUM_SEQS):
        ledger.admit(f"r{i}", 120, 200)
        ledger.advance(f"r{i}", 120)  # 8 blocks each: 32 of 100 in use
    ledger.set_reported_used_blocks(32)  # the engine's own gauge (vLLM counts cached-unreferenced as free)
    return ledger


def idle_with_a_full_prefix_cache() -> Ledger:
    ledger = Ledger([PoolSpec("0", B, 1024, BLOCKS)], admission="dynamic", max_model_len=4096,
                    max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=2048)
    for i in range(BLOCKS // 10):
        ledger.admit(f"p{i}", 10 * B, 1)
        blocks = ledger.advance(f"p{i}", 10 * B)
        ledger.cache(blocks, [("prefix", i, j) for j in range(len(blocks))])
        ledger.release(f"p{i}")
    ledger.set_reported_used_blocks(BLOCKS)  # an engine that counts cached blocks as used reads 100 %
    return ledger


def bound_by_its_quota() -> Ledger:
    ledger = Ledger([PoolSpec("0", B, 1024, BLOCKS)], admission="reserve-cap", max_model_len=4096,
                    max_num_seqs=64, max_num_batched_tokens=2048)
    admitted = 0
    while ledger.admit(f"q{admitted}", B, 300):  # 20 blocks reserved each, 1 in use
        ledger.advance(f"q{admitted}", B)
        admitted += 1
    assert admitted == BLOCKS // 20
    ledger.set_reported_used_blocks(admitted)
    return ledger


class Engine:
    """The engine behind the ledger server: every 0.2 s a decode step of the running requests
    (the document stays fresh), every second one more request waiting when ``queue_grows``."""

    def __init__(self, ledger: Ledger, queue_grows: bool) -> None:
        self.ledger, self.queue_grows = ledger, queue_grows
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def swap(self, ledger: Ledger, queue_grows: bool) -> None:
        with self._lock:
            self.ledger, self.queue_grows = ledger, queue_grows

    def document(self) -> dict[str, Any]:
        with self._lock:
            return self.ledger.to_document()

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(0.2):
            with self._lock:
                running = len(self.ledger.request_ids("running"))
                if running:
                    self.ledger.set_iteration_tokens(running)
                if self.queue_grows and tick % 5 == 0:
                    self.ledger.submit(f"w{tick}", 120, 200)
            tick += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Engine, PrometheusServer]]:
    engine = Engine(bound_by_sequences(), queue_grows=True)
    server = serve_http(engine.document)
    config = tmp_path / "kvledger.yml"
    config.write_text(f"""
interval_seconds: 0.25
nvml: {{enabled: false}}
engines:
  - {{name: {ENGINE}, kind: ledger, url: "{server.url}", timeout_seconds: 1}}
""")
    # the rule file as shipped, its alerts without `for` (the generator's test variant)
    rules = tmp_path / "kvledger.rules.yml"
    rules.write_text(generate.render(for_override="0s"))
    try:
        with run_serve(tmp_path / "daemon", config) as daemon:
            cfg = prometheus_config([daemon.target], [rules])
            # the target labels the prometheus-operator gives a pod in namespace "default"
            cfg["scrape_configs"][0]["static_configs"][0]["labels"] = {"namespace": NAMESPACE}
            prom = start_prometheus_with_config(tmp_path / "prometheus", cfg)
            try:
                prom.wait_for_target_up()
                yield engine, prom
            finally:
                prom.stop()
    finally:
        server.stop()
        engine.stop()


def eventually(prom: PrometheusServer, what: str, probe: Callable[[], Any], timeout: float = 40.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached in {timeout:g} s\n{prom.log_tail(1500)}")
        time.sleep(0.5)


def binding(prom: PrometheusServer) -> list[str]:
    return [s["metric"]["constraint"] for s in prom.query(f'kvledger:saturation_binding:ratio{{engine="{ENGINE}"}}')]


def queries(prom: PrometheusServer) -> tuple[float | None, float | None]:
    """(KEDA's query, the adapter's query for an HPA in NAMESPACE), evaluated as the files hold them."""
    return prom.query_value(keda_query()), prom.query_value(adapter_query(NAMESPACE))


def test_the_shipped_queries_scale_on_the_binding_constraint_not_the_usage_ratio(
    stack: tuple[Engine, PrometheusServer],
) -> None:
    engine, prom = stack
    threshold = keda_threshold()
    usage = f'kvledger_engine_reported_kv_used_blocks{{engine="{ENGINE}"}} / kvledger_kv_capacity_blocks'

    # 1. bound by sequences, the queue growing, KV at 32 %
    def sequences_bound() -> bool:
        keda, adapter = queries(prom)
        trend = prom.query_value(f'kvledger_deployment:requests_waiting:deriv2m{{engine="{ENGINE}"}}')
        return (binding(prom) == ["sequences"] and keda is not None and adapter is not None
                and keda > threshold and adapter > threshold and trend is not None and trend > 0)

    eventually(prom, "sequences bound over the threshold with a growing queue", sequences_bound)
    keda, adapter = queries(prom)
    assert keda == adapter == 1.0  # running / max_num_seqs
    own_usage = prom.query_value(usage)
    physical = prom.query_value(f'kvledger_kv_utilization_ratio{{engine="{ENGINE}",view="physical"}}')
    assert own_usage == physical == 0.32 and own_usage < threshold  # the usage ratio would not scale
    alert = prom.wait_for_alert("KVLedgerBoundByOneConstraint", state="firing", timeout=40)
    assert alert["labels"]["constraint"] == "sequences" and alert["labels"]["engine"] == ENGINE

    # 2. idle, the prefix cache full: the engine's own gauge reads 100 %, the queries stay low
    engine.swap(idle_with_a_full_prefix_cache(), queue_grows=False)

    def idle_below() -> bool:
        keda, adapter = queries(prom)
        return keda is not None and adapter is not None and keda < threshold and adapter < threshold

    eventually(prom, "idle engine below the threshold", idle_below)
    assert prom.query_value(usage) == 1.0
    keda, adapter = queries(prom)
    assert keda == adapter == 0.0
    assert prom.query_value(f'kvledger_kv_blocks{{engine="{ENGINE}",state="reclaimable"}}') == BLOCKS

    # 3. reserve-cap, its reservations filling the pool while 5 % holds data
    engine.swap(bound_by_its_quota(), queue_grows=True)

    def quota_bound() -> bool:
        keda, adapter = queries(prom)
        return (binding(prom) == ["kv_quota"] and keda is not None and adapter is not None
                and keda > threshold and adapter > threshold)

    eventually(prom, "quota bound over the threshold", quota_bound)
    keda, adapter = queries(prom)
    assert keda == adapter == 1.0
    assert prom.query_value(usage) == 0.05
