"""kvledger's SGLang plugin (engine/kvledger_engine/sglang) in a real SGLang 0.5.23 (CPU),
proven against the engine's own state counted independently inside the scheduler by the
test-only recount plugin (``recount_plugin/``: the allocator's free lists, the radix tree's
device slots and every live request's ``req_to_token`` row).

The session server (``conftest.sglang_server``) runs the plugin from a per-checkout venv
(``server.kvledger_venv``) and serves its ledger on a Unix socket (``server.ledger_url``). At
frozen points (``POST /pause_generation {"mode": "in_place"}``, then a request through the
scheduler: the pause published the state it stops in), the recount is read twice (equal:
frozen) and the ledger is read as the daemon reads it (``parse_document``) and accounted by the
daemon's accounting step:

- in-use, reclaimable (evictable radix pages) and free equal the recount, and so does every
  admitted request's pages held;
- the reservation equals the sum of the admitted requests' caps (``ceil((prompt +
  max_new_tokens) / page)`` pages each), and SGLang's own estimate is stated beside it;
- idle: nothing in use, the cached prefix and outputs reclaimable;
- an overcommitted pool: SGLang retracts; the ledger counts every retraction the recount's
  hook saw, and the tokens they threw away;
- saturation names the constraint that binds (running requests at ``max_running_requests``
  while the pool has room);
- the daemon's ``sglang`` kind reads the ledger beside /metrics (``ledger:``) with the same
  figures.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
from accounting_support import accounts_of

from kvledger.collect.sources.document import parse_document
from kvledger.collect.sources.http_client import HttpClient
from kvledger.domain.accounts import EngineAccount
from kvledger.domain.facts import EngineFacts, Snapshot

from .server import SglangServer, http_post_json, prefix_ids, suffix_ids

pytestmark = pytest.mark.sglang

PREFIX_TOKENS = 96
BURST = 6
SUFFIX_TOKENS = 16
BURST_NEW_TOKENS = 48
STEP_TOKENS = BURST * 8  # decode tokens between two frozen points: 8 steps
#: the overcommitted burst: SGLang admits about 13 of them on its estimate (16 + 0.7 x 200 tokens each),
#: which grow to 13 x 216 tokens, more than the 2,048-token pool: it must retract
RETRACT_REQUESTS, RETRACT_PROMPT, RETRACT_NEW = 20, 16, 200


@dataclass
class Point:
    label: str
    recount: dict[str, Any]
    document: dict[str, Any]
    facts: EngineFacts
    account: EngineAccount

    def describe(self) -> str:
        r, pool = self.recount, self.facts.pools[0]
        return (f"{self.label}: recount in_use {r['in_use']} evictable {r['evictable']} free {r['free']} running "
                f"{r['running']} waiting {r['waiting']} retractions {len(r['retractions'])}; ledger "
                f"{pool.in_use} {pool.reclaimable} {pool.free} requests {len(list(self.facts.requests or ()))}")


def capture(label: str, server: SglangServer) -> Point:
    """The recount and the ledger at one frozen point (the caller paused the engine)."""
    assert server.ledger_url is not None
    recount = server.recount()
    body = HttpClient(server.ledger_url, timeout=30, accept="application/json").get()
    again = server.recount()
    assert again == recount, f"{label}: the engine moved while paused"
    facts = parse_document(body, server.ledger_url, "tiny")
    (account,) = accounts_of(Snapshot(engines=[facts])).engines
    return Point(label, recount, json.loads(body), facts, account)


def points_while(label: str, server: SglangServer, alive: Any, step_tokens: int, limit: int) -> list[Point]:
    points: list[Point] = []
    while alive() and len(points) < limit:
        since = server.decoded_tokens()
        server.wait_decoded(since, step_tokens, stop=lambda: not alive())
        if not alive():
            break
        with server.frozen():
            points.append(capture(f"{label} {len(points) + 1}", server))
    return points


def idle_point(label: str, server: SglangServer) -> Point:
    server.wait_idle()
    with server.frozen():
        return capture(label, server)


@dataclass
class Record:
    burst: list[Point]
    idle: Point
    retraction: list[Point] = field(default_factory=list)
    retraction_results: list[tuple[int, dict[str, Any]]] = field(default_factory=list)

    def all_points(self) -> list[Point]:
        return [*self.burst, self.idle, *self.retraction]


@pytest.fixture(scope="module")
def record(sglang_server: SglangServer) -> Record:
    server = sglang_server
    server.wait_idle()
    server.flush_cache()
    prefix = prefix_ids(PREFIX_TOKENS, offset=300)
    assert server.generate(prefix, 4).status == 200  # the shared prefix cached first: the burst is admitted together
    burst = server.burst([prefix + suffix_ids(i, SUFFIX_TOKENS) for i in range(BURST)], BURST_NEW_TOKENS)
    points = points_while("burst", server, burst.alive, STEP_TOKENS, 4)
    burst.join()
    rec = Record(points, idle_point("idle, prefix and outputs cached", server))
    server.flush_cache()
    results: list[tuple[int, dict[str, Any]] | None] = [None] * RETRACT_REQUESTS

    def one(i: int) -> None:
        body = {"input_ids": prefix_ids(RETRACT_PROMPT, offset=600 + 37 * i),
                "sampling_params": {"max_new_tokens": RETRACT_NEW, "temperature": 0.0}}
        status, text = http_post_json(f"{server.base_url}/generate", body)
        results[i] = (status, json.loads(text) if status == 200 else {"error": text})

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(RETRACT_REQUESTS)]
    for t in threads:
        t.start()
    rec.retraction = points_while("overcommitted", server, lambda: any(t.is_alive() for t in threads),
                                  RETRACT_REQUESTS * 20, 3)
    for t in threads:
        t.join(300)
    rec.retraction_results = [r for r in results if r is not None]
    rec.retraction.append(idle_point("idle after the retractions", server))
    for p in rec.all_points():
        print(p.describe())
    return rec


def test_in_use_reclaimable_and_free_equal_the_recount(record: Record) -> None:
    assert len(record.burst) >= 2, "the burst gave fewer than two frozen points"
    for p in record.all_points():
        r, pool = p.recount, p.facts.pools[0]
        assert r["unaccounted"] == 0, p.describe()
        assert (pool.in_use, pool.reclaimable, pool.free) == (r["in_use"], r["evictable"], r["free"]), p.describe()
        assert (pool.num_blocks, pool.block_size) == (r["capacity"], r["page_size"]), p.describe()


def test_every_admitted_request_and_its_pages_equal_the_recount(record: Record) -> None:
    for p in record.all_points():
        ledger = {r.id: (r.state, r.prompt_tokens, r.generated_tokens, r.max_output_tokens, r.blocks_held)
                  for r in p.facts.requests or ()}
        # the recount's rows are every live request holding a req_to_token row (the running batch,
        # a prefill batch not merged yet, the chunked request): the admitted ones
        counted = {rid: ("running", row["prompt_tokens"], row["output_tokens"], row["max_new_tokens"], row["held"])
                   for rid, row in p.recount["requests"].items()}
        running = {rid: v for rid, v in ledger.items() if v[0] == "running"}
        assert running == counted, p.describe()
        assert sum(1 for v in ledger.values() if v[0] == "waiting") == p.recount["waiting"], p.describe()


def test_the_reservation_is_the_sum_of_the_admitted_requests_caps(record: Record) -> None:
    for p in record.all_points():
        page = p.recount["page_size"]
        caps = sum(-(-(row["prompt_tokens"] + row["max_new_tokens"]) // page) for row in p.recount["requests"].values())
        (acc,) = p.account.pools
        assert acc.reserved_blocks is not None and acc.reserved_blocks.exact == caps, p.describe()
    busy = [p for p in record.burst if p.recount["running"] == BURST]
    assert busy, "no frozen point saw the whole burst running"
    for p in busy:  # the engine's bet is beside the reservation, never in it
        (acc,) = p.account.pools
        estimate = p.document["pools"][0]["admission_estimate"]
        remaining = sum(row["max_new_tokens"] - row["output_tokens"] for row in p.recount["requests"].values())
        assert acc.engine_admission_estimate_tokens == pytest.approx(estimate["new_token_ratio"] * remaining)
        assert acc.engine_new_token_ratio is not None and 0 < acc.engine_new_token_ratio <= 1


def test_idle_shows_nothing_in_use_and_the_cached_prefix_reclaimable(record: Record) -> None:
    idle = record.idle
    pool = idle.facts.pools[0]
    assert pool.in_use == 0 == idle.recount["in_use"] and not list(idle.facts.requests or ())
    assert pool.reclaimable == idle.recount["evictable"] >= PREFIX_TOKENS + BURST * SUFFIX_TOKENS
    (acc,) = idle.account.pools
    assert acc.reserved_blocks is not None and acc.reserved_blocks.exact == 0


def test_retractions_and_their_discarded_tokens_are_counted(record: Record) -> None:
    assert [s for s, _ in record.retraction_results] == [200] * RETRACT_REQUESTS
    last = record.retraction[-1]
    retracted = last.recount["retractions"]
    assert retracted, "SGLang did not retract: the pool was not overcommitted"
    assert last.facts.counters.get("preemptions") == len(retracted)
    # each retraction threw away what it had computed beyond the prefix the radix cache keeps:
    # at most its prompt and output so far, and something (the burst has no shared prefix)
    discarded = last.facts.pools[0].preempted_tokens
    assert discarded is not None
    assert 0 < discarded <= sum(r["input_tokens"] + r["output_tokens"] for r in retracted)


def test_saturation_names_the_binding_constraint(record: Record) -> None:
    """Dynamic admission: the token pool (kv_physical) or the running requests (sequences) bind;
    the binding one is the larger ratio, as on vLLM."""
    for p in record.all_points():
        if p.recount["running"] == 0:
            continue
        acc = p.account
        physical = acc.pools[0].saturation["kv_physical"].exact
        sequences = acc.saturation["sequences"].exact
        assert physical is not None and sequences is not None, p.describe()
        assert physical == pytest.approx(p.recount["in_use"] / p.recount["capacity"]), p.describe()
        assert acc.binding == ("kv_physical" if physical >= sequences else "sequences"), p.describe()


def test_the_sglang_kind_reads_the_ledger_beside_metrics(sglang_server: SglangServer, record: Record) -> None:
    from kvledger.collect.sources.sglang.source import SglangSource
    from kvledger.config.loader import config_from_mapping

    cfg = config_from_mapping({"engines": [{"name": "tiny", "kind": "sglang", "url": sglang_server.metrics_url,
                                            "ledger": sglang_server.ledger_url, "timeout_seconds": 20}]}).engines[0]
    source = SglangSource(cfg)
    try:
        with sglang_server.frozen():
            facts = source.poll().facts
            recount = sglang_server.recount()
        pool = facts.pools[0]
        assert (pool.in_use, pool.reclaimable, pool.free) == (recount["in_use"], recount["evictable"], recount["free"])
        assert facts.requests is not None and [(r.name, r.up) for r in source.subsource_health()] == [
            ("ledger", True), ("metrics", True)]
        assert facts.counters.get("preemptions") == len(recount["retractions"])
    finally:
        source.close()
