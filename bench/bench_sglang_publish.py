"""The in-engine SGLang ledger's cost per scheduler step at 1k and 10k running requests, on a
modelled scheduler (no SGLang needed; issue 30). Engine time is simulated: each step takes
``--step-ms`` (the throttle reads that clock), so publications fall due as they would in a
real engine.

``SchedulerLedger`` (the plugin's scheduler-thread half and its document) runs against
``SchedulerView`` over ``ModelScheduler``: the attributes the view reads of SGLang's
``Scheduler`` (running batch, waiting queue, the token pool's allocator, the radix cache,
the new-token ratio) over a plain Python model of a busy engine: every running request
decodes one token per step (a page every ``--page`` tokens), about 5 % of the requests
are replaced per second of steps. A reader polls the ledger's socket once a second of
engine time, as the daemon does, asking for the columnar form (or the row form,
``--form rows``).

Reported, per step (thread CPU, medians over the run): the hooks' own work (``after_step``
without a publication due), a publication (the snapshot: one pass over the requests the
scheduler holds, into the document), the renders a reader causes (the document thread: it
holds the interpreter too), and the total per step as a share of a step of ``--step-ms``
(the throttle keeps publication and render near 1 % of the scheduler's time by
construction: the publication interval stretches when they cost more).

Run: .venv/bin/python bench/bench_sglang_publish.py [--steps 1000] [--step-ms 30] [--requests 1000,10000]
"""

from __future__ import annotations

import random
from typing import Any

from publish_cost import arguments, cases, measure, print_header, print_row, socket_path

from kvledger_engine.sglang.internals import SchedulerView
from kvledger_engine.sglang.ledger import SchedulerLedger
from kvledger_engine.sglang.settings import Settings


class Params:
    def __init__(self, cap: int) -> None:
        self.max_new_tokens = cap


class KvInfo:
    """SGLang 0.5.23's ``ReqKvInfo``: the KV a request holds."""

    def __init__(self, tokens: int) -> None:
        self.req_pool_idx = 1
        self.kv_allocated_len = self.kv_committed_len = tokens
        self.cache_protected_len = 0


class Req:
    """What the view reads of SGLang's ``Req``."""

    def __init__(self, rid: str, prompt: int, cap: int) -> None:
        self.rid = rid
        self.origin_input_ids = range(prompt)  # len() is what the view reads
        self.output_ids: list[int] = []
        self.sampling_params = Params(cap)
        self.kv = KvInfo(prompt)
        self.priority = None

    def finished(self) -> bool:
        return False


class Batch:
    def __init__(self, reqs: list[Req]) -> None:
        self.reqs = reqs


class Allocator:
    def __init__(self, size: int, page: int) -> None:
        self.size, self.page_size, self.used = size, page, 0

    def available_size(self) -> int:
        return self.size - self.used

    def get_kvcache(self) -> Any:
        allocator = self

        class KV:
            def get_kv_size_bytes(self) -> tuple[int, int]:
                half = (allocator.size + allocator.page_size) * 64 * 1024
                return half, half

        return KV()


class RadixCache:
    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0


class Tracker:
    current = 0.7


class ModelScheduler:
    """The attributes SchedulerView reads, over a modelled busy engine."""

    def __init__(self, requests: int, page: int, seed: int = 1) -> None:
        self.rng = random.Random(seed)
        self.page = page
        self.token_to_kv_pool_allocator = Allocator(requests * 1600 // page * page, page)
        self.tree_cache = RadixCache()
        self.running_batch = Batch([])
        self.cur_batch = self.last_batch = None
        self.chunked_req = None
        self.waiting_queue: list[Req] = []
        self.max_running_requests = requests * 2
        self.new_token_ratio_tracker = Tracker()
        self.forward_ct = 0
        self.next_id = 0
        for _ in range(requests):
            self.add()

    def add(self) -> None:
        self.next_id += 1
        req = Req(f"{self.next_id:032x}", self.rng.randint(100, 1000), self.rng.randint(200, 600))
        self.running_batch.reqs.append(req)
        self.token_to_kv_pool_allocator.used += -(-req.kv.kv_allocated_len // self.page) * self.page

    def step(self, replace: int) -> Batch:
        self.forward_ct += 1
        page = self.page
        alloc = self.token_to_kv_pool_allocator
        for req in self.running_batch.reqs:
            kv = req.kv
            if kv.kv_allocated_len % page == 0:
                alloc.used += page
            kv.kv_allocated_len += 1
            kv.kv_committed_len += 1
            req.output_ids.append(1)
        for _ in range(replace):
            req = self.running_batch.reqs.pop(self.rng.randrange(len(self.running_batch.reqs)))
            alloc.used -= -(-req.kv.kv_allocated_len // page) * page
            self.add()
        return self.running_batch


def run(requests: int, steps: int, form: str, step_ms: float, page: int) -> dict[str, float]:
    scheduler = ModelScheduler(requests, page)
    sock = socket_path()
    ledger = SchedulerLedger(SchedulerView(scheduler), Settings(address=f"unix://{sock}", min_interval=0.1), "0.5.23")
    return measure(ledger, sock, requests=requests, steps=steps, form=form, step_ms=step_ms,
                   advance=scheduler.step, hook=lambda batch: ledger.after_step((batch,)))  # the hook after process_batch_result


def main() -> None:
    ap = arguments("a scheduler")
    ap.add_argument("--page", type=int, default=1, help="tokens per page (SGLang's --page-size)")
    args = ap.parse_args()
    print_header("scheduler")
    for n, form in cases(args):
        print_row(n, form, run(n, args.steps, form, args.step_ms, args.page), args.step_ms)


if __name__ == "__main__":
    main()
