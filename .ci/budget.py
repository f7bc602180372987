#!/usr/bin/env python3
"""Run CI's jobs one after another, time each, and report every job's time against its budget.

    python3 .ci/budget.py                  # every job of JOBS (what .ci/run does)
    python3 .ci/budget.py test test-vllm   # only these jobs (by name), same report

A job's output streams as it runs. At the end (also after a failure) a table gives each
job's wall time, its budget and the share of the budget it used, then the total against
TOTAL_BUDGET_SECONDS. A job over its budget is marked OVER: the report is how a change
that breaks the budget is seen when it lands, it never fails CI by itself (only a failing
job does; the exit status is the first failing job's). The budgets and the last measured
breakdown are in docs/contributing.md ("How long CI takes").

Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

#: CI's whole run (a fresh 2-core machine): the limit after which nothing lands is 90 minutes
TOTAL_BUDGET_SECONDS = 30 * 60


@dataclass(frozen=True)
class Job:
    name: str
    argv: tuple[str, ...]
    budget_seconds: int
    #: run only when the Makefile has this target (a suite that lands later joins by itself)
    make_target: str | None = None


#: CI's jobs in order, with their budgets (seconds); the budgets add up to TOTAL_BUDGET_SECONDS
JOBS: tuple[Job, ...] = (
    # the project's venv and the Debian tools: what every later job needs (make venv system-deps)
    Job("install", ("make", "venv", "system-deps"), 240),
    Job("test", ("make", "test"), 360),
    Job("test-image", ("make", "test-image"), 240),
    Job("test-vllm", ("make", "test-vllm"), 480),
    Job("test-llamacpp", ("make", "test-llamacpp"), 180),
    Job("test-sglang", ("make", "test-sglang"), 300, make_target="test-sglang"),
)


def has_make_target(target: str) -> bool:
    """``make -n TARGET`` knows it (``make -q`` answers 2 for an unknown target)."""
    res = subprocess.run(["make", "-q", target], capture_output=True, text=True, check=False)
    return res.returncode != 2 or "No rule to make target" not in res.stderr


def fmt(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes:d}:{secs:02d}"


@dataclass
class Outcome:
    job: Job
    seconds: float | None  # None: not run
    status: str  # "ok", "failed (N)", "not run: ..."


def report(outcomes: list[Outcome], total_seconds: float) -> str:
    lines = ["", "==== CI time budget (a report: a job over budget does not fail CI) ====",
             f"{'job':<16}{'time':>8}{'budget':>9}{'used':>7}  status"]
    for o in outcomes:
        if o.seconds is None:
            lines.append(f"{o.job.name:<16}{'-':>8}{fmt(o.job.budget_seconds):>9}{'':>7}  {o.status}")
            continue
        share = o.seconds / o.job.budget_seconds
        over = "  OVER BUDGET" if o.seconds > o.job.budget_seconds else ""
        lines.append(f"{o.job.name:<16}{fmt(o.seconds):>8}{fmt(o.job.budget_seconds):>9}{share:>6.0%}  {o.status}{over}")
    share = total_seconds / TOTAL_BUDGET_SECONDS
    over = "  OVER BUDGET" if total_seconds > TOTAL_BUDGET_SECONDS else ""
    lines.append(f"{'total':<16}{fmt(total_seconds):>8}{fmt(TOTAL_BUDGET_SECONDS):>9}{share:>6.0%}{over}")
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        lines.append(f"load average at the end: {load} on {os.cpu_count()} CPUs")
    except OSError:
        pass
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    wanted = set(argv)
    unknown = wanted - {j.name for j in JOBS}
    if unknown:
        print(f"budget.py: unknown job(s) {sorted(unknown)}; jobs: {[j.name for j in JOBS]}", file=sys.stderr)
        return 2
    outcomes: list[Outcome] = []
    first_failure = 0
    began = time.monotonic()
    for job in JOBS:
        if wanted and job.name not in wanted:
            continue
        if first_failure:
            outcomes.append(Outcome(job, None, "not run: an earlier job failed"))
            continue
        if job.make_target and not has_make_target(job.make_target):
            outcomes.append(Outcome(job, None, f"not run: no `make {job.make_target}` in this tree"))
            continue
        print(f"\n==== {job.name}: {' '.join(job.argv)} (budget {fmt(job.budget_seconds)})", flush=True)
        start = time.monotonic()
        code = subprocess.run(job.argv, check=False).returncode
        seconds = time.monotonic() - start
        print(f"==== {job.name}: {fmt(seconds)} of {fmt(job.budget_seconds)}, exit {code}", flush=True)
        outcomes.append(Outcome(job, seconds, "ok" if code == 0 else f"failed ({code})"))
        if code != 0:
            first_failure = code
    print(report(outcomes, time.monotonic() - began), flush=True)
    return first_failure


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
