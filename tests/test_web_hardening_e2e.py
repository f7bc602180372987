"""The server under attack, end to end (issue 25): the real daemon (`kvledger serve` with
basic auth) scraped by a real Prometheus while 64 clients send wrong passwords, and
while 10,100 idle connections are held open. Prometheus must stay up with scrapes far
under its 1 s timeout, and a new scraper must get in within a second.

No clock is read here: a scrape over 1 s is a failed scrape, by Prometheus' scrape_timeout
(up = 0) and by the test scrapers' own 1 s client timeout; how long scrapes take is
measured by bench/bench_web_hardening.py. Loopback only; the flood and the idle sockets
end by themselves.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from web_hardening_support import Flood, Scraper, auth_daemon, close_all, first_scrape_after, open_idle, scrape_job

from harness.httpjson import wait_until
from harness.prometheus import PrometheusServer, prometheus_config, start_prometheus_with_config

pytestmark = pytest.mark.e2e

IDLE = 10_100  # the cap is 10,000


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, PrometheusServer]]:
    """The daemon's port and a Prometheus scraping it every second with the right password."""
    workdir = tmp_path_factory.mktemp("hardening")
    with auth_daemon(workdir / "daemon") as daemon:
        port: int = daemon.port  # type: ignore[attr-defined]
        cfg = prometheus_config([])
        cfg["scrape_configs"] = [scrape_job(port)]
        prom = start_prometheus_with_config(workdir / "prom", cfg)
        try:
            wait_until(lambda: (prom.query_value('count_over_time(up{job="kvledger"}[10s])') or 0) >= 3
                       and prom.query_value('min_over_time(up{job="kvledger"}[10s])') == 1.0, 30,
                       what="three successful scrapes")
            yield port, prom
        finally:
            prom.stop()


def prometheus_over(prom: PrometheusServer, start: float, end: float) -> dict[str, Any]:
    """Prometheus' own view of its scrapes between ``start`` and ``end`` (Unix seconds)."""
    window = f"{max(1, int(end - start))}s"

    def value(expr: str) -> float | None:
        result: list[dict[str, Any]] = prom.query(expr, at=end)
        return float(result[0]["value"][1]) if result else None

    return {"up_min": value(f'min_over_time(up{{job="kvledger"}}[{window}])'),
            "scrapes": value(f'count_over_time(up{{job="kvledger"}}[{window}])'),
            "duration_max": value(f'max_over_time(scrape_duration_seconds{{job="kvledger"}}[{window}])'),
            "series": [(round(float(t) - start, 1), v) for r in prom.query_range(
                'scrape_duration_seconds{job="kvledger"} * up{job="kvledger"}', start, end, 1) for t, v in r["values"]],
            "last_error": [t.get("lastError") for t in prom.targets()]}  # type: ignore[dict-item]


@pytest.mark.parametrize("mode", ["fixed", "random"])
def test_prometheus_stays_up_under_a_wrong_password_flood(scraped: tuple[int, PrometheusServer], mode: str) -> None:
    """64 clients sending wrong passwords (``fixed``: each its own, repeated; ``random``: a
    new one every request) for 8 s: before, bcrypt ran in the 8 request workers and
    Prometheus went down (every scrape past its 1 s timeout)."""
    port, prom = scraped
    seconds = 8.0
    start = time.time()
    scraper = Scraper(port, seconds, timeout=1.0).start()  # a scrape over 1 s fails
    with Flood(port, 64, seconds, mode):
        scraper.join()  # the scraper's run (``seconds``) is the flood's span
    end = time.time()
    seen = prometheus_over(prom, start + 1, end)
    # up stays 1: no scrape past Prometheus' 1 s scrape_timeout
    assert seen["up_min"] == 1.0 and (seen["scrapes"] or 0) >= seconds - 3, (seen, [round(x, 3) for x in scraper.latencies])
    summary = scraper.summary()
    assert summary["failures"] == 0 and summary["scrapes"] > 0, (summary, scraper.failures[:5])


def test_idle_connections_never_lock_out_a_scrape(scraped: tuple[int, PrometheusServer]) -> None:
    """10,100 connections that send nothing (the cap is 10,000): before, every new
    connection past the cap was reset until the idle ones timed out (10 s); now the
    longest-silent one is closed to make room. While they are opened, no scrape is
    refused; once they are open, a new scraper gets in within a second, and Prometheus
    stays up."""
    port, prom = scraped
    during = Scraper(port, 120, interval=0.2, keep_alive=False, timeout=5.0).start()
    socks = open_idle(port, IDLE)
    try:
        opened = time.time()
        first, failed = first_scrape_after(port, budget=10.0, timeout=1.0)
        # a new scraper gets in within a second: its first attempt (1 s client timeout) is answered
        assert first is not None and failed == [], (first, failed)
        after = Scraper(port, 3.0, interval=0.1, keep_alive=False, timeout=1.0).start()
        after.join()
        during.stop()
        assert after.summary()["failures"] == 0, after.failures[:5]
        assert during.summary()["failures"] == 0, during.failures[:5]  # not while the sockets were opened either
        seen = prometheus_over(prom, opened, time.time())
        assert seen["up_min"] == 1.0, seen  # no scrape past Prometheus' 1 s scrape_timeout
    finally:
        during.stop()
        close_all(socks)
