"""The fake libnvidia-ml.so.1 for tests: building it and writing its inventory.

The library (fake_nvml.c) is compiled by gcc into tests/_build/ (git-ignored) and
loaded by the unmodified pynvml: in-process by loading it with ctypes before
pynvml's first nvmlInit (glibc then resolves ``libnvidia-ml.so.1`` to it by SONAME),
in a subprocess through ``LD_LIBRARY_PATH``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fake_nvml.build import build_library  # noqa: F401  (re-exported)

ENV_VAR = "FAKE_NVML_INVENTORY"
GIB = 1 << 30
MIB = 1 << 20


@dataclass
class FakeGpu:
    total: int = 80 * GIB
    reserved: int = 512 * MIB
    used: int = 0
    free: int | None = None  # default: total - reserved - used
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str | None = None
    procs: Sequence[tuple[int, int | None]] = ()  # (pid, bytes or None = not available)
    lost: bool = False
    mig: bool = False
    max_mig: int | None = None
    migs: Mapping[int, FakeGpu] = field(default_factory=dict)
    rc: Mapping[str, int] = field(default_factory=dict)  # forced return codes for this device

    def lines(self, prefix: str) -> list[str]:
        out = [
            f"{prefix}.name={self.name}",
            f"{prefix}.total={self.total}",
            f"{prefix}.reserved={self.reserved}",
            f"{prefix}.used={self.used}",
        ]
        if self.free is not None:
            out.append(f"{prefix}.free={self.free}")
        if self.uuid is not None:
            out.append(f"{prefix}.uuid={self.uuid}")
        if self.procs:
            out.append(f"{prefix}.procs=" + ",".join(f"{p}:{'na' if b is None else b}" for p, b in self.procs))
        if self.lost:
            out.append(f"{prefix}.lost=1")
        if self.mig:
            out.append(f"{prefix}.mig=1")
        if self.max_mig is not None:
            out.append(f"{prefix}.max_mig={self.max_mig}")
        for func, code in self.rc.items():
            out.append(f"{prefix}.rc.{func}={code}")
        for m, inst in self.migs.items():
            out.extend(inst.lines(f"{prefix}.mig.{m}"))
        return out


@dataclass
class Inventory:
    gpus: list[FakeGpu] = field(default_factory=list)
    driver_version: str = "550.54.15"
    rc: Mapping[str, int] = field(default_factory=dict)  # forced return codes, all devices
    memory_v2_version: int | None = None  # the v2 struct version the fake driver accepts

    def text(self) -> str:
        lines = [f"driver_version={self.driver_version}", f"count={len(self.gpus)}"]
        if self.memory_v2_version is not None:
            lines.append(f"memory_v2_version={self.memory_v2_version:#x}")
        for func, code in self.rc.items():
            lines.append(f"rc.{func}={code}")
        for i, gpu in enumerate(self.gpus):
            lines.extend(gpu.lines(f"gpu.{i}"))
        return "\n".join(lines) + "\n"

    def write(self, path: Path) -> None:
        """Replace the file atomically (a new inode, so the fake always notices)."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.text())
        os.replace(tmp, path)
