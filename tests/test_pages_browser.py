"""The pages in a real headless Chromium (Debian's chromium and chromium-driver, driven by
selenium): the cache lab served by `kvledger lab --serve`, and the live ledger page of
`kvledger demo` checked against /metrics of the same accounting cycle.

Same cycle, without freezing anything: the page tells which accounts it drew
(``data-taken-at``, the accounts' ``taken_at``) and announces each render with a
``kvledger:rendered`` event; the test reads the page inside that event, then has the browser
fetch /metrics at once, whose ``X-Kvledger-Accounts-Taken-At`` header names the accounts it
shows. Only a page render and a /metrics answer of the same cycle are compared; when a new
cycle slipped in between (the daemon publishes one a second), the test waits for the page's
next render and reads again, so a slow machine costs attempts, never a false result.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait
from test_pages import Samples, by_basis, metrics_samples

from harness.browser import chromium, console_errors
from harness.kvledger_daemon import Daemon, run_demo, run_lab
from kvledger.collect.collector import Collector
from kvledger.collect.sources.base import Contribution, EngineContribution, Source
from kvledger.domain.facts import Budgets, EngineFacts, KvGroupFacts, PoolFacts, RequestFacts, TenantQuota
from kvledger.tools.lab import MAX_REQUESTS
from kvledger.tools.lab import run_lab as lab_run
from kvledger.web.server import KvledgerHTTPServer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    with chromium(log_dir=tmp_path_factory.mktemp("chromium")) as d:
        yield d


# ---------------------------------------------------------------- the lab


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with run_lab(tmp_path_factory.mktemp("lab")) as daemon:
        yield daemon


def _text(driver: WebDriver, element_id: str) -> str:
    return str(driver.find_element(By.ID, element_id).text)


def _wait_text(driver: WebDriver, element_id: str, value: str, timeout: float = 30) -> None:
    WebDriverWait(driver, timeout).until(lambda d: _text(d, element_id) == value,
                                         f"#{element_id} never read {value!r}")


def _set(driver: WebDriver, element_id: str, value: int) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(str(value))


def _reset(driver: WebDriver, capacity: int, ids: int) -> None:
    _set(driver, "capacity", capacity)
    _set(driver, "ids", ids)
    driver.find_element(By.ID, "reset").click()
    _wait_text(driver, "requests", "0")
    WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "step").is_enabled(), "the run never loaded")


def _step(driver: WebDriver, times: int) -> None:
    button = driver.find_element(By.ID, "step")
    for _ in range(times):
        button.click()


def _counters(driver: WebDriver) -> tuple[int, int, int]:
    return int(_text(driver, "requests")), int(_text(driver, "hits")), int(_text(driver, "misses"))


def _slots(driver: WebDriver) -> list[str]:
    return [str(s.get_attribute("data-key")) for s in driver.find_elements(By.CSS_SELECTOR, "#slots .slot")]


def _cached(capacity: int, ids: int, requests: int) -> set[str]:
    """What the cache holds after ``requests`` requests, by kvledger.tools.lab.run_lab."""
    return {str(k) for k in lab_run(capacity, ids, requests).steps[-1].cache}


def test_lab_page_fits_thrashes_and_plays_to_the_cap(driver: WebDriver, lab: Daemon) -> None:
    driver.get(lab.url + "/")
    assert "LRU eviction is cheap only in this toy" in _text(driver, "caution") and "recomputing" in _text(driver, "caution")

    # C=4, s=4: the working set fits; after the first pass every request hits
    _reset(driver, 4, 4)
    driver.find_element(By.ID, "prediction").send_keys("12")
    _step(driver, 16)
    _wait_text(driver, "requests", "16")
    assert _counters(driver) == (16, 12, 4)
    assert _text(driver, "evictions") == "0"
    slots = _slots(driver)
    assert len(slots) == 4 and set(slots) == _cached(4, 4, 16)
    assert "You predicted 12 hits in the first 16 requests; there were 12." in _text(driver, "message")

    # C=3, s=4: one identifier too many, LRU evicts the very one needed next: no hit at all
    _reset(driver, 3, 4)
    assert _slots(driver) == ["", "", ""]
    _step(driver, 16)
    _wait_text(driver, "requests", "16")
    assert _counters(driver) == (16, 0, 16)
    assert _text(driver, "evictions") == str(lab_run(3, 4, 16).evictions) == "13"
    slots = _slots(driver)
    assert len(slots) == 3 and set(slots) == _cached(3, 4, 16)
    assert "evicted 0" in _text(driver, "message")  # request 16 (identifier 3) evicted 0

    # Play runs to the cap of 4,096 requests and stops there
    Select(driver.find_element(By.ID, "speed")).select_by_value("max")
    play = driver.find_element(By.ID, "play")
    play.click()
    _wait_text(driver, "requests", str(MAX_REQUESTS), timeout=60)
    full = lab_run(3, 4, MAX_REQUESTS)
    assert _counters(driver) == (MAX_REQUESTS, full.hits, full.misses) == (MAX_REQUESTS, 0, MAX_REQUESTS)
    assert set(_slots(driver)) == _cached(3, 4, MAX_REQUESTS)
    assert play.text == "Play" and not play.is_enabled() and not driver.find_element(By.ID, "step").is_enabled()
    assert "cap of 4,096 requests" in _text(driver, "message")

    # Pause stops a playing run where it is; Step goes on from there
    _reset(driver, 4, 4)
    Select(driver.find_element(By.ID, "speed")).select_by_value("slow")
    play.click()
    assert play.text == "Pause"
    WebDriverWait(driver, 30).until(lambda d: int(_text(d, "requests")) >= 2, "Play never stepped")
    play.click()
    assert play.text == "Play"
    paused = int(_text(driver, "requests"))
    time.sleep(1.0)  # four steps' time at this speed
    assert int(_text(driver, "requests")) == paused
    _step(driver, 1)
    _wait_text(driver, "requests", str(paused + 1))
    prefix = lab_run(4, 4, paused + 1)
    assert _counters(driver) == (paused + 1, prefix.hits, prefix.misses)

    # the page's address may carry C and S (`kvledger lab --serve --capacity 3 --working-set 4` prints one)
    driver.get(lab.url + "/?capacity=3&working_set=4")
    WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "step").is_enabled(), "the run never loaded")
    assert driver.find_element(By.ID, "capacity").get_attribute("value") == "3"
    _step(driver, 4)
    _wait_text(driver, "requests", "4")
    assert _counters(driver) == (4, 0, 4) and _slots(driver) == ["3", "1", "2"]  # 3 took the slot of 0, the LRU

    # a value the lab cannot run is refused on the page, not sent
    _set(driver, "capacity", 0)
    driver.find_element(By.ID, "reset").click()
    WebDriverWait(driver, 10).until(lambda d: "capacity C must be a whole number from 1 to 256" in _text(d, "message"))
    assert not driver.find_element(By.ID, "step").is_enabled()
    assert console_errors(driver) == []


def test_lab_served_alone_has_no_daemon_routes(lab: Daemon) -> None:
    import urllib.error
    import urllib.request

    with urllib.request.urlopen(lab.url + "/lab/run.json?capacity=4&working_set=4&requests=16", timeout=10) as resp:
        assert resp.status == 200
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(lab.url + "/metrics", timeout=10)
    assert err.value.code == 404
    assert f"the cache lab on {lab.url}/ (Ctrl-C stops)" in lab.process.log_tail()


# ---------------------------------------------------------------- the ledger page


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with run_demo(tmp_path_factory.mktemp("demo")) as daemon:
        yield daemon


#: read the page inside its next render, then fetch /metrics from the page at once
NEXT_RENDER_AND_METRICS = r"""
const done = arguments[arguments.length - 1];
const num = (v) => (v === undefined ? null : Number(v));
function readPage() {
  const root = document.getElementById("ledger");
  const figures = (node) => Object.fromEntries([...node.querySelectorAll(".figure")].map((f) => [f.dataset.quantity, {
    basis: f.dataset.basis, exact: num(f.dataset.exact), lower_bound: num(f.dataset.lowerBound),
    upper_bound: num(f.dataset.upperBound), text: f.querySelector(".value").textContent}]));
  const chips = (node) => [...node.querySelectorAll(".chip")].map((c) => [c.dataset.source, c.dataset.up === "1"]);
  return {
    takenAt: root.dataset.takenAt,
    nodeSources: chips(document.getElementById("node-sources")),
    engines: [...root.querySelectorAll(".engine")].map((e) => ({
      engine: e.dataset.engine,
      policy: Object.assign({}, e.querySelector(".policy").dataset),
      requests: Object.fromEntries([...e.querySelectorAll(".requests b")].map((b) => [b.dataset.state, b.textContent])),
      sources: chips(e.querySelector(".sources")),
      tenants: [...e.querySelectorAll("tr[data-tenant]")].map((t) => t.dataset.tenant),
      pools: [...e.querySelectorAll(".pool")].map((p) => {
        const bar = p.querySelector(".bar");
        const mark = p.querySelector(".reserve-mark");
        return {
          pool: p.dataset.pool, unit: p.dataset.unit, capacity: num(bar.dataset.capacity),
          barWidth: bar.clientWidth, figures: figures(p),
          segments: [...bar.querySelectorAll(".seg")].map((s) => ({kind: s.dataset.segment, from: num(s.dataset.from),
            to: num(s.dataset.to), width: s.getBoundingClientRect().width})),
          reserveMark: mark ? {at: num(mark.dataset.at), bound: mark.classList.contains("bound")} : null,
        };
      }),
    })),
  };
}
document.addEventListener("kvledger:rendered", async () => {
  const page = readPage();
  try {
    const response = await fetch("metrics", {cache: "no-store"});
    page.metricsTakenAt = response.headers.get("X-Kvledger-Accounts-Taken-At");
    page.metrics = await response.text();
  } catch (err) {
    page.error = String(err);
  }
  done(page);
}, {once: true});
"""


def fmt_bytes(value: float) -> str:
    """The page's byte format (ledger.js fmtBytes; JavaScript's toFixed rounds half away from zero)."""
    for suffix, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            x = value / scale
            digits = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2
            q = Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)
            return f"{q} {suffix}".replace("-", "\u2212")
    return f"{value:.0f} B".replace("-", "\u2212")


def described(q: dict[str, float]) -> str:
    if "exact" in q:
        return fmt_bytes(q["exact"])
    if "lower_bound" in q and "upper_bound" in q:
        return f"{fmt_bytes(q['lower_bound'])} \u2013 {fmt_bytes(q['upper_bound'])}"
    if "lower_bound" in q:
        return f"\u2265 {fmt_bytes(q['lower_bound'])}"
    return f"\u2264 {fmt_bytes(q['upper_bound'])}" if q else "unknown"


def expected_segments(capacity: float, in_use: dict[str, float], allocated: dict[str, float],
                      free: dict[str, float]) -> list[tuple[str, float, float]]:
    """The bar from /metrics: [0, C] cut where in use ends and where allocated ends; a boundary
    known only by bounds becomes a span covering them (kinds joined by "|")."""
    def lo(q: dict[str, float]) -> float | None:
        return q.get("exact", q.get("lower_bound"))

    def hi(q: dict[str, float]) -> float | None:
        return q.get("exact", q.get("upper_bound"))

    a_lo, a_hi = lo(allocated), hi(allocated)
    free_lo, free_hi = lo(free), hi(free)
    if a_lo is None and free_hi is not None:
        a_lo = capacity - free_hi
    if a_hi is None and free_lo is not None:
        a_hi = capacity - free_lo
    u_lo, u_hi = lo(in_use), hi(in_use)
    if u_lo is None and u_hi is None and a_lo is None and a_hi is None:
        return [("unknown", 0.0, capacity)]

    def clamp(v: float) -> float:
        return min(capacity, max(0.0, v))

    u0 = clamp(u_lo if u_lo is not None else 0.0)
    u1 = clamp(max(u0, next(v for v in (u_hi, a_hi, capacity) if v is not None)))
    a0 = clamp(max(u1, a_lo if a_lo is not None else u1))
    a1 = clamp(max(a0, a_hi if a_hi is not None else capacity))
    cuts = [("in_use", 0.0, u0), ("in_use|reclaimable", u0, u1), ("reclaimable", u1, a0),
            ("reclaimable|free", a0, a1), ("free", a1, capacity)]
    return [c for c in cuts if c[2] > c[1]]


FIGURE_FAMILY = {"in_use": "kvledger_kv_in_use_bytes", "reclaimable": "kvledger_kv_reclaimable_bytes",
                 "free": "kvledger_kv_free_bytes", "reserved": "kvledger_kv_reserved_bytes"}


def _quantity_on_page(figure: dict[str, Any]) -> dict[str, float]:
    return {b: figure[b] for b in ("exact", "lower_bound", "upper_bound") if figure[b] is not None}


def check_page_against_metrics(page: dict[str, Any], samples: Samples) -> int:
    """Every number the page shows equals /metrics; returns the pools checked."""
    capacities = {(lab["engine"], lab["pool"]): v for lab, v in samples["kvledger_kv_capacity_bytes"]}
    shown = {(e["engine"], p["pool"]): p for e in page["engines"] for p in e["pools"]}
    assert set(shown) == set(capacities)
    for (engine, pool_id), pool in shown.items():
        where = f"{engine}/{pool_id}"
        ep = {"engine": engine, "pool": pool_id}
        assert pool["unit"] == "bytes" and pool["capacity"] == capacities[(engine, pool_id)], where
        figures = pool["figures"]
        assert _quantity_on_page(figures["capacity"]) == {"exact": capacities[(engine, pool_id)]}
        metrics: dict[str, dict[str, float]] = {q: by_basis(samples, f, **ep) for q, f in FIGURE_FAMILY.items()}
        for kind in ("quota", "physical"):
            metrics[f"{kind}_headroom"] = by_basis(samples, "kvledger_kv_headroom_bytes", **ep, view=kind)
        for quantity, expected in metrics.items():
            figure = figures[quantity]
            assert _quantity_on_page(figure) == expected, (where, quantity)
            assert figure["text"] == described(expected), (where, quantity, figure["text"])
            basis = figure["basis"]
            assert basis == ("unknown" if not expected else "exact" if "exact" in expected else
                             "range" if len(expected) == 2 else next(iter(expected))), (where, quantity)
        # the bar: its cuts are the /metrics values, each segment as wide as its share of capacity
        allocated = by_basis(samples, "kvledger_kv_allocated_bytes", **ep)
        cuts = expected_segments(pool["capacity"], metrics["in_use"], allocated, metrics["free"])
        assert [(s["kind"], s["from"], s["to"]) for s in pool["segments"]] == cuts, where
        for s in pool["segments"]:
            share = (s["to"] - s["from"]) / pool["capacity"] * pool["barWidth"]
            assert abs(s["width"] - share) <= 1.0, (where, s)
        assert abs(sum(s["width"] for s in pool["segments"]) - pool["barWidth"]) <= 1.0, where
        for kind, _, _ in cuts:  # a range is never drawn as an exact split
            if "|" in kind:
                assert not ("exact" in metrics["in_use"] and "exact" in allocated), where
        reserved = metrics["reserved"]
        if reserved:
            assert pool["reserveMark"] == {"at": reserved.get("exact", reserved.get("upper_bound")),
                                           "bound": "exact" not in reserved}, where
        else:
            assert pool["reserveMark"] is None, where
    policy = {lab["engine"]: lab for lab, _ in samples["kvledger_policy_info"]}
    requests: dict[str, dict[str, str]] = {}
    for lab, v in samples["kvledger_requests"]:
        requests.setdefault(lab["engine"], {})[lab["state"]] = f"{v:.0f}"
    up: dict[str, list[tuple[str, bool]]] = {}
    for lab, v in samples["kvledger_source_up"]:
        up.setdefault(lab["engine"], []).append((lab["source"], v == 1.0))
    assert sorted(map(tuple, page["nodeSources"])) == sorted(up.pop("", []))
    for engine in page["engines"]:
        name = engine["engine"]
        assert engine["policy"] == {k: policy[name][k] for k in ("sharing", "admission", "overflow")}
        assert {s: n for s, n in engine["requests"].items() if n != "unknown"} == requests.get(name, {})
        assert sorted(map(tuple, engine["sources"])) == sorted(up[name]), name
    return len(shown)


def _same_cycle(driver: WebDriver, attempts: int = 30) -> tuple[dict[str, Any], Samples]:
    for _ in range(attempts):
        page = driver.execute_async_script(NEXT_RENDER_AND_METRICS)
        assert "error" not in page, page.get("error")
        if page["takenAt"] and page["metricsTakenAt"] and float(page["takenAt"]) == float(page["metricsTakenAt"]):
            return page, metrics_samples(page["metrics"])
    raise AssertionError(f"no page render and /metrics answer of the same cycle in {attempts} attempts")


def test_ledger_page_shows_the_metrics_of_the_same_cycle(driver: WebDriver, demo: Daemon) -> None:
    driver.get(demo.url + "/")
    # every cycle read is checked whole; reading goes on until the page has drawn each shape of
    # quantity (a fresh demo's stock vLLM knows reclaimable by bounds only once KV events arrived)
    wanted = {("sim-vllm", "exact"), ("sim-stock-vllm", "range"), ("sim-stock-trtllm", "upper_bound"),
              ("sim-stock-tgi", "unknown")}
    seen: set[tuple[str, str]] = set()
    deadline = time.monotonic() + 90
    while True:
        page, samples = _same_cycle(driver)
        assert check_page_against_metrics(page, samples) == 9  # every pool of the demo's nine engines (llama.cpp included)
        seen |= {(e["engine"], f["basis"]) for e in page["engines"] for p in e["pools"] for f in p["figures"].values()}
        if wanted <= seen:
            break
        assert time.monotonic() < deadline, f"the page never drew {sorted(wanted - seen)}"
    tenants = {e["engine"]: e["tenants"] for e in page["engines"]}
    assert tenants["sim-vllm"] == ["team-a", "team-b"]  # the demo enables the JSON view
    # refreshed every few seconds: a later render draws a later cycle (the daemon publishes one a second)
    for _ in range(10):
        later = driver.execute_async_script(NEXT_RENDER_AND_METRICS)
        if float(later["takenAt"]) > float(page["takenAt"]):
            break
    else:
        raise AssertionError("ten renders of the page drew no later accounting cycle")
    assert console_errors(driver) == []


def test_ledger_page_keeps_the_links_and_leads_to_the_lab(driver: WebDriver, demo: Daemon) -> None:
    driver.get(demo.url + "/")
    links = {a.text: a.get_attribute("href") for a in driver.find_elements(By.CSS_SELECTOR, "nav a")}
    assert links == {"/metrics": demo.url + "/metrics", "/-/healthy": demo.url + "/-/healthy",
                     "/-/ready": demo.url + "/-/ready", "/api/v1/accounts": demo.url + "/api/v1/accounts",
                     "/lab (the cache lab)": demo.url + "/lab"}
    driver.find_element(By.LINK_TEXT, "/lab (the cache lab)").click()
    _reset(driver, 4, 4)
    _step(driver, 16)
    _wait_text(driver, "requests", "16")
    assert _counters(driver) == (16, 12, 4)
    assert console_errors(driver) == []


HOSTILE = '<img src=x onerror="document.title=1">'


class Hostile(Source):
    """An engine whose pool id (engine data) and tenant name carry markup."""

    engine = "eng"
    kind = "ledger"

    def poll(self) -> Contribution:
        pool = PoolFacts(id=HOSTILE, block_size=16, num_blocks=10, block_bytes=2**20, in_use=3, reclaimable=2, free=5)
        return EngineContribution(EngineFacts(name="eng", kind="ledger", source="ledger", pools=[pool], requests=[],
                                              tenants=[TenantQuota(HOSTILE, 2**20)]))


def _page_of(driver: WebDriver, json_view: bool, sources: list[Source]) -> dict[str, Any]:
    collector = Collector(sources, base_engines=[EngineFacts(name=s.engine, kind="ledger", source="ledger") for s in sources])
    collector.poll_once()
    server = KvledgerHTTPServer("127.0.0.1:0", collector, json_view=json_view)
    server.start()
    try:
        driver.get(server.url + "/")
        WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "ledger").get_attribute("data-taken-at"))
        page: dict[str, Any] = driver.execute_script(
            "return {text: document.body.innerText, images: document.querySelectorAll('img').length,"
            " title: document.title, segments: [...document.querySelectorAll('.seg')].map((s) => s.dataset.segment)}")
        return page
    finally:
        # leave the page before its server stops: a page left open polls ledger.json and logs the
        # refused connection as a console error (seen under xdist, where the next test comes later)
        driver.get("about:blank")
        server.stop()
        collector.stop()


def test_ledger_page_writes_names_as_text_and_tenants_only_with_the_json_view(driver: WebDriver) -> None:
    shown = _page_of(driver, True, [Hostile()])
    assert f"pool {HOSTILE}" in shown["text"] and HOSTILE in shown["text"].split("quota", 1)[1]  # the tenant row
    assert shown["images"] == 0 and shown["title"] == "kvledger"  # markup from the engine stays text
    assert shown["segments"] == ["in_use", "reclaimable", "free"]
    hidden = _page_of(driver, False, [Hostile()])
    assert HOSTILE not in hidden["text"].replace(f"pool {HOSTILE}", "")  # only the pool id, never the tenant
    assert "Tenants are not listed: the JSON view is off" in hidden["text"]
    assert console_errors(driver) == []


class Hybrid(Source):
    """A hybrid model's engine: one pool shared by a sliding-window and a full-attention group."""

    engine = "gemma"
    kind = "ledger"

    def poll(self) -> Contribution:
        groups = (KvGroupFacts("0", "sliding_window", window=64, in_use=3), KvGroupFacts("1", "full_attention", in_use=9))
        pool = PoolFacts(id="0", block_size=32, num_blocks=255, block_bytes=4096, in_use=12, reclaimable=3, free=240,
                         groups=groups, layer_groups=2)  # fmt: skip
        request = RequestFacts(id="r", state="running", prompt_tokens=280, max_output_tokens=20, blocks_held=12)
        return EngineContribution(EngineFacts(name="gemma", kind="vllm", source="ledger", pools=[pool], requests=[request],
                                              budgets=Budgets(max_model_len=1024)))  # fmt: skip


def test_ledger_page_shows_the_groups_within_a_pool(driver: WebDriver) -> None:
    page = _page_of(driver, False, [Hybrid()])
    text: str = page["text"]
    groups = text[text.index("group 0:"):].splitlines()[:6]
    # R = min(10, ceil(64 / 32) + 1) + ceil(300 / 32): 3 + 10 blocks
    assert groups == ["group 0: sliding window (64 tokens)", "in use 3 blocks", "reserved 3 blocks",
                      "group 1: full attention", "in use 9 blocks", "reserved 10 blocks"], text
    assert console_errors(driver) == []
