"""kvledger: one declared KV-cache accounting policy for LLM inference servers.

``__version__`` is the engine-side library's (``kvledger_engine.__version__``, the one place
the version of both distributions is written; the daemon pins that library at exactly its
version, so the two agree); everything that prints or exports the version reads it here.

``build_info()`` says which build runs: the version, the git revision and the build date
that the build baked into ``_build_info.json`` (setup.py writes it into every sdist and
wheel), and the Python version running it. Where nothing was baked (a source checkout or
an editable install), the revision is asked of git once, and the build date is unknown; a
wheel built without git and without ``KVLEDGER_REVISION`` says ``unknown`` too.
"""

from __future__ import annotations

import functools
import json
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvledger_engine import __version__ as __version__

UNKNOWN = "unknown"
_BAKED = Path(__file__).with_name("_build_info.json")


@dataclass(frozen=True)
class BuildInfo:
    version: str
    revision: str
    build_date: str
    python_version: str


def _baked() -> dict[str, str]:
    try:
        data = json.loads(_BAKED.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str) and v}


def _git_revision(where: Path) -> str | None:
    """HEAD of the git work tree holding this package (a checkout, an editable install);
    None when there is none or git is missing."""
    try:
        out = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    revision = out.stdout.strip()
    return revision if out.returncode == 0 and revision else None


@functools.cache
def build_info() -> BuildInfo:
    baked = _baked()
    revision = baked.get("revision") or (None if baked else _git_revision(_BAKED.parent)) or UNKNOWN
    return BuildInfo(version=__version__, revision=revision, build_date=baked.get("build_date", UNKNOWN),
                     python_version=platform.python_version())


def version_text() -> str:
    """``kvledger --version``, laid out as Prometheus exporters print theirs."""
    b = build_info()
    return (f"kvledger, version {b.version} (revision: {b.revision})\n"
            f"  build date:       {b.build_date}\n"
            f"  python version:   {b.python_version}\n"
            f"  platform:         {platform.system().lower()}/{platform.machine()}")
