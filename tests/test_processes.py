"""Resolving engine PIDs from config: real processes started by the test, and a fake /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.processes import resolve_pids
from kvledger.config.types import ProcessMatch

# parent (argv carries the marker) -> child "engine core" -> grandchild "worker";
# each prints its PID once it exists, then waits for stdin to close.
GRANDCHILD = "import os,sys; print(os.getpid(), flush=True); sys.stdin.read()"
CHILD = (
    "import os,subprocess,sys; print(os.getpid(), flush=True); "
    f"subprocess.Popen([sys.executable, '-c', {GRANDCHILD!r}], stdin=sys.stdin); sys.stdin.read()"
)
PARENT = (
    "import os,subprocess,sys; "
    f"subprocess.Popen([sys.executable, '-c', {CHILD!r}], stdin=sys.stdin); "
    "print(os.getpid(), flush=True); sys.stdin.read()"
)


@pytest.fixture
def tree() -> Iterator[tuple[str, list[int]]]:
    marker = f"kvledger-test-engine-{uuid.uuid4().hex}"
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT, marker], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        pids = sorted(int(proc.stdout.readline()) for _ in range(3))
        yield marker, pids
    finally:
        proc.stdin.close()  # every level exits when stdin closes
        proc.wait(timeout=30)
        proc.stdout.close()


def test_match_includes_child_processes(tree):
    marker, pids = tree
    assert resolve_pids(ProcessMatch(match=marker)) == pids


def test_explicit_pid_includes_descendants(tree):
    _, pids = tree
    assert resolve_pids(ProcessMatch(pids=(pids[0],))) == pids


def test_explicit_pid_not_visible_is_kept():
    # A host PID the daemon's namespace cannot see (PIDs above pid_max never exist).
    assert resolve_pids(ProcessMatch(pids=(2**30,))) == [2**30]


def test_own_process_is_never_matched():
    own_cmdline = Path(f"/proc/{os.getpid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    word = own_cmdline.split()[0]
    assert os.getpid() not in resolve_pids(ProcessMatch(match=word))


def test_no_match():
    assert resolve_pids(ProcessMatch(match=f"nothing-runs-this-{uuid.uuid4().hex}")) == []


def write_proc(root: Path, pid: int, ppid: int, comm: str, argv: list[str]) -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 0 0\n")


def test_fake_proc_tree(tmp_path):
    write_proc(tmp_path, 10, 1, "python3", ["python3", "-m", "vllm.entrypoints.openai.api_server"])
    write_proc(tmp_path, 11, 10, "VLLM::EngineCor", ["VLLM::EngineCore"])  # no 'vllm' substring
    write_proc(tmp_path, 12, 11, "weird ) (name", ["worker"])
    write_proc(tmp_path, 20, 1, "bash", ["bash"])
    write_proc(tmp_path, 21, 20, "sleep", ["sleep", "100"])
    (tmp_path / "30").mkdir()  # vanished meanwhile: no files
    (tmp_path / "self").mkdir()
    assert resolve_pids(ProcessMatch(match="vllm"), tmp_path) == [10, 11, 12]
    assert resolve_pids(ProcessMatch(match="sleep 100"), tmp_path) == [21]
    assert resolve_pids(ProcessMatch(pids=(20,)), tmp_path) == [20, 21]


def test_unreadable_proc_root(tmp_path):
    with pytest.raises(SourceError) as err:
        resolve_pids(ProcessMatch(match="x"), tmp_path / "missing")
    assert err.value.reason == "proc" and "missing" in err.value.message
