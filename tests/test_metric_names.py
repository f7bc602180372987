"""Names (issue 22): units last in every family name, one meaning per label name across the
catalogue, and every rename since 0.1.0 listed in CHANGELOG.md with its reason, gone from
what the repository generates, and still read by `kvledger plan --from` from an older daemon."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest
from accounting_support import accounts_of
from test_exposition import rich_snapshot

from kvledger.collect.engine_kinds import KINDS
from kvledger.output.catalog import CATALOG, RENAMED_FAMILIES, RENAMED_LABELS
from kvledger.tools.plan import parse_live

ROOT = Path(__file__).resolve().parent.parent

#: every label name of the catalogue and the one thing it means; where its values are a
#: closed set, that set (None: open, e.g. names from the configuration)
LABELS: dict[str, tuple[str, frozenset[str] | None]] = {
    "engine": ("the engine's name in the configuration", None),
    "pool": ("a KV pool's id", None),
    "gpu": ("a GPU index", None),
    "tenant": ("a tenant named in the configuration", None),
    "basis": ("whether a figure is exact or a bound", frozenset({"exact", "upper_bound", "lower_bound"})),
    "kind": ("the engine kind of the configuration", frozenset(KINDS)),
    "view": ("the quota view (reservations) or the physical one (blocks holding data)", frozenset({"quota", "physical"})),
    "limit": ("whether a limit is a hard cap or an estimate", frozenset({"hard", "estimate"})),
    "purpose": ("what an extra context slot is for", frozenset({"speculative", "branch"})),
    "provenance": ("where a budget figure comes from", frozenset({"measured", "configured", "estimate"})),
    "source": ("the kvledger source reading an engine", None),
    "state": ("the state of the blocks or requests counted", frozenset({"in_use", "reclaimable", "free", "running",
                                                                          "waiting", "preempted"})),
    "output_bound": ("the kind of a request's output bound", frozenset({"cap", "estimate"})),
    "category": ("a device budget term", frozenset({"weights", "workspace", "runtime_buffers", "reserve", "kv_pool"})),
    "direction": ("a socket queue's direction", frozenset({"send", "receive"})),
    "result": ("an admission re-check's result", frozenset({"accepted", "rejected"})),
    "type": ("a KV event's type", None),
    "reason": ("why a source failed", None),
    "check": ("the ledger invariant violated", None),
    "label": ("the label whose values were limited", None),
    "action": ("what was done to a label value over the limit", None),
    "memory_type": ("the engine's own memory category", None),
    "sharing": ("the sharing rule", frozenset({"per-request", "reference-aware"})),
    "admission": ("the engine's admission behaviour", frozenset({"reserve-cap", "dynamic", "unknown"})),
    "overflow": ("what happens when an estimate is exceeded", frozenset({"preempt-recompute", "reject", "swap", "unknown"})),
    "tenant_rule": ("the rule tenant figures use", frozenset({"per-request"})),
    "version": ("the version of what the info family describes (kvledger, an engine)", None),
    "revision": ("kvledger's git revision", None),
    "python_version": ("the Python running kvledger", None),
    "uuid": ("a GPU's UUID", None),
    "name": ("a GPU's product name", None),
    "driver_version": ("the NVIDIA driver's version", None),
    "mig": ("whether the GPU is a MIG instance", frozenset({"true", "false"})),
    "group": ("a KV-cache group of a pool (a hybrid model's layer type)", None),
    "layer_type": ("the layer type of a KV-cache group",
                   frozenset({"full_attention", "sliding_window", "chunked_local_attention", "mamba"})),
    "window_tokens": ("the tokens a KV-cache group's window or chunk spans (empty: none)", None),
    "constraint": ("a limit that stops an engine admitting work",
                   frozenset({"kv_quota", "kv_physical", "sequences", "token_budget"})),
}


def test_units_come_last_in_every_family_name() -> None:
    wrong = [f"{s.name} (unit {s.unit})" for s in CATALOG if s.unit and not s.name.removesuffix("_total").endswith(f"_{s.unit}")]
    assert wrong == []


def test_every_label_name_has_one_documented_meaning() -> None:
    assert sorted({label for s in CATALOG for label in s.labels} - set(LABELS)) == []


def test_label_values_stay_within_their_one_meaning() -> None:
    accounts = accounts_of(rich_snapshot())
    seen: dict[str, set[str]] = defaultdict(set)
    for spec in CATALOG:
        for labels, _value in spec.samples(accounts):
            for name, value in zip(spec.labels, labels, strict=True):
                seen[name].add(value)
    for name, (_meaning, allowed) in LABELS.items():
        if allowed is not None:
            assert seen[name] <= allowed, name
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
