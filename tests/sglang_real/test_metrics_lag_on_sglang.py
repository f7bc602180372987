"""How far SGLang's /metrics lags its allocator at the default ``--decode-log-interval`` (40),
measured on the real engine, and what kvledger shows a user about it.

SGLang refreshes its KV and request gauges at prefill batches and every ``decode_log_interval``
decode steps; in between, each running request adds one token per step that /metrics does not
show yet. On a tiny Qwen3 started without ``--decode-log-interval`` (SGLang's default, 40), a
burst of requests sharing a cached prefix is frozen at points that fall at different phases of
the interval. At each point the recount (inside the scheduler) gives the truth, /metrics gives
SGLang's gauges, a daemon poll made inside the pause gives what kvledger exports:

- kvledger is faithful to /metrics (its in-use equals SGLang's gauges, not the truth);
- the lag is real (some point differs) and bounded by the interval: at most ``running x steps
  since the last refresh`` tokens, the steps below 40 (``forward_ct_decode`` modulo 40);
- the user sees it: ``kvledger_source_refresh_interval_steps{source="sglang"}`` is 40, read from
  the server's /server_info (docs/engines/sglang.md, "Gauges lag the pool").

The measured lag is listed in the summary (``real SGLang`` section).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from harness.kvledger_daemon import Daemon, run_serve

from .conftest import SUMMARY
from .server import SglangServer, gauge, prefix_ids, suffix_ids
from .test_kvledger_on_sglang import Scrape, wait_for_scrape

pytestmark = pytest.mark.sglang

ENGINE = "qwen"
POOL = "0"
DEFAULT_INTERVAL = 40  # SGLang 0.5.23's --decode-log-interval default
BURST = 4
PREFIX_TOKENS = 199
NEW_TOKENS = 120
STEP_TOKENS = 4 * 13  # 13 decode steps of the four requests between points: phases move through the interval
MAX_POINTS = 9


@pytest.fixture(scope="module")
def daemon(sglang_server_default_interval: SglangServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    work = tmp_path_factory.mktemp("kvledger-sglang-lag")
    config = work / "kvledger.yaml"
    config.write_text(f"""\
interval_seconds: 0.2
nvml: {{enabled: false}}
engines:
  - name: {ENGINE}
    kind: sglang
    url: {sglang_server_default_interval.metrics_url}
    timeout_seconds: 10
""")
    with run_serve(work, config) as d:
        wait_for_scrape(d.url, lambda s: s.get("kvledger_source_refresh_interval_steps", engine=ENGINE,
                                               source="sglang") is not None, 60, "the refresh interval read")
        yield d


@dataclass
class LagPoint:
    recount: dict[str, Any]
    metrics_in_use: int  # capacity - available - evictable, as SGLang's gauges state it
    metrics_running: int
    scrape: Scrape

    @property
    def lag(self) -> int:
        return int(self.recount["in_use"]) - self.metrics_in_use

    @property
    def steps_since_refresh(self) -> int:
        return int(self.recount["forward_ct_decode"]) % DEFAULT_INTERVAL


def _poll_started(s: Scrape) -> float:
    last = s.get("kvledger_source_last_success_timestamp_seconds", engine=ENGINE, source="sglang") or 0.0
    return last - (s.get("kvledger_source_duration_seconds", engine=ENGINE, source="sglang") or 0.0)


@pytest.fixture(scope="module")
def lag_points(sglang_server_default_interval: SglangServer, daemon: Daemon) -> list[LagPoint]:
    server = sglang_server_default_interval
    server.wait_idle()
    server.flush_cache()
    prefix = prefix_ids(PREFIX_TOKENS, offset=300)
    server.generate(prefix, 4)
    burst = server.burst([prefix + suffix_ids(i, 16) for i in range(BURST)], NEW_TOKENS)
    points: list[LagPoint] = []
    while burst.alive() and len(points) < MAX_POINTS:
        since = server.decoded_tokens()
        server.wait_decoded(since, STEP_TOKENS, stop=lambda: not burst.alive())  # raises only when decoding stalls
        if not burst.alive():
            break
        with server.frozen():
            recount = server.recount()
            text = server.metrics_text()
            cap = gauge(text, "sglang:max_total_num_tokens")
            used = cap - gauge(text, "sglang:kv_available_tokens") - gauge(text, "sglang:kv_evictable_tokens")
            t0 = time.time()
            scrape = wait_for_scrape(daemon.url, lambda s, t0=t0: _poll_started(s) > t0, 30, "a poll inside the pause")
            points.append(LagPoint(recount, int(used), int(gauge(text, "sglang:num_running_reqs")), scrape))
    burst.join()
    lags = [(p.lag, p.steps_since_refresh, p.recount["running"]) for p in points]
    worst = max(points, key=lambda p: abs(p.lag)) if points else None
    SUMMARY.append(
        f"/metrics lag at --decode-log-interval {DEFAULT_INTERVAL} (tiny Qwen3, {BURST} requests): "
        f"(tokens behind, decode steps since the last refresh, running) at {len(points)} frozen points: {lags}; "
        f"worst {worst.lag if worst else None} tokens ({worst.lag / max(1, worst.recount['capacity']):.1%} of the pool)"
        if worst else "/metrics lag: no frozen point")
    return points


def test_the_user_sees_the_refresh_interval(lag_points: list[LagPoint]) -> None:
    for p in lag_points:
        assert p.scrape.get("kvledger_source_refresh_interval_steps", engine=ENGINE, source="sglang") == DEFAULT_INTERVAL


def test_kvledger_shows_what_metrics_states(lag_points: list[LagPoint]) -> None:
    """The daemon neither hides nor invents the lag: its in-use is SGLang's gauges' figure."""
    assert len(lag_points) >= 3
    for p in lag_points:
        assert p.scrape.get("kvledger_kv_blocks", engine=ENGINE, pool=POOL, state="in_use") == p.metrics_in_use


def test_metrics_lags_the_allocator_by_at_most_the_interval(lag_points: list[LagPoint]) -> None:
    busy = [p for p in lag_points if p.recount["running"] == BURST]  # no request finished yet
    assert len(busy) >= 3
    assert any(p.lag != 0 for p in busy), "no frozen point showed a lag: does SGLang refresh at every step now?"
    for p in busy:
        bound = p.recount["running"] * p.steps_since_refresh
        assert 0 <= p.lag <= bound, (p.lag, p.steps_since_refresh, p.recount["running"])
        assert p.steps_since_refresh < DEFAULT_INTERVAL
