"""Start a real Prometheus for a test and talk to it through its HTTP API.

Typical use::

    from harness.prometheus import start_prometheus

    with start_prometheus(tmp_path, targets=["127.0.0.1:9400"],
                          rule_files=[Path("alerts/kvledger.rules.yml")]) as prom:
        prom.wait_for_target_up()
        value = prom.query_value('sum(kvledger_kv_capacity_bytes)')
        firing = prom.wait_for_alert("KVLedgerGPULost", state="firing", timeout=30)

Everything lives under the given work directory (config, TSDB, log); the server binds
127.0.0.1 on a free port. Scrape and evaluation intervals default to 1 s so tests are
quick. The binary is ``prometheus`` from PATH (Debian package ``prometheus``); a missing
binary raises ProcessError so the test fails instead of skipping.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.httpjson import get_json, wait_until
from harness.process import PORT_ATTEMPTS, ManagedProcess, ProcessError, free_port, port_taken, require_binary, start_ready


class PrometheusAPIError(RuntimeError):
    """The HTTP API answered with status "error"."""


#: the project's Prometheus configuration: the five-minute path and deploy/compose use it as is
DEPLOY_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "prometheus.yml"


def prometheus_config(targets: Sequence[str], rule_files: Sequence[Path] = (),
                      alertmanagers: Sequence[str] = (), scrape_interval: str = "1s",
                      evaluation_interval: str = "1s", job: str = "kvledger",
                      external_labels: dict[str, str] | None = None) -> dict[str, Any]:
    """The prometheus.yml document: deploy/prometheus/prometheus.yml (one source of truth)
    with only what a test must change: the scrape job's targets ("host:port", static
    instead of the file_sd files), the rule files (absolute paths), the Alertmanagers
    ("host:port"; none: no alerting section) and the intervals."""
    cfg: dict[str, Any] = yaml.safe_load(DEPLOY_CONFIG.read_text())
    cfg["global"].update(scrape_interval=scrape_interval, evaluation_interval=evaluation_interval,
                         scrape_timeout=scrape_interval)
    if external_labels:
        cfg["global"]["external_labels"] = dict(external_labels)
    cfg["rule_files"] = [str(Path(p).resolve()) for p in rule_files]
    (scrape_job,) = cfg["scrape_configs"]
    scrape_job.pop("file_sd_configs")
    scrape_job.update(job_name=job, static_configs=[{"targets": list(targets)}])
    (alerting,) = cfg["alerting"]["alertmanagers"]
    alerting.pop("file_sd_configs")
    if alertmanagers:
        alerting["static_configs"] = [{"targets": list(alertmanagers)}]
    else:
        del cfg["alerting"]
    return cfg


@dataclass
class PrometheusServer:
    """A running Prometheus. ``url`` is its base URL (http://127.0.0.1:PORT)."""

    url: str
    port: int
    config_path: Path
    process: ManagedProcess = field(repr=False)

    # ------------------------------------------------------------------ raw API

    def api(self, path: str, params: dict[str, str] | None = None) -> Any:
        """GET /api/v1/<path>; return ``data`` or raise PrometheusAPIError."""
        body = get_json(f"{self.url}/api/v1/{path}", params)
        if body.get("status") != "success":
            raise PrometheusAPIError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; the result vector as a list of {"metric": {...}, "value": [t, "v"]}."""
        params = {"query": expr}
        if at is not None:
            params["time"] = str(at)
        data = self.api("query", params)
        if data["resultType"] != "vector":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """Range query; a list of {"metric": {...}, "values": [[t, "v"], ...]}."""
        data = self.api("query_range", {"query": expr, "start": str(start), "end": str(end), "step": str(step)})
        return list(data["result"])

    def label_values(self, selector: str, label: str, lookback: float = 600.0) -> list[str]:
        """Grafana's ``label_values(selector, label)``: values of ``label`` on matching series."""
        series = self.api("series", {"match[]": selector, "start": str(time.time() - lookback)})
        return sorted({s[label] for s in series if label in s})

    def query_value(self, expr: str) -> float | None:
        """The single value of an instant query; None when the result is empty;
        ValueError when it has more than one series."""
        result = self.query(expr)
        if not result:
            return None
        if len(result) > 1:
            raise ValueError(f"{expr} returned {len(result)} series")
        return float(result[0]["value"][1])

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending and firing): {"labels", "annotations", "state", "value", ...}."""
        return list(self.api("alerts")["alerts"])

    def rule_groups(self) -> list[dict[str, Any]]:
        return list(self.api("rules")["groups"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets")["activeTargets"])

    # ------------------------------------------------------------------ waiting

    def wait_for_target_up(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Wait until every active target has health "up"; return the targets."""
        def probe() -> list[dict[str, Any]] | None:
            ts = self.targets()
            return ts if ts and all(t["health"] == "up" for t in ts) else None
        return wait_until(probe, timeout, what="all scrape targets up")

    def wait_for_rules_loaded(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Wait until at least one rule group is loaded; return the groups."""
        return wait_until(lambda: self.rule_groups() or None, timeout, what="rule groups loaded")

    def wait_for_alert(self, name: str, state: str = "firing", timeout: float = 30.0,
                       labels: dict[str, str] | None = None) -> dict[str, Any]:
        """Wait until an alert ``name`` in ``state`` (with ``labels`` a subset of its
        labels) is active; return it."""
        def probe() -> dict[str, Any] | None:
            for a in self.alerts():
                if (a["labels"].get("alertname") == name and a["state"] == state
                        and all(a["labels"].get(k) == v for k, v in (labels or {}).items())):
                    return a
            return None
        return wait_until(probe, timeout, what=f"alert {name} {state}")

    def wait_for_no_alert(self, name: str, timeout: float = 30.0) -> None:
        """Wait until no alert ``name`` is active (neither pending nor firing)."""
        wait_until(lambda: not any(a["labels"].get("alertname") == name for a in self.alerts()),
                   timeout, what=f"alert {name} gone")

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        self.process.stop()

    def log_tail(self, chars: int = 4000) -> str:
        return self.process.log_tail(chars)


def start_prometheus_with_config(workdir: Path, config: dict[str, Any], port: int | None = None,
                                 ready_timeout: float = 30.0,
                                 extra_args: Sequence[str] = ()) -> PrometheusServer:
    """Write ``config`` as prometheus.yml under ``workdir`` and start Prometheus on
    127.0.0.1:``port`` (a free one by default); return once /-/ready answers.
    The caller stops it (or use :func:`start_prometheus` as a context manager)."""
    binary = require_binary("prometheus")
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    for attempt in range(PORT_ATTEMPTS):
        chosen = port or free_port()
        argv = [binary, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{chosen}", "--web.enable-lifecycle",
                "--log.level=info", *extra_args]
        url = f"http://127.0.0.1:{chosen}"
        try:
            proc = start_ready(argv, workdir / "prometheus.log", f"{url}/-/ready", ready_timeout, cwd=workdir)
        except ProcessError as exc:
            if port is not None or attempt == PORT_ATTEMPTS - 1 or not port_taken(exc):
                raise
            continue
        return PrometheusServer(url=url, port=chosen, config_path=config_path, process=proc)
    raise AssertionError("unreachable")


@contextmanager
def start_prometheus(workdir: Path, targets: Sequence[str], rule_files: Sequence[Path] = (),
                     alertmanagers: Sequence[str] = (), scrape_interval: str = "1s",
                     evaluation_interval: str = "1s", port: int | None = None,
                     ready_timeout: float = 30.0) -> Iterator[PrometheusServer]:
    """Context manager: a ready Prometheus scraping ``targets`` with ``rule_files``,
    sending alerts to ``alertmanagers``; stopped on exit."""
    cfg = prometheus_config(targets, rule_files, alertmanagers, scrape_interval, evaluation_interval)
    server = start_prometheus_with_config(workdir, cfg, port=port, ready_timeout=ready_timeout)
    try:
        yield server
    finally:
        server.stop()
