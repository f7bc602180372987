"""bench/device_check.py stays runnable: its NVML part against the fake library (no allocation)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fake_nvml import ENV_VAR, GIB, MIB, FakeGpu, Inventory, build_library

ROOT = Path(__file__).resolve().parents[1]


def test_device_check_writes_markdown_from_nvml(tmp_path):
    inventory = tmp_path / "inventory"
    Inventory(gpus=[FakeGpu(used=GIB, reserved=300 * MIB), FakeGpu(lost=True)]).write(inventory)
    out = tmp_path / "check.md"
    env = dict(os.environ, LD_LIBRARY_PATH=str(build_library().parent), PYTHONPATH=str(ROOT / "exporter"))
    env[ENV_VAR] = str(inventory)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "device_check.py"), "--no-alloc", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    # GPU 0: v1 used = 1024 + 300 MiB; v2 splits it; both identities hold on the fake.
    assert "| 0 | NVIDIA H100 80GB HBM3 | False | 81920 | 1324 | 80596 | 81920 | 300 | 1024 | 80596 | True (diff 0 B) | True (diff 0 B) |" in text
    assert "| 1 | (down) |" in text


def test_device_check_without_nvml_fails_clearly(tmp_path):
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path), PYTHONPATH=str(ROOT / "exporter"))
    env.pop(ENV_VAR, None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "device_check.py"), "--out", str(tmp_path / "x.md")],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "no usable NVML (library)" in proc.stderr
    assert not (tmp_path / "x.md").exists()
