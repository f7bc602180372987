"""The type gate: mypy (strict, settings in pyproject.toml) and ruff pass on the tree, and
every ``type: ignore`` left under exporter/ names its error code and says why.

mypy and ruff come with the ``test`` extra (pip install -e '.[test]'), so ``make test``
and CI run the gate; ``make lint`` runs the same two tools by hand.
"""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from kvledger.domain import facts

ROOT = Path(__file__).resolve().parent.parent
#: "# type: ignore[code, ...]  # reason": a code list and a comment after it on the same line
_IGNORE = re.compile(r"#\s*type:\s*ignore")
_JUSTIFIED = re.compile(r"#\s*type:\s*ignore\[[a-z0-9-]+(?:\s*,\s*[a-z0-9-]+)*\]\s*#\s*\S")


def _unjustified_ignores(text: str, name: str) -> list[str]:
    return [
        f"{name}:{number}: {line.strip()}"
        for number, line in enumerate(text.splitlines(), start=1)
        if _IGNORE.search(line) and not _JUSTIFIED.search(line)
    ]


def test_every_type_ignore_names_its_code_and_a_reason() -> None:
    bad: list[str] = []
    for path in sorted((ROOT / "exporter").rglob("*.py")):
        bad += _unjustified_ignores(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not bad, (
        "a `type: ignore` needs an error code and a reason on the same line, "
        "e.g. `# type: ignore[attr-defined]  # why`:\n" + "\n".join(bad)
    )


@pytest.mark.parametrize(
    ("line", "flagged"),
    [
        ("x = f()  # type: ignore", True),
        ("x = f()  # type: ignore[arg-type]", True),
        ("x = f()  # type: ignore  # no code", True),
        ("x = f()  # type: ignore[arg-type]  # the loader checks the Literal", False),
        ("x = f()  # type: ignore[arg-type, misc]  # two codes, one reason", False),
        ("x = f()  # nothing to see", False),
    ],
)
def test_the_ignore_scan_itself(line: str, flagged: bool) -> None:
    assert bool(_unjustified_ignores(line, "f.py")) is flagged


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_mypy_strict_passes() -> None:
    result = _run("mypy")  # files, strictness and error codes: [tool.mypy] in pyproject.toml
    assert result.returncode == 0, f"mypy found problems:\n{result.stdout}{result.stderr}"


def test_ruff_passes() -> None:
    result = _run("ruff", "check", ".")
    assert result.returncode == 0, f"ruff found problems:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize(
    ("values", "literal"),
    [
        (facts.ADMISSIONS, facts.Admission),
        (facts.OVERFLOWS, facts.Overflow),
        (facts.SHARINGS, facts.Sharing),
        (facts.REQUEST_STATES, facts.RequestState),
        (facts.OUTPUT_BOUNDS, facts.OutputBound),
        (facts.TERM_SOURCES, facts.TermSource),
        (facts.LIMIT_KINDS, facts.LimitKind),
        (facts.GROUP_HOLDINGS, facts.GroupHolding),
        (facts.NVML_ENABLED, facts.NvmlEnabled),
    ],
)
def test_value_tuples_spell_out_their_literal(values: tuple[str, ...], literal: object) -> None:
    """mypy checks each value belongs to the Literal; this checks none is missing (and the order)."""
    assert values == typing.get_args(literal)
