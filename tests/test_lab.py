"""The cache lab (LRU working set vs capacity), through the CLI."""

from __future__ import annotations

import pytest

from kvledger.cli import main
from kvledger.tools.lab import run_lab


def test_working_set_fits() -> None:
    r = run_lab(4, 4, 16)
    assert (r.hits, r.misses, r.evictions) == (12, 4, 0)


def test_working_set_one_too_big_never_hits() -> None:
    r = run_lab(3, 4, 16)
    assert (r.hits, r.misses, r.evictions) == (0, 16, 13)
    assert r.steps[3].evicted == 0  # LRU victim is the oldest


def test_cli_prints_steps_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lab", "--capacity", "4", "--working-set", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "totals: hits=12 misses=4 evictions=0 of 16 requests"
    assert sum(1 for line in out if line.startswith("step")) == 16


def test_cli_limits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lab", "--capacity", "4", "--working-set", "4", "--requests", "4097"]) == 2
    assert "between 1 and 4096" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["lab", "--help"])
    assert "not a model of safe KV eviction" in capsys.readouterr().out.replace("\n", " ").replace("NOT", "not")
