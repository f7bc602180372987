"""deploy/alertmanager/alertmanager.yml: valid for amtool, routes by severity."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which("amtool")
    assert path, "amtool not on PATH: apt-get install prometheus-alertmanager"
    return subprocess.run([path, *args], capture_output=True, text=True)


def test_amtool_check_config() -> None:
    out = amtool("check-config", str(CONFIG))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@pytest.mark.parametrize(("labels", "receiver"), [
    (["severity=critical", "alertname=KVLedgerQuotaExceedsCapacity"], "pager"),
    (["severity=critical", "alertname=KVLedgerGPULost"], "pager"),
    (["severity=warning", "alertname=KVLedgerPrefixCountingInconsistent"], "ticket"),
    (["severity=info"], "ticket"),
    (["alertname=Unlabelled"], "ticket"),
])
def test_routes_by_severity(labels: list[str], receiver: str) -> None:
    out = amtool("config", "routes", "test", f"--config.file={CONFIG}", *labels)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == [receiver]
    verified = amtool("config", "routes", "test", f"--config.file={CONFIG}",
                      f"--verify.receivers={'ticket' if receiver == 'pager' else 'pager'}", *labels)
    assert verified.returncode != 0


def test_gpu_lost_and_source_down_inhibit_dependent_alerts() -> None:
    inhibits = yaml.safe_load(CONFIG.read_text())["inhibit_rules"]
    by_source = {r["source_matchers"][0]: r for r in inhibits}
    gpu = by_source['alertname="KVLedgerGPULost"']
    assert set(gpu["equal"]) == {"instance", "gpu"}
    assert "KVLedgerGPUMemoryUnaccounted" in gpu["target_matchers"][0]
    source = by_source['alertname="KVLedgerSourceDown"']
    assert set(source["equal"]) == {"instance", "engine"}
    assert 'severity="warning"' in source["target_matchers"]
