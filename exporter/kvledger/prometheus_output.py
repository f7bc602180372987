"""The Prometheus custom collector: metric families built from the latest Accounts at
each scrape, straight from the catalogue (no global gauges are mutated)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.process_collector import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvledger.catalog import CATALOG, MetricSpec
from kvledger.policy import Accounts


def build_family(spec: MetricSpec, accounts: Accounts | None) -> Metric:
    family: GaugeMetricFamily | CounterMetricFamily
    if spec.type == "counter":
        family = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
    else:
        family = GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
    if accounts is not None:
        for labels, value in spec.samples(accounts):
            family.add_metric(labels, value)
    return family


class AccountsCollector(Collector):
    """Reads the latest Accounts through ``latest`` (never waits on an engine)."""

    def __init__(self, latest: Callable[[], Accounts | None]) -> None:
        self._latest = latest

    def collect(self) -> Iterator[Metric]:
        accounts = self._latest()
        for spec in CATALOG:
            yield build_family(spec, accounts)


def make_registry(latest: Callable[[], Accounts | None], process_metrics: bool = True) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AccountsCollector(latest))
    if process_metrics:
        ProcessCollector(registry=registry)
    return registry
