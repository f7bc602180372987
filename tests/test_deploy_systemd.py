"""deploy/systemd: the unit passes `systemd-analyze verify` with no message at all, runs as
its dedicated user, restarts always, and its sandbox leaves open what kvledger reads.

`systemd-analyze verify` loads the unit offline (it needs no running systemd): every key
and value is parsed, the executables must exist. The unit's ExecStart names
/opt/kvledger/bin/kvledger, which exists only where the README's steps ran, so the check
runs on a copy whose ExecStart is this checkout's kvledger. What is not checked here (no
systemd as PID 1 in this container): that the sandbox lets NVML open the devices at run time."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "deploy" / "systemd" / "kvledger.service"
SYSUSERS = ROOT / "deploy" / "systemd" / "kvledger.sysusers"
INSTALLED = "/opt/kvledger/bin/kvledger"


def verify(unit_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is required (Debian package systemd; make system-deps)"
    kvledger = Path(sys.executable).with_name("kvledger")
    assert kvledger.exists(), kvledger
    unit = tmp_path / "kvledger.service"
    unit.write_text(unit_text.replace(INSTALLED, str(kvledger)))
    return subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)


def test_unit_verifies_without_a_message(tmp_path: Path) -> None:
    text = UNIT.read_text()
    assert text.count(INSTALLED) == 1
    proc = verify(text, tmp_path)
    assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("Restart=always", "Restart=allways", "Failed to parse service restart specifier"),
        ("ProtectHome=read-only", "ProtectHome=readonly", "Failed to parse protect home value"),
        ("NoNewPrivileges=yes", "NoNewPrivilege=yes", "Unknown key 'NoNewPrivilege'"),
    ],
)
def test_verify_reports_what_systemd_would_ignore(tmp_path: Path, old: str, new: str, message: str) -> None:
    """systemd ignores a bad line with a warning (exit status 0): the test reads the output."""
    text = UNIT.read_text()
    assert old in text
    proc = verify(text.replace(old, new), tmp_path)
    assert message in proc.stdout + proc.stderr


def service() -> dict[str, list[str]]:
    """The [Service] section's keys and their values, in order (a key may repeat)."""
    values: dict[str, list[str]] = {}
    section = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        if section == "Service":
            values.setdefault(key, []).append(value)
    return values


def test_dedicated_user_and_always_restart() -> None:
    s = service()
    assert s["User"] == ["kvledger"] and s["Group"] == ["kvledger"]
    assert "DynamicUser" not in s
    assert SYSUSERS.read_text().splitlines()[-1].split()[:2] == ["u", "kvledger"]
    assert s["Restart"] == ["always"]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]  # SIGHUP reloads the configuration


def test_sandbox_keeps_nvml_and_proc_reachable() -> None:
    s = service()
    assert s["NoNewPrivileges"] == ["yes"] and s["ProtectSystem"] == ["strict"] and s["CapabilityBoundingSet"] == [""]
    # NVML opens /dev/nvidiactl and /dev/nvidia<N>: not hidden, and allowed by the device policy
    assert s.get("PrivateDevices", ["no"]) == ["no"]
    assert s["DevicePolicy"] == ["closed"] and "char-nvidia-frontend r" in s["DeviceAllow"]
    # process matching reads other users' /proc/PID; host sockets come from the host's /proc/net
    assert s.get("ProtectProc", ["default"]) == ["default"] and s.get("ProcSubset", ["all"]) == ["all"]
    assert s.get("PrivateNetwork", ["no"]) == ["no"]
    assert set(s["RestrictAddressFamilies"][0].split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}  # HTTP, ZMQ, ledger sockets


def test_sysusers_file_creates_the_user(tmp_path: Path) -> None:
    """systemd-sysusers applies the file in a scratch root: a system user without a login."""
    sysusers = shutil.which("systemd-sysusers")
    assert sysusers, "systemd-sysusers is required (Debian package systemd; make system-deps)"
    (tmp_path / "etc" / "sysusers.d").mkdir(parents=True)
    shutil.copy(SYSUSERS, tmp_path / "etc" / "sysusers.d" / "kvledger.conf")
    proc = subprocess.run([sysusers, f"--root={tmp_path}", "kvledger.conf"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (entry,) = [ln.split(":") for ln in (tmp_path / "etc" / "passwd").read_text().splitlines() if ln.startswith("kvledger:")]
    assert int(entry[2]) < 1000 and entry[5:] == ["/nonexistent", "/usr/sbin/nologin"]
