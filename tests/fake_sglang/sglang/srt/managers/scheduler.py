"""The scheduler: FCFS admission against free plus evictable tokens less the admission
estimate (``new_token_ratio`` x each running request's clipped remaining output), prefix
pages from the radix cache, a step that prefills the newly admitted requests or else
decodes one token for every running request, decode retraction when a step cannot get its
pages, finished requests' full pages cached. As in SGLang, a prefilled batch joins the
running batch only when the scheduler next looks for work (``last_batch`` until then),
and a finished request leaves the running batch then too (its pages freed already); the
scheduler takes the plan's running batch only once ``get_next_batch_to_run`` returned."""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.managers.schedule_batch import NextBatchPlan, Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.radix_cache import RadixCache


@dataclass
class ServerArgs:
    page_size: int = 1
    chunked_prefill_size: int = 8192
    dp_size: int = 1


@dataclass
class ModelConfig:
    context_len: int


@dataclass
class NewTokenRatioTracker:
    init: float = 0.7
    min: float = 0.1
    decay: float = 0.001
    current: float = 0.7

    def decay_step(self) -> None:
        self.current = max(self.current - self.decay, self.min)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, server_args: ServerArgs, *, tokens: int, max_running_requests: int, context_len: int = 4096,
                 bytes_per_token: int = 256, tp_rank: int = 0, dp_rank: int | None = None) -> None:
        self.server_args = server_args
        self.page_size = server_args.page_size
        self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(tokens, self.page_size, bytes_per_token)
        self.tree_cache = RadixCache(self.token_to_kv_pool_allocator, self.page_size)
        self.running_batch = ScheduleBatch([], self)
        self.waiting_queue: list[Req] = []
        self.chunked_req: Req | None = None
        self.last_batch: ScheduleBatch | None = None
        self.all_reqs: dict[str, Req] = {}  # every request ever added (the recount's list)
        self.max_running_requests = max_running_requests
        self.model_config = ModelConfig(context_len)
        self.new_token_ratio_tracker = NewTokenRatioTracker()
        self.forward_ct = 0
        self.tp_rank, self.pp_rank, self.dp_rank = tp_rank, 0, dp_rank
        self.paused = False
        # the fake engine's own tally (the ground truth the plugin's counters are held to)
        self.retracted_total = 0
        self.retracted_tokens_total = 0

    # ------------------------------------------------------------ pool
    def _take(self, pages: int) -> list[int] | None:
        alloc = self.token_to_kv_pool_allocator
        short = pages - len(alloc.free_pages)
        if short > 0:
            self.tree_cache.evict(short)
        return alloc.alloc(pages)

    def _room(self) -> int:
        """Pages a step can get: free, and evictable."""
        return (self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()) // self.page_size

    def decode_fits(self, reqs: list[Req]) -> bool:
        return sum(1 for r in reqs if r.kv.kv_allocated_len % self.page_size == 0) <= self._room()

    def release(self, req: Req, *, retract: bool = False) -> None:
        """Give a request's pages back: its full pages to the radix cache when it finished,
        everything it does not share with the cache to the pool."""
        tree, kv = self.tree_cache, req.kv
        if not retract:
            full = kv.kv_committed_len // self.page_size
            req.pages, duplicates = tree.insert(req.fill_ids[: kv.kv_committed_len], req.pages, full)
            self.token_to_kv_pool_allocator.free(duplicates)
            kept = full
        else:
            self.retracted_total += 1
            self.retracted_tokens_total += kv.kv_committed_len - kv.cache_protected_len
            kept = len(req.locked)
            req.is_retracted = True
        tree.unlock(req.locked)
        self.token_to_kv_pool_allocator.free(req.pages[kept:])
        req.pages, req.locked = [], []
        kv.kv_allocated_len = kv.kv_committed_len = kv.cache_protected_len = 0
        kv.req_pool_idx = None

    # ------------------------------------------------------------ scheduling
    def add_request(self, req: Req) -> None:
        self.all_reqs[req.rid] = req
        self.waiting_queue.append(req)

    def _estimate(self, reqs: list[Req]) -> float:
        ratio = self.new_token_ratio_tracker.current
        return sum(min(r.sampling_params.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) * ratio for r in reqs)

    def _admit(self, req: Req, admitted: list[Req], running: ScheduleBatch) -> bool:
        tree, page = self.tree_cache, self.page_size
        tokens = req.fill_ids
        keys = tree.match_prefix(tokens)
        new_pages = _ceil(len(tokens), page) - len(keys)
        tree.lock(keys)
        budget = self._room() * page - self._estimate(running.reqs + admitted)
        need = new_pages * page + self._estimate([req])
        pages = self._take(new_pages) if need <= budget else None
        if pages is None:
            tree.unlock(keys)
            return False
        req.pages = [tree.page(k) for k in keys] + pages
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(tokens)  # prefilled by this step
        req.kv.req_pool_idx = id(req) % 100_000
        full = len(tokens) // page
        req.pages, duplicates = tree.insert(tokens, req.pages, full)
        self.token_to_kv_pool_allocator.free(duplicates)
        fresh = tree._keys(tokens, full)[len(keys):]
        tree.lock(fresh)
        req.locked = keys + fresh
        req.kv.cache_protected_len = full * page
        req.is_retracted = False
        return True

    def get_next_batch_to_run(self, running_batch: ScheduleBatch, last_batch: ScheduleBatch | None) -> NextBatchPlan:
        """As SGLang's: the prefilled batch merged into (a new) running batch, finished requests
        filtered out; the scheduler takes the plan's running batch only once this returns."""
        reqs = [r for r in running_batch.reqs if not r.finished()]
        if last_batch is not None and last_batch.prefill:
            reqs.extend(r for r in last_batch.reqs if not r.finished() and r not in reqs)
        running = ScheduleBatch(reqs, self)
        admitted: list[Req] = []
        for req in list(self.waiting_queue):
            if len(running.reqs) + len(admitted) >= self.max_running_requests or not self._admit(req, admitted, running):
                break
            self.waiting_queue.remove(req)
            admitted.append(req)
        if admitted:
            return NextBatchPlan(ScheduleBatch(admitted, self, prefill=True), running)
        if not running.reqs:
            return NextBatchPlan(None, running)
        if not self.decode_fits(running.reqs):
            retracted, ratio, _ = running.retract_decode()
            self.new_token_ratio_tracker.current = ratio
            self.waiting_queue[:0] = retracted
        for req in running.reqs:  # the next token's KV
            if req.kv.kv_allocated_len % self.page_size == 0:
                got = self._take(1)
                assert got is not None, "retraction left no room"
                req.pages.extend(got)
            req.kv.kv_allocated_len += 1
        return NextBatchPlan(running, running)

    def run_batch(self, batch: ScheduleBatch) -> list[int]:
        self.forward_ct += 1
        return [(len(r.fill_ids) * 7 + 3) % 50 for r in batch.reqs]

    def process_batch_result(self, batch: ScheduleBatch, result: list[int]) -> None:
        for req, token in zip(batch.reqs, result, strict=True):
            req.kv.kv_committed_len = req.kv.kv_allocated_len
            req.output_ids.append(token)
            if len(req.output_ids) >= req.finish_at:
                self.release(req)
                req.finished_reason = "length"
        if not batch.prefill:
            self.new_token_ratio_tracker.decay_step()

    def pause_generation(self, recv_req: object = None) -> None:
        self.paused = True

    def continue_generation(self, recv_req: object = None) -> None:
        self.paused = False

    def step(self) -> bool:
        """One turn of the event loop; False when there was nothing to run."""
        if self.paused:
            return False
        plan = self.get_next_batch_to_run(running_batch=self.running_batch, last_batch=self.last_batch)
        self.running_batch = plan.running_batch
        batch = plan.batch_to_run
        if batch is not None:
            self.process_batch_result(batch, self.run_batch(batch))
        self.last_batch = batch
        return batch is not None
