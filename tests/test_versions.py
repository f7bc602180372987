"""Versions that tell builds apart (issue 32): the version of both distributions is written
once (engine/kvledger_engine/__init__.py; the daemon's version and its pin on kvledger-engine
are read from there); a build from the tree between releases reports the next version's
.devN, never a released one; and CHANGELOG.md's sections match (Unreleased on top while the
version is a .dev one, the released version on top when it is not, newest first)."""

from __future__ import annotations

import re
import runpy
import tomllib
from pathlib import Path
from typing import Any

import pytest

import kvledger_engine
from kvledger import __version__, build_info

ROOT = Path(__file__).resolve().parent.parent
SECTION = re.compile(r"^## \[([^\]]+)\]", re.MULTILINE)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:\.dev\d+)?", version).groups())  # type: ignore[union-attr]


def changelog_problems(version: str, changelog: str) -> list[str]:
    sections = SECTION.findall(changelog)
    if not sections:
        return ["CHANGELOG.md has no ## [VERSION] sections"]
    released = [s for s in sections if s != "Unreleased"]
    problems = []
    if "Unreleased" in sections[1:]:
        problems.append("## [Unreleased] must be the first section")
    if released != sorted(released, key=_release, reverse=True) or len(set(released)) != len(released):
        problems.append(f"released sections are not newest first, each once: {released}")
    dev = re.search(r"\.dev\d+$", version)
    if dev:
        if sections[0] != "Unreleased":
            problems.append(f"version {version} is unreleased, but the first section is [{sections[0]}]")
        if released and _release(version) <= _release(released[0]):
            problems.append(f"version {version} is not newer than the last release {released[0]}")
    else:
        if version not in released:
            problems.append(f"version {version} is a release, but CHANGELOG.md has no ## [{version}] section")
        elif sections[0] != version and not (sections[0] == "Unreleased" and sections[1] == version):
            problems.append(f"version {version} is a release, but the newest section is [{sections[0]}]")
    return problems


def test_the_version_is_written_once() -> None:
    assert __version__ == kvledger_engine.__version__ == build_info().version
    engine = tomllib.loads((ROOT / "engine" / "pyproject.toml").read_text())["project"]
    daemon = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in engine and "version" in engine["dynamic"]
    assert "version" not in daemon and {"version", "dependencies"} <= set(daemon["dynamic"])
    # no build file spells the version or pins the engine by hand
    for name in ("pyproject.toml", "engine/pyproject.toml", "setup.py", "Makefile"):  # (image tags: test_deploy_kubernetes)
        text = (ROOT / name).read_text()
        assert __version__ not in text, name
        assert not re.search(r"kvledger-engine==\d", text), name


def test_the_daemon_pins_the_engine_side_library_at_its_own_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """setup.py gives setuptools the version and the pin it read (the built wheels' metadata:
    tests/test_release.py)."""
    import setuptools

    given: dict[str, Any] = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: given.update(kwargs))
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(ROOT / "setup.py"), run_name="setup")
    assert given["version"] == __version__
    assert given["install_requires"][0] == f"kvledger-engine=={__version__}"


def test_an_unreleased_tree_reports_a_dev_version() -> None:
    """Between releases the version is the next one's .devN: this build and a released one
    never print the same version."""
    sections = SECTION.findall((ROOT / "CHANGELOG.md").read_text())
    if sections[0] == "Unreleased":
        assert re.fullmatch(r"\d+\.\d+\.\d+\.dev\d+", __version__), __version__


def test_the_changelog_sections_match_the_version() -> None:
    assert changelog_problems(__version__, (ROOT / "CHANGELOG.md").read_text()) == []


def test_mismatches_are_caught() -> None:
    log = "# Changelog\n\n## [Unreleased]\n\n- x\n\n## [0.1.0] - 2026-11-01\n\n- y\n"
    assert changelog_problems("0.2.0.dev0", log) == []
    assert changelog_problems("0.1.0", log) == []  # a tree at its release, with notes gathering above it
    assert changelog_problems("0.2.0", log) == ["version 0.2.0 is a release, but CHANGELOG.md has no ## [0.2.0] section"]
    assert changelog_problems("0.1.0.dev3", log) == ["version 0.1.0.dev3 is not newer than the last release 0.1.0"]
    released = log.replace("## [Unreleased]", "## [0.2.0] - 2026-12-24")
    assert changelog_problems("0.2.0.dev0", released) == [
        "version 0.2.0.dev0 is unreleased, but the first section is [0.2.0]",
        "version 0.2.0.dev0 is not newer than the last release 0.2.0"]
    assert changelog_problems("0.2.0", released) == []
    swapped = "## [0.1.0]\n\n## [0.2.0]\n"
    assert "released sections are not newest first, each once: ['0.1.0', '0.2.0']" in changelog_problems("0.2.0", swapped)
