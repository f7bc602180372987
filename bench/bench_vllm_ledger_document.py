"""The in-engine vLLM ledger's document: size, build time and the engine's publish cost.

    PYTHONPATH=exporter python bench/bench_vllm_ledger_document.py [--quick]

1. ``PublishedLedger`` (kvledger_engine.vllm.published, what the server thread of the
   integration renders) at 1,000 and 10,000 requests, 256 of them running: the bytes
   served, and the median time of a render (a) from cold (every row rendered), (b) after a
   realistic publication (every running request's computed tokens advanced, ~5 % of the
   requests replaced per second, at the default 0.1 s interval: 0.5 % per publication),
   (c) after a publication that changed no row (the head only, every row's text cached).
2. The reference ledger (``kvledger_engine.reference_ledger.Ledger.to_document`` plus
   the JSON encoding ``document_server`` does) with the same requests, without and with
   the block lists, for comparison.
3. ``EngineLedger.publish`` (the engine thread's share) on the fake vLLM of the unit tests
   (tests/fake_vllm) at 1,000 and 10,000 requests with 256 running: median per
   publication, and as a share of the engine thread at the default 0.1 s interval.

Times are CPU time of the measuring thread (``time.thread_time``), medians; ratios. Nothing
here is asserted anywhere (docs/design.md §9).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the fake vLLM of the unit tests

from kvledger_engine.reference_ledger import Ledger, PoolSpec  # noqa: E402
from kvledger_engine.vllm.published import PoolStatic, PublishedLedger, RequestRow  # noqa: E402
from kvledger_engine.vllm.tracker import PoolSummary  # noqa: E402

RUNNING = 256
BLOCK = 16
INTERVAL = 0.1  # KVLEDGER_VLLM_INTERVAL's default
REPLACED_PER_SECOND = 0.05


# CPU time of the measuring thread: what the engine (or the server thread) spends, and
# steady on a shared machine where wall time also counts other processes' turns
clock = time.thread_time


def median_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        began = clock()
        fn()
        times.append(clock() - began)
    return statistics.median(times) * 1000


def request_id(rng: random.Random) -> str:
    return f"cmpl-{rng.getrandbits(128):032x}-0"  # the shape of vLLM's ids


class Rows:
    """N requests as the integration states them: RUNNING decode, the rest waiting."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.rows: dict[str, RequestRow] = {}
        for i in range(n):
            self.add("running" if i < RUNNING else "waiting")

    def add(self, state: str) -> str:
        rng = self.rng
        prompt = rng.randint(200, 2000)
        computed = prompt + rng.randint(0, 300) if state == "running" else 0
        rid = request_id(rng)
        self.rows[rid] = RequestRow(
            id=rid, state=state, prompt_tokens=prompt, max_output_tokens=rng.choice([256, 512, 1024, 4096 - prompt]),
            generated_tokens=max(0, computed - prompt), computed_tokens=computed,
            blocks_held=-(-computed // BLOCK) if state == "running" else 0,
            tenant=f"team-{rng.randrange(16)}" if rng.random() < 0.8 else None,
        )  # fmt: skip
        return rid

    def step(self) -> tuple[dict[str, RequestRow], set[str]]:
        """One publication's changes: running rows advance, 0.5 % replaced (new ones wait; waiting ones
        take the seats freed)."""
        changed: dict[str, RequestRow] = {}
        for rid, row in list(self.rows.items()):
            if row.state == "running":
                computed = row.computed_tokens + 1
                changed[rid] = self.rows[rid] = RequestRow(
                    rid, "running", row.prompt_tokens, row.max_output_tokens, row.generated_tokens + 1, computed,
                    -(-computed // BLOCK), row.tenant,
                )  # fmt: skip
        replaced = max(1, round(len(self.rows) * REPLACED_PER_SECOND * INTERVAL))
        gone = set(self.rng.sample(sorted(self.rows), replaced))
        for rid in gone:
            del self.rows[rid]
            changed.pop(rid, None)
        running = sum(row.state == "running" for row in self.rows.values())
        for rid, row in list(self.rows.items()):  # the engine admits waiting requests into freed seats
            if running >= RUNNING:
                break
            if row.state == "waiting":
                changed[rid] = self.rows[rid] = RequestRow(
                    rid, "running", row.prompt_tokens, row.max_output_tokens, 0, row.prompt_tokens,
                    -(-row.prompt_tokens // BLOCK), row.tenant,
                )  # fmt: skip
                running += 1
        for _ in range(replaced):
            rid = self.add("waiting")
            changed[rid] = self.rows[rid]
        return changed, gone


SUMMARY = PoolSummary(in_use=9000, reclaimable=4000, free=3383, references=10500, shared=800)
BUDGETS = {"max_num_batched_tokens": 16384, "max_num_seqs": RUNNING, "max_model_len": 4096, "iteration_tokens": 300}
STATIC = PoolStatic(id="0", block_size=BLOCK, block_bytes=2 << 20, num_blocks=16383, sliding_window=None, speculative_slots=0)


def new_document() -> PublishedLedger:
    return PublishedLedger({"kind": "vllm", "version": "0.32.0"}, STATIC, {"name": "kvledger-vllm", "dp_rank": 0, "pid": 1})


def bench_document(n: int, runs: int) -> dict[str, Any]:
    rows = Rows(n)
    stats = {"publications": 1, "publish_seconds_total": 0.1, "resyncs": 0}

    def cold() -> bytes:
        document = new_document()
        document.publish(SUMMARY, BUDGETS, rows.rows, set(), stats)
        return document.render()

    body = cold()
    cold_ms = median_ms(cold, runs)
    document = new_document()
    document.publish(SUMMARY, BUDGETS, rows.rows, set(), stats)
    document.render()
    changed_times, changed_counts = [], []
    for _ in range(runs):
        changed, gone = rows.step()
        document.publish(SUMMARY, BUDGETS, changed, gone, stats)
        changed_counts.append(len(changed) + len(gone))
        began = clock()
        body = document.render()
        changed_times.append(clock() - began)

    def head_only() -> bytes:
        document.publish(SUMMARY, BUDGETS, {}, set(), stats)
        return document.render()

    cached_ms = median_ms(head_only, runs)
    return {
        "bytes": len(body),
        "cold_ms": cold_ms,
        "changed_ms": statistics.median(changed_times) * 1000,
        "changed_rows": statistics.median(changed_counts),
        "cached_ms": cached_ms,
        "rows": rows,
    }


def bench_reference(rows: Rows, runs: int) -> dict[str, Any]:
    ledger = Ledger([PoolSpec("0", BLOCK, 2 << 20, 16383)], max_model_len=4096, max_num_seqs=RUNNING, max_num_batched_tokens=16384,
                    engine_kind="vllm", engine_version="0.32.0")  # fmt: skip
    for row in rows.rows.values():
        if row.state == "running":
            ledger.admit(row.id, row.prompt_tokens, row.max_output_tokens, tenant=row.tenant, check=False)
            ledger.advance(row.id, min(row.computed_tokens, row.prompt_tokens + row.max_output_tokens, 16383 * BLOCK // RUNNING))
        else:
            ledger.submit(row.id, row.prompt_tokens, row.max_output_tokens, tenant=row.tenant)

    def render(include_blocks: bool) -> bytes:
        return json.dumps(ledger.to_document(include_blocks=include_blocks), separators=(",", ":")).encode()

    return {
        "bytes": len(render(False)),
        "ms": median_ms(lambda: render(False), runs),
        "bytes_blocks": len(render(True)),
        "ms_blocks": median_ms(lambda: render(True), runs),
    }


def bench_publish(n: int, publications: int) -> dict[str, Any]:
    """EngineLedger.publish on the fake vLLM: n requests, RUNNING of them decoding."""
    from fake_vllm import installed
    from plugin_support import plugin_environment

    from kvledger_engine.vllm import plugin

    with tempfile.TemporaryDirectory(prefix="kvl-bench-", dir="/tmp") as directory, installed() as driver:
        with plugin_environment(("KVLEDGER_VLLM_LEDGER", "KVLEDGER_VLLM_TENANT"),
                                KVLEDGER_VLLM_LEDGER=f"{directory}/ledger.sock", KVLEDGER_VLLM_TENANT="request"):
            plugin.register()
            spec = driver.EngineSpec(num_gpu_blocks=16384, block_size=BLOCK, bytes_per_block=2 << 20, max_model_len=4096,
                                     max_num_seqs=RUNNING, max_num_batched_tokens=16384)  # fmt: skip
            scheduler = driver.build_scheduler(spec)
        ledger = scheduler._kvledger
        assert ledger is not None, "the integration did not attach"
        ledger.throttle.cost_ratio = 0.0  # publish at every step below: the clock jumps 1 s a step
        now = [ledger.throttle.next_at]
        ledger.throttle.clock = lambda: now[0]
        work = driver.Workload(scheduler, seed=1, prefixes=8)
        for _ in range(n):
            work.add(prompt_tokens=work.rng.randint(200, 700), max_tokens=3000)
        while len(scheduler.running) < RUNNING or any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running):
            now[0] += 1
            work.step(stop_probability=0.0)  # prefill until RUNNING requests decode
        times: list[float] = []
        rows_read: list[int] = []
        blocks_read: list[int] = []
        publish = ledger.publish

        def timed() -> None:
            rows_read.append(len(ledger.reqs.touched))
            blocks_read.append(len(ledger.pool.dirty))
            began = clock()
            publish()
            times.append(clock() - began)

        ledger.publish = timed  # type: ignore[method-assign]
        replaced = max(1, round(n * REPLACED_PER_SECOND * INTERVAL))
        ledger.document.render()  # the first GET renders every row; from here on only what changed
        renders: list[float] = []
        for _ in range(publications):
            work.abort(replaced)
            for _ in range(replaced):
                work.add(prompt_tokens=work.rng.randint(200, 700), max_tokens=3000)
            now[0] += 1
            work.step(stop_probability=0.0)
            renders.append(median_ms(ledger.document.render, 1))  # a GET after every publication (the server thread)
        assert len(times) >= publications and len(scheduler.running) == RUNNING
        size = len(ledger.document.render())
        # the steps the throttle lets pass: the hooks only note what was touched
        ledger.throttle.next_at = float("inf")
        hooks: list[float] = []
        after_schedule = ledger.after_schedule

        def timed_schedule(output: Any, before: dict[str, int] | None = None) -> None:
            began = clock()
            after_schedule(output, before)
            hooks.append(clock() - began)

        ledger.after_schedule = timed_schedule  # type: ignore[method-assign]
        published = ledger.publications
        for _ in range(publications):
            work.step(stop_probability=0.0)
        assert ledger.publications == published
        ledger.close()
        return {
            "ms": statistics.median(times) * 1000,
            "rows": statistics.median(rows_read),
            "blocks": statistics.median(blocks_read),
            "render_ms": statistics.median(renders),
            "hooks_us": statistics.median(hooks) * 1e6,
            "bytes": size,
            "requests": len(scheduler.requests),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer runs (a smoke test of the script)")
    args = parser.parse_args()
    runs = 5 if args.quick else 25
    publications = 10 if args.quick else 60

    print(f"kvledger/v1 document of one vLLM engine core: {RUNNING} running, the rest waiting; medians of {runs} renders")
    print(f"{'requests':>9} | {'PublishedLedger':>15} {'cold':>8} {'changed':>8} {'rows':>5} {'cached':>8} | "
          f"{'reference':>10} {'to_doc':>8} | {'+blocks':>10} {'to_doc':>8}")  # fmt: skip
    for n in (1_000, 10_000):
        doc = bench_document(n, runs)
        ref = bench_reference(doc["rows"], max(3, runs // 5))
        print(f"{n:>9,} | {doc['bytes'] / 1024:>12.0f} KiB {doc['cold_ms']:>6.2f}ms {doc['changed_ms']:>6.2f}ms "
              f"{doc['changed_rows']:>5.0f} {doc['cached_ms']:>6.2f}ms | {ref['bytes'] / 1024:>6.0f} KiB {ref['ms']:>6.2f}ms | "
              f"{ref['bytes_blocks'] / 1024:>6.0f} KiB {ref['ms_blocks']:>6.2f}ms")  # fmt: skip
    print("  cold: every row rendered; changed: after one publication (running rows advanced, 0.5 % replaced);")
    print("  cached: after a publication that changed no row; reference: Ledger.to_document() + json.dumps,")
    print("  without and with block_refs/block_ids")
    print()
    print(f"EngineLedger.publish on the fake vLLM (tests/fake_vllm), {RUNNING} running; medians of {publications} publications")
    print(f"{'requests':>9} | {'publish':>8} {'rows read':>9} {'blocks read':>11} | {'share at 0.1 s':>14} | {'render':>8} {'size':>9} | "
          f"{'hooks/step':>10}")  # fmt: skip
    for n in (1_000, 10_000):
        pub = bench_publish(n, publications)
        print(f"{pub['requests']:>9,} | {pub['ms']:>6.2f}ms {pub['rows']:>9.0f} {pub['blocks']:>11.0f} | "
              f"{pub['ms'] / (INTERVAL * 1000):>13.2%} | {pub['render_ms']:>6.2f}ms {pub['bytes'] / 1024:>5.0f} KiB | "
              f"{pub['hooks_us']:>8.0f}us")  # fmt: skip
    print("  share: publish time over the 0.1 s between publications (publishing at every step here; the throttle")
    print("  itself keeps publish + render under 1/100 of wall time); render: a GET after a publication (the server")
    print("  thread); hooks/step: a step the throttle lets pass. Times are CPU time of the measuring thread.")


if __name__ == "__main__":
    main()
