"""A release people can install (issue 22): `make dist` builds the sdist and wheel of the
daemon and of the engine-side library, each carrying LICENSE and the build's identity; the
wheels install into a clean venv where `kvledger --version` and kvledger_build_info name
the git revision they were built from; and the README's install line from a clone
(`pip install ./engine .`) works from a copy without .git, where the revision is honestly
`unknown`. The clean venvs get kvledger's dependencies from the configured package index;
PYTHONPATH is dropped so that nothing of this checkout leaks in."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import urllib.request
import zipfile
from pathlib import Path

import pytest

import kvledger_engine
from harness.process import free_port, start_ready
from kvledger import __version__

ROOT = Path(__file__).resolve().parent.parent
ENGINE_VERSION = kvledger_engine.__version__
DATE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")

pytestmark = pytest.mark.e2e  # builds, and installs into fresh venvs


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def _expected_revision() -> str:
    """What setup.py bakes from this checkout: HEAD, -dirty when tracked files differ."""
    return _git("rev-parse", "HEAD") + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVLEDGER_REVISION", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _venv(where: Path) -> Path:
    subprocess.run(["python3", "-m", "venv", str(where)], check=True, timeout=120)
    return where / "bin"


def _pip(bin_dir: Path, *args: str, cwd: Path) -> None:
    res = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", *args], cwd=cwd, env=_clean_env(),
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _version_lines(bin_dir: Path, cwd: Path) -> list[str]:
    res = subprocess.run([str(bin_dir / "kvledger"), "--version"], cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    res = subprocess.run(["make", "dist", f"DIST={out}"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def test_make_dist_builds_both_distributions_with_license_and_build_identity(dist: Path) -> None:
    assert sorted(p.name for p in dist.iterdir()) == sorted([
        f"kvledger-{__version__}.tar.gz", f"kvledger-{__version__}-py3-none-any.whl",
        f"kvledger_engine-{ENGINE_VERSION}.tar.gz", f"kvledger_engine-{ENGINE_VERSION}-py3-none-any.whl",
    ])
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert (ROOT / "engine" / "LICENSE").read_text() == license_text  # the engine's sdist holds only engine/

    with zipfile.ZipFile(dist / f"kvledger-{__version__}-py3-none-any.whl") as whl:
        baked = json.loads(whl.read("kvledger/_build_info.json"))
        meta = whl.read(f"kvledger-{__version__}.dist-info/METADATA").decode()
        assert whl.read(f"kvledger-{__version__}.dist-info/licenses/LICENSE").decode() == license_text
        assert {"kvledger/web/static/ledger.html", "kvledger/protocol/schema/kvledger-v1.json"} <= set(whl.namelist())
    assert baked["revision"] == _expected_revision() and DATE.fullmatch(baked["build_date"])
    assert f"\nVersion: {__version__}\n" in meta and "\nLicense-Expression: Apache-2.0\n" in meta
    assert f"\nRequires-Dist: kvledger-engine=={ENGINE_VERSION}\n" in meta

    with zipfile.ZipFile(dist / f"kvledger_engine-{ENGINE_VERSION}-py3-none-any.whl") as whl:
        meta = whl.read(f"kvledger_engine-{ENGINE_VERSION}.dist-info/METADATA").decode()
        assert whl.read(f"kvledger_engine-{ENGINE_VERSION}.dist-info/licenses/LICENSE").decode() == license_text
    assert "\nLicense-Expression: Apache-2.0\n" in meta and "Requires-Dist" not in meta

    with tarfile.open(dist / f"kvledger-{__version__}.tar.gz") as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
        carried = sdist.extractfile(f"kvledger-{__version__}/exporter/kvledger/_build_info.json")
        assert carried is not None
        assert json.loads(carried.read())["revision"] == _expected_revision()
    assert {"LICENSE", "CHANGELOG.md", "README.md", "setup.py", "pyproject.toml"} <= names
    assert not [n for n in names if n.startswith("tests/")]


def test_the_wheels_install_into_a_clean_venv_and_report_their_build(dist: Path, tmp_path: Path) -> None:
    bin_dir = _venv(tmp_path / "venv")
    _pip(bin_dir, str(dist / f"kvledger_engine-{ENGINE_VERSION}-py3-none-any.whl"),
         str(dist / f"kvledger-{__version__}-py3-none-any.whl"), cwd=tmp_path)
    check = subprocess.run([str(bin_dir / "python"), "-m", "pip", "check"], env=_clean_env(), capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    lines = _version_lines(bin_dir, tmp_path)
    revision = _expected_revision()
    assert lines[0] == f"kvledger, version {__version__} (revision: {revision})"
    assert DATE.fullmatch(lines[1].removeprefix("  build date:       ")), lines

    # the installed daemon serves, and its build_info says the same
    port = free_port()
    process = start_ready([str(bin_dir / "kvledger"), "demo", "--web.listen-address", f"127.0.0.1:{port}"],
                          tmp_path / "demo.log", f"http://127.0.0.1:{port}/-/ready", 60.0, cwd=tmp_path, env=_clean_env(),
                          body_prefix=b"kvledger")  # not a simulated engine that took the port first
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            body = resp.read().decode()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as resp:
            assert resp.status == 200  # the page's static files came with the wheel
    finally:
        process.stop()
    assert f'kvledger_build_info{{version="{__version__}",revision="{revision}",' in body


def test_a_clone_without_git_installs_with_pip_and_says_revision_unknown(tmp_path: Path) -> None:
    """The README's `pip install ./engine .` from a copy of the clone's files without .git
    (as from a source archive): it installs, and the revision is unknown, not invented."""
    clone = tmp_path / "clone"
    for name in _git("ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0"):
        source = ROOT / name
        if name and source.is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, clone / name)
    assert not (clone / ".git").exists()
    bin_dir = _venv(tmp_path / "venv")
    _pip(bin_dir, "./engine", ".", cwd=clone)
    lines = _version_lines(bin_dir, tmp_path)
    assert lines[0] == f"kvledger, version {__version__} (revision: unknown)"
    assert DATE.fullmatch(lines[1].removeprefix("  build date:       ")), lines
