"""Schedulers of the fake SGLang, workloads, and a page-by-page recount of a scheduler's
state (independent of kvledger). Import it only inside ``fake_sglang.installed()``."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler import Scheduler, ServerArgs
from sglang.srt.plugins import load_plugins


def start(*, tokens: int = 512, page_size: int = 4, max_running_requests: int = 16, context_len: int = 4096,
          **kwargs: Any) -> Scheduler:
    """SGLang's scheduler process: the plugins loaded (entry points ``sglang.srt.plugins``),
    then the scheduler built."""
    load_plugins()
    return Scheduler(ServerArgs(page_size=page_size), tokens=tokens, max_running_requests=max_running_requests,
                     context_len=context_len, **kwargs)


def request(rng: random.Random, rid: str, prefixes: list[list[int]], *, max_prompt: int = 60, max_new: int = 40,
            priority: int | None = None) -> Req:
    """A request: one of the shared prefixes (or none) and a tail of its own."""
    prefix = rng.choice(prefixes) if prefixes and rng.random() < 0.7 else []
    prompt = prefix + [rng.randrange(1000, 2000) for _ in range(rng.randint(1, max(1, max_prompt - len(prefix))))]
    cap = rng.randint(1, max_new)
    return Req(rid, prompt, cap, finish_at=rng.randint(1, cap), priority=priority)


@dataclass(frozen=True)
class Recount:
    """A scheduler's state counted page by page."""

    in_use: int  # pages some running request's row points at
    reclaimable: int  # pages of radix nodes no request locks
    free: int  # pages on the allocator's free list
    requests: dict[str, tuple[str, int, int, int, int]]  # id: (state, prompt, generated, cap, pages held)
    reserved_pages: int  # sum over admitted requests of ceil(min(prompt + cap, context) / page)
    retractions: int
    retracted_tokens: int


def recount(s: Scheduler) -> Recount:
    page = s.page_size
    # admitted: every request that holds a row of the request-to-token pool and has not
    # finished, wherever the scheduler keeps it (running batch, a prefill not merged yet)
    running = [r for r in s.all_reqs.values() if r.kv.req_pool_idx is not None and not r.finished()]
    held: set[int] = set()
    for r in running:
        held.update(r.pages)
    cached_free = {n.page for n in s.tree_cache.nodes.values() if n.lock_ref == 0}
    free = set(s.token_to_kv_pool_allocator.free_pages)
    pages = s.token_to_kv_pool_allocator.num_pages
    assert not (held & cached_free) and not (held & free) and not (cached_free & free)
    assert len(held) + len(cached_free) + len(free) == pages, "the fake engine lost a page"
    requests = {r.rid: ("running", len(r.origin_input_ids), len(r.output_ids), r.sampling_params.max_new_tokens,
                        len(r.pages)) for r in running}
    requests.update({r.rid: ("waiting", len(r.origin_input_ids), len(r.output_ids), r.sampling_params.max_new_tokens, 0)
                     for r in s.waiting_queue})
    context = s.model_config.context_len
    reserved = sum(-(-min(len(r.origin_input_ids) + r.sampling_params.max_new_tokens, context) // page) for r in running)
    return Recount(len(held), len(cached_free), len(free), requests, reserved, s.retracted_total,
                   s.retracted_tokens_total)
