"""The plan's report: the memory terms (``SIZE:SOURCE`` as the command line gives them), the
length distribution, the pools, KV-cache groups and figures of one plan, and the verdict of
the device budget. Every figure carries its basis: ``hard`` when every term under it is
measured, configured or counted, ``estimate`` when one is an estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvledger.domain.facts import TERM_SOURCES
from kvledger.tools.plan.sizing import PLAN_TERM_ORDER, breaking_term

GIB = 1 << 30


class PlanError(ValueError):
    """The plan's inputs cannot give an answer; the message names the bad input."""


@dataclass(frozen=True, slots=True)
class Term:
    """One memory term of the device budget, per GPU, with where its figure comes from."""

    category: str
    bytes: int
    source: str  # measured | configured | estimate | counted | derived


def parse_term(text: str, option: str) -> Term:
    """``SIZE:SOURCE`` (``3GiB:measured``); the source must be given: an unmarked figure
    could be read as a measurement."""
    from kvledger.config.loader import parse_size

    size, sep, source = text.rpartition(":")
    if not sep or source not in TERM_SOURCES:
        raise PlanError(f"{option} {text!r}: expected SIZE:SOURCE with SOURCE one of {', '.join(TERM_SOURCES)} "
                        f"(e.g. 3GiB:measured)")
    try:
        value = parse_size(size)
    except ValueError as exc:
        raise PlanError(f"{option} {text!r}: {exc}") from None
    return Term(option.removeprefix("--").replace("-", "_"), value, source)


def parse_lengths(specs: Sequence[str], file: str | None) -> list[tuple[int, int, int]]:
    """A length distribution: ``PROMPT:OUTPUT`` entries (``--length``, each one request)
    and/or a file of lines ``PROMPT OUTPUT [COUNT]`` ('#' starts a comment)."""
    out: list[tuple[int, int, int]] = []
    for spec in specs:
        parts = spec.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise PlanError(f"--length {spec!r}: expected PROMPT:OUTPUT tokens, e.g. 1000:200")
        out.append((int(parts[0]), int(parts[1]), 1))
    if file is not None:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PlanError(f"--lengths-file {file}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
        for number, line in enumerate(text.splitlines(), start=1):
            fields = line.split("#", 1)[0].replace(",", " ").split()
            if not fields:
                continue
            if len(fields) not in (2, 3) or not all(f.isdigit() for f in fields):
                raise PlanError(f"{file}:{number}: expected 'PROMPT OUTPUT [COUNT]' (non-negative integers), got {line.strip()!r}")
            out.append((int(fields[0]), int(fields[1]), int(fields[2]) if len(fields) == 3 else 1))
    return out


# ---------------------------------------------------------------- the report


@dataclass
class PoolReport:
    id: str
    layers: int | None
    sliding_window: int | None
    layer_groups: int | None
    bytes_per_token: int | None  # all layers of the pool, all TP ranks
    bytes_per_token_per_gpu: int | None
    block_bytes: int  # one block of the pool's layers, all TP ranks
    block_bytes_per_gpu: int | None
    blocks_per_request_at_cap: int | None


@dataclass
class GroupReport:
    """One KV-cache group as vLLM forms it: a block table over some layers of one type."""

    index: int
    pool: str  # the layer type's pool id (full, sliding-W, linear-attention)
    kind: str  # full_attention | sliding_attention | linear_attention
    sliding_window: int | None
    layers: list[int]  # the model's layer indices in this group
    padding_layers: int  # layers the group lacks to the group size
    block_size: int  # tokens per block (a state group: the attention block size)
    page_bytes_per_gpu: int  # one block of one of its layers on one GPU (padded)
    page_padding_bytes_per_gpu: int
    state_bytes_per_gpu: int | None  # one sequence's state of one layer (state groups)
    blocks_per_request_at_cap: int


@dataclass
class Report:
    origin: str  # "model" or "live"
    source: str  # the config path or the URL
    device: dict[str, Any]
    shapes: dict[str, Any]
    weights: dict[str, Any] | None
    pools: list[PoolReport]
    terms: list[Term]
    unknown_terms: list[str]
    kv: dict[str, Any]
    concurrency: dict[str, Any]
    verdict: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    groups: list[GroupReport] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "origin": self.origin,
            "source": self.source,
            "device": self.device,
            "shapes": self.shapes,
            "weights": self.weights,
            "pools": [dataclasses.asdict(p) for p in self.pools],
            "kv_cache_groups": [dataclasses.asdict(g) for g in self.groups],
            "budget": {
                "per_gpu": True,
                "terms": [dataclasses.asdict(t) for t in self.terms],
                "unknown_terms": self.unknown_terms,
            },
            "kv": self.kv,
            "concurrency": self.concurrency,
            "verdict": self.verdict,
            "notes": self.notes,
        }


def terms_basis(terms: Sequence[Term]) -> str:
    return "estimate" if any(t.source == "estimate" for t in terms) else "hard"


def budget_verdict(
    total: int | None,
    terms: list[Term],
    unknown: list[str],
    min_kv_bytes: int,
    kv_bytes: int | None,
    extra_failures: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """Whether weights + workspace + runtime_buffers + reserve + kv_pool <= total closes with
    a KV pool that holds one request at its cap (and the null block), and if not, which term
    breaks it."""
    by = {t.category: t.bytes for t in terms}
    estimates = sorted({t.category for t in terms if t.source == "estimate"})
    failures: list[tuple[str, str]] = []
    if total is None:
        closes: bool | None = None
        message = "no device memory given (--gpu or --gpu-memory): the budget inequality is not checked"
    elif unknown:
        closes = None
        message = f"cannot decide: {', '.join(unknown)} not given (SIZE:measured, :configured or :estimate)"
        failures.append((unknown[0], "not given"))
    else:
        term = breaking_term(total, by)
        kv = by.get("kv_pool", 0)
        if term is not None:
            closes = False
            message = (f"{' + '.join(f'{c} {_gib(by[c])}' for c in PLAN_TERM_ORDER if c in by)} "
                       f"= {_gib(sum(by.values()))} exceeds the device's {_gib(total)}; {term} breaks it")
            failures.append((term, "exceeds the device"))
        elif kv < min_kv_bytes:
            closes = False
            message = (f"the KV pool ({_gib(kv)} per GPU) cannot hold one request at its cap "
                       f"({_gib(min_kv_bytes)} with the null block); kv_pool breaks it")
            failures.append(("kv_pool", "below one request at its cap"))
        else:
            closes = True
            if (kv_bytes is not None and "kv_pool" in by and total - sum(by.values()) > 0) or min_kv_bytes == 0:
                message = f"slack {_gib(total - sum(by.values()))} per GPU beside the KV pool"
            else:
                message = (f"the KV pool left ({_gib(kv)} per GPU) holds one request at its cap "
                           f"({_gib(min_kv_bytes)}) and more")
    if kv_bytes is not None and kv_bytes < min_kv_bytes and not failures:
        closes = False
        message = (f"the KV pool ({_gib(kv_bytes)} per GPU) cannot hold one request at its cap "
                   f"({_gib(min_kv_bytes)}); kv_pool breaks it")
        failures.append(("kv_pool", "below one request at its cap"))
    for term, why in extra_failures:
        failures.append((term, why))
        if closes is not False:
            closes = False
            message = f"{why}; {term} breaks it"
    if closes and estimates:
        message += f"; rests on estimates ({', '.join(estimates)}): not a hard guarantee"
    elif closes is False and estimates and total is not None and not extra_failures:
        # a failure rests on the estimates when the other terms alone would close
        derived = any(t.category == "kv_pool" and t.source == "derived" for t in terms)
        hard = {c: b for c, b in by.items() if c not in estimates and not (derived and c == "kv_pool")}
        pool = total - sum(hard.values()) if derived else by.get("kv_pool", 0)
        if breaking_term(total, hard) is None and pool >= min_kv_bytes:
            message += f"; rests on estimates ({', '.join(estimates)}): without them it would close"
    return {
        "closes": closes,
        "breaking_term": failures[0][0] if failures else None,
        "failures": [{"term": t, "why": w} for t, w in failures],
        "rests_on_estimates": estimates,
        "message": message,
    }


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"
