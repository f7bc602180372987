"""`kvledger serve` against real llama.cpp servers (llama-server b11434, the tiny GGUF model):
what the daemon exports, checked against what the servers themselves answer.

Three servers run for the module: ``split`` (``-c 8192 -np 4``: four slots of 2,048
tokens, each its own KV stream), ``unified`` (the same with ``--kv-unified``) and
``sleepy`` (``--sleep-idle-seconds 2``; it falls asleep although the daemon polls it, since
the daemon does not read /slots of an idle server whose counters stand still). One daemon (a real process, interval 0.2 s) reads
them: ``llama`` and ``llama-unified`` through a freezing proxy, ``llama-direct`` and
``llama-sleepy`` directly.

Exact comparisons at one moment: the proxy fetches /props, /slots and /metrics of the
server while concurrent requests with a shared prefix are running, then serves exactly
those answers; once the daemon's /metrics shows that moment, every figure must equal the
one computed here from the frozen answers (tokens of busy slots in use, of idle slots
reclaimable, busy slots x 2,048 reserved, the engine's own ``requests_processing`` equal to
the busy slots, its prefix-cache counters). Idle moments need no freeze: nothing moves.

The outage test stops and restarts the ``split`` server; it stays the last test.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.kvledger_daemon import Daemon, run_serve

from .server import BYTES_PER_TOKEN, CTX_SIZE, SLOT_CTX, SLOTS, TRAIN_CTX, FreezingProxy, LlamaServer

POOL = "0"
INTERVAL = 0.2
N_PREDICT = 300  # long enough to be caught running, short enough for a loaded CI machine
# a long shared prefix: prompts share it, so a later request reuses a slot's cached tokens
PREFIX = " ".join(f"The cache line {i} holds the tokens of request number {i}." for i in range(30))


# ---------------------------------------------------------------- reading the daemon


@dataclass(frozen=True)
class Scrape:
    samples: tuple[tuple[str, dict[str, str], float], ...]

    @classmethod
    def fetch(cls, daemon: Daemon) -> Scrape:
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return cls(tuple((s.name, dict(s.labels), float(s.value))
                         for f in text_string_to_metric_families(text) for s in f.samples))

    def get(self, name: str, **labels: str) -> float | None:
        found = [v for n, lab, v in self.samples if n == name and labels.items() <= lab.items()]
        assert len(found) <= 1, f"{len(found)} samples of {name} {labels}"
        return found[0] if found else None

    def labels(self, name: str, **labels: str) -> list[dict[str, str]]:
        return [lab for n, lab, _ in self.samples if n == name and labels.items() <= lab.items()]


def until(daemon: Daemon, check: Callable[[Scrape], bool], what: str, timeout: float = 15.0) -> Scrape:
    deadline = time.monotonic() + timeout
    while True:
        scrape = Scrape.fetch(daemon)
        if check(scrape):
            return scrape
        if time.monotonic() > deadline:
            shown = "\n".join(f"{n}{lab} {v}" for n, lab, v in scrape.samples if n.startswith(("kvledger_kv_blocks", "kvledger_source")))
            raise AssertionError(f"{what}: not reached within {timeout:g}s; last scrape:\n{shown}")
        time.sleep(0.05)


# ---------------------------------------------------------------- what the answers say, by hand


def expected(answers: dict[str, Any], unified: bool = False) -> dict[str, float]:
    """The daemon's figures for one moment, computed from the server's own answers."""
    slots = answers["slots"]
    busy = [s for s in slots if s["is_processing"]]
    idle = [s for s in slots if not s["is_processing"]]
    capacity = max(s["n_ctx"] for s in slots) if unified else sum(s["n_ctx"] for s in slots)
    in_use = sum(s.get("n_prompt_tokens", 0) for s in busy)
    reclaimable = sum(s.get("n_prompt_tokens", 0) for s in idle)
    metrics = engine_metrics(answers["metrics"])
    out = {
        "capacity": capacity,
        "in_use": in_use,
        "reclaimable": reclaimable,
        "free": capacity - in_use - reclaimable,
        "running": len(busy),
        "waiting": metrics["llamacpp:requests_deferred"],
        "hits": metrics["llamacpp:prompt_tokens_cached_total"],
        "queried": metrics["llamacpp:prompt_tokens_total"] + metrics["llamacpp:prompt_tokens_cached_total"],
        "engine_processing": metrics["llamacpp:requests_processing"],
    }
    out["reserved"] = len(busy) * capacity if unified else sum(s["n_ctx"] for s in busy)
    return out


def engine_metrics(text: str) -> dict[str, float]:
    return {s.name: float(s.value) for f in text_string_to_metric_families(text) for s in f.samples}


def daemon_view(s: Scrape, engine: str) -> dict[str, float | None]:
    sel = {"engine": engine, "pool": POOL}
    return {
        "capacity": s.get("kvledger_kv_capacity_blocks", **sel),
        "in_use": s.get("kvledger_kv_blocks", **sel, state="in_use"),
        "reclaimable": s.get("kvledger_kv_blocks", **sel, state="reclaimable"),
        "free": s.get("kvledger_kv_blocks", **sel, state="free"),
        "running": s.get("kvledger_requests", engine=engine, state="running"),
        "waiting": s.get("kvledger_requests", engine=engine, state="waiting"),
        "hits": s.get("kvledger_prefix_cache_hit_tokens_total", engine=engine),
        "queried": s.get("kvledger_prefix_cache_queried_tokens_total", engine=engine),
    }


# ---------------------------------------------------------------- the module's servers and daemon


@dataclass
class Setup:
    split: LlamaServer
    unified: LlamaServer
    sleepy: LlamaServer
    proxy: FreezingProxy
    unified_proxy: FreezingProxy
    daemon: Daemon


@pytest.fixture(scope="module")
def setup(llama_build: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    binary, model = llama_build
    work = tmp_path_factory.mktemp("llamacpp-real")
    servers = {
        "split": LlamaServer(binary, model, work / "split.log"),
        "unified": LlamaServer(binary, model, work / "unified.log", extra_flags=("--kv-unified",)),
        "sleepy": LlamaServer(binary, model, work / "sleepy.log", extra_flags=("--sleep-idle-seconds", "2")),
    }
    proxies: list[FreezingProxy] = []
    try:
        for server in servers.values():
            server.start()
        proxy, unified_proxy = FreezingProxy(servers["split"].url), FreezingProxy(servers["unified"].url)
        proxies += [proxy, unified_proxy]
        cfg = work / "kvledger.yml"
        cfg.write_text(f"""
interval_seconds: {INTERVAL}
nvml: {{enabled: false}}
engines:
  - {{name: llama, kind: llamacpp, url: "{proxy.url}/metrics", block_bytes: {BYTES_PER_TOKEN}, timeout_seconds: 2}}
  - {{name: llama-direct, kind: llamacpp, url: "{servers['split'].url}", block_bytes: {BYTES_PER_TOKEN}, timeout_seconds: 2}}
  - {{name: llama-unified, kind: llamacpp, url: "{unified_proxy.url}", kv_unified: true, kv_size: {CTX_SIZE},
     block_bytes: {BYTES_PER_TOKEN}}}
  - {{name: llama-sleepy, kind: llamacpp, url: "{servers['sleepy'].url}/metrics", block_bytes: {BYTES_PER_TOKEN}}}
""")
        with run_serve(work / "daemon", cfg) as daemon:
            yield Setup(servers["split"], servers["unified"], servers["sleepy"], proxy, unified_proxy, daemon)
    finally:
        for p in proxies:
            p.stop()
        for server in servers.values():
            server.stop()


def busy_moment(server: LlamaServer, proxy: FreezingProxy, prompts: list[str], n_predict: int,
                min_busy: int = 2) -> dict[str, Any]:
    """Send ``prompts`` concurrently; freeze the proxy at a moment with ``min_busy`` busy
    slots holding tokens, where the engine's own ``requests_processing`` (from the /metrics
    fetched just after /slots) counts the same busy slots; the frozen answers."""
    threads = server.burst(prompts, n_predict)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            answers = proxy.freeze()
            busy = [s for s in answers["slots"] if s["is_processing"] and s.get("n_prompt_tokens", 0) > 0]
            processing = engine_metrics(answers["metrics"])["llamacpp:requests_processing"]
            # one moment: no request started or ended between the GETs of /slots and /metrics
            same = processing == sum(s["is_processing"] for s in answers["slots"])
            if len(busy) >= min_busy and same:
                return answers
            proxy.thaw()
            time.sleep(0.02)
        raise AssertionError(f"never saw {min_busy} busy slots")
    finally:
        if proxy.frozen is None:
            for t in threads:
                t.join(timeout=120)


# ---------------------------------------------------------------- the engine facts relied on


def test_the_server_is_b11434_without_kv_gauges(setup: Setup) -> None:
    props = setup.split.get_json("/props")
    assert props["build_info"].startswith("b11434-") and props["total_slots"] == SLOTS
    assert props["default_generation_settings"]["n_ctx"] == SLOT_CTX and props["is_sleeping"] is False
    slots = setup.split.get_json("/slots")
    assert [(s["id"], s["n_ctx"], s["is_processing"]) for s in slots] == [(i, SLOT_CTX, False) for i in range(SLOTS)]
    names = set(engine_metrics(setup.split.metrics_text()))
    assert not any("kv_cache" in n for n in names), names  # removed by ggml-org/llama.cpp#13660
    assert {"llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total", "llamacpp:requests_processing",
            "llamacpp:requests_deferred"} <= names


def test_bytes_per_token_match_the_servers_kv_buffer(setup: Setup) -> None:
    """The startup log's KV buffer (``size = X MiB (N cells, L layers, S/T seqs)``: N cells
    per stream, T streams) against the block_bytes given per token: 2 x 2 x 16 x 2 bytes."""
    for server, streams in ((setup.split, SLOTS), (setup.unified, 1)):
        log = server.log_tail(200_000)
        m = re.search(r"llama_kv_cache: +size = +([0-9.]+) MiB \( *(\d+) cells, +(\d+) layers, +(\d+)/(\d+) seqs\)", log)
        assert m, "no llama_kv_cache size line in the server log"
        mib, cells, layers, seqs, n_stream = float(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5])
        assert (cells * n_stream, layers, seqs, n_stream) == (CTX_SIZE, 2, SLOTS, streams)
        assert mib * 2**20 == pytest.approx(CTX_SIZE * BYTES_PER_TOKEN, rel=1e-3)


def test_a_slots_token_count_is_its_kv_sequence(setup: Setup) -> None:
    """After a completion the slot keeps prompt + generated tokens, the last sampled one
    excepted (it was never decoded); a second request with the same prefix reuses them."""
    server = setup.split
    server.wait_idle()
    prompt = PREFIX + " First question."
    n_prompt = len(server.tokenize(prompt)) + 1  # + BOS
    first = server.complete(prompt, 40)
    assert first["tokens_predicted"] == 40 and first["tokens_evaluated"] == n_prompt
    slot = next(s for s in server.get_json("/slots") if s["id"] == first["id_slot"])
    assert slot["n_prompt_tokens"] == n_prompt + 40 - 1
    second = server.complete(PREFIX + " Second question, longer than the first.", 8, id_slot=first["id_slot"])
    assert second["tokens_cached"] >= n_prompt - 8  # the shared prefix came from the slot's cache


# ---------------------------------------------------------------- kvledger against the server


def test_idle_servers_match_exactly(setup: Setup) -> None:
    setup.proxy.thaw()
    setup.split.wait_idle()
    answers = {"slots": setup.split.get_json("/slots"), "metrics": setup.split.metrics_text()}
    want = expected(answers)
    for engine in ("llama", "llama-direct"):
        s = until(setup.daemon, lambda s, e=engine: daemon_view(s, e) == {k: want[k] for k in daemon_view(s, e)},
                  f"{engine}: the idle server's figures")
        assert s.get("kvledger_kv_reserved_blocks", engine=engine, pool=POOL, basis="exact") == 0
        assert s.get("kvledger_kv_capacity_bytes", engine=engine, pool=POOL) == CTX_SIZE * BYTES_PER_TOKEN
        assert want["reclaimable"] > 0  # the earlier completions left tokens in idle slots
        info = s.labels("kvledger_engine_info", engine=engine)[0]
        assert info["kind"] == "llamacpp" and info["version"].startswith("b11434-")
        policy = s.labels("kvledger_policy_info", engine=engine)[0]
        assert (policy["admission"], policy["overflow"]) == ("reserve-cap", "reject")


def test_a_frozen_busy_moment_matches_exactly(setup: Setup) -> None:
    server, proxy = setup.split, setup.proxy
    server.wait_idle()
    server.complete(PREFIX + " Warm up one slot with the shared prefix.", 4)
    before = expected({"slots": server.get_json("/slots"), "metrics": server.metrics_text()})
    prompts = [PREFIX + f" Request {i} asks about slot {i}." for i in range(3)]
    try:
        answers = busy_moment(server, proxy, prompts, n_predict=N_PREDICT)
        want = expected(answers)
        s = until(setup.daemon, lambda s: daemon_view(s, "llama") == {k: want[k] for k in daemon_view(s, "llama")},
                  "the frozen moment in the daemon")
        sel = {"engine": "llama", "pool": POOL}
        assert s.get("kvledger_kv_reserved_blocks", **sel, basis="exact") == want["reserved"] == want["running"] * SLOT_CTX
        assert s.get("kvledger_kv_headroom_bytes", **sel, view="quota", basis="exact") == (CTX_SIZE - want["reserved"]) * BYTES_PER_TOKEN
        assert s.get("kvledger_kv_headroom_bytes", **sel, view="physical", basis="exact") == (CTX_SIZE - want["in_use"]) * BYTES_PER_TOKEN
        assert s.get("kvledger_admission_headroom_requests", **sel, basis="exact") == SLOTS - want["running"]
        assert s.get("kvledger_kv_in_use_bytes", **sel, basis="exact") == want["in_use"] * BYTES_PER_TOKEN
        assert s.get("kvledger_ledger_invariant_violations_total", engine="llama") is None
    finally:
        proxy.thaw()
        server.wait_idle()
    # the shared prefix was served from the warmed slot's cache: the counters moved
    after = expected({"slots": server.get_json("/slots"), "metrics": server.metrics_text()})
    assert after["hits"] > before["hits"] and server.failures == []
    until(setup.daemon, lambda s: daemon_view(s, "llama-direct")["hits"] == after["hits"], "the prefix-cache counters")


def test_unified_server_capacity_is_one_buffer_and_reservations_a_bound(setup: Setup) -> None:
    """-c 8192 --kv-unified: one buffer of 8,192 cells; each slot may use all of it but is
    capped at the model's training context (4,096 tokens), so the slots do not show the
    buffer: ``kv_size: 8192`` gives it."""
    server, proxy = setup.unified, setup.unified_proxy
    slots = server.get_json("/slots")
    assert [s["n_ctx"] for s in slots] == [TRAIN_CTX] * SLOTS
    prompts = [PREFIX + f" Unified request {i}." for i in range(3)]
    try:
        answers = busy_moment(server, proxy, prompts, n_predict=N_PREDICT)
        want = expected(answers, unified=True)
        want["capacity"], want["free"] = CTX_SIZE, CTX_SIZE - want["in_use"] - want["reclaimable"]
        s = until(setup.daemon, lambda s: daemon_view(s, "llama-unified") == {k: want[k] for k in daemon_view(s, "llama-unified")},
                  "the frozen unified moment in the daemon")
        sel = {"engine": "llama-unified", "pool": POOL}
        assert s.get("kvledger_kv_capacity_blocks", **sel) == CTX_SIZE
        assert s.get("kvledger_kv_reserved_blocks", **sel, basis="exact") is None
        assert s.get("kvledger_kv_reserved_blocks", **sel, basis="upper_bound") == max(want["running"] * TRAIN_CTX, want["in_use"])
        assert s.labels("kvledger_policy_info", engine="llama-unified")[0]["admission"] == "dynamic"
    finally:
        proxy.thaw()
        server.wait_idle()


def test_a_sleeping_server_is_not_woken_by_the_daemon(setup: Setup) -> None:
    server = setup.sleepy
    deadline = time.monotonic() + 30
    while not server.get_json("/props")["is_sleeping"]:
        assert time.monotonic() < deadline, "the server never went to sleep"
        time.sleep(0.2)
    s = until(setup.daemon, lambda s: s.get("kvledger_kv_capacity_blocks", engine="llama-sleepy", pool=POOL) is None,
              "no pool while asleep")
    assert s.get("kvledger_source_up", engine="llama-sleepy", source="llamacpp") == 1
    polls: set[float | None] = set()  # the daemon's successful polls of the sleeping server, by their time

    def ten_more_polls(scrape: Scrape) -> bool:
        polls.add(scrape.get("kvledger_source_last_success_timestamp_seconds", engine="llama-sleepy", source="llamacpp"))
        return len(polls) > 10

    until(setup.daemon, ten_more_polls, "ten more polls of the sleeping server (/props and /metrics)", timeout=60)
    assert server.get_json("/props")["is_sleeping"] is True  # ... and never GET /slots, which would wake it
    assert s.get("kvledger_requests", engine="llama-sleepy", state="running") == 0


def test_outage_and_restart(setup: Setup) -> None:
    """Last: the split server stops (the direct engine goes down: connect) and comes back."""
    server = setup.split
    server.stop()
    until(setup.daemon, lambda s: s.get("kvledger_source_up", engine="llama-direct", source="llamacpp") == 0
          and (s.get("kvledger_source_errors_total", engine="llama-direct", source="llamacpp", reason="connect") or 0) > 0,
          "the direct engine down with reason connect")
    s = Scrape.fetch(setup.daemon)
    assert s.get("kvledger_kv_capacity_blocks", engine="llama-direct", pool=POOL) is None  # gone, not stale
    assert s.get("kvledger_source_up", engine="llama-unified", source="llamacpp") == 1  # the others unharmed
    server.start()
    s = until(setup.daemon, lambda s: s.get("kvledger_source_up", engine="llama-direct", source="llamacpp") == 1,
              "the direct engine back")
    until(setup.daemon, lambda s: s.get("kvledger_kv_blocks", engine="llama-direct", pool=POOL, state="reclaimable") == 0,
          "a restarted server holds no cached tokens")
