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

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from publish_cost import arguments, cases, measure, print_header, print_row, socket_path

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

    def finished_unreported(self) -> set[str]:
        return set()  # every finish is in its step's output here (FakeOutput.finished_req_ids)

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


def run(requests: int, steps: int, form: str, step_ms: float, hybrid: bool = False) -> dict[str, float]:
    view = FakeView(requests, hybrid=hybrid)
    sock = socket_path()
    ledger = EngineLedger(view, Settings(address=f"unix://{sock}", min_interval=0.1), "0.32.0")  # type: ignore[arg-type]
    return measure(ledger, sock, requests=requests, steps=steps, form=form, step_ms=step_ms,
                   advance=view.step, hook=ledger.after_schedule, read_timeout=30)


def main() -> None:
    ap = arguments("an engine")
    ap.add_argument("--hybrid", action="store_true", help="a pool shared by two sliding-window groups and a full one")
    args = ap.parse_args()
    print_header("engine")
    for n, form in cases(args):
        print_row(n, form, run(n, args.steps, form, args.step_ms, args.hybrid), args.step_ms)


if __name__ == "__main__":
    main()
