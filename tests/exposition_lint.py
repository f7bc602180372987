"""A name lint stricter than promtool, for kvledger's exposition (used by tests)."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

UNIT_SUFFIXES = ("_bytes", "_blocks", "_tokens", "_seconds", "_requests", "_ratio", "_total", "_info", "_depth", "_limit", "_slots", "_up")
FORBIDDEN_UNITS = ("_mb", "_mib", "_gb", "_gib", "_kb", "_milliseconds", "_ms", "_percent", "_perc")
SNAKE = re.compile(r"^[a-z_][a-z0-9_]*$")


def lint_exposition(text: str, prefix: str = "kvledger_") -> list[str]:
    """Problems found in an exposition: names, label names, types, info values."""
    problems: list[str] = []
    for family in text_string_to_metric_families(text):
        name = family.name
        if not name.startswith(prefix):
            continue
        if ":" in name:
            problems.append(f"{name}: colons are reserved for recording rules")
        if not SNAKE.match(name):
            problems.append(f"{name}: not snake_case")
        if any(name.endswith(u) or u + "_" in name for u in FORBIDDEN_UNITS):
            problems.append(f"{name}: use base units (bytes, seconds, ratios)")
        for sample in family.samples:
            exported = sample.name
            for label in sample.labels:
                if not SNAKE.match(label):
                    problems.append(f"{exported}: label {label!r} is not snake_case")
            if exported.endswith("_total") and family.type != "counter":
                problems.append(f"{exported}: _total on a {family.type}")
            if family.type == "counter" and not exported.endswith(("_total", "_created")):
                problems.append(f"{exported}: counter without _total")
            if exported.endswith("_info") and (family.type != "gauge" or sample.value != 1.0):
                problems.append(f"{exported}: _info must be a gauge equal to 1 (got {family.type} {sample.value})")
    return sorted(set(problems))
