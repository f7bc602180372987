"""deploy/kubernetes: every manifest validated against a schema, the generated ones equal
to their sources, the kvledger configurations in the ConfigMaps loadable, and the pieces
wired to each other (labels, ports, the sidecar's socket).

What is checked, and against what:
- Kubernetes' own resources (DaemonSet, Deployment, Service, ConfigMap): the JSON schemas
  of Kubernetes 1.29 and 1.37 from the kubernetes-validate wheel, strict (a field the API
  does not know is an error, as `kubectl apply --validate=strict` makes it);
- ServiceMonitor and PrometheusRule: the vendored schemas in deploy/kubernetes/schemas
  (prometheus-operator v0.80.1's CRDs as modelled by cloudcoil-models-prometheus-operator
  0.80.1.0; see vendor.py), made strict the same way; KEDA's ScaledObject likewise (KEDA
  v2.16.1's CRD as modelled by cloudcoil-models-keda 2.16.1.0), and its prometheus trigger's
  metadata against the keys KEDA's prometheus scaler documents;
- prometheus-adapter's rules (a ConfigMap's config.yaml): deploy/kubernetes/schemas/
  prometheus-adapter-config.json, the adapter's configuration format (strict, as it reads it);
- not checked: admission by a real API server, the operator's own validating webhook (it
  also parses the PromQL: promtool does that here, tests/test_alert_rules.py), that the
  images exist, and anything a running cluster decides (scheduling, NVML in the pod).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvledger import __version__
from kvledger.config.engine_kinds import kind_specific_keys
from kvledger.config.loader import config_from_mapping

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
VERSIONS = ("1.29.0", "1.37.0")
SIDECAR_SOCKET = "/run/kvledger/vllm.sock"


@cache
def manifests() -> list[tuple[str, dict[str, Any]]]:
    """Every document under deploy/kubernetes (parsed once: tests copy before changing one)."""
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out.append((str(path.relative_to(K8S)), doc))
    return out


def find(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for _, d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _strict(node: Any) -> Any:
    """additionalProperties: false on every object schema that lists its properties."""
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)
    return node


#: the API groups of the custom resources and the suffix of their vendored schemas
CRD_GROUPS = {"monitoring.coreos.com/v1": "monitoring-v1", "keda.sh/v1alpha1": "keda-v1alpha1"}


@cache
def crd_validator(kind: str, api_version: str = "monitoring.coreos.com/v1") -> jsonschema.Draft202012Validator:
    schema = json.loads((K8S / "schemas" / f"{kind.lower()}-{CRD_GROUPS[api_version]}.json").read_text())
    return jsonschema.Draft202012Validator(_strict(schema))


def _leaves(error: jsonschema.ValidationError) -> list[jsonschema.ValidationError]:
    """The innermost errors (an anyOf of "a list or null" fails as a whole; say why the list failed)."""
    if not error.context:
        return [error]
    return [leaf for sub in error.context for leaf in _leaves(sub) if sub.validator != "type" or "null" not in str(sub.validator_value)]


def crd_errors(doc: dict[str, Any]) -> list[str]:
    api_version = doc.get("apiVersion", "")
    if api_version not in CRD_GROUPS:
        return [f"apiVersion: {api_version!r}"]
    return [f"{'.'.join(map(str, leaf.absolute_path))}: {leaf.message}"
            for e in crd_validator(doc["kind"], api_version).iter_errors(doc) for leaf in _leaves(e)]


def k8s_errors(doc: dict[str, Any], version: str) -> list[str]:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.path))}: {exc.message}"]
    return []


EXPECTED = {
    ("DaemonSet", "kvledger"), ("ConfigMap", "kvledger-config"), ("Service", "kvledger"),
    ("ServiceMonitor", "kvledger"), ("PrometheusRule", "kvledger"), ("ConfigMap", "kvledger-dashboards"),
    ("Deployment", "vllm"), ("ConfigMap", "kvledger-sidecar-config"), ("Service", "vllm-kvledger"),
    ("ScaledObject", "vllm"), ("ConfigMap", "prometheus-adapter-kvledger"), ("HorizontalPodAutoscaler", "vllm"),
}


def test_the_manifests_are_the_documented_set() -> None:
    found = {(d["kind"], d["metadata"]["name"]) for _, d in manifests()}
    assert found == EXPECTED  # no RBAC: kvledger never calls the Kubernetes API


@pytest.mark.parametrize(("path", "doc"), manifests(), ids=[f"{p}:{d['kind']}" for p, d in manifests()])
def test_manifest_is_valid(path: str, doc: dict[str, Any]) -> None:
    if doc["apiVersion"] in CRD_GROUPS:
        assert crd_errors(doc) == []
    else:
        for version in VERSIONS:
            assert k8s_errors(doc, version) == [], version
    assert "namespace" not in doc["metadata"]  # `kubectl apply -n NAMESPACE` decides


@pytest.mark.parametrize(
    ("kind", "name", "mutate", "message"),
    [
        ("DaemonSet", "kvledger", lambda d: d["spec"]["template"]["spec"].update(hostPid=True), "'hostPid' was unexpected"),
        ("DaemonSet", "kvledger", lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(readOnlyRootFS=True),
         "'readOnlyRootFS' was unexpected"),
        ("Service", "kvledger", lambda d: d["spec"]["ports"][0].update(port="9477"), "'9477' is not of type 'integer'"),
        ("ServiceMonitor", "kvledger", lambda d: d["spec"]["endpoints"][0].update(intervall="15s"), "'intervall' was unexpected"),
        ("ServiceMonitor", "kvledger", lambda d: d["spec"]["endpoints"][0].update(interval="15 s"), "'15 s' does not match"),
        ("PrometheusRule", "kvledger", lambda d: d["spec"]["groups"][0]["rules"][0].update(recrod="x"), "'recrod' was unexpected"),
        ("PrometheusRule", "kvledger", lambda d: d["spec"]["groups"][2]["rules"][0].update({"for": "2 minutes"}), "does not match"),
        ("ScaledObject", "vllm", lambda d: d["spec"].update(maxReplicas=8), "'maxReplicas' was unexpected"),
        ("ScaledObject", "vllm", lambda d: d["spec"]["triggers"][0].update(metricsType="Value"), "'metricsType' was unexpected"),
        ("ScaledObject", "vllm", lambda d: d["spec"].update(minReplicaCount="1"), "'1' is not of type 'integer'"),
        ("HorizontalPodAutoscaler", "vllm", lambda d: d["spec"]["metrics"][0]["external"]["target"].update(averageVal="1"),
         "'averageVal' was unexpected"),
    ],
    ids=["ds-typo", "ds-nested-typo", "svc-type", "sm-typo", "sm-duration", "rule-typo", "rule-duration",
         "so-typo", "so-trigger-typo", "so-replicas-type", "hpa-typo"],
)
def test_the_checks_catch_typos_and_bad_values(kind: str, name: str, mutate: Any, message: str) -> None:
    doc = copy.deepcopy(find(kind, name))
    mutate(doc)
    errors = crd_errors(doc) if kind in ("ServiceMonitor", "PrometheusRule", "ScaledObject") else k8s_errors(doc, VERSIONS[-1])
    assert any(message in e for e in errors), errors


# ---------------------------------------------------------------- generated manifests

def test_generated_manifests_are_fresh() -> None:
    proc = subprocess.run([sys.executable, str(K8S / "generate.py"), "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_generate_check_detects_a_stale_file(tmp_path: Path) -> None:
    for name in ("prometheusrule.yaml", "dashboards-configmap.yaml"):
        (tmp_path / name).write_text((K8S / name).read_text())
    stale = tmp_path / "prometheusrule.yaml"
    stale.write_text(stale.read_text().replace("severity: critical", "severity: page", 1))
    proc = subprocess.run([sys.executable, str(K8S / "generate.py"), "--check", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "-        severity: page" in proc.stdout and "make kubernetes" in proc.stderr


def test_prometheus_rule_equals_the_rule_file() -> None:
    rules = yaml.safe_load((ROOT / "alerts" / "kvledger.rules.yml").read_text())
    assert find("PrometheusRule", "kvledger")["spec"] == {"groups": rules["groups"]}


def test_dashboards_configmap_holds_the_dashboards_byte_for_byte() -> None:
    cm = find("ConfigMap", "kvledger-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {p.name: p.read_text() for p in (ROOT / "dashboards" / "json").glob("*.json")}
    assert cm["data"] == files
    # what client-side `kubectl apply` would store in its last-applied annotation (256 KiB at most)
    assert len(json.dumps(cm, separators=(",", ":"))) < 256 * 1024


# ---------------------------------------------------------------- the configurations in ConfigMaps

def kvledger_config(configmap: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(find("ConfigMap", configmap)["data"]["kvledger.yml"])
    return data


def test_daemonset_config_loads() -> None:
    config = config_from_mapping(kvledger_config("kvledger-config"), "kvledger-config")
    assert config.engines and not config.warnings and config.listen == "0.0.0.0:9477"


def test_sidecar_config_loads() -> None:
    """The in-engine ledger option (``ledger:``) arrives with the vLLM plugin (issue 11):
    until this tree has it, the rest of the file is loaded without it."""
    data = kvledger_config("kvledger-sidecar-config")
    (engine,) = data["engines"]
    assert engine["kind"] == "vllm" and engine["url"] == "http://localhost:8000/metrics"
    assert engine["ledger"] == f"unix://{SIDECAR_SOCKET}"
    if "ledger" not in kind_specific_keys():
        engine = dict(engine)
        del engine["ledger"]
        data = {**data, "engines": [engine]}
    config = config_from_mapping(data, "kvledger-sidecar-config")
    assert config.engines and not config.warnings


# ---------------------------------------------------------------- wiring

def containers(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["spec"]["template"]["spec"]["containers"]}


def test_sidecar_shares_the_ledger_socket_through_an_emptydir() -> None:
    deployment = find("Deployment", "vllm")
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    cs = containers(deployment)
    vllm, kvledger = cs["vllm"], cs["kvledger"]
    assert {"name": "KVLEDGER_VLLM_LEDGER", "value": f"unix://{SIDECAR_SOCKET}"} in vllm["env"]
    socket_dir = str(Path(SIDECAR_SOCKET).parent)
    shared = [m["name"] for m in vllm["volumeMounts"] if m["mountPath"] == socket_dir]
    assert shared and [m["name"] for m in kvledger["volumeMounts"] if m["mountPath"] == socket_dir] == shared
    assert volumes[shared[0]] == {"name": shared[0], "emptyDir": {}}
    config_mount = next(m for m in kvledger["volumeMounts"] if m["mountPath"] == "/etc/kvledger")
    assert volumes[config_mount["name"]]["configMap"]["name"] == "kvledger-sidecar-config"
    assert "pip install ./engine" in (K8S / "sidecar" / "vllm-deployment.yaml").read_text()
    # the socket's group is one both containers share
    assert pod["securityContext"]["fsGroup"] == kvledger["securityContext"]["runAsGroup"]


def test_servicemonitor_scrapes_both_services_as_job_kvledger() -> None:
    monitor = find("ServiceMonitor", "kvledger")["spec"]
    selector = monitor["selector"]["matchLabels"]
    (endpoint,) = monitor["endpoints"]
    for name, workload in (("kvledger", find("DaemonSet", "kvledger")), ("vllm-kvledger", find("Deployment", "vllm"))):
        service = find("Service", name)
        assert selector.items() <= service["metadata"]["labels"].items()
        assert service["metadata"]["labels"][monitor["jobLabel"]] == "kvledger"  # the alerts select job=~"kvledger.*"
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        named = {p["name"]: p["containerPort"] for c in containers(workload).values() for p in c.get("ports", [])}
        assert named[port["targetPort"]] == port["port"] == 9477


def test_daemonset_sees_the_host() -> None:
    ds = find("DaemonSet", "kvledger")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    text = (K8S / "daemonset.yaml").read_text()
    assert "hostPID lets NVML's host PIDs match" in text and "hostNetwork lets /proc/net/tcp" in text
    config_mount = containers(ds)["kvledger"]["volumeMounts"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[config_mount["name"]]["configMap"]["name"] == "kvledger-config"


def test_images_and_users_match_the_dockerfile_and_the_package() -> None:
    version = __version__  # written once: engine/kvledger_engine/__init__.py; the image tags follow it
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "USER 65532:65532" in dockerfile
    for kind, name in (("DaemonSet", "kvledger"), ("Deployment", "vllm")):
        doc = find(kind, name)
        kvledger = containers(doc)["kvledger"]
        assert kvledger["image"] == f"kvledger:{version}"
        assert kvledger["args"] == ["serve", "--config", "/etc/kvledger/kvledger.yml"]
        context = {**doc["spec"]["template"]["spec"].get("securityContext", {}), **kvledger["securityContext"]}
        assert context["runAsNonRoot"] is True and context["runAsUser"] == 65532
        assert kvledger["securityContext"]["readOnlyRootFilesystem"] is True
        probes = {kvledger["livenessProbe"]["httpGet"]["path"], kvledger["readinessProbe"]["httpGet"]["path"]}
        assert probes == {"/-/healthy", "/-/ready"}
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "compose.yaml").read_text())
    assert compose["x-kvledger-image"]["image"] == f"kvledger:{version}"
