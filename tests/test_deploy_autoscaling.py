"""deploy/kubernetes/autoscaling: the KEDA ScaledObject and the HPA through prometheus-adapter
read the saturation of the binding constraint, and every piece is wired to the others.

The schemas: KEDA's CRD (tests/test_deploy_kubernetes.py validates the ScaledObject, the HPA
and the ConfigMap like every manifest), prometheus-adapter's configuration format
(deploy/kubernetes/schemas/prometheus-adapter-config.json) for the rules in the ConfigMap,
and the keys KEDA's prometheus scaler documents for the trigger's metadata. What the queries
return on a live Prometheus is tests/test_autoscaling_e2e.py's.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import promql_parser as pp
import pytest
import yaml
from autoscaling_queries import (
    adapter_config,
    adapter_query,
    adapter_rule,
    hpa,
    hpa_external_metric,
    hpa_threshold,
    keda_query,
    keda_threshold,
    keda_trigger,
    scaled_object,
)

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from alerts import lint  # noqa: E402
from monitoring import config as mon  # noqa: E402

#: the prometheus scaler's metadata keys as KEDA documents them (keda.sh/docs/2.16/scalers/prometheus)
KEDA_PROMETHEUS_KEYS = {
    "serverAddress", "query", "queryParameters", "threshold", "activationThreshold", "namespace",
    "customHeaders", "ignoreNullValues", "unsafeSsl", "timeout", "authModes",
}
KEDA_REQUIRED = {"serverAddress", "query", "threshold"}
#: the metric types of a ScaledObject trigger (the HPA's target types KEDA maps them to)
KEDA_METRIC_TYPES = {"AverageValue", "Value", "Utilization"}


def adapter_errors(config: dict[str, Any]) -> list[str]:
    schema = json.loads((K8S / "schemas" / "prometheus-adapter-config.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(config)]


def sidecar_engine() -> str:
    (cm,) = [d for d in yaml.safe_load_all((K8S / "sidecar" / "configmap.yaml").read_text())]
    (engine,) = yaml.safe_load(cm["data"]["kvledger.yml"])["engines"]
    return str(engine["name"])


def sidecar_deployment() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((K8S / "sidecar" / "vllm-deployment.yaml").read_text())
    return doc


# ---------------------------------------------------------------- formats

def test_the_adapter_rules_are_its_configuration_format() -> None:
    assert adapter_errors(adapter_config()) == []


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c["externalRules"][0].update(metricQuery="x"), "'metricQuery' was unexpected"),
        (lambda c: c["externalRules"][0].pop("seriesQuery"), "'seriesQuery' is a required property"),
        (lambda c: c["externalRules"][0]["resources"]["overrides"].update(namespace={"resourc": "namespace"}),
         "'resourc' was unexpected"),
        (lambda c: c.update(externalrules=[]), "'externalrules' was unexpected"),
    ],
    ids=["rule-typo", "rule-required", "override-typo", "top-typo"],
)
def test_the_adapter_format_catches_typos(mutate: Any, message: str) -> None:
    config = copy.deepcopy(adapter_config())
    mutate(config)
    assert any(message in e for e in adapter_errors(config)), adapter_errors(config)


def test_the_keda_trigger_uses_the_prometheus_scalers_keys() -> None:
    trigger = keda_trigger()
    metadata = trigger["metadata"]
    assert KEDA_REQUIRED <= set(metadata) <= KEDA_PROMETHEUS_KEYS
    assert all(isinstance(v, str) for v in metadata.values())  # the CRD's metadata is a map of strings
    assert trigger["metricType"] in KEDA_METRIC_TYPES
    float(metadata["threshold"]), float(metadata["activationThreshold"])


# ---------------------------------------------------------------- the queries

def _names(query: str) -> set[str]:
    return {name for name, _ in lint.selectors(pp.parse(query)) if name is not None}


def test_both_queries_read_the_deployment_saturation_record() -> None:
    for query in (keda_query(), adapter_query("default")):
        assert _names(query) == {mon.DEPLOYMENT_SATURATION.record}, query
    # the adapter discovers the same series its name mapping serves
    rule = adapter_rule(hpa_external_metric()["metric"]["name"])
    assert _names(rule["seriesQuery"]) == {mon.DEPLOYMENT_SATURATION.record}


def test_each_query_selects_one_deployment_by_its_labels() -> None:
    keda = pp.parse(keda_query())
    assert isinstance(keda, pp.AggregateExpr)  # KEDA needs one element: the query aggregates to it
    (selector,) = [keda.expr]
    assert isinstance(selector, pp.VectorSelector)
    matched = {m.name for m in selector.matchers.matchers if m.op == pp.MatchOp.Equal}
    assert set(mon.DEPLOYMENT_LABELS) <= matched
    adapter = pp.parse(adapter_query("default"))
    assert isinstance(adapter, pp.AggregateExpr) and isinstance(adapter.expr, pp.VectorSelector)
    assert {m.name for m in adapter.expr.matchers.matchers} >= {"namespace", "engine"}


def test_the_examples_scale_the_sidecar_deployment_of_the_named_engine_at_one_threshold() -> None:
    deployment = sidecar_deployment()
    assert scaled_object()["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    target = hpa()["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", deployment["metadata"]["name"])
    engine = sidecar_engine()
    assert f'engine="{engine}"' in keda_query()
    assert hpa_external_metric()["metric"]["selector"]["matchLabels"] == {"engine": engine}
    assert keda_threshold() == hpa_threshold() == 0.8
    # both scale by the utilization rule (replicas x value / threshold), not per pod
    assert keda_trigger()["metricType"] == "Value" and hpa_external_metric()["target"]["type"] == "Value"
