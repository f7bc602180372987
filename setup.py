"""Bakes the build's identity into every sdist and wheel of kvledger (pyproject.toml holds the rest),
and gives the version and the runtime dependencies: the version is read from the engine-side
library (engine/kvledger_engine/__init__.py, the one place it is written), and the daemon
depends on that library at exactly that version.

``exporter/kvledger/_build_info.json`` ({"revision", "build_date"}) is written into the sdist's
tree and into the wheel's build directory, never into the checkout. The revision is, first
found: ``KVLEDGER_REVISION`` (a build from a tree without .git, e.g. a container build), git's
HEAD when this directory is the top of a git work tree (``-dirty`` when tracked files
differ), the revision an sdist already carries (a wheel built from it), else ``unknown``.
The build date is ``SOURCE_DATE_EPOCH`` when set (reproducible builds), else now, in UTC.
``kvledger --version`` and ``kvledger_build_info`` read it (kvledger.build_info()).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
BAKED = Path("exporter", "kvledger", "_build_info.json")
#: where the version of both distributions is written (MANIFEST.in carries it into the daemon's sdist)
VERSION_FILE = Path("engine", "kvledger_engine", "__init__.py")


def _version() -> str:
    match = re.search(r'^__version__ = "([^"]+)"$', (ROOT / VERSION_FILE).read_text(encoding="utf-8"), re.MULTILINE)
    if match is None:
        raise SystemExit(f"{VERSION_FILE}: no __version__ line")
    return match.group(1)


VERSION = _version()
#: the daemon's runtime dependencies; kvledger-engine is pinned to the same version (released together)
DEPENDENCIES = [
    f"kvledger-engine=={VERSION}",  # engine/: the wire terms and R(r) the policy shares with the engine side (built from this repository)
    "prometheus-client>=0.20",
    "opentelemetry-sdk>=1.25",
    "opentelemetry-exporter-otlp-proto-http>=1.25",  # OTLP push (optional output)
    "nvidia-ml-py==13.615.71",
    "pyyaml>=6.0",
    "pyzmq>=25",
    "msgpack>=1.0",
    "jsonschema>=4.20",
    "orjson>=3.9",  # kvledger/v1 documents parse ~3x faster than with json: the poll path's CPU budget
    # decodes a document's requests[] straight into typed, range-checked structs in C (document_decoder.py):
    # faster than orjson's dicts, and no per-field checks in Python
    "msgspec>=0.18",
    "numpy>=1.26",  # columnar accounting of 1,000,000-block ledgers within the 50 ms budget
    "h11>=0.14",  # HTTP/1.1 parsing and framing for the asyncio server (keep-alive, limits, bodies on GET)
    "bcrypt>=4.0",  # basic_auth_users of the exporter-toolkit web config are bcrypt hashes
]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _revision() -> str:
    if os.environ.get("KVLEDGER_REVISION"):
        return os.environ["KVLEDGER_REVISION"]
    top = _git("rev-parse", "--show-toplevel")
    if top and Path(top).resolve() == ROOT:  # this tree's own history, not an enclosing repository's
        head = _git("rev-parse", "HEAD")
        if head:
            dirty = _git("status", "--porcelain", "--untracked-files=no")
            return head + ("-dirty" if dirty else "")
    try:
        carried = json.loads((ROOT / BAKED).read_text(encoding="utf-8")).get("revision")
    except (OSError, ValueError, AttributeError):
        carried = None
    return carried if isinstance(carried, str) and carried else "unknown"


def _build_date() -> str:
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = datetime.datetime.fromtimestamp(int(epoch), datetime.UTC) if epoch else datetime.datetime.now(datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _write(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"revision": _revision(), "build_date": _build_date()}) + "\n", encoding="utf-8")


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install reads git at run time (kvledger.build_info)
            _write(Path(self.build_lib, "kvledger", "_build_info.json"))


class Sdist(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        target = Path(base_dir, BAKED)
        if target.exists():
            target.unlink()  # a hard link to the checkout's copy, should one exist: never write through it
        _write(target)


setup(version=VERSION, install_requires=DEPENDENCIES, cmdclass={"build_py": BuildPy, "sdist": Sdist})
