"""Scrape targets for end-to-end alert tests, with a fault that can be switched.

A target has an ``address`` ("host:port") Prometheus scrapes and ``set_fault(name)``
(``None`` clears it). Two kinds:

- :class:`FakeKvledgerExporter`: an in-process prometheus_client server whose custom
  collector serves catalogue-named samples of one healthy reserve-cap engine; the faults
  ``reserve-overcommit`` (exact reservations above capacity) and ``per-request-used``
  (the engine's used-block claim equals the per-request reference count) change them.
- :class:`DemoTarget`: the real ``kvledger demo --listen ADDR --fault NAME`` process,
  restarted on the same port to switch the fault.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from harness.kvledger_daemon import Daemon, start_daemon
from harness.process import free_port

EXPORTER = Path(__file__).resolve().parents[2] / "exporter"  # the package source root
FAULTS = ("reserve-overcommit", "per-request-used")


class Target(Protocol):
    @property
    def address(self) -> str: ...

    def set_fault(self, fault: str | None) -> None: ...

    def stop(self) -> None: ...


class _FakeCollector(Collector):
    """One engine "tgi" (reserve-cap), pool "0", 100-byte blocks, 10 blocks capacity."""

    def __init__(self) -> None:
        self.fault: str | None = None
        self.lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            fault = self.fault
        block = 100.0
        capacity_blocks, in_use, references = 10.0, 6.0, 9.0  # 3 shared prefix blocks, 2 requests
        reserved_blocks = 12.0 if fault == "reserve-overcommit" else 8.0
        claim = references if fault == "per-request-used" else in_use
        ep = ["engine", "pool"]

        def gauge(name: str, labels: list[str], *samples: tuple[list[str], float]) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, name, labels=labels)
            for values, v in samples:
                g.add_metric(values, v)
            return g

        yield gauge("kvledger_kv_capacity_bytes", ep, (["tgi", "0"], capacity_blocks * block))
        yield gauge("kvledger_kv_capacity_blocks", ep, (["tgi", "0"], capacity_blocks))
        yield gauge("kvledger_kv_reserved_bytes", [*ep, "basis"], (["tgi", "0", "exact"], reserved_blocks * block))
        yield gauge("kvledger_kv_blocks", [*ep, "state"], (["tgi", "0", "in_use"], in_use),
                    (["tgi", "0", "reclaimable"], 1.0), (["tgi", "0", "free"], capacity_blocks - in_use - 1.0))
        yield gauge("kvledger_kv_block_references", ep, (["tgi", "0"], references))
        yield gauge("kvledger_kv_shared_blocks", ep, (["tgi", "0"], 3.0))
        yield gauge("kvledger_engine_reported_kv_used_blocks", ep, (["tgi", "0"], claim))
        yield gauge("kvledger_policy_info", ["engine", "sharing", "admission", "overflow", "tenant_rule"],
                    (["tgi", "reference-aware", "reserve-cap", "reject", "per-request"], 1.0))
        yield gauge("kvledger_source_up", ["engine", "source"], (["tgi", "ledger"], 1.0))
        yield gauge("kvledger_gpu_up", ["gpu"], (["0"], 1.0))
        c = CounterMetricFamily("kvledger_preemptions", "preemptions", labels=["engine"])
        c.add_metric(["tgi"], 0.0)
        yield c


class FakeKvledgerExporter:
    """An in-process exporter on 127.0.0.1:<free port> serving :class:`_FakeCollector`."""

    def __init__(self) -> None:
        self._collector = _FakeCollector()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self._collector)
        self.port = free_port()
        self._server, self._thread = start_http_server(self.port, addr="127.0.0.1", registry=registry)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_fault(self, fault: str | None) -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")
        with self._collector.lock:
            self._collector.fault = fault

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class DemoTarget:
    """``kvledger demo`` as a child process; switching the fault restarts it on the same port."""

    def __init__(self, workdir: Path, fault: str | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self._daemon: Daemon | None = None
        self.set_fault(fault)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_fault(self, fault: str | None) -> None:
        self.stop()
        self._daemon = start_daemon(self.workdir, ["demo", "--fault", fault or "none", "--interval", "0.5"], port=self.port)

    def stop(self) -> None:
        if self._daemon is not None:
            self._daemon.stop()
            self._daemon = None
