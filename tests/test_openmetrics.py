"""OpenMetrics on /metrics (issue 22, point 2): served when the scraper asks for it, chosen
as prometheus_client chooses, rendered from memory like the text format (once per Accounts
and format), read by prometheus_client's OpenMetrics parser and by Prometheus' own (promtool),
and scraped by a real Prometheus, which asks for OpenMetrics first.

``promtool check metrics`` (Prometheus 2.42, Debian's) reads only the text format: it lints
the text rendering (tests/test_exposition.py), and here the OpenMetrics body is read by
``promtool tsdb create-blocks-from openmetrics``, which parses it with the OpenMetrics
parser Prometheus scrapes with (that command wants a timestamp on every sample: the test
adds one, nothing else)."""

from __future__ import annotations

import gzip
import http.client
import math
import subprocess
import time
from pathlib import Path

import pytest
from accounting_support import accounts_of
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from test_exposition import rich_snapshot
from test_metrics_from_memory import _collector, engine, serving  # noqa: F401  (the fixture)

from harness.process import require_binary
from harness.prometheus import start_prometheus
from kvledger.output.catalog import CATALOG, MetricSpec
from kvledger.output.prometheus import (
    OPENMETRICS,
    OPENMETRICS_CONTENT_TYPE,
    TEXT,
    TEXT_CONTENT_TYPE,
    _openmetrics_header,
    negotiate,
    process_registry,
    render_openmetrics,
    render_text,
)
from kvledger.web.connection import Request
from kvledger.web.endpoints import Endpoints

PROMETHEUS_2 = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
PROMETHEUS_3 = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
                "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
                "text/plain;version=0.0.4;q=0.3,*/*;q=0.2")
#: what Prometheus 2.x is answered (it names the version: the answer names the escaping too)
OM_VERSIONED = f"{OPENMETRICS_CONTENT_TYPE}; escaping=underscores"
ACCEPTS = [
    "", "*/*", "text/plain", "text/plain; version=0.0.4", "text/plain;version=1.0.0", "text/plain;version=1.0.0;escaping=dots",
    "application/openmetrics-text", "application/openmetrics-text; version=1.0.0",
    "application/openmetrics-text;version=0.0.1", "application/openmetrics-text;version=1", "application/openmetrics-text;version=2.0.0",
    "application/openmetrics-text;version=1.0.0;escaping=bogus", "application/json, application/openmetrics-text",
    "text/html,application/xhtml+xml", PROMETHEUS_2, PROMETHEUS_3,
]


@pytest.mark.parametrize("accept", ACCEPTS)
def test_the_format_is_chosen_as_prometheus_client_chooses_it(accept: str) -> None:
    fmt, content_type = negotiate(accept)
    _, expected = choose_encoder(accept)
    assert content_type == expected
    assert fmt == (OPENMETRICS if expected.startswith("application/openmetrics-text") else TEXT)


def test_prometheus_gets_openmetrics_and_a_browser_the_text_format() -> None:
    assert negotiate(PROMETHEUS_2) == (OPENMETRICS, OM_VERSIONED)
    assert negotiate("application/openmetrics-text") == (OPENMETRICS, OPENMETRICS_CONTENT_TYPE)
    assert negotiate("text/html,application/xhtml+xml,*/*;q=0.8") == (TEXT, TEXT_CONTENT_TYPE)


def _samples(families: object) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    return sorted((s.name, tuple(sorted(s.labels.items())), s.value) for f in families for s in f.samples)  # type: ignore[attr-defined]


def test_openmetrics_carries_the_text_formats_samples_under_openmetrics_headers() -> None:
    accounts = accounts_of(rich_snapshot())
    body = render_openmetrics(accounts, process_registry()).decode()
    assert body.endswith("\n# EOF\n") and body.count("# EOF") == 1
    families = list(parse_openmetrics(body))  # strict: EOF, UNIT suffixes, counter samples named _total
    text = render_text(accounts, process_registry()).decode()
    om, txt = _samples(families), _samples(parse_text(text))
    # the same samples; the process figures (CPU, RSS) move between the two renders
    assert [s for s in om if not s[0].startswith("process_")] == [s for s in txt if not s[0].startswith("process_")]
    assert {s[0] for s in om if s[0].startswith("process_")} == {s[0] for s in txt if s[0].startswith("process_")}
    by_name = {f.name: f for f in families}
    for spec in CATALOG:
        family = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
        assert f"# TYPE {family} {spec.type}\n" in body
        if family in by_name:
            assert by_name[family].type == spec.type and by_name[family].documentation == spec.help
            assert by_name[family].unit == (spec.unit if family.endswith(f"_{spec.unit}") and spec.unit else "")
    assert "# UNIT kvledger_kv_capacity_bytes bytes\n" in body and "# TYPE kvledger_preemptions counter\n" in body


def test_help_quotes_and_backslashes_are_escaped_as_openmetrics_wants() -> None:
    """OpenMetrics escapes double quotes in HELP too (the text format does not): a help
    such as 'kind="hard" \\ "estimate"' reads back whole."""
    spec = MetricSpec("kvledger_test_limit_bytes_total", "counter", "bytes", "host", ("engine",),
                      'Limit; kind="hard" or "estimate" \\ a backslash\nand a second line.', lambda a: [(("e",), 1.0)])
    header = _openmetrics_header(spec)
    assert header.splitlines()[0] == r'# HELP kvledger_test_limit_bytes Limit; kind=\"hard\" or \"estimate\" \\ a backslash\nand a second line.'
    (family,) = parse_openmetrics(header + "kvledger_test_limit_bytes_total{engine=\"e\"} 1.0\n# EOF\n")
    assert (family.name, family.type, family.unit, family.documentation) == ("kvledger_test_limit_bytes", "counter", "bytes", spec.help)


def test_prometheus_own_openmetrics_parser_reads_every_sample(tmp_path: Path) -> None:
    """promtool tsdb create-blocks-from openmetrics: Prometheus' OpenMetrics parser (the
    scrape's) over the whole body, headers and # EOF included."""
    accounts = accounts_of(rich_snapshot())
    body = render_openmetrics(accounts, process_registry()).decode()
    samples = [line for line in body.splitlines() if line and not line.startswith("#")]
    stamped = "\n".join(f"{line} 1700000000" if line and not line.startswith("#") else line for line in body.splitlines()) + "\n"
    source = tmp_path / "metrics.om"
    source.write_text(stamped)
    res = subprocess.run([require_binary("promtool"), "tsdb", "create-blocks-from", "openmetrics", str(source), str(tmp_path / "blocks")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    row = res.stdout.strip().splitlines()[-1].split()
    assert int(row[4]) == len(samples) == int(row[6]), res.stdout  # NUM SAMPLES, NUM SERIES


def test_both_formats_are_served_from_memory_once_per_accounts(engine) -> None:  # noqa: F811
    _, server = engine
    collector = _collector(server.url)
    accounts = collector.poll_once()
    endpoints = Endpoints(collector, None, json_view=False)

    def get(accept: str, gzip_ok: bool) -> tuple[bytes, dict[str, str]]:
        headers = {"accept": accept, **({"accept-encoding": "gzip"} if gzip_ok else {})}
        response = endpoints.respond(Request("GET", "/metrics", headers))
        assert response.status == 200
        return response.body, dict(response.headers)

    om, om_headers = get(PROMETHEUS_2, False)
    assert om == render_openmetrics(accounts) and om_headers["Content-Type"] == OM_VERSIONED
    assert om_headers["Vary"] == "Accept, Accept-Encoding"
    text, text_headers = get("", False)
    assert text == render_text(accounts) and text_headers["Content-Type"] == TEXT_CONTENT_TYPE
    zipped, zip_headers = get(PROMETHEUS_2, True)
    assert gzip.decompress(zipped) == om and zip_headers["Content-Encoding"] == "gzip"
    for _ in range(5):
        assert get(PROMETHEUS_2, False)[0] is om and get(PROMETHEUS_2, True)[0] is zipped and get("", False)[0] is text
    assert (endpoints.metrics.renders, endpoints.metrics.compressions) == (2, 1)
    fast = endpoints.from_memory(Request("GET", "/metrics", {"accept": PROMETHEUS_2, "accept-encoding": "gzip"}))
    assert fast is not None and fast.body is zipped and ("Content-Type", OM_VERSIONED) in fast.headers
    assert endpoints.from_memory(Request("GET", "/metrics", {"accept": "text/plain;version=1.0.0", "accept-encoding": "gzip"})) is None
    collector.poll_once()  # a new cycle: each format rendered again when asked
    assert get(PROMETHEUS_2, False)[0] is not om and endpoints.metrics.renders == 3


def _scrape(url: str, accept: str) -> tuple[dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/metrics", headers={"Accept": accept, "Accept-Encoding": "gzip"})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    assert resp.status == 200
    return {k.lower(): v for k, v in resp.getheaders()}, gzip.decompress(body)


@pytest.mark.e2e
def test_a_real_prometheus_scrapes_openmetrics(tmp_path: Path, engine) -> None:  # noqa: F811
    """Prometheus 2.x asks for OpenMetrics first and gets it: its metadata holds the units
    that only OpenMetrics carries, counters are stored under their _total samples, and
    the target reports no scrape error."""
    _, server = engine
    with serving(server.url) as (_, daemon):
        headers, body = _scrape(daemon.url, PROMETHEUS_2)
        assert headers["content-type"] == OM_VERSIONED and body.endswith(b"# EOF\n")
        host, port = daemon.server_address
        with start_prometheus(tmp_path, targets=[f"{host}:{port}"], scrape_interval="1s") as prom:
            (target,) = prom.wait_for_target_up()
            deadline = time.monotonic() + 30
            while prom.query_value('kvledger_requests{engine="eng",state="running"}') is None:
                assert time.monotonic() < deadline, "Prometheus never stored the ledger's series"
                time.sleep(0.2)
            assert daemon.endpoints is not None and daemon.endpoints.metrics.served_openmetrics >= 1
            assert prom.query_value('kvledger_kv_capacity_blocks{engine="eng"}') == 256
            metadata = prom.api("metadata")
            assert metadata["kvledger_kv_capacity_bytes"][0]["unit"] == "bytes"  # only OpenMetrics says it
            assert metadata["kvledger_kv_capacity_bytes"][0]["type"] == "gauge"
            errors = prom.query_value(f'sum(kvledger_source_errors_total{{instance="{host}:{port}"}}) or vector(0)')
            assert errors is not None and math.isfinite(errors)
            assert [t["lastError"] for t in prom.targets()] == [""]
            assert target["health"] == "up"
            scraped = prom.query_value(f'scrape_samples_scraped{{instance="{host}:{port}"}}')
            assert scraped is not None and scraped > 0
