"""The container image, built from the Dockerfile and run (make test-image; marker `image`).

No registry serves base images to these machines, so the base is made here: debootstrap
lays out Debian bookworm (minbase, plus python3 and python3-venv) from Debian's own
packages, and buildah commits it as ``localhost/kvledger-base:bookworm``; the Dockerfile is
built with ``--build-arg PYTHON_IMAGE=`` that image instead of python:3.11-slim-bookworm
(the same Debian release, Python 3.11 from Debian instead of python.org's build). buildah
(Debian package, vfs storage under tests/_build/image, chroot isolation) builds it as
Docker would; the build's pip uses this machine's pip configuration and CA certificates,
as pip on this machine does. Then, inside the image: the user, the entrypoint and command,
the health check run as Docker would run it against the demo, and what the venv holds.

What is not verified: the official base image itself, Docker's or Kubernetes' runtime
(HEALTHCHECK scheduling, the NVIDIA runtime injecting NVML)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.process import free_port
from kvledger import __version__

pytestmark = pytest.mark.image

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "tests" / "_build" / "image"
BASE = "localhost/kvledger-base:bookworm"
IMAGE = "localhost/kvledger:test"
MIRROR = os.environ.get("KVLEDGER_DEBIAN_MIRROR", "http://deb.debian.org/debian")


def buildah(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("buildah")
    assert binary, "buildah is required (make image-deps)"
    argv = [binary, "--root", str(WORK / "storage"), "--runroot", str(WORK / "run"), "--storage-driver", "vfs", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{' '.join(args[:2])}: {proc.stderr[-4000:]}"
    return proc


def ensure_base() -> None:
    if buildah("images", "--quiet", BASE, check=False).returncode == 0:
        return
    debootstrap = shutil.which("debootstrap")
    assert debootstrap, "debootstrap is required (make image-deps)"
    rootfs = WORK / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    proc = subprocess.run([debootstrap, "--variant=minbase", "--include=python3,python3-venv", "bookworm", str(rootfs), MIRROR],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for leftover in ("var/lib/apt/lists", "var/cache/apt"):
        shutil.rmtree(rootfs / leftover, ignore_errors=True)
    container = buildah("from", "scratch").stdout.strip()
    try:
        buildah("copy", container, str(rootfs), "/")
        buildah("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", container)
        buildah("commit", "--quiet", "--format", "docker", container, BASE)
    finally:
        buildah("rm", container, check=False)
    shutil.rmtree(rootfs, ignore_errors=True)


#: the revision the test builds the image with, as a release build passes it
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def image() -> Iterator[dict[str, object]]:
    WORK.mkdir(parents=True, exist_ok=True)
    ensure_base()
    mounts = [a for path in ("/etc/pip.conf", "/etc/ssl/certs/ca-certificates.crt") if Path(path).exists()
              for a in ("--volume", f"{path}:{path}:ro")]
    buildah("bud", "--format", "docker", "--isolation", "chroot", "--network", "host", "--layers=false", *mounts,
            "--build-arg", f"PYTHON_IMAGE={BASE}", "--build-arg", f"KVLEDGER_REVISION={REVISION}", "--tag", IMAGE, "--file", str(ROOT / "Dockerfile"), str(ROOT), timeout=1200)
    info: dict[str, object] = json.loads(buildah("inspect", "--type", "image", IMAGE).stdout)
    yield info
    buildah("rmi", "--force", IMAGE, check=False)


@pytest.fixture(scope="module")
def container(image: dict[str, object]) -> Iterator[str]:
    """A working container of the image (one for all checks: vfs copies the image per container)."""
    name = buildah("from", "--quiet", IMAGE).stdout.strip()
    yield name
    buildah("rm", name, check=False)


def run_in(container: str, script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``sh -c SCRIPT`` in the container, as the image's user (buildah run applies USER)."""
    return buildah("run", "--isolation", "chroot", container, "--", "sh", "-c", script, timeout=timeout, check=False)


def test_image_config(image: dict[str, object]) -> None:
    config = image["Docker"]["config"]  # type: ignore[index]
    assert config["User"] == "65532:65532"
    assert config["Entrypoint"] + config["Cmd"] == ["kvledger", "serve", "--config", "/etc/kvledger/kvledger.yml"]
    assert "9477/tcp" in config["ExposedPorts"]
    assert config["Healthcheck"]["Test"][0] == "CMD" and "KVLEDGER_HEALTH_URL" in config["Healthcheck"]["Test"][-1]
    assert "KVLEDGER_HEALTH_URL=http://127.0.0.1:9477/-/healthy" in config["Env"]


def test_image_runs_as_its_user_with_runtime_dependencies_only(container: str) -> None:
    proc = run_in(container, "id -u; kvledger --version; "
                  "python3 -c 'import importlib.util as u; print([m for m in (\"pytest\", \"hypothesis\", \"mypy\", \"grafanalib\", \"pip\") if u.find_spec(m)])'")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    # the revision given at build time (the Dockerfile's KVLEDGER_REVISION), not "unknown"
    assert (lines[0], lines[1], lines[-1]) == ("65532", f"kvledger, version {__version__} (revision: {REVISION})", "[]")


def test_healthcheck_passes_against_the_demo(image: dict[str, object], container: str) -> None:
    """The HEALTHCHECK's own command, as Docker runs it, against `kvledger demo` in the image."""
    test = image["Docker"]["config"]["Healthcheck"]["Test"]  # type: ignore[index]
    port = free_port()
    check = " ".join("'" + arg.replace("'", "'\"'\"'") + "'" for arg in test[1:])
    script = (f"kvledger demo --listen 127.0.0.1:{port} > /tmp/demo.log 2>&1 & pid=$!; "
              f"export KVLEDGER_HEALTH_URL=http://127.0.0.1:{port}/-/healthy; ok=no; "
              f"for i in $(seq 1 40); do if {check}; then ok=yes; break; fi; sleep 0.25; done; "
              f"echo healthy=$ok; kill $pid; wait $pid; echo exit=$?; cat /tmp/demo.log")
    proc = run_in(container, script)
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["healthy=yes", "exit=0"], proc.stdout + proc.stderr
    # the demo announces its address (after a warning, where the container's open-file limit is low)
    assert any(f"metrics on http://127.0.0.1:{port}/metrics" in line for line in lines[2:]), proc.stdout
    # and it fails when nothing serves: Docker would mark the container unhealthy
    dead = run_in(container, f"KVLEDGER_HEALTH_URL=http://127.0.0.1:{free_port()}/-/healthy {check}; echo exit=$?")
    assert dead.stdout.strip().splitlines()[-1] != "exit=0"



def test_image_adds_little_to_its_base(container: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Runtime dependencies only: the venv (all the image adds to its base) is well under 150 MiB."""
    proc = run_in(container, "du -sb /opt/kvledger | cut -f1")
    assert proc.returncode == 0, proc.stderr
    added = int(proc.stdout.strip())
    base = json.loads(buildah("images", "--json", BASE).stdout)[0]["size"]
    with capsys.disabled():
        print(f"\nthe image adds {added / 2**20:.0f} MiB (/opt/kvledger) to its base ({base})")
    assert 0 < added < 150 * 2**20
