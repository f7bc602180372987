"""Parse speed of kvledger/v1 documents (run: PYTHONPATH=exporter python bench/bench_protocol.py).

Builds a document with 10,000 requests and 1,000,000 block_refs (every request lists
its block_ids) and reports the median time of facts_from_document over a few runs,
plus json.loads of the same document for scale. Not a timed test.
"""

from __future__ import annotations

import json
import statistics
import time

from kvledger.protocol.reader import facts_from_document


def build(requests: int = 10_000, blocks: int = 1_000_000) -> dict:
    per = blocks // requests
    reqs = []
    for i in range(requests):
        reqs.append({
            "id": f"req-{i}", "tenant": f"t{i % 16}", "pool": "0", "state": "running" if i % 10 else "preempted",
            "prompt_tokens": 1000, "max_output_tokens": 600, "output_bound": "cap" if i % 3 else "estimate",
            "generated_tokens": 500, "computed_tokens": 1500, "contexts": 1, "speculative_slots": 0,
            "blocks_held": per, "block_ids": list(range(i * per, (i + 1) * per)),
        })
    return {
        "schema": "kvledger/v1",
        "engine": {"kind": "custom", "version": "1"},
        "admission": "dynamic",
        "budgets": {"max_num_batched_tokens": 8192, "iteration_tokens": 8000, "max_num_seqs": 10_000, "max_model_len": 8192},
        "pools": [{
            "id": "0", "block_size": 16, "block_bytes": 65536, "num_blocks": blocks,
            "blocks": {"in_use": blocks, "reclaimable": 0, "free": 0}, "references": blocks, "shared": 0,
            "block_refs": [[b, 1, b % 2 == 0] for b in range(blocks)],
        }],
        "requests": reqs,
        "counters": {"preemptions": 1},
    }


def median_time(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    doc = build()
    text = json.dumps(doc)
    loads = median_time(lambda: json.loads(text), 3)
    parse = median_time(lambda: facts_from_document(doc, "bench"), 5)
    no_refs = dict(doc, pools=[dict(doc["pools"][0], block_refs=None)],
                   requests=[dict(r, block_ids=None) for r in doc["requests"]])
    summary = median_time(lambda: facts_from_document(no_refs, "bench"), 5)
    print(f"document: 10,000 requests, 1,000,000 block_refs, {len(text) / 2**20:.1f} MiB of JSON")
    print(f"json.loads:                          {loads * 1000:8.1f} ms")
    print(f"facts_from_document (with blocks):   {parse * 1000:8.1f} ms")
    print(f"facts_from_document (summary only):  {summary * 1000:8.1f} ms")
    print(f"parse / json.loads ratio:            {parse / loads:8.2f}")


if __name__ == "__main__":
    main()
