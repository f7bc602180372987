"""The in-engine ledger of a vLLM (``ledger:`` option): exact pools and requests.

vLLM's EngineCore, with kvledger's integration enabled (docs/engines/vllm.md), serves one
kvledger/v1 document per data-parallel rank at the address its ``KVLEDGER_VLLM_LEDGER``
names; ``{dp_rank}`` in the address stands for the rank. ``LedgerReader.read(ranks)``
fetches every rank's document in one poll (each GET bounded by the engine's timeout and
body limit, no rank started once the timeout has passed since the first), and
``merge_ledger`` puts them in place of the bounds /metrics gives:

- each pool becomes the ledger's (exact in use, reclaimable, free, references, shared;
  exact block bytes), keeping what only /metrics and KV events say about it (vLLM's own
  usage claim, the cached-block count);
- the requests are the ledger's, so reservations and resident tokens are exact; the
  counts from /metrics are dropped with the bound they fed;
- budgets come from the ledger (per-rank limits summed over ranks, the context limit as is).

All or nothing: when any rank's document is missing, malformed or disagrees with /metrics
about the pool's shape, the poll keeps the /metrics bounds for every pool and the ``ledger``
sub-source reports why. Exact values of an earlier poll are never mixed with fresh bounds.
"""

from __future__ import annotations

import dataclasses
import time

from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.document import DocumentReader
from kvledger.collect.sources.http_client import HttpClient
from kvledger.config.model import EngineConfig
from kvledger.model.facts import Budgets, EngineFacts
from kvledger.model.request_table import RequestTable

DP_PLACEHOLDER = "{dp_rank}"


class LedgerReader:
    def __init__(self, address: str, cfg: EngineConfig) -> None:
        self.address = address
        self.cfg = cfg
        self._readers: dict[str, DocumentReader] = {}

    def url(self, rank: str) -> str:
        return self.address.replace(DP_PLACEHOLDER, rank)

    def read(self, ranks: list[str]) -> dict[str, EngineFacts]:
        """Each rank's facts; SourceError (naming the rank's address) on the first failure."""
        if len(ranks) > 1 and DP_PLACEHOLDER not in self.address:
            raise SourceError(
                "config",
                f"ledger: {self.address} has no {DP_PLACEHOLDER}, but /metrics shows {len(ranks)} data-parallel ranks "
                "(each serves its own ledger)",
            )
        out: dict[str, EngineFacts] = {}
        # one deadline for all ranks: a slow rank cannot stretch the poll to ranks x timeout
        deadline = time.monotonic() + self.cfg.timeout_seconds
        for rank in ranks:
            if time.monotonic() > deadline:
                raise SourceError(
                    "timeout",
                    f"ledger: the documents of {len(ranks)} ranks took over {self.cfg.timeout_seconds:g}s "
                    f"(rank {rank} not read)",
                )
            reader = self._readers.get(rank)
            if reader is None:
                client = HttpClient(
                    self.url(rank), timeout=self.cfg.timeout_seconds, max_bytes=self.cfg.max_response_bytes,
                    accept="application/json",
                )  # fmt: skip
                reader = self._readers[rank] = DocumentReader(client, self.cfg.name)
            out[rank] = reader.read()  # the columnar form and conditional reads when the rank serves them
        return out

    def close(self) -> None:
        for reader in self._readers.values():
            reader.client.abort()


def merge_ledger(metrics: EngineFacts, ledgers: dict[str, EngineFacts]) -> EngineFacts:
    """``metrics`` (the /metrics facts) with every pool and request taken from ``ledgers``
    (by data-parallel rank = pool id); SourceError ``schema`` when they disagree."""
    pools = []
    requests: list[RequestTable] = []
    for pool in metrics.pools:
        doc = ledgers.get(pool.id)
        if doc is None:
            raise SourceError("schema", f"ledger: no document for data-parallel rank {pool.id}")
        found = [p for p in doc.pools if p.id == pool.id]
        if len(found) != 1 or len(doc.pools) != 1:
            names = ", ".join(repr(p.id) for p in doc.pools) or "none"
            raise SourceError("schema", f"ledger of rank {pool.id}: expected one pool with id {pool.id!r}, found {names}")
        exact = found[0]
        if (exact.num_blocks, exact.block_size) != (pool.num_blocks, pool.block_size):
            raise SourceError(
                "schema",
                f"ledger of rank {pool.id}: {exact.num_blocks} blocks of {exact.block_size} tokens, but /metrics "
                f"says {pool.num_blocks} blocks of {pool.block_size} (another server on this address?)",
            )
        pools.append(dataclasses.replace(
            exact,
            engine_reported_used_blocks=pool.engine_reported_used_blocks,
            cached_blocks=pool.cached_blocks,
            source_violations=pool.source_violations + exact.source_violations,
        ))  # fmt: skip
        requests.append(RequestTable.from_requests(doc.requests or []))
    return dataclasses.replace(
        metrics,
        pools=pools,
        requests=RequestTable.concat(requests),
        request_counts=None,
        budgets=_budgets([ledgers[p.id].budgets for p in metrics.pools], metrics.budgets),
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
    return Budgets(
        max_num_batched_tokens=total("max_num_batched_tokens"),
        iteration_tokens=total("iteration_tokens"),
        max_num_seqs=total("max_num_seqs"),
        max_model_len=min(lens) if lens else fallback.max_model_len,
    )
