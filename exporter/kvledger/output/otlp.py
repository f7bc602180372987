"""Optional OTLP push (opentelemetry-sdk): the same Accounts, the same catalogue.

Each catalogue family becomes an observable instrument whose callback reads the latest
Accounts; the SDK's periodic reader pushes them over OTLP/HTTP. Gauges stay gauges,
counters become cumulative monotonic sums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from kvledger import __version__
from kvledger.domain.accounts import Accounts
from kvledger.output.catalog import CATALOG, MetricSpec

UNITS = {"bytes": "By", "seconds": "s", "tokens": "{token}", "blocks": "{block}", "requests": "{request}", "": "1"}


class OtlpOutput:
    def __init__(self, endpoint: str, latest: Callable[[], Accounts | None], interval_seconds: float = 10.0) -> None:
        if not endpoint.rstrip("/").endswith("/v1/metrics"):
            endpoint = endpoint.rstrip("/") + "/v1/metrics"
        self._latest = latest
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=endpoint, timeout=5), export_interval_millis=interval_seconds * 1000
        )
        self.provider = MeterProvider(
            metric_readers=[reader],
            resource=Resource.create({"service.name": "kvledger", "service.version": __version__}),
        )
        meter = self.provider.get_meter("kvledger", __version__)
        for spec in CATALOG:
            create = meter.create_observable_counter if spec.type == "counter" else meter.create_observable_gauge
            create(spec.name, callbacks=[self._callback(spec)], unit=UNITS.get(spec.unit, "1"), description=spec.help)

    def _callback(self, spec: MetricSpec) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            accounts = self._latest()
            if accounts is None:
                return []
            return [Observation(value, labels) for labels, value in spec.labelled(accounts)]

        return observe

    def flush(self) -> None:
        self.provider.force_flush()

    def stop(self) -> None:
        self.provider.shutdown()
