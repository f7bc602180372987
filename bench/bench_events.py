"""KV-event ingest rate on one core (budget >= 500,000 block events/s): msgpack batches of
BlockStored/BlockRemoved in both encodings, decoded and applied to the cached-block multiset,
against a bare ``msgpack.unpackb`` loop over the same stream (the floor: decoding alone),
measured side by side (median of 5 alternating runs).

Run: .venv/bin/python bench/bench_events.py
"""

from __future__ import annotations

import random
import statistics
import time

import msgpack

from kvledger.collect.sources.vllm.events_state import KvEventState

BUDGET = 500_000


def batches(n_batches: int, hashes_per_event: int, encoding: str, seed: int = 5) -> tuple[list[bytes], int]:
    rng = random.Random(seed)
    live: list[int] = []
    out, blocks = [], 0
    for _ in range(n_batches):
        events = []
        for _ in range(4):
            if live and rng.random() < 0.45:
                gone = [live.pop() for _ in range(min(len(live), hashes_per_event))]
                ev = ({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU", "group_idx": 0}
                      if encoding == "map" else ["BlockRemoved", gone, "GPU"])
                blocks += len(gone)
            else:
                new = [rng.getrandbits(63) for _ in range(hashes_per_event)]
                live.extend(new)
                ev = ({"type": "BlockStored", "block_hashes": new, "parent_block_hash": None, "token_ids": [],
                       "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0}
                      if encoding == "map" else ["BlockStored", new, None, [], 16, None, "GPU"])
                blocks += len(new)
            events.append(ev)
        out.append(msgpack.packb([time.time(), events, 0]))
    return out, blocks


def main() -> None:
    for encoding in ("array", "map"):
        payloads, blocks = batches(5_000, 16, encoding)
        ingest, floor = [], []
        for _ in range(5):
            t = time.perf_counter()
            for p in payloads:
                msgpack.unpackb(p)
            floor.append(time.perf_counter() - t)
            ledger = KvEventState()
            t = time.perf_counter()
            for seq, payload in enumerate(payloads):
                ledger.receive(seq, payload)
            ingest.append(time.perf_counter() - t)
        i, f = statistics.median(ingest), statistics.median(floor)
        rate = blocks / i
        print(f"KV events ({encoding} encoding): {rate:,.0f} block events/s ({rate / BUDGET:.2f} x the 500,000/s budget); "
              f"ingest / bare msgpack decode of the same stream = {i / f:.2f}x")


if __name__ == "__main__":
    main()
