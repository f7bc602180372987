"""Check the nvml source and NVML's memory arithmetic on a real GPU (run by hand when one is lent).

    PYTHONPATH=exporter python bench/device_check.py [--gpu 0] [--bytes 1GiB] [--out docs/nvml-device-check.md]

Records, per GPU: memory v1 and v2 side by side (does total = reserved + used + free
hold? is v1 used = v2 used + reserved?), then allocates and frees a known number of
bytes on one GPU (torch if installed, else cudaMalloc from libcudart through ctypes)
and records how used / free / reserved and this process's usedGpuMemory move. Writes
the findings as markdown. Not a test: CI never runs it.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import importlib.metadata
import os
import sys
from pathlib import Path

import pynvml

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.nvml import NvmlSource
from kvledger.config.loader import parse_size

MIB = 1 << 20


class Allocator:
    """Allocate/free device memory with torch, or cudaMalloc through libcudart."""

    def __init__(self, gpu: int) -> None:
        self.gpu, self.kind, self._held = gpu, "none", None
        try:
            import torch  # type: ignore[import-not-found]

            if torch.cuda.is_available():
                self.torch, self.kind = torch, "torch"
                torch.cuda.set_device(gpu)
                torch.zeros(1, device="cuda")  # create the context before the baseline
                return
        except ImportError:
            pass
        for name in (ctypes.util.find_library("cudart"), "libcudart.so", "libcudart.so.12", "libcudart.so.11.0"):
            try:
                self.cudart = ctypes.CDLL(name) if name else None
            except OSError:
                continue
            if self.cudart is not None and self.cudart.cudaSetDevice(gpu) == 0:
                self.kind = "cudart"
                self.cudart.cudaFree(None)  # create the context before the baseline
                return

    def alloc(self, nbytes: int) -> None:
        if self.kind == "torch":
            self._held = self.torch.empty(nbytes, dtype=self.torch.uint8, device="cuda")
            self.torch.cuda.synchronize()
        elif self.kind == "cudart":
            ptr = ctypes.c_void_p()
            rc = self.cudart.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
            if rc != 0:
                raise RuntimeError(f"cudaMalloc failed: {rc}")
            self._held = ptr

    def free(self) -> None:
        if self.kind == "torch":
            self._held = None
            self.torch.cuda.empty_cache()
            self.torch.cuda.synchronize()
        elif self.kind == "cudart" and self._held is not None:
            self.cudart.cudaFree(self._held)
            self._held = None


def raw_memory(index: int) -> dict[str, int | str]:
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    out: dict[str, int | str] = {"v1_total": m1.total, "v1_used": m1.used, "v1_free": m1.free}
    try:
        m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        out.update(v2_total=m2.total, v2_reserved=m2.reserved, v2_used=m2.used, v2_free=m2.free)
    except pynvml.NVMLError as exc:
        out["v2_error"] = str(exc)
    return out


def own_process_bytes(src: NvmlSource, gpu: int) -> str:
    g = src.poll().gpus[gpu]
    if g.processes is None:
        return "unknown (processes not supported)"
    mine = [p for p in g.processes if p.pid == os.getpid()]
    if not mine:
        return f"PID {os.getpid()} not listed (container without hostPID?); listed: {[p.pid for p in g.processes]}"
    return "n/a" if mine[0].used_bytes is None else f"{mine[0].used_bytes / MIB:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--bytes", default="1GiB")
    ap.add_argument("--out", default="docs/nvml-device-check.md")
    ap.add_argument("--no-alloc", action="store_true", help="only read NVML (no allocation)")
    args = ap.parse_args(argv)
    nbytes = parse_size(args.bytes)

    src = NvmlSource("true")
    try:
        first = src.poll()
    except SourceError as exc:
        print(f"device_check: no usable NVML ({exc.reason}): {exc.message}", file=sys.stderr)
        return 2
    lines = [
        "# NVML device check",
        "",
        f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC} by `bench/device_check.py`; "
        f"driver {first.driver_version}, nvidia-ml-py {importlib.metadata.version('nvidia-ml-py')}.",
        "",
        "## v1 and v2 per GPU (MiB)",
        "",
        "| gpu | name | mig | v1 total | v1 used | v1 free | v2 total | v2 reserved | v2 used | v2 free "
        "| total = reserved+used+free | v1 used = v2 used+reserved |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in first.gpus:
        if not g.up:
            lines.append(f"| {g.index} | (down) |||||||||||")
            continue
        r = raw_memory(g.index)
        if "v2_error" in r:
            lines.append(f"| {g.index} | {g.name} | {g.mig} | {r['v1_total'] // MIB} | {r['v1_used'] // MIB} "
                         f"| {r['v1_free'] // MIB} | v2 failed: {r['v2_error']} |||||")
            continue
        sum_ok = r["v2_total"] == r["v2_reserved"] + r["v2_used"] + r["v2_free"]
        v1_ok = r["v1_used"] == r["v2_used"] + r["v2_reserved"]
        cells = [r[k] // MIB for k in ("v1_total", "v1_used", "v1_free", "v2_total", "v2_reserved", "v2_used", "v2_free")]
        lines.append(f"| {g.index} | {g.name} | {g.mig} | " + " | ".join(map(str, cells))
                     + f" | {sum_ok} (diff {r['v2_total'] - r['v2_reserved'] - r['v2_used'] - r['v2_free']} B)"
                     + f" | {v1_ok} (diff {r['v1_used'] - r['v2_used'] - r['v2_reserved']} B) |")

    alloc = None if args.no_alloc else Allocator(args.gpu)
    lines += ["", f"## Allocating {nbytes / MIB:.0f} MiB on GPU {args.gpu} "
              f"(allocator: {'skipped' if alloc is None else alloc.kind})", ""]
    if alloc is not None and alloc.kind != "none":
        steps = []
        steps.append(("baseline (context created)", src.poll().gpus[args.gpu], own_process_bytes(src, args.gpu)))
        alloc.alloc(nbytes)
        steps.append(("allocated", src.poll().gpus[args.gpu], own_process_bytes(src, args.gpu)))
        alloc.free()
        steps.append(("freed", src.poll().gpus[args.gpu], own_process_bytes(src, args.gpu)))
        lines += ["| step | used MiB | free MiB | reserved MiB | delta used B | this process |", "|---|---|---|---|---|---|"]
        base_used = steps[0][1].used_bytes or 0
        for name, g, mine in steps:
            reserved = "unknown" if g.driver_reserved_bytes is None else g.driver_reserved_bytes // MIB
            lines.append(f"| {name} | {(g.used_bytes or 0) // MIB} | {(g.free_bytes or 0) // MIB} | {reserved} "
                         f"| {(g.used_bytes or 0) - base_used} | {mine} |")
        lines.append(f"\nAllocated {nbytes} B; `used` moved by {(steps[1][1].used_bytes or 0) - base_used} B.")
    else:
        lines.append("No allocation (torch with CUDA and libcudart not found, or --no-alloc).")
    src.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
