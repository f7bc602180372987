"""CI's time budget (.ci/budget.py, what .ci/run runs): the jobs' budgets add up to CI's, every
job is a Makefile target, and the report marks a job over its budget without failing CI."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _budget() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_budget", ROOT / ".ci" / "budget.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ci_budget"] = module
    spec.loader.exec_module(module)
    return module


budget = _budget()


def test_the_jobs_budgets_add_up_to_cis() -> None:
    assert sum(j.budget_seconds for j in budget.JOBS) == budget.TOTAL_BUDGET_SECONDS == 30 * 60
    assert [j.name for j in budget.JOBS][:2] == ["install", "test"]
    assert next(j for j in budget.JOBS if j.name == "test").budget_seconds == 6 * 60


def test_every_job_is_a_make_target_or_waits_for_one() -> None:
    makefile = (ROOT / "Makefile").read_text()
    for job in budget.JOBS:
        assert job.argv[0] == "make"
        targets = [a for a in job.argv[1:] if not a.startswith("-")]
        missing = [t for t in targets if f"\n{t}:" not in makefile]
        assert not missing or job.make_target in missing, (job.name, missing)


def test_the_report_marks_what_is_over_and_fails_nothing() -> None:
    install, test, *_, sglang = budget.JOBS
    text = budget.report([budget.Outcome(install, 200.0, "ok"), budget.Outcome(test, 400.0, "ok"),
                          budget.Outcome(sglang, None, "not run: no `make test-sglang` in this tree")], 600.0)
    lines = {line.split()[0]: line for line in text.splitlines() if line and line.split()[0] in ("install", "test", "test-sglang", "total")}
    assert "3:20" in lines["install"] and "4:00" in lines["install"] and "OVER" not in lines["install"]
    assert "6:40" in lines["test"] and "111%" in lines["test"] and lines["test"].endswith("OVER BUDGET")
    assert "not run" in lines["test-sglang"]
    assert "10:00" in lines["total"] and "30:00" in lines["total"] and "OVER" not in lines["total"]


def test_an_unknown_job_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert budget.main(["tset"]) == 2
    assert "unknown job(s) ['tset']" in capsys.readouterr().err


def test_a_failing_job_ends_the_run_with_its_status_and_the_report(tmp_path: Path) -> None:
    """The jobs run in order; after a failure the rest are reported as not run, and the exit
    status is the failing job's (here with a Makefile whose targets fail or pass at once)."""
    (tmp_path / "Makefile").write_text("venv:\n\t@true\nsystem-deps:\n\t@true\ntest:\n\t@exit 3\n")
    res = subprocess.run([sys.executable, str(ROOT / ".ci" / "budget.py"), "install", "test", "test-image"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr  # make's status for a failed recipe
    table = res.stdout[res.stdout.index("==== CI time budget"):]
    assert "failed (2)" in table and "not run: an earlier job failed" in table
