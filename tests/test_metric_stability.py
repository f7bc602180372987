"""Stability levels (issue 29, point 7): every catalogue family is stable or experimental;
a stable family, or a label of one, is never renamed or dropped without CHANGELOG.md's
"Renamed" entry and the catalogue's RENAMED_* tables (which `kvledger plan --from` reads).

The stable surface is recorded in tests/fixtures/stable-metrics.txt (family, then its
labels). A stable family added is added there (`KVLEDGER_REGEN=1` rewrites the record from
the catalogue, keeping what it already holds: an entry leaves the record only by hand, in
the commit that releases the rename)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from kvledger.output.catalog import CATALOG, RENAMED_FAMILIES, RENAMED_LABELS, STABLE, MetricSpec

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "tests" / "fixtures" / "stable-metrics.txt"


def _renamed_section(changelog: str) -> str:
    unreleased = changelog.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
    return unreleased.split("### Renamed", 1)[1].split("\n### ", 1)[0] if "### Renamed" in unreleased else ""


def read_record(text: str) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            family, _, labels = line.partition(" ")
            out[family] = tuple(x for x in labels.strip().split(",") if x)
    return out


def stable_surface_problems(catalog: Iterable[MetricSpec], stable: frozenset[str], record: Mapping[str, tuple[str, ...]],
                            renamed_families: Mapping[str, str], renamed_labels: Mapping[tuple[str, str], str],
                            changelog: str) -> list[str]:
    """What breaks the promise of the stable families: each recorded family and label is still
    there, or its rename is in the RENAMED tables and in the changelog's Renamed section (the
    old and the new name on one entry)."""
    names = {s.name: s for s in catalog}
    section = _renamed_section(changelog)
    entries = section.split("\n- ")

    def in_changelog(*words: str) -> bool:
        return any(all(f"`{w}`" in entry for w in words) for entry in entries)

    problems: list[str] = []
    for family, labels in record.items():
        current = family
        if family not in names:
            new = renamed_families.get(family)
            if new is None or new not in names:
                problems.append(f"stable family {family} is gone: rename it with RENAMED_FAMILIES and CHANGELOG's Renamed entry")
                continue
            if not in_changelog(family, new):
                problems.append(f"stable family {family} renamed to {new} without CHANGELOG.md's Renamed entry")
            current = new
        if current not in stable:
            problems.append(f"stable family {current} is no longer stable")
        for label in labels:
            if label in names[current].labels:
                continue
            new_label = renamed_labels.get((current, label))
            if new_label is None or new_label not in names[current].labels:
                problems.append(f"label {label} of stable family {current} is gone: rename it with RENAMED_LABELS and "
                                "CHANGELOG's Renamed entry")
            elif not in_changelog(current, label, new_label):
                problems.append(f"label {label} of stable family {current} renamed to {new_label} without CHANGELOG.md's "
                                "Renamed entry")
    recorded = set(record) | {renamed_families.get(f, f) for f in record}
    problems += [f"{name} is stable but not in {RECORD.name} (KVLEDGER_REGEN=1 adds it)" for name in sorted(stable - recorded)]
    return problems


def _changelog() -> str:
    return (ROOT / "CHANGELOG.md").read_text()


def test_every_family_has_a_stability_level() -> None:
    assert STABLE <= {s.name for s in CATALOG}, sorted(STABLE - {s.name for s in CATALOG})
    assert {s.stability for s in CATALOG} == {"stable", "experimental"}
    assert all(s.stability == ("stable" if s.name in STABLE else "experimental") for s in CATALOG)


def test_the_stable_surface_is_kept() -> None:
    if os.environ.get("KVLEDGER_REGEN"):
        record = read_record(RECORD.read_text()) if RECORD.exists() else {}
        for spec in CATALOG:
            if spec.name in STABLE and spec.name not in {RENAMED_FAMILIES.get(f, f) for f in record}:
                record[spec.name] = spec.labels
        RECORD.write_text("# The stable metric families and their labels (tests/test_metric_stability.py).\n"
                          + "".join(f"{f} {','.join(labels)}\n" for f, labels in sorted(record.items())))
    problems = stable_surface_problems(CATALOG, STABLE, read_record(RECORD.read_text()), RENAMED_FAMILIES, RENAMED_LABELS,
                                       _changelog())
    assert problems == []


def _renamed(spec_name: str, new_name: str) -> list[MetricSpec]:
    return [dataclasses.replace(s, name=new_name) if s.name == spec_name else s for s in CATALOG]


def test_a_stable_family_renamed_without_its_changelog_entry_fails() -> None:
    catalog = _renamed("kvledger_requests", "kvledger_requests_current")
    stable = (STABLE - {"kvledger_requests"}) | {"kvledger_requests_current"}
    record = read_record(RECORD.read_text())
    silent = stable_surface_problems(catalog, stable, record, RENAMED_FAMILIES, RENAMED_LABELS, _changelog())
    assert "stable family kvledger_requests is gone: rename it with RENAMED_FAMILIES and CHANGELOG's Renamed entry" in silent
    tabled = {**RENAMED_FAMILIES, "kvledger_requests": "kvledger_requests_current"}
    unwritten = stable_surface_problems(catalog, stable, record, tabled, RENAMED_LABELS, _changelog())
    assert unwritten == ["stable family kvledger_requests renamed to kvledger_requests_current without CHANGELOG.md's Renamed entry"]
    changelog = _changelog().replace("### Renamed\n", "### Renamed\n\n- `kvledger_requests` → `kvledger_requests_current`: a reason.\n", 1)
    assert stable_surface_problems(catalog, stable, record, tabled, RENAMED_LABELS, changelog) == []


def test_a_label_of_a_stable_family_renamed_without_its_changelog_entry_fails() -> None:
    catalog = [dataclasses.replace(s, labels=("engine", "phase")) if s.name == "kvledger_requests" else s for s in CATALOG]
    record = read_record(RECORD.read_text())
    silent = stable_surface_problems(catalog, STABLE, record, RENAMED_FAMILIES, RENAMED_LABELS, _changelog())
    assert silent == ["label state of stable family kvledger_requests is gone: rename it with RENAMED_LABELS and CHANGELOG's "
                      "Renamed entry"]
    tabled = {**RENAMED_LABELS, ("kvledger_requests", "state"): "phase"}
    assert stable_surface_problems(catalog, STABLE, record, RENAMED_FAMILIES, tabled, _changelog()) == [
        "label state of stable family kvledger_requests renamed to phase without CHANGELOG.md's Renamed entry"]


@pytest.mark.parametrize("name", ["kvledger_kv_group_info", "kvledger_label_values_limited_total"])
def test_an_experimental_family_may_change(name: str) -> None:
    catalog = _renamed(name, name + "_v2")
    assert stable_surface_problems(catalog, STABLE, read_record(RECORD.read_text()), RENAMED_FAMILIES, RENAMED_LABELS,
                                   _changelog()) == []


def test_a_new_stable_family_must_be_recorded() -> None:
    catalog = _renamed("kvledger_kv_group_info", "kvledger_kv_group_info")
    problems = stable_surface_problems(catalog, STABLE | {"kvledger_kv_group_info"}, read_record(RECORD.read_text()),
                                       RENAMED_FAMILIES, RENAMED_LABELS, _changelog())
    assert problems == [f"kvledger_kv_group_info is stable but not in {RECORD.name} (KVLEDGER_REGEN=1 adds it)"]
