"""The in-engine ledger of a vLLM (``ledger:`` option): exact pools and requests.

vLLM's EngineCore, with kvledger's integration enabled (docs/engines/vllm.md), serves one
kvledger/v1 document per data-parallel rank at the address its ``KVLEDGER_VLLM_LEDGER``
names; ``{dp_rank}`` in the address stands for the rank. ``RankFactsReader.read(ranks, probe)``
fetches every rank's document in one read bounded by one deadline in all (each GET gets
what is left of it) and the engine's body limit; the source runs it beside its /metrics
GET, on its own deadline, so a slow or failing /metrics never hides the ledger.

Which ranks: the ones /metrics names in ``vllm:cache_config_info`` (``CacheShape``: vLLM
exports it for every rank from the start, while a rank's usage gauge appears only once
that rank has served a request). Before /metrics has named them, or while it does not
answer, the reader also probes upward from the ranks it must read: rank k is read when
something listens at its address, and the first address with nothing listening ends the
ranks. A rank that answered once and no longer does is a failure, never a smaller engine.

``merge_rank_facts`` puts the documents in place of the bounds /metrics gives:

- each pool becomes the ledger's (exact in use, reclaimable, free, references, shared;
  exact block bytes), keeping what only /metrics and KV events say about it (vLLM's own
  usage claim, the cached-block count) where /metrics has a pool of that shape for the
  rank (a rank without its gauge yet has none: no claim);
- the requests are the ledger's, so reservations and resident tokens are exact; the
  counts from /metrics are dropped with the bound they fed;
- budgets come from the ledger (per-rank limits summed over ranks, the context limit as is).

All or nothing: when any rank's document is missing, malformed or disagrees with /metrics
about the pools' shape (``cache_config_info``: the ranks, the block size, the blocks summed
over the ranks), the poll keeps the /metrics bounds for every pool and the ``ledger``
sub-source reports why. Exact values of an earlier poll are never mixed with fresh bounds.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.document import FactsReader
from kvledger.collect.sources.http_client import HttpClient
from kvledger.collect.sources.prom_text import Exposition
from kvledger.collect.sources.vllm.metrics import CACHE_CONFIG, MAX_DP_RANK, PID_LABEL, RANK_LABEL
from kvledger.config.types import EngineConfig
from kvledger.domain.facts import Budgets, EngineFacts, PoolFacts
from kvledger.domain.request_table import RequestTable

DP_PLACEHOLDER = "{dp_rank}"


def _rank_number(rank: str) -> int | None:
    """A data-parallel rank written canonically (0..MAX_DP_RANK), else None."""
    if not (rank.isascii() and rank.isdigit() and len(rank) <= 4) or str(int(rank)) != rank:
        return None
    number = int(rank)
    return number if number <= MAX_DP_RANK else None


def _label_int(value: str | None) -> int | None:
    """A cache_config_info label holding a whole number ("128", "128.0"), else None."""
    if value is None or not value.isascii() or len(value) > 24:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if number.is_integer() and number >= 0 else None


@dataclass(frozen=True)
class CacheShape:
    """The pools /metrics describes, gauges or not: every rank's ``cache_config_info``."""

    ranks: tuple[str, ...]  # by number
    block_sizes: tuple[int | None, ...]  # per rank (a rank without its own series: the lowest rank's)
    num_gpu_blocks: int | None  # the sum over the ranks, null blocks included, as vLLM exports it

    @classmethod
    def of_metrics(cls, exp: Exposition) -> CacheShape | None:
        """The shape ``cache_config_info`` gives; None without the series or with a label
        that is no rank (vllm_facts_from_metrics names those errors)."""
        by_rank: dict[str, dict[str, str]] = {}
        for s in sorted(exp.get(CACHE_CONFIG, []), key=lambda s: s.labels.get(PID_LABEL, "")):
            by_rank.setdefault(s.labels.get(RANK_LABEL, "0"), dict(s.labels))
        if not by_rank or any(_rank_number(r) is None for r in by_rank):
            return None
        ranks = tuple(sorted(by_rank, key=int))
        totals = {_label_int(info.get("num_gpu_blocks")) for info in by_rank.values()}
        return cls(
            ranks,
            tuple(_label_int(by_rank[r].get("block_size")) for r in ranks),
            totals.pop() if len(totals) == 1 else None,
        )

    @classmethod
    def of_pools(cls, pools: Sequence[PoolFacts]) -> CacheShape:
        """The shape the /metrics pools imply (their null blocks added back)."""
        return cls(
            tuple(p.id for p in pools),
            tuple(p.block_size for p in pools),
            sum(p.num_blocks + 1 for p in pools),
        )

    def expected(self, rank: str) -> tuple[int | None, int | None]:
        """(blocks, block size) /metrics implies for ``rank``: equal-sized ranks assumed."""
        per_rank = self.num_gpu_blocks // len(self.ranks) - 1 if self.num_gpu_blocks is not None else None
        return per_rank, self.block_sizes[self.ranks.index(rank)]


def _listening(url: str, timeout: float) -> bool:
    """Whether something accepts a connection at ``url`` (unix:// or http(s)://)."""
    parts = urlsplit(url)
    try:
        if parts.scheme == "unix":
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout)
                sock.connect(parts.path)
            return True
        default = 443 if parts.scheme == "https" else 80
        with socket.create_connection((parts.hostname or "", parts.port or default), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


class RankFactsReader:
    def __init__(self, address: str, cfg: EngineConfig, timeout: float | None = None) -> None:
        self.address = address
        self.cfg = cfg
        self.timeout = cfg.timeout_seconds if timeout is None else timeout  # for all ranks together
        self.per_rank = DP_PLACEHOLDER in address
        self._readers: dict[str, FactsReader] = {}
        self._probed = 0  # ranks found by probing: a later probe must find at least as many

    def document_age(self) -> float | None:
        """The oldest age among the ranks' latest documents (None before any carried one)."""
        ages = [r.age for r in self._readers.values() if r.age is not None]
        return max(ages) if ages else None

    def url(self, rank: str) -> str:
        return self.address.replace(DP_PLACEHOLDER, rank)

    def check_ranks(self, ranks: Sequence[str]) -> None:
        """SourceError ``config`` when /metrics names several ranks and the address one."""
        if len(ranks) > 1 and not self.per_rank:
            raise SourceError(
                "config",
                f"ledger: {self.address} has no {DP_PLACEHOLDER}, but /metrics shows {len(ranks)} data-parallel ranks "
                "(each serves its own ledger)",
            )

    def read(self, ranks: Sequence[str], probe: bool = False) -> dict[str, EngineFacts]:
        """Each rank's facts: ``ranks`` (every one must answer) and, with ``probe``, the
        ranks above them that something listens for. SourceError (naming the rank's
        address) on the first failure. Everything within ``timeout``."""
        self.check_ranks(ranks)
        deadline = time.monotonic() + self.timeout
        if not self.per_rank:
            rank = ranks[0] if ranks else "0"
            facts = self._read(rank, deadline, len(ranks) or 1)
            if not ranks and len(facts.pools) == 1:
                rank = facts.pools[0].id  # the one pool the address serves, whatever its rank
            return {rank: facts}
        out = {rank: self._read(rank, deadline, len(ranks)) for rank in ranks}
        if probe:
            numbers = [_rank_number(r) for r in ranks]
            following = max((n for n in numbers if n is not None), default=-1) + 1
            while following <= MAX_DP_RANK:
                rank = str(following)
                if following > 0 and not _listening(self.url(rank), max(0.01, deadline - time.monotonic())):
                    break
                out[rank] = self._read(rank, deadline, following + 1)
                following += 1
            if following < self._probed:
                raise SourceError(
                    "connect", f"ledger: nothing listens at {self.url(str(following))}, but rank {following} answered before"
                )
            self._probed = following
        else:
            self._probed = 0
        return out

    def _read(self, rank: str, deadline: float, of: int) -> EngineFacts:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SourceError(
                "timeout",
                f"ledger: the documents of {of} ranks took over {self.timeout:g}s (rank {rank} not read)",
            )
        reader = self._readers.get(rank)
        if reader is None:
            client = HttpClient(
                self.url(rank), timeout=self.timeout, max_bytes=self.cfg.max_response_bytes,
                accept="application/json", auth=self.cfg.client_auth,
            )  # fmt: skip
            reader = self._readers[rank] = FactsReader(client, self.cfg.name)
        # one deadline for all ranks: a slow rank cannot stretch the read to ranks x timeout
        reader.client.timeout = max(0.001, min(self.timeout, round(left, 3)))
        return reader.read()  # the columnar form and conditional reads when the rank serves them

    def close(self) -> None:
        for reader in self._readers.values():
            reader.client.abort()


def merge_rank_facts(metrics: EngineFacts, rank_facts: dict[str, EngineFacts], shape: CacheShape | None = None) -> EngineFacts:
    """``metrics`` (the /metrics facts, or an engine's bare facts when /metrics gave none)
    with every pool and request taken from ``rank_facts`` (by data-parallel rank = pool id).
    ``shape``: what /metrics' ``cache_config_info`` says (by default what its pools imply);
    the ranks' facts must cover exactly its ranks and agree with it. SourceError ``schema`` when
    they disagree."""
    if shape is None and metrics.pools:
        shape = CacheShape.of_pools(metrics.pools)
    ranks = list(shape.ranks) if shape is not None else sorted(rank_facts, key=lambda r: (len(r), r))
    for rank in ranks:
        if rank not in rank_facts:
            raise SourceError("schema", f"ledger: no document for data-parallel rank {rank}")
    extra = sorted(set(rank_facts) - set(ranks))
    if extra:
        raise SourceError("schema", f"ledger: a document for data-parallel rank {extra[0]}, which /metrics does not name")
    exact_pools: list[PoolFacts] = []
    for rank in ranks:
        doc = rank_facts[rank]
        found = [p for p in doc.pools if p.id == rank]
        if len(found) != 1 or len(doc.pools) != 1:
            names = ", ".join(repr(p.id) for p in doc.pools) or "none"
            raise SourceError("schema", f"ledger of rank {rank}: expected one pool with id {rank!r}, found {names}")
        exact_pools.append(found[0])
    if shape is not None:
        _check_shape(exact_pools, shape)
    by_id = {p.id: p for p in metrics.pools}
    pools = []
    for exact in exact_pools:
        seen = by_id.get(exact.id)
        if seen is not None and (seen.num_blocks, seen.block_size) != (exact.num_blocks, exact.block_size):
            seen = None  # /metrics sized this rank without all ranks' gauges: its claim is not about this pool
        pools.append(dataclasses.replace(
            exact,
            engine_reported_used_blocks=seen.engine_reported_used_blocks if seen is not None else None,
            cached_blocks=seen.cached_blocks if seen is not None else None,
            source_violations=(seen.source_violations if seen is not None else ()) + exact.source_violations,
        ))  # fmt: skip
    return dataclasses.replace(
        metrics,
        pools=pools,
        requests=RequestTable.concat([RequestTable.from_requests(rank_facts[r].requests or []) for r in ranks]),
        request_counts=None,
        budgets=_budgets([rank_facts[r].budgets for r in ranks], metrics.budgets),
    )


def _check_shape(pools: list[PoolFacts], shape: CacheShape) -> None:
    """The ledger's pools are the ones /metrics describes: each rank's block size, and its
    blocks (ranks of equal size as /metrics reads them, or of any sizes that sum to vLLM's
    total)."""
    expected = [shape.expected(p.id) for p in pools]
    sizes_agree = all(size is None or p.block_size == size for p, (_, size) in zip(pools, expected, strict=True))
    if sizes_agree and (
        shape.num_gpu_blocks is None
        or all(p.num_blocks == blocks for p, (blocks, _) in zip(pools, expected, strict=True))
        or sum(p.num_blocks + 1 for p in pools) == shape.num_gpu_blocks
    ):
        return
    for p, (blocks, size) in zip(pools, expected, strict=True):
        if (blocks is not None and p.num_blocks != blocks) or (size is not None and p.block_size != size):
            raise SourceError(
                "schema",
                f"ledger of rank {p.id}: {p.num_blocks} blocks of {p.block_size} tokens, but /metrics says {blocks} blocks "
                f"of {size} (another server on this address?)",
            )
    raise SourceError(
        "schema", f"ledger: {sum(p.num_blocks + 1 for p in pools)} blocks over the ranks, but /metrics says {shape.num_gpu_blocks}"
    )


def _budgets(ranks: list[Budgets], fallback: Budgets) -> Budgets:
    def total(name: str) -> int | None:
        values: list[int | None] = [getattr(b, name) for b in ranks]
        known = [v for v in values if v is not None]
        if len(known) < len(values):
            fallback_value: int | None = getattr(fallback, name)
            return fallback_value
        return sum(known)

    lens = [b.max_model_len for b in ranks if b.max_model_len is not None]
    iterations = [b.window_iterations for b in ranks]
    # the ranks step together (as iteration_tokens and the budget, summed, assume): the
    # window's tokens add up over the ranks, its iterations are each rank's
    window_iterations = None if None in iterations else max(i for i in iterations if i is not None)
    return Budgets(
        max_num_batched_tokens=total("max_num_batched_tokens"),
        iteration_tokens=total("iteration_tokens"),
        window_scheduled_tokens=total("window_scheduled_tokens") if window_iterations is not None else None,
        window_iterations=window_iterations,
        max_num_seqs=total("max_num_seqs"),
        max_model_len=min(lens) if lens else fallback.max_model_len,
    )
