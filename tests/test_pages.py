"""The pages' data and routes, without a browser (tests/test_pages_browser.py drives them in
Chromium): the ledger document carries exactly the /metrics samples of the same accounts,
tenants only with the JSON view; the lab document is run_lab's run; the routes, their
headers, the web config's basic auth over them, and the package's web files."""

from __future__ import annotations

import http.client
import json
import re
import tomllib
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml
from accounting_support import accounts_of
from prometheus_client.parser import text_string_to_metric_families
from test_exposition import rich_snapshot
from tls_support import bcrypt_hash

from kvledger.cli import main
from kvledger.collect.collector import Collector
from kvledger.collect.sources.base import Contribution, Source, SourceError
from kvledger.domain.accounts import Accounts
from kvledger.domain.facts import EngineFacts, PoolFacts, Snapshot
from kvledger.output.prometheus import render_text
from kvledger.tools.lab import MAX_REQUESTS, run_lab
from kvledger.web.pages import ACCOUNTS_HEADER, LabRequestError, lab_page_data, ledger_page_data
from kvledger.web.server import KvledgerHTTPServer, basic_auth_header

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "exporter" / "kvledger" / "web" / "static"

Samples = dict[str, list[tuple[dict[str, str], float]]]


def metrics_samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def by_basis(samples: Samples, name: str, **labels: str) -> dict[str, float]:
    """{basis: value} of one series group of ``name``, as the ledger document writes it."""
    return {lab["basis"]: v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())}


def rich_accounts() -> Accounts:
    accounts = accounts_of(rich_snapshot())
    accounts.taken_at = 1_700_000_000.25
    return accounts


# ---------------------------------------------------------------- the ledger document


QUANTITIES = {"in_use": "kvledger_kv_in_use_bytes", "reclaimable": "kvledger_kv_reclaimable_bytes",
              "free": "kvledger_kv_free_bytes", "allocated": "kvledger_kv_allocated_bytes",
              "reserved": "kvledger_kv_reserved_bytes"}


def test_every_number_of_the_ledger_document_is_a_metrics_sample() -> None:
    accounts = rich_accounts()
    doc = ledger_page_data(accounts, json_view=False)
    samples = metrics_samples(render_text(accounts).decode())
    assert doc["taken_at"] == accounts.taken_at and doc["sharing"] == "per-request"
    pools = {(e["engine"], p["pool"]): p for e in doc["engines"] for p in e["pools"]}
    assert set(pools) == {(lab["engine"], lab["pool"]) for lab, _ in samples["kvledger_kv_capacity_bytes"]}
    for (engine, pool_id), pool in pools.items():
        ep = {"engine": engine, "pool": pool_id}
        assert pool["unit"] == "bytes"
        assert [pool["capacity"]] == [v for lab, v in samples["kvledger_kv_capacity_bytes"] if lab == ep]
        for quantity, family in QUANTITIES.items():
            assert pool.get(quantity) == (by_basis(samples, family, **ep) or None), (engine, quantity)
        for kind in ("quota", "physical"):
            expected = by_basis(samples, "kvledger_kv_headroom_bytes", **ep, view=kind) or None
            assert pool.get(f"{kind}_headroom") == expected, (engine, kind)
    # the shapes the page must draw differently: exact, bounds, an upper bound alone, nothing physical
    assert pools[("sim", "0")]["in_use"] == {"exact": 2000.0}
    assert set(pools[("vllm", "0")]["reclaimable"]) == {"lower_bound", "upper_bound"}
    assert set(pools[("trt", "0")]["free"]) == {"upper_bound"}
    assert "in_use" not in pools[("tgi", "0")] and pools[("tgi", "0")]["reserved"] == {"exact": 150 * 2048.0}
    engines = {e["engine"]: e for e in doc["engines"]}
    policy = {lab["engine"]: lab for lab, _ in samples["kvledger_policy_info"]}
    for name, engine in engines.items():
        assert engine["policy"] == {k: policy[name][k] for k in ("sharing", "admission", "overflow", "tenant_rule")}
    assert engines["trt"]["policy"]["admission"] == "reserve-cap"
    assert engines["sim"]["requests"] == {lab["state"]: v for lab, v in samples["kvledger_requests"] if lab["engine"] == "sim"}
    assert engines["sim"]["sources"] == [{"source": "ledger", "up": True, "reason": None, "last_success": 1.0}]


def test_tenant_names_only_with_the_json_view() -> None:
    accounts = rich_accounts()
    hidden = ledger_page_data(accounts, json_view=False)
    assert all("tenants" not in e for e in hidden["engines"])
    assert '"t1"' not in json.dumps(hidden)
    shown = ledger_page_data(accounts, json_view=True)
    samples = metrics_samples(render_text(accounts).decode())
    reserved = [v for lab, v in samples["kvledger_tenant_reserved_bytes"] if lab == {"engine": "sim", "tenant": "t1"}]
    assert {e["engine"]: e["tenants"] for e in shown["engines"]}["sim"] == [
        {"tenant": "t1", "reserved_bytes": reserved[0], "quota_bytes": 5000.0}]


def test_a_pool_without_bytes_per_block_is_drawn_in_blocks() -> None:
    pool = PoolFacts(id="x", block_size=16, num_blocks=10, in_use=3, reclaimable=2, free=5)
    accounts = accounts_of(Snapshot(engines=[EngineFacts(name="e", kind="ledger", source="ledger", pools=[pool])]))
    (doc_pool,) = ledger_page_data(accounts, json_view=False)["engines"][0]["pools"]
    assert doc_pool["unit"] == "blocks" and doc_pool["capacity"] == 10
    assert (doc_pool["in_use"], doc_pool["reclaimable"], doc_pool["free"]) == ({"exact": 3}, {"exact": 2}, {"exact": 5})
    assert "quota_headroom" not in doc_pool  # headroom is exported in bytes only


def test_no_accounts_yet() -> None:
    doc = ledger_page_data(None, json_view=True)
    assert doc["taken_at"] is None and doc["engines"] == [] and doc["node_sources"] == []


# ---------------------------------------------------------------- the lab document


@pytest.mark.parametrize(("capacity", "working_set"), [(4, 4), (3, 4), (1, 1), (5, 3), (2, 7), (256, 4096)])
def test_the_lab_document_is_run_labs_run(capacity: int, working_set: int) -> None:
    doc = lab_page_data(f"capacity={capacity}&working_set={working_set}")
    result = run_lab(capacity, working_set, MAX_REQUESTS)
    steps = doc["steps"]
    assert doc["requests"] == doc["max_requests"] == MAX_REQUESTS == len(steps["key"])
    assert steps["key"] == [s.key for s in result.steps]
    assert steps["hit"] == [s.hit for s in result.steps]
    assert steps["evicted"] == [s.evicted for s in result.steps]
    for n in (1, 16, 100, MAX_REQUESTS):  # the running totals are those of a run of n requests
        prefix = run_lab(capacity, working_set, n)
        assert (steps["hits"][n - 1], steps["misses"][n - 1], steps["evictions"][n - 1]) == (
            prefix.hits, prefix.misses, prefix.evictions)
    assert doc["totals"] == {"hits": result.hits, "misses": result.misses, "evictions": result.evictions}
    assert doc["cache"] == list(result.steps[-1].cache)


def test_the_lab_documents_numbers() -> None:
    assert lab_page_data("capacity=4&working_set=4")["steps"]["hits"][15] == 12
    assert lab_page_data("capacity=3&working_set=4")["steps"]["hits"][15] == 0
    short = lab_page_data("capacity=4&working_set=4&requests=16")
    assert short["requests"] == 16 and short["totals"]["hits"] == 12


@pytest.mark.parametrize(("query", "message"), [
    ("working_set=4", "capacity is required"),
    ("capacity=4", "working_set is required"),
    ("capacity=four&working_set=4", "capacity must be an integer"),
    ("capacity=0&working_set=4", "capacity must be between 1 and 256"),
    ("capacity=257&working_set=4", "capacity must be between 1 and 256"),
    ("capacity=4&working_set=4097", "working_set must be between 1 and 4096"),
    ("capacity=4&working_set=4&requests=4097", "requests must be between 1 and 4096"),
    # ASCII digits only: int() would read every one of these as a number
    ("capacity=%D9%A3&working_set=4", "capacity must be an integer"),  # Arabic-Indic three
    ("capacity=%EF%BC%94&working_set=4", "capacity must be an integer"),  # fullwidth four
    ("capacity=4&working_set=%E0%A5%AA", "working_set must be an integer"),  # Devanagari four
    ("capacity=%2B4&working_set=4", "capacity must be an integer"),  # +4
    ("capacity=%204&working_set=4", "capacity must be an integer"),  # " 4"
    ("capacity=4%0A&working_set=4", "capacity must be an integer"),  # "4\n"
    ("capacity=1_0&working_set=4", "capacity must be an integer"),
    ("capacity=-1&working_set=4", "capacity must be an integer"),
    ("capacity=4&working_set=4&requests=0x10", "requests must be an integer"),
    ("capacity=4&working_set=4&requests=" + "9" * 5000, "requests must be an integer"),
])
def test_the_lab_refuses_what_it_cannot_run(query: str, message: str) -> None:
    with pytest.raises(LabRequestError, match=message):
        lab_page_data(query)


# ---------------------------------------------------------------- routes


class RichSource(Source):
    """Every engine of the exposition tests' rich snapshot, as one source's contribution."""

    engine = "sim"
    kind = "ledger"

    def poll(self) -> Contribution:
        return _Engines()


class _Engines(Contribution):
    order = 0

    def apply(self, snapshot: Snapshot) -> None:
        snapshot.engines.extend(rich_snapshot().engines)


class Broken(Source):
    engine = "gone"
    kind = "ledger"

    def poll(self) -> Contribution:
        raise SourceError("connect", "connecting to http://10.0.0.7:8000/ledger: refused")


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector([RichSource(), Broken()], base_engines=[EngineFacts(name="gone", kind="ledger", source="ledger")])
    try:
        c.poll_once()
        yield c
    finally:
        c.stop()


def fetch(server: KvledgerHTTPServer, path: str, method: str = "GET",
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(*server.server_address, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_routes_and_their_headers(collector: Collector) -> None:
    server = KvledgerHTTPServer("127.0.0.1:0", collector)
    server.start()
    try:
        status, headers, body = fetch(server, "/")
        assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
        assert "default-src 'self'" in headers["content-security-policy"]
        html = body.decode()
        for href in ("metrics", "-/healthy", "-/ready", "lab"):
            assert f'<a href="{href}">' in html
        assert "api/v1/accounts" not in html and 'id="ledger"' in html and 'src="static/ledger.js"' in html
        status, headers, body = fetch(server, "/ui/ledger.json")
        doc = json.loads(body)
        taken_at = collector.latest().taken_at  # type: ignore[union-attr]
        assert status == 200 and doc["taken_at"] == taken_at and headers[ACCOUNTS_HEADER.lower()] == repr(taken_at)
        assert fetch(server, "/metrics")[1][ACCOUNTS_HEADER.lower()] == repr(taken_at)
        gone = {e["engine"]: e for e in doc["engines"]}["gone"]
        assert gone["sources"] == [{"source": "ledger", "up": False, "reason": "connect", "last_success": None}]
        assert "10.0.0.7" not in body.decode()  # failure messages (addresses) only with the JSON view
        status, headers, body = fetch(server, "/lab")
        assert status == 200 and 'id="capacity"' in body.decode() and '<a href="./">' in body.decode()
        status, headers, body = fetch(server, "/lab/run.json?capacity=4&working_set=4&requests=16")
        assert status == 200 and json.loads(body)["totals"]["hits"] == 12
        status, headers, body = fetch(server, "/lab/run.json?capacity=0&working_set=4")
        assert status == 400 and json.loads(body) == {"error": "capacity must be between 1 and 256"}
        status, headers, body = fetch(server, "/lab/run.json?capacity=%D9%A3&working_set=4")  # an Arabic-Indic 3
        assert status == 400 and json.loads(body) == {"error": "capacity must be an integer (ASCII digits 0-9 only)"}
        status, headers, body = fetch(server, "/static/ledger.js")
        assert status == 200 and headers["content-type"].startswith("text/javascript") and b"ui/ledger.json" in body
        assert fetch(server, "/static/kvledger.css")[1]["content-type"].startswith("text/css")
        for bad in ("/static/ledger.html", "/static/../pages.py", "/static/%2e%2e/pages.py", "/static/nope.js",
                    "/static/", "/static/.hidden.js"):
            assert fetch(server, bad)[0] == 404, bad
        status, headers, body = fetch(server, "/", "HEAD")
        assert status == 200 and body == b"" and int(headers["content-length"]) > 0
    finally:
        server.stop()


def test_failure_messages_and_tenants_with_the_json_view(collector: Collector) -> None:
    server = KvledgerHTTPServer("127.0.0.1:0", collector, json_view=True)
    server.start()
    try:
        body = fetch(server, "/")[2].decode()
        assert '<a href="api/v1/accounts">' in body
        doc = json.loads(fetch(server, "/ui/ledger.json")[2])
        engines = {e["engine"]: e for e in doc["engines"]}
        assert engines["gone"]["sources"][0]["message"] == "connecting to http://10.0.0.7:8000/ledger: refused"
        assert [t["tenant"] for t in engines["sim"]["tenants"]] == ["t1"]
    finally:
        server.stop()


def test_basic_auth_covers_the_pages(collector: Collector, tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"basic_auth_users": {"viewer": bcrypt_hash("secret")}}))
    server = KvledgerHTTPServer("127.0.0.1:0", collector, web_config_file=web)
    server.start()
    auth = {"Authorization": basic_auth_header("viewer", "secret")}
    try:
        for path in ("/", "/ui/ledger.json", "/lab", "/lab/run.json?capacity=4&working_set=4", "/static/ledger.js",
                     "/static/lab.js", "/static/kvledger.css"):
            assert fetch(server, path)[0] == 401, path
            assert fetch(server, path, headers=auth)[0] == 200, path
    finally:
        server.stop()


# ---------------------------------------------------------------- the package's web files


def test_every_web_file_is_package_data() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kvledger"]
    files = sorted(p.relative_to(WEB.parent.parent).as_posix() for p in WEB.iterdir())
    assert files and all(any(fnmatch(f, pat) for pat in patterns) for f in files), files


def test_the_pages_load_nothing_from_elsewhere() -> None:
    """No external assets: no absolute URL, no protocol-relative one, no root-relative one
    (the pages work behind a path prefix), and no inline script (the CSP forbids it)."""
    for path in WEB.iterdir():
        text = path.read_text().replace('xmlns="http://www.w3.org/2000/svg"', "")  # a name, not a fetch
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]", text, re.IGNORECASE), path
        assert not re.search(r"""(src|href)=["']/""", text), path
        assert not re.search(r"fetch\(\s*[`'\"]/", text), path
        if path.suffix == ".html":
            assert re.findall(r"<script[^>]*>", text) == ['<script src="static/' + path.stem + '.js">'], path
            assert not re.search(r"<[^>]+\son[a-z]+=", text), path  # no inline event handlers


# ---------------------------------------------------------------- the command


def test_lab_command_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lab", "--capacity", "4"]) == 2
    assert "--capacity and --working-set are required" in capsys.readouterr().err
    assert main(["lab", "--capacity", "4", "--working-set", "4", "--listen", "127.0.0.1:0"]) == 2
    assert "go with --serve" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["lab", "--help"])
    assert "--serve" in capsys.readouterr().out


def test_the_docs_show_both_pages() -> None:
    page = (ROOT / "docs" / "dashboards.md").read_text()
    for name in ("ledger-page.png", "lab-page.png"):
        assert f"](previews/{name})" in page
        assert (ROOT / "docs" / "previews" / name).stat().st_size > 10_000, f"{name}: run make previews"
