"""A busy engine's ledger as it really moves (issue 14), for the benchmarks.

Every running request's computed and generated tokens advance at every step (``tokens_per_tick``
per second of decode, 20 by default), its blocks grow every ``block_size`` tokens, and about
``replace_share`` of the requests (5 % by default) finish and are replaced by new ones each
second. ``Load.tick()`` moves the state one second on; ``rows_document()`` and
``columns_document()`` render the kvledger/v1 document in its row form and its columnar form
(docs/ledger.md, "The columnar form") from the same state, so both carry the same facts.
"""

from __future__ import annotations

import json
import random
from typing import Any

from kvledger_engine.request_wire import int64le

STATES = ("running",) * 18 + ("waiting", "preempted")


class Load:
    def __init__(self, requests: int = 1250, *, tenants: int = 16, seed: int = 1, block_size: int = 16,
                 tokens_per_tick: int = 20, replace_share: float = 0.05, changing_share: float = 1.0) -> None:
        self.rng = random.Random(seed)
        self.n = requests
        self.tenants = tenants
        self.block_size = block_size
        self.tokens_per_tick = tokens_per_tick
        self.replace_share = replace_share
        self.changing_share = changing_share  # share of running requests that decode this second
        self.next_id = 0
        self.rows: list[dict[str, Any]] = [self._new() for _ in range(requests)]
        # capacity: room for every request at its largest
        self.num_blocks = max(1024, sum(-(-(r["prompt_tokens"] + r["max_output_tokens"]) // block_size) for r in self.rows))
        self.counters = {"preemptions": 0, "reservation_overflows": 0}
        self.iteration_tokens = 0

    def _new(self) -> dict[str, Any]:
        rng = self.rng
        self.next_id += 1
        prompt = rng.randint(200, 4000)
        state = rng.choice(STATES)
        generated = rng.randint(0, 400) if state != "waiting" else 0
        computed = prompt + generated if state == "running" else 0
        return {
            "id": f"cmpl-{self.next_id:08d}-{rng.getrandbits(32):08x}", "pool": "0", "state": state,
            "tenant": f"t{rng.randrange(self.tenants)}", "prompt_tokens": prompt,
            "max_output_tokens": rng.randint(500, 2000), "output_bound": "cap" if rng.random() < 0.8 else "estimate",
            "generated_tokens": generated, "computed_tokens": computed, "contexts": 1, "speculative_slots": 0,
            "blocks_held": -(-computed // self.block_size),
        }

    def tick(self) -> None:
        """One second: running requests decode, blocks grow, ~5 % of requests are replaced."""
        rng, b, step = self.rng, self.block_size, self.tokens_per_tick
        self.iteration_tokens = 0
        for i, r in enumerate(self.rows):
            if r["state"] == "running" and (self.changing_share >= 1.0 or rng.random() < self.changing_share):
                g = min(r["generated_tokens"] + step, r["max_output_tokens"])
                self.iteration_tokens += g - r["generated_tokens"]
                r["generated_tokens"] = g
                r["computed_tokens"] = r["prompt_tokens"] + g
                r["blocks_held"] = -(-r["computed_tokens"] // b)
                if g >= r["max_output_tokens"]:
                    self.rows[i] = self._new()
        for _ in range(round(self.n * self.replace_share)):
            self.rows[rng.randrange(self.n)] = self._new()

    def _head(self) -> dict[str, Any]:
        in_use = sum(r["blocks_held"] for r in self.rows)
        reclaimable = min(self.num_blocks - in_use, self.num_blocks // 10)
        return {
            "schema": "kvledger/v1",
            "engine": {"kind": "bench", "version": "1"},
            "admission": "dynamic",
            "overflow": "preempt-recompute",
            "budgets": {"max_num_batched_tokens": 8192, "iteration_tokens": self.iteration_tokens,
                        "max_num_seqs": 2048, "max_model_len": 8192},
            "pools": [{"id": "0", "block_size": self.block_size, "block_bytes": 2 << 20, "num_blocks": self.num_blocks,
                       "blocks": {"in_use": in_use, "reclaimable": reclaimable,
                                  "free": self.num_blocks - in_use - reclaimable},
                       "references": in_use, "shared": 0}],
            "counters": dict(self.counters),
            "tenants": [{"name": f"t{t}", "quota_bytes": 10**10} for t in range(self.tenants)],
        }

    def rows_document(self) -> dict[str, Any]:
        return dict(self._head(), requests=[dict(r) for r in self.rows])

    def columns_document(self) -> dict[str, Any]:
        keys = list(self.rows[0])
        columns: dict[str, Any] = {k: [r[k] for r in self.rows] for k in keys}
        for k, values in columns.items():  # a column the same for every request: one value
            if k != "id" and values.count(values[0]) == len(values):
                columns[k] = values[0]
            elif type(values[0]) is int:  # integers as machine integers, as the vLLM integration writes them
                columns[k] = int64le(values)
        return dict(self._head(), request_columns=columns)


def dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()
