"""Shipped deployment files are valid."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvledger.config import load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "deploy/examples").glob("*.yml")), ids=lambda p: p.name)
def test_example_configs_load(path: Path) -> None:
    config = load_config(path)
    assert config.engines


def test_prometheus_config_is_valid(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (make system-deps)"
    cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    cfg["rule_files"] = [str(p) for p in sorted((ROOT / "alerts").glob("*.rules.yml"))]
    cfg.pop("alerting")
    p = tmp_path / "prometheus.yml"
    p.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([promtool, "check", "config", str(p)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
