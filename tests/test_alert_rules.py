"""The alert and recording rules: promtool checks, our own lint, generator freshness."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from alerts_support import ALERTS, ROOT, RULES, load

generate = load("generate")
lint = load("lint")

CONTRACT_ALERTS = {
    "KVLedgerQuotaExceedsCapacity": "critical", "KVLedgerOvercommitHigh": "warning",
    "KVLedgerTenantQuotasOversubscribed": "warning", "KVLedgerGPUBudgetExceedsDevice": "critical",
    "KVLedgerPrefixCountingInconsistent": "warning", "KVLedgerGPUMemoryUnaccounted": "warning",
    "KVLedgerResidentTokensNearCapacity": "warning", "KVLedgerReservationLeak": "warning",
    "KVLedgerEstimateOverflowing": "warning", "KVLedgerHostBufferNearLimit": "warning",
    "KVLedgerNetworkQueueNearLimit": "warning", "KVLedgerPreemptionStorm": "warning",
    "KVLedgerGPULost": "critical", "KVLedgerSourceDown": "warning", "KVLedgerInvariantViolated": "warning",
    "KVLedgerConfigReloadFailed": "warning",
}
DASHBOARD_RECORDINGS = {
    "kvledger:kv_capacity_bytes:sum", "kvledger:kv_reserved_bytes:sum", "kvledger:kv_allocated_bytes:sum",
    "kvledger:kv_overcommit:ratio", "kvledger:gpu_memory_unaccounted_bytes:sum",
    "kvledger:gpu_memory_used_bytes:sum", "kvledger:gpu_memory_total_bytes:sum",
}
TEST_FILES = sorted((ALERTS / "tests").glob("*.yml"))


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not on PATH: apt-get install prometheus"
    return path


def rules_doc() -> dict:
    return yaml.safe_load(RULES.read_text())


def all_rules() -> list[dict]:
    return [r for g in rules_doc()["groups"] for r in g["rules"]]


# ---------------------------------------------------------------- promtool

def test_promtool_check_rules() -> None:
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_unit_tests_pass() -> None:
    assert TEST_FILES
    out = subprocess.run([promtool(), "test", "rules", *map(str, TEST_FILES)], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(TEST_FILES)


def test_every_rule_has_firing_and_near_miss_tests() -> None:
    fired: set[str] = set()
    quiet: set[str] = set()
    for path in TEST_FILES:
        for group in yaml.safe_load(path.read_text())["tests"]:
            for case in group.get("alert_rule_test") or []:
                (fired if case.get("exp_alerts") else quiet).add(case["alertname"])
            for case in group.get("promql_expr_test") or []:
                (fired if case.get("exp_samples") else quiet).add(case["expr"])
    names = {r.get("alert") or r.get("record") for r in all_rules()}
    assert names - fired == set(), "rules without a firing test"
    assert names - quiet == set(), "rules without a not-firing test"


# ---------------------------------------------------------------- contract

def test_contract_alerts_and_recordings_exist_with_severity() -> None:
    alerts = {r["alert"]: r["labels"]["severity"] for r in all_rules() if "alert" in r}
    for name, severity in CONTRACT_ALERTS.items():
        assert alerts.get(name) == severity, name
    records = {r["record"] for r in all_rules() if "record" in r}
    assert DASHBOARD_RECORDINGS <= records


def test_quota_alert_only_reads_exact_reservations_of_reserve_cap_engines() -> None:
    rule = next(r for r in all_rules() if r.get("alert") == "KVLedgerQuotaExceedsCapacity")
    assert 'kvledger_kv_reserved_bytes{basis="exact"}' in rule["expr"]
    assert 'kvledger_policy_info{admission="reserve-cap"}' in rule["expr"]


# ---------------------------------------------------------------- generator

def test_committed_rules_match_the_generator() -> None:
    assert RULES.read_text() == generate.render(), "stale: run python alerts/generate.py"


def test_thresholds_come_from_the_table() -> None:
    table = generate.load_thresholds()
    changed = copy.deepcopy(table)
    changed["alerts"]["KVLedgerOvercommitHigh"]["ratio"] = 1.75
    changed["alerts"]["KVLedgerOvercommitHigh"]["for"] = "3m"
    doc = yaml.safe_load(generate.render(changed))
    rule = next(r for g in doc["groups"] for r in g["rules"] if r.get("alert") == "KVLedgerOvercommitHigh")
    assert ") > 1.75\n" in rule["expr"] and rule["for"] == "3m"
    variant = yaml.safe_load(generate.render(table, for_override="0s"))
    assert {r["for"] for g in variant["groups"] for r in g["rules"] if "alert" in r} == {"0s"}


def test_generator_check_mode_detects_staleness(tmp_path: Path) -> None:
    out = tmp_path / "rules.yml"
    assert generate.main(["--out", str(out)]) == 0
    assert generate.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text().replace("> 1.2", "> 1.3"))
    assert generate.main(["--check", "--out", str(out)]) == 1


def test_thresholds_table_must_cover_every_alert(tmp_path: Path) -> None:
    table = yaml.safe_load((ALERTS / "thresholds.yml").read_text())
    del table["alerts"]["KVLedgerGPULost"]
    path = tmp_path / "t.yml"
    path.write_text(yaml.safe_dump(table))
    with pytest.raises(ValueError, match="KVLedgerGPULost"):
        generate.load_thresholds(path)


# ---------------------------------------------------------------- lint

def test_rules_pass_the_lint() -> None:
    assert [str(p) for p in lint.lint_files([RULES])] == []


def test_runbook_has_a_section_per_alert() -> None:
    anchors = lint.heading_anchors((ROOT / "docs" / "runbooks.md").read_text())
    for r in all_rules():
        if "alert" in r:
            assert r["alert"].lower() in anchors


BAD_RULES = """
groups:
- name: bad
  rules:
  - record: kvledger_no_colons
    expr: sum(kvledger_kv_capacity_bytes)
  - alert: kvledger_snake_case
    expr: kvledger_gpu_up == 0
    labels: {severity: page}
    annotations:
      summary: GPU {{ $labels.gpu }} lost
      description: A GPU is lost.
      runbook_url: https://example.com/docs/runbooks.md#no-such-section
  - alert: KVLedgerCounterMisuse
    expr: kvledger_preemptions_total > 5 or max_over_time(kvledger_reservation_leaks_total[5m]) > 0
    labels: {severity: warning}
    annotations:
      summary: Static.
      description: "{{ $value }}"
  - alert: KVLedgerUnknownMetric
    expr: vllm:num_requests_running > 0 and rate(kvledger_preemptions_total[5m]) > 0 and {__name__="kvledger_nope"}
    labels: {severity: warning}
    annotations:
      summary: Static.
      description: "{{ $value }}"
      runbook_url: https://example.com/r.md#kvledgergpulost
  - alert: KVLedgerBroken
    expr: sum(rate(
    labels: {}
"""


def test_lint_reports_each_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.rules.yml"
    path.write_text(BAD_RULES)
    problems = [str(p) for p in lint.lint_files([path])]

    def has(rule: str, pattern: str) -> bool:
        return any(p.startswith(rule + ":") and re.search(pattern, p) for p in problems)

    assert has("kvledger_no_colons", "level:metric:operations")
    assert has("kvledger_snake_case", "CamelCase")
    assert has("kvledger_snake_case", "severity 'page'")
    assert has("kvledger_snake_case", "summary annotation is templated")
    assert has("kvledger_snake_case", "description annotation is not templated")
    assert has("kvledger_snake_case", "anchor #no-such-section")
    assert has("KVLedgerCounterMisuse", "counter kvledger_preemptions_total used without rate")
    assert has("KVLedgerCounterMisuse", "counter kvledger_reservation_leaks_total used without rate")
    assert has("KVLedgerCounterMisuse", "runbook_url annotation missing")
    assert has("KVLedgerUnknownMetric", "metric vllm:num_requests_running is not in the catalogue")
    assert has("KVLedgerUnknownMetric", "metric kvledger_nope is not in the catalogue")
    assert not has("KVLedgerUnknownMetric", "kvledger_preemptions_total")  # rate() is fine
    assert has("KVLedgerBroken", "does not parse")
    assert has("KVLedgerBroken", "severity None")
    assert has("KVLedgerBroken", "summary annotation missing")
    assert has("KVLedgerBroken", "description annotation missing")
    assert len(problems) == 16, problems
