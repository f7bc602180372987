"""The autoscaling queries exactly as the shipped manifests hold them (deploy/kubernetes/autoscaling):
KEDA's ScaledObject trigger query as written, and prometheus-adapter's external rule with its
metricsQuery template expanded the way the adapter expands it for an HPA's metric (Go
text/template with ``<<`` ``>>`` delimiters over ``.Series``, ``.LabelMatchers`` and
``.GroupBy``). Any other template action is refused, so a query is never evaluated in a
form the files do not hold."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
AUTOSCALING = ROOT / "deploy" / "kubernetes" / "autoscaling"


def _doc(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((AUTOSCALING / name).read_text())
    return doc


def scaled_object() -> dict[str, Any]:
    return _doc("keda-scaledobject.yaml")


def keda_trigger() -> dict[str, Any]:
    (trigger,) = scaled_object()["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    return dict(trigger)


def hpa() -> dict[str, Any]:
    return _doc("hpa.yaml")


def adapter_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(_doc("prometheus-adapter-config.yaml")["data"]["config.yaml"])
    return config


def hpa_external_metric() -> dict[str, Any]:
    (metric,) = hpa()["spec"]["metrics"]
    assert metric["type"] == "External"
    return dict(metric["external"])


_ACTION = re.compile(r"<<\s*(.*?)\s*>>")
_FIELDS = ("Series", "LabelMatchers", "GroupBy")


def expand(template: str, series: str, matchers: dict[str, str], group_by: tuple[str, ...] = ()) -> str:
    """The adapter's expansion of a metricsQuery: ``.Series`` the series name, ``.LabelMatchers``
    the matchers joined by commas (``name="value"``), ``.GroupBy`` the labels joined by commas."""
    values = {
        "Series": series,
        "LabelMatchers": ",".join(f'{k}="{v}"' for k, v in matchers.items()),
        "GroupBy": ",".join(group_by),
    }

    def field(m: re.Match[str]) -> str:
        action = m.group(1)
        if not action.startswith(".") or action[1:] not in _FIELDS:
            raise ValueError(f"template action {m.group(0)!r} is not one this expansion knows")
        return values[action[1:]]

    return _ACTION.sub(field, template)


def adapter_rule(metric: str) -> dict[str, Any]:
    """The external rule that serves ``metric`` (its ``name.as``)."""
    (rule,) = [r for r in adapter_config()["externalRules"] if r["name"]["as"] == metric]
    return dict(rule)


def adapter_query(namespace: str) -> str:
    """The PromQL the adapter runs for the HPA's external metric (hpa.yaml) in ``namespace``:
    the rule's series (``name.matches`` without its anchors), the namespace the rule's
    resources map plus the HPA's selector as label matchers."""
    external = hpa_external_metric()
    rule = adapter_rule(external["metric"]["name"])
    series = rule["name"]["matches"].removeprefix("^").removesuffix("$")
    overrides = rule["resources"]["overrides"]
    matchers = {label: namespace for label, target in overrides.items() if target["resource"] == "namespace"}
    matchers.update(external["metric"]["selector"]["matchLabels"])
    return expand(rule["metricsQuery"], series, matchers)


def keda_query() -> str:
    return str(keda_trigger()["metadata"]["query"])


def keda_threshold() -> float:
    return float(keda_trigger()["metadata"]["threshold"])


def hpa_threshold() -> float:
    """The HPA's target value (a Kubernetes quantity: ``800m`` is 0.8)."""
    value = str(hpa_external_metric()["target"]["value"])
    return int(value[:-1]) / 1000 if value.endswith("m") else float(value)
