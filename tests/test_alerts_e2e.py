"""End to end: a real Prometheus evaluates the project's rules against a scrape target
whose fault is switched on and off; a real Alertmanager, configured with the project's
deploy/alertmanager/alertmanager.yml (receivers pointed at a webhook in this test, waits
shortened), routes the alerts by severity and sends the resolution.

The rules are the generator's test variant (every ``for`` is 0s) so the test needs no
long waits; thresholds and expressions are the production ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from alerts_support import ROOT, load

from harness.alertmanager import start_alertmanager
from harness.prometheus import start_prometheus
from harness.targets import DemoTarget, FakeKvledgerExporter, Target
from harness.webhook import Payload, WebhookReceiver

pytestmark = pytest.mark.e2e

AM_CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
RUNBOOK = "https://github.com/kvledger/kvledger/blob/main/docs/runbooks.md#"
TIMEOUT = 30.0

TARGET_KINDS = ["fake", "demo"]


def am_config_for_test(hook_url: str) -> dict[str, Any]:
    """The project's Alertmanager config, receivers pointed at the test webhook
    (``/pager`` and ``/ticket``), every wait shortened to a second."""
    cfg = yaml.safe_load(AM_CONFIG.read_text())
    for receiver in cfg["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{hook_url}/{receiver['name']}"

    def shorten(route: dict[str, Any]) -> None:
        route.update(group_wait="1s", group_interval="1s", repeat_interval="1h")
        for child in route.get("routes", []):
            shorten(child)

    shorten(cfg["route"])
    return cfg


def find_alert(payload: Payload, alertname: str, status: str) -> dict[str, Any] | None:
    for alert in payload.get("alerts", []):
        if alert["labels"].get("alertname") == alertname and alert["status"] == status:
            return alert
    return None


@pytest.fixture
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    t: Target = FakeKvledgerExporter() if request.param == "fake" else DemoTarget(tmp_path / "demo")
    try:
        yield t
    finally:
        t.stop()


@pytest.mark.parametrize("target", TARGET_KINDS, indirect=True)
def test_faults_page_and_ticket_then_resolve(target: Target, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(load("generate").render(for_override="0s"))

    with WebhookReceiver() as hook, \
            start_alertmanager(tmp_path / "am", am_config_for_test(hook.url.rsplit("/", 1)[0])) as am, \
            start_prometheus(tmp_path / "prom", targets=[target.address], rule_files=[rules],
                             alertmanagers=[am.address]) as prom:
        prom.wait_for_target_up(timeout=TIMEOUT)
        # healthy: nothing of ours fires
        assert prom.query_value('count(kvledger_policy_info{admission="reserve-cap"})') is not None
        assert not [a for a in prom.alerts() if a["labels"]["alertname"] in
                    ("KVLedgerQuotaExceedsCapacity", "KVLedgerPrefixCountingInconsistent")]

        # fault 1: a reserve-cap engine admits beyond capacity -> page
        target.set_fault("reserve-overcommit")
        page = hook.wait_for(lambda p: p["_path"] == "/pager" and
                             find_alert(p, "KVLedgerQuotaExceedsCapacity", "firing") is not None, TIMEOUT)
        alert = find_alert(page, "KVLedgerQuotaExceedsCapacity", "firing")
        assert alert is not None
        assert page["receiver"] == "pager"
        assert alert["labels"]["severity"] == "critical"
        assert alert["labels"]["basis"] == "exact"
        assert alert["labels"]["admission"] == "reserve-cap"
        assert alert["labels"]["job"] == "kvledger" and alert["labels"]["instance"] == target.address
        assert alert["annotations"]["summary"] == \
            "A reserve-cap engine has admitted more exact KV reservations than its pool can hold."
        assert alert["annotations"]["runbook_url"] == RUNBOOK + "kvledgerquotaexceedscapacity"
        assert f"Engine {alert['labels']['engine']} pool {alert['labels']['pool']}" in \
            alert["annotations"]["description"]

        # the fault stops -> the resolution arrives at the same receiver
        target.set_fault(None)
        hook.wait_for(lambda p: p["_path"] == "/pager" and p["status"] == "resolved" and
                      find_alert(p, "KVLedgerQuotaExceedsCapacity", "resolved") is not None, TIMEOUT)

        # fault 2: the engine's used-block claim equals per-request references -> ticket
        target.set_fault("per-request-used")
        ticket = hook.wait_for(lambda p: p["_path"] == "/ticket" and
                               find_alert(p, "KVLedgerPrefixCountingInconsistent", "firing") is not None,
                               TIMEOUT)
        alert = find_alert(ticket, "KVLedgerPrefixCountingInconsistent", "firing")
        assert alert is not None
        assert ticket["receiver"] == "ticket"
        assert alert["labels"]["severity"] == "warning"
        assert alert["labels"]["check"] == "engine_claim"
        assert alert["annotations"]["runbook_url"] == RUNBOOK + "kvledgerprefixcountinginconsistent"
        assert "used blocks more than the unique in-use blocks" in alert["annotations"]["description"]
        # a critical alert never went to the ticket receiver, nor a warning to the pager
        for p in hook.payloads():
            for a in p.get("alerts", []):
                assert (p["_path"] == "/pager") == (a["labels"].get("severity") == "critical"), p

        target.set_fault(None)
        hook.wait_for(lambda p: p["_path"] == "/ticket" and
                      find_alert(p, "KVLedgerPrefixCountingInconsistent", "resolved") is not None, TIMEOUT)
        assert am.alerts() is not None
