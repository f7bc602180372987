"""Shipped deployment files are valid; the Prometheus configuration is one file for every
flavour (the five-minute path, compose, the end-to-end tests' harness)."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from harness.prometheus import DEPLOY_CONFIG, prometheus_config
from kvledger.config.loader import load_config

ROOT = Path(__file__).resolve().parents[1]
PROM_DIR = ROOT / "deploy" / "prometheus"


@pytest.mark.parametrize("path", sorted((ROOT / "deploy/examples").glob("*.yml")), ids=lambda p: p.name)
def test_example_configs_load(path: Path) -> None:
    config = load_config(path)
    assert config.engines and not config.warnings


def promtool_check_config(path: Path) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (make system-deps)"
    return subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)


def test_prometheus_config_is_valid_as_shipped() -> None:
    """From the repository, as the five-minute path runs it: the rule file resolves
    relative to the config (../../alerts) and promtool checks it too."""
    proc = promtool_check_config(DEPLOY_CONFIG)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "alerts/kvledger.rules.yml" in proc.stdout and "SUCCESS: 1 rule files found" in proc.stdout, proc.stdout


@pytest.mark.parametrize("name", ["kvledger.yml", "alertmanager.yml"])
def test_target_files_are_file_sd_groups(name: str) -> None:
    for directory in (PROM_DIR / "targets", ROOT / "deploy" / "compose" / "prometheus-targets"):
        groups = yaml.safe_load((directory / name).read_text())
        assert isinstance(groups, list) and groups
        for group in groups:
            assert set(group) <= {"targets", "labels"}
            assert all(isinstance(t, str) and t.rpartition(":")[2].isdigit() for t in group["targets"])


def test_the_harness_runs_the_shipped_config_with_only_addresses_rules_and_intervals_changed() -> None:
    shipped = yaml.safe_load(DEPLOY_CONFIG.read_text())
    harness = prometheus_config(["127.0.0.1:1"], [ROOT / "alerts" / "kvledger.rules.yml"], ["127.0.0.1:2"])
    # put back what the harness may change: the rest must be the shipped file, key for key
    restored = copy.deepcopy(harness)
    for key in ("scrape_interval", "evaluation_interval"):
        restored["global"][key] = shipped["global"][key]
    restored["global"].pop("scrape_timeout")
    restored["rule_files"] = shipped["rule_files"]
    (job,) = restored["scrape_configs"]
    assert job.pop("static_configs") == [{"targets": ["127.0.0.1:1"]}]
    job["file_sd_configs"] = shipped["scrape_configs"][0]["file_sd_configs"]
    (am,) = restored["alerting"]["alertmanagers"]
    assert am.pop("static_configs") == [{"targets": ["127.0.0.1:2"]}]
    am["file_sd_configs"] = shipped["alerting"]["alertmanagers"][0]["file_sd_configs"]
    assert restored == shipped
    assert harness["rule_files"] == [str((ROOT / "alerts" / "kvledger.rules.yml").resolve())]


def test_the_harness_config_passes_promtool(tmp_path: Path) -> None:
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(prometheus_config(["127.0.0.1:9477"], [ROOT / "alerts" / "kvledger.rules.yml"],
                                                     ["127.0.0.1:9093"])))
    proc = promtool_check_config(path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
