"""NvmlSource in a separate Python process: pynvml finds the fake through LD_LIBRARY_PATH.

This is how the daemon runs against the fake; it also covers what one process cannot:
no library at all, and a library that lacks nvmlDeviceGetComputeRunningProcesses_v3.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_nvml import ENV_VAR, GIB, MIB, FakeGpu, Inventory, build_library

EXPORTER = Path(__file__).resolve().parents[1] / "exporter"

SCRIPT = r"""
import json, sys
from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.nvml import NvmlSource

src = NvmlSource(sys.argv[1])
out = {"available": src.available()}
try:
    c = src.poll()
except SourceError as exc:
    out["error"] = [exc.reason, exc.message]
else:
    out["driver"] = c.driver_version
    out["gpus"] = [
        {"index": g.index, "up": g.up, "uuid": g.uuid, "used": g.used_bytes, "reserved": g.driver_reserved_bytes,
         "processes": None if g.processes is None else [[p.pid, p.used_bytes] for p in g.processes]}
        for g in c.gpus
    ]
src.close()
print(json.dumps(out))
"""


def run_poll(lib_dir: Path, enabled: str = "auto", inventory: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, "LD_LIBRARY_PATH", "LD_PRELOAD")}
    env["LD_LIBRARY_PATH"] = str(lib_dir)
    env["PYTHONPATH"] = str(EXPORTER)
    if inventory is not None:
        env[ENV_VAR] = str(inventory)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, enabled], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def inventory_file(tmp_path: Path) -> Path:
    path = tmp_path / "inventory"
    Inventory(
        gpus=[FakeGpu(used=GIB, uuid="GPU-sub-0", procs=[(321, 900 * MIB)]), FakeGpu(lost=True)],
        driver_version="560.35.03",
    ).write(path)
    return path


def test_subprocess_polls_the_fake_through_ld_library_path(inventory_file):
    out = run_poll(build_library().parent, "true", inventory_file)
    assert out["available"] is True
    assert out["driver"] == "560.35.03"
    assert out["gpus"] == [
        {"index": 0, "up": True, "uuid": "GPU-sub-0", "used": GIB, "reserved": 512 * MIB,
         "processes": [[321, 900 * MIB]]},
        {"index": 1, "up": False, "uuid": None, "used": None, "reserved": None, "processes": None},
    ]


def test_subprocess_without_inventory_is_a_driverless_host():
    out = run_poll(build_library().parent, "auto")
    assert out["available"] is True
    assert out["error"][0] == "driver" and "Driver Not Loaded" in out["error"][1]


def _no_real_nvml() -> None:
    # The "library missing" cases need a host without a real NVML in the ld.so cache.
    assert ctypes.util.find_library("nvidia-ml") is None, "a real libnvidia-ml is installed on this host"


def test_library_missing_auto_is_absent(tmp_path):
    _no_real_nvml()
    out = run_poll(tmp_path, "auto")  # an empty LD_LIBRARY_PATH directory
    assert out["available"] is False
    assert out["error"][0] == "absent"
    assert "libnvidia-ml.so.1" in out["error"][1] and "Not Found" in out["error"][1]


def test_library_missing_when_required_is_an_error(tmp_path):
    _no_real_nvml()
    out = run_poll(tmp_path, "true")
    assert out["available"] is True  # required: present in the sense that it must be watched
    assert out["error"][0] == "library"


def test_library_without_processes_v3_keeps_memory(inventory_file):
    lib = build_library("no-processes-v3", ("FAKE_NVML_NO_PROCESSES_V3",))
    out = run_poll(lib.parent, "true", inventory_file)
    gpu = out["gpus"][0]
    # pynvml raises NVMLLibraryMismatchError (not an NVMLError): processes unknown, memory reported.
    assert gpu["up"] and gpu["used"] == GIB and gpu["processes"] is None
