"""Compile tests/fake_nvml/fake_nvml.c into a libnvidia-ml.so.1 (``python tests/fake_nvml/build.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_nvml.c")
BUILD_DIR = Path(__file__).resolve().parents[1] / "_build"
SONAME = "libnvidia-ml.so.1"


def build_library(variant: str = "full", defines: tuple[str, ...] = ()) -> Path:
    """Build (if the source is newer) and return the library's absolute path.

    Each variant lives in its own directory (``tests/_build/fake_nvml-<variant>/``) so
    that a subprocess can point ``LD_LIBRARY_PATH`` at exactly one of them.
    """
    out_dir = BUILD_DIR / f"fake_nvml-{variant}"
    out = out_dir / SONAME
    if out.exists() and out.stat().st_mtime_ns >= SOURCE.stat().st_mtime_ns:
        return out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{SONAME}.{os.getpid()}"
    cmd = [
        "gcc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-shared", "-fPIC",
        f"-Wl,-soname,{SONAME}", *(f"-D{d}" for d in defines), "-o", str(tmp), str(SOURCE),
    ]
    subprocess.run(cmd, check=True)
    os.replace(tmp, out)
    return out.resolve()


if __name__ == "__main__":
    print(build_library())
    print(build_library("no-processes-v3", ("FAKE_NVML_NO_PROCESSES_V3",)), file=sys.stdout)
