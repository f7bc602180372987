"""README's "See an alert fire in five minutes", run for real: the fault demo, Prometheus
on deploy/prometheus/prometheus.yml, Alertmanager on deploy/alertmanager/alertmanager.yml,
and the compose stack's notification sink (deploy/compose/alert-sink.py) standing in for
the pager and ticket webhooks. The page arrives at the sink as the compose stack shows it.

Differences from the README's path, all of them addresses or waiting: free ports instead
of 9477/9090/9093; the webhooks' host names (compose service aliases) replaced by the
sink's address; every rule's `for` 0s instead of 2m (the generator's test variant), so the
test takes seconds instead of minutes, and with it every group_interval 5s instead of
minutes (an alert without its `for` can flap while the first group waits; the next
notification would then wait a group_interval). Routes, receivers, group waits and the
rule expressions are the shipped ones."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from alerts_support import load

from harness.alertmanager import start_alertmanager
from harness.kvledger_daemon import run_demo
from harness.process import free_port
from harness.prometheus import start_prometheus

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


class Sink:
    """deploy/compose/alert-sink.py as a process; its printed lines in a queue."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "deploy/compose/alert-sink.py"), "--listen",
                                      f"127.0.0.1:{self.port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.wait_for(lambda ln: ln.startswith("alert-sink: listening"), 10)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, predicate: Any, timeout: float) -> str:
        seen = []
        try:
            while True:
                line = self.lines.get(timeout=timeout)
                seen.append(line)
                if predicate(line):
                    return line
        except queue.Empty:
            raise AssertionError(f"no matching line within {timeout}s; seen: {seen}") from None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def sink() -> Iterator[Sink]:
    s = Sink()
    try:
        yield s
    finally:
        s.stop()


def shipped_alertmanager_config(sink: Sink) -> dict[str, Any]:
    cfg: dict[str, Any] = yaml.safe_load((ROOT / "deploy/alertmanager/alertmanager.yml").read_text())
    for receiver in cfg["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            scheme, _, _host, path = hook["url"].split("/", 3)
            hook["url"] = f"{scheme}//127.0.0.1:{sink.port}/{path}"

    def shorten(route: dict[str, Any]) -> None:
        route["group_interval"] = "5s"
        for child in route.get("routes", []):
            shorten(child)

    shorten(cfg["route"])
    return cfg


def test_the_fault_demo_pages_through_the_shipped_configs(tmp_path: Path, sink: Sink) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(load("generate").render(for_override="0s"))
    with run_demo(tmp_path / "demo", faults=["reserve-overcommit"]) as demo, \
            start_alertmanager(tmp_path / "am", shipped_alertmanager_config(sink)) as am, \
            start_prometheus(tmp_path / "prom", targets=[demo.target], rule_files=[rules], alertmanagers=[am.address],
                             scrape_interval="2s", evaluation_interval="2s") as prom:
        prom.wait_for_target_up(timeout=30)
        firing = prom.wait_for_alert("KVLedgerQuotaExceedsCapacity", "firing", timeout=60)
        assert firing["labels"]["engine"] == "sim-tgi"
        # the pager route's group_wait is 10s: the page reaches the sink within a minute
        line = sink.wait_for(lambda ln: "KVLedgerQuotaExceedsCapacity" in ln, 60)
        assert line.startswith("pager   FIRING   KVLedgerQuotaExceedsCapacity severity=critical engine=sim-tgi pool=0"), line
