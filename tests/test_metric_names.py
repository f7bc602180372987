"""Names (issue 22): units last in every family name, one meaning per label name across the
catalogue, and every rename since 0.1.0 listed in CHANGELOG.md with its reason, gone from
what the repository generates, and still read by `kvledger plan --from` from an older daemon."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from accounting_support import accounts_of
from test_exposition import rich_snapshot

from kvledger.config.engine_kinds import KINDS
from kvledger.domain.accounts import Accounts, ConfigReload
from kvledger.output.catalog import BY_NAME, CATALOG, LABELS, RENAMED_FAMILIES, RENAMED_LABELS, Sample
from kvledger.output.prometheus import _family_lines
from kvledger.tools.plan import parse_live

ROOT = Path(__file__).resolve().parent.parent

def test_units_come_last_in_every_family_name() -> None:
    wrong = [f"{s.name} (unit {s.unit})" for s in CATALOG if s.unit and not s.name.removesuffix("_total").endswith(f"_{s.unit}")]
    assert wrong == []


def test_every_label_name_has_one_documented_meaning() -> None:
    used = {label for s in CATALOG for label in s.labels}
    assert sorted(used - set(LABELS)) == []
    assert sorted(set(LABELS) - used) == []  # the vocabulary names no label the catalogue has dropped
    assert all(label.meaning for label in LABELS.values())


def test_every_sample_names_exactly_its_familys_labels() -> None:
    """Each extractor gives its labels by name: every sample of every family (all of them shown by
    the rich snapshot) carries the family's label names, no other; nothing reads them by position."""
    accounts = accounts_of(rich_snapshot())
    accounts.invariant_totals = {("sim", "partition"): 1}
    accounts.labels_limited = {("sim", "tenant", "dropped"): 3}
    accounts.config_reload = ConfigReload(successful=True, success_at=1_700_000_000.0)
    silent = []
    for spec in CATALOG:
        samples = list(spec.samples(accounts))
        silent += [] if samples else [spec.name]
        wrong = {tuple(sorted(labels)) for labels, _value in samples} - {tuple(sorted(spec.labels))}
        assert wrong == set(), spec.name
    assert silent == []


def test_the_renderer_writes_labels_by_name_in_the_familys_order() -> None:
    """A sample's names, not its order, say where its values go; a sample naming other labels than
    its family's is refused (a bug of ours), never written under the family's names."""
    spec = BY_NAME["kvledger_kv_headroom_bytes"]  # engine, pool, view, basis
    accounts = accounts_of(rich_snapshot())

    def reordered(a: Accounts) -> Iterator[Sample]:
        for labels, value in spec.samples(a):
            yield dict(reversed(labels.items())), value

    assert _family_lines(dataclasses.replace(spec, samples=reordered), accounts, check=True) == \
        _family_lines(spec, accounts, check=True)
    line = _family_lines(spec, accounts, check=True).splitlines()[0]
    assert re.match(r'kvledger_kv_headroom_bytes\{engine="[^"]*",pool="[^"]*",view="(quota|physical)",basis="\w+"\} ', line)
    good = {"engine": "e", "pool": "0", "view": "quota", "basis": "exact"}  # its prefix is kept from here on:
    _family_lines(dataclasses.replace(spec, samples=lambda a: iter([(good, 1.0)])), accounts, check=True)
    for bad in ({"engine": "e", "pool": "0", "view": "quota", "basis": "exact", "kind": "quota"},  # one name too many
                {"engine": "e", "pool": "0", "basis": "exact", "kind": "quota"}):  # view under another name
        wrong = dataclasses.replace(spec, samples=lambda a, labels=bad: iter([(labels, 1.0)]))
        with pytest.raises((ValueError, KeyError)):
            _family_lines(wrong, accounts, check=True)


def test_label_values_stay_within_their_one_meaning() -> None:
    accounts = accounts_of(rich_snapshot())
    seen: dict[str, set[str]] = defaultdict(set)
    for spec in CATALOG:
        for labels, _value in spec.labelled(accounts):
            for name, value in labels.items():
                seen[name].add(value)
    for name, label in LABELS.items():  # the vocabulary is the catalogue's own
        if label.values is not None:
            assert seen[name] <= label.values, name
    assert seen["kind"] <= set(KINDS)  # kind's values: the registered engine kinds
    # what each renamed label used to share with another meaning is gone from it
    assert not seen["source"] & {"measured", "configured", "estimate"}
    assert not seen["kind"] & {"quota", "physical", "hard", "estimate", "speculative", "branch"}
    assert {"view", "limit", "purpose", "provenance"} <= set(seen)


def test_renames_point_from_gone_names_to_catalogue_names() -> None:
    names = {s.name: s for s in CATALOG}
    assert not set(RENAMED_FAMILIES) & set(names)
    assert set(RENAMED_FAMILIES.values()) <= set(names)
    for (family, old), new in RENAMED_LABELS.items():
        assert family in names and new in names[family].labels and old not in names[family].labels, (family, old)


def _changelog_renamed() -> str:
    text = (ROOT / "CHANGELOG.md").read_text()
    unreleased = text.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
    return unreleased.split("### Renamed", 1)[1].split("\n### ", 1)[0]


@pytest.mark.parametrize("old", sorted(RENAMED_FAMILIES))
def test_each_family_rename_is_in_the_changelog_with_a_reason(old: str) -> None:
    section = _changelog_renamed()
    (line,) = [ln for ln in section.splitlines() if f"`{old}`" in ln]
    assert f"`{RENAMED_FAMILIES[old]}`" in line and "units last" in section.split(f"`{old}`", 1)[1].split("\n- ", 1)[0]


@pytest.mark.parametrize(("family", "old"), sorted(RENAMED_LABELS))
def test_each_label_rename_is_in_the_changelog_with_a_reason(family: str, old: str) -> None:
    section = _changelog_renamed()
    entries = [ln for ln in section.split("\n- ") if f"`{family}`" in ln]
    assert len(entries) == 1, family
    assert f"`{old}`" in entries[0] and f"`{RENAMED_LABELS[(family, old)]}`" in entries[0]
    assert "one meaning per label name" in " ".join(entries[0].split())


GENERATED = [*(ROOT / "alerts").glob("*.yml"), *(ROOT / "alerts" / "tests").glob("*.yml"), *(ROOT / "dashboards" / "json").glob("*.json"),
             *(ROOT / "dashboards" / "src").glob("*.py"), *(ROOT / "deploy").rglob("*.yaml"), *(ROOT / "docs").rglob("*.md"),
             ROOT / "README.md", ROOT / "alerts" / "generate.py"]


@pytest.mark.parametrize("old", sorted(RENAMED_FAMILIES))
def test_no_rule_dashboard_or_doc_names_a_gone_family(old: str) -> None:
    """Only a line that states the rename (old → new) may still name the old family."""
    new = RENAMED_FAMILIES[old]
    found = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in GENERATED for line in p.read_text().splitlines()
             if re.search(rf"\b{old}\b", line) and f"`{old}` → `{new}`" not in line]
    assert found == []


def test_no_rule_or_dashboard_selects_a_renamed_label_by_its_old_name() -> None:
    found = []
    for path in GENERATED:
        text = path.read_text()
        for (family, old), _new in RENAMED_LABELS.items():
            # a selector or a legend of the family with the old label: family{...old=...} or {{old}} next to it
            if re.search(rf"{family}\{{[^}}]*\b{old}=", text.replace('\\"', '"')):
                found.append(f"{path.relative_to(ROOT)}: {family} {old}")
    assert found == []


def test_plan_reads_a_0_1_0_daemon_under_the_current_names() -> None:
    old = (b'kvledger_kv_token_capacity{engine="e",pool="0"} 4096.0\n'
           b'kvledger_iteration_token_budget{engine="e"} 8192.0\n'
           b'kvledger_gpu_budget_bytes{gpu="0",engine="e",category="weights",source="measured"} 1e9\n'
           b'kvledger_kv_headroom_bytes{engine="e",pool="0",kind="quota",basis="exact"} 5.0\n'
           b'kvledger_engine_info{engine="e",kind="vllm",version="",source="vllm"} 1.0\n')
    samples = parse_live(old, "test")
    assert samples["kvledger_kv_capacity_tokens"] == [({"engine": "e", "pool": "0"}, 4096.0)]
    assert samples["kvledger_iteration_budget_tokens"] == [({"engine": "e"}, 8192.0)]
    assert samples["kvledger_gpu_budget_bytes"] == [({"gpu": "0", "engine": "e", "category": "weights", "provenance": "measured"}, 1e9)]
    assert samples["kvledger_kv_headroom_bytes"][0][0]["view"] == "quota"
    assert samples["kvledger_engine_info"] == [({"engine": "e", "kind": "vllm", "version": "", "source": "vllm"}, 1.0)]
