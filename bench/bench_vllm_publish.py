"""The in-engine vLLM ledger's cost per engine step at 1k and 10k requests, on a fake
scheduler (no vLLM needed; issue 14). Engine time is simulated: each step takes ``--step-ms``
(the throttle reads that clock), so publications fall due as they would in a real engine.

``EngineLedger`` (the integration's engine-thread half and its document) runs against
``FakeView``, an engine view with the interface of ``internals.EngineView`` over a plain
Python model of a busy engine: every running request computes one token per step (a block
every 16 tokens), about 5 % of the requests are replaced per second of steps (50 steps a
second). A reader polls the ledger's socket once a second of engine time, as the daemon does,
asking for the columnar form (or the row form, ``--form rows``).

Reported, per step (thread CPU, medians over the run): the hooks' own work
(``after_schedule`` without a publication due), a publication (what changed read into the
document), the renders a reader causes (the document thread: it holds the interpreter too),
and the total per step as a share of a step of ``--step-ms`` (the integration's throttle
keeps publication and render below 1 % of the engine thread by construction: the publish
interval stretches when they cost more).

``--hybrid``: a hybrid model's pool (Gemma 3's shape): every request holds blocks in two
sliding-window groups (a 1,024-token window: the blocks that fall out of it are freed and
become null entries) and one full-attention group; the view hands each newly seen block to
the tracker with its group, as ``internals.EngineView`` does, so a publication also keeps each
group's blocks in use.

Run: .venv/bin/python bench/bench_vllm_publish.py [--steps 1000] [--step-ms 30] [--hybrid]
"""

from __future__ import annotations

import argparse
import http.client
import random
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvledger_engine.vllm.engine_core import EngineLedger
from kvledger_engine.vllm.published import GroupStatic, PoolStatic, RequestRow
from kvledger_engine.vllm.settings import Settings

BLOCK = 16
WINDOW = 1024  # --hybrid: the sliding-window groups' window (tokens)


@dataclass
class FakeRequest:
    prompt: int
    max_tokens: int
    state: str = "running"
    computed: int = 0
    generated: int = 0
    blocks: list[int] = field(default_factory=list)  # full attention
    windows: list[list[int | None]] = field(default_factory=list)  # sliding-window groups (None: null)
    seen: list[int] = field(default_factory=list)  # per group, entries already handed to the tracker


@dataclass
class FakeOutput:
    num_scheduled_tokens: dict[str, int]
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    total_num_scheduled_tokens: int


class FakeView:
    """The interface of internals.EngineView over a modelled engine (one pool, no vLLM)."""

    def __init__(self, requests: int, seed: int = 1, hybrid: bool = False) -> None:
        self.rng = random.Random(seed)
        self.hybrid = hybrid
        capacity = requests * (200 + (2 * (WINDOW // BLOCK + 1) if hybrid else 0))
        groups = (GroupStatic("0", "sliding_window", WINDOW, None), GroupStatic("1", "sliding_window", WINDOW, None),
                  GroupStatic("2", "full_attention", None, None)) if hybrid else ()  # fmt: skip
        self.managers = [None] * (len(groups) or 1)
        self.static = PoolStatic("0", BLOCK, 65536, capacity, None, 0, groups)
        self.blocks = [None] * (capacity + 1)  # id 0: the null block
        self.null_id = 0
        self.ref = [0] * (capacity + 1)
        self.free = list(range(capacity, 0, -1))
        self.requests: dict[str, FakeRequest] = {}
        self.dp_rank, self.dp_size = 0, 1
        self.dirty: Callable[[], set[int]] = set
        self.next_id = 0
        for _ in range(requests):
            self.add()

    def add(self) -> str:
        self.next_id += 1
        rid = f"cmpl-{self.next_id:010d}-0"
        req = FakeRequest(self.rng.randint(100, 2000), self.rng.randint(200, 1000))
        self.requests[rid] = req
        self.grow(req, req.prompt)
        return rid

    def take(self) -> int:
        bid = self.free.pop()
        self.ref[bid] = 1
        self.dirty().add(bid)
        return bid

    def drop(self, bid: int) -> None:
        self.ref[bid] = 0
        self.free.append(bid)
        self.dirty().add(bid)

    def grow(self, req: FakeRequest, tokens: int) -> None:
        req.computed += tokens
        need = -(-req.computed // BLOCK)
        while len(req.blocks) < need:
            req.blocks.append(self.take())
        if self.hybrid:
            if not req.windows:
                req.windows = [[], []]
            skipped = max(0, req.computed - WINDOW + 1) // BLOCK  # blocks wholly before the window
            for table in req.windows:
                while len(table) < need:
                    table.append(self.take())
                for i in range(skipped - 1, -1, -1):
                    bid = table[i]
                    if bid is None:
                        break
                    self.drop(bid)
                    table[i] = None

    def finish(self, rid: str) -> None:
        req = self.requests.pop(rid)
        for bid in [*req.blocks, *(b for t in req.windows for b in t if b is not None)]:
            self.drop(bid)

    def step(self, replace: int) -> FakeOutput:
        scheduled = {}
        for rid, req in self.requests.items():
            self.grow(req, 1)
            req.generated += 1
            scheduled[rid] = 1
        finished = set(self.rng.sample(list(self.requests), replace)) if replace else set()
        for rid in finished:
            self.finish(rid)
            self.add()
        return FakeOutput(scheduled, finished, set(), len(scheduled))

    # -- EngineView's interface
    def read_block(self, bid: int) -> tuple[int, bool]:
        return self.ref[bid], False

    def num_free(self) -> int:
        return len(self.free)

    def wrap_pool(self, dirty: Callable[[], set[int]], on_reset: Callable[[], None]) -> None:
        self.dirty = dirty

    def is_idle(self) -> bool:
        return not self.requests

    def running_ids(self) -> list[str]:
        return list(self.requests)

    def read_request(self, rid: str, assign: Callable[[int, int], None] | None = None) -> RequestRow | None:
        req = self.requests.get(rid)
        if req is None:
            return None
        held = len(req.blocks)
        if self.hybrid:
            tables: list[list[int | None]] = [*req.windows, req.blocks]  # type: ignore[list-item]
            if not req.seen:
                req.seen = [0] * len(tables)
            for g, table in enumerate(tables):  # as EngineView: only the entries not seen yet
                if assign is not None:
                    for bid in table[req.seen[g]:]:
                        if bid is not None:
                            assign(bid, g)
                req.seen[g] = len(table)
            if len(req.seen) == len(tables):
                req.seen += [0] * len(req.windows)  # then the null prefix of each window table
            for w, table in enumerate(req.windows):  # as EngineView: the null prefix only grows
                start = req.seen[len(tables) + w]
                while start < len(table) and table[start] is None:
                    start += 1
                req.seen[len(tables) + w] = start
                held += len(table) - start
        return RequestRow(rid, req.state, req.prompt, req.max_tokens, req.generated, req.computed, held)

    def budgets(self, iteration_tokens: int | None) -> dict[str, int]:
        return {"max_num_batched_tokens": 8192, "max_num_seqs": 100_000, "max_model_len": 8192,
                **({} if iteration_tokens is None else {"iteration_tokens": iteration_tokens})}


def read_socket(path: str, accept: str) -> bytes:
    class Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(path)

    conn = Conn("localhost", timeout=30)
    conn.request("GET", "/", headers={"Accept": accept})
    body = conn.getresponse().read()
    conn.close()
    return body


def run(requests: int, steps: int, form: str, step_ms: float, hybrid: bool = False) -> dict[str, float]:
    view = FakeView(requests, hybrid=hybrid)
    sock = str(Path(tempfile.mkdtemp()) / "ledger.sock")
    ledger = EngineLedger(view, Settings(address=f"unix://{sock}", min_interval=0.1), "0.32.0")  # type: ignore[arg-type]
    accept = "application/vnd.kvledger.v1.columns+json" if form == "columns" else "application/json"
    steps_per_second = 1000 / step_ms
    replace_every = max(1, round(steps_per_second / (0.05 * requests)))  # ~5 % of requests a second
    hooks, publishes, renders = [], [], []
    clock = [0.0]  # engine time: each step takes step_ms, as the throttle sees it
    ledger.throttle.clock = lambda: clock[0]
    ledger.throttle.next_at = 0.0
    try:
        for i in range(steps):
            output = view.step(1 if i % replace_every == 0 else 0)
            publications = ledger.publications
            t = time.thread_time()
            ledger.after_schedule(output)
            cost = time.thread_time() - t
            (publishes if ledger.publications != publications else hooks).append(cost)
            if int((i + 1) / steps_per_second) != int(i / steps_per_second):  # the daemon's poll, once a second
                before = ledger.document.render_seconds
                read_socket(sock, accept)
                renders.append(ledger.document.render_seconds - before)
            clock[0] += step_ms / 1000
    finally:
        ledger.close()
    return {
        "hooks_us": statistics.median(hooks) * 1e6 if hooks else 0.0,
        "publish_ms": statistics.median(publishes) * 1e3 if publishes else 0.0,
        "publishes_per_step": len(publishes) / steps,
        "render_ms": statistics.median(renders) * 1e3 if renders else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--step-ms", type=float, default=30.0, help="an engine step's time, for the share")
    ap.add_argument("--form", default="columns,rows")
    ap.add_argument("--requests", default="1000,10000", help="running requests, comma-separated")
    ap.add_argument("--hybrid", action="store_true", help="a pool shared by two sliding-window groups and a full one")
    args = ap.parse_args()
    print("| requests | form read | hooks / step (no publication) | publication | publications / step | render per read "
          "| engine-thread cost per step | share of a step |")
    print("|---|---|---|---|---|---|---|---|")
    for n in map(int, args.requests.split(",")):
        for form in args.form.split(","):
            r = run(n, args.steps, form, args.step_ms, args.hybrid)
            per_step_ms = (r["hooks_us"] / 1000 * (1 - r["publishes_per_step"]) + r["publish_ms"] * r["publishes_per_step"]
                           + r["render_ms"] * args.step_ms / 1000)
            print(f"| {n:,} | {form} | {r['hooks_us']:.0f} us | {r['publish_ms']:.2f} ms | {r['publishes_per_step']:.3f} "
                  f"| {r['render_ms']:.2f} ms | {per_step_ms * 1000:.0f} us | {per_step_ms / args.step_ms:.2%} |", flush=True)


if __name__ == "__main__":
    main()
