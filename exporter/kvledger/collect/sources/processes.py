"""Engine processes for NVML attribution, from the engine's ``processes`` config.

``{match: "vllm"}`` selects processes whose command line (``/proc/PID/cmdline``, NUL
separators read as spaces) contains the substring; ``{pids: [...]}`` names them.
Descendants of the selected processes are included: vLLM runs its GPU work in an
EngineCore child (and tensor-parallel workers below it), whose command line need not
match. The daemon's own process is never included (its command line may well contain
the substring, e.g. ``--config vllm.yaml``).

PIDs are in the PID namespace of ``proc_root``; NVML reports host PIDs, so inside a
container the daemon needs the host PID namespace (``hostPID: true``) for them to
match. Explicit ``pids`` are kept even when ``proc_root`` does not show them (they may
be host PIDs that this namespace cannot see).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from kvledger.collect.sources.base import EnginePatch, Source, SourceError
from kvledger.config.types import ProcessMatch


def _read_process(entry: Path) -> tuple[str, int] | None:
    """(command line, parent PID) of one /proc entry; None when it vanished or is unreadable."""
    try:
        cmdline = (entry / "cmdline").read_bytes()
        stat = (entry / "stat").read_text()
    except OSError:  # exited meanwhile (ENOENT/ESRCH), or hidden from us (EACCES)
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    rest = stat.rpartition(")")[2].split()
    if len(rest) < 2 or not rest[1].isdigit():
        return None
    return cmdline.replace(b"\0", b" ").decode(errors="replace").strip(), int(rest[1])


def list_processes(proc_root: str | Path = "/proc") -> dict[int, tuple[str, int]]:
    """PID -> (command line, parent PID) for every process visible under ``proc_root``."""
    root = Path(proc_root)
    try:
        entries = [e for e in root.iterdir() if e.name.isdigit()]
    except OSError as exc:
        raise SourceError("proc", f"cannot list {root}: {exc.strerror or exc}") from None
    out = {}
    for entry in entries:
        info = _read_process(entry)
        if info is not None:
            out[int(entry.name)] = info
    return out


def resolve_pids(match: ProcessMatch, proc_root: str | Path = "/proc") -> list[int]:
    """The engine's PIDs: matched or named processes and all their descendants, sorted."""
    procs = list_processes(proc_root)
    own = os.getpid()
    seeds = set(match.pids)
    if match.match:
        seeds.update(pid for pid, (cmd, _) in procs.items() if match.match in cmd)
    children: dict[int, list[int]] = {}
    for pid, (_, ppid) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    stack = list(seeds)
    while stack:
        pid = stack.pop()
        if pid in found or pid == own:
            continue
        found.add(pid)
        stack.extend(children.get(pid, ()))
    return sorted(found)


class ProcessSource(Source):
    """Resolves an engine's PIDs each poll (processes come and go) for NVML attribution."""

    kind = "processes"

    def __init__(self, engine_name: str, match: ProcessMatch, proc_root: str | Path = "/proc") -> None:
        self.engine = engine_name
        self.match = match
        self.proc_root = proc_root

    def poll(self) -> EnginePatch:
        pids = resolve_pids(self.match, self.proc_root)
        return EnginePatch(self.engine, lambda engine: dataclasses.replace(engine, pids=pids))
