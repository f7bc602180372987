"""Accounting as a pure step: the assembled Snapshot in, the Accounts and what accounting
observed out.

``account_snapshot`` is the part of a collector cycle that turns facts into numbers. It
does no I/O, starts no thread, reads no clock and logs nothing; it touches no source and
no health. The collector (``collector.py``) keeps the polling (threads, deadlines,
health), assembles the Snapshot, calls this step and applies what it returns: it adds the
findings of fresh polls to its totals, marks the sources of invalid engines down
(``invalid``) and logs.

Isolation (docs/design.md §3b): each engine is accounted and render-checked alone. An
engine whose facts the label limits, the policy or the renderer cannot carry is *invalid*:
it is reported in ``AccountingResult.invalid`` with the exception, and, when its facts
came from a source and the configuration names the engine, it is accounted from its
configured facts alone (like an engine whose source is down); otherwise it is left out.
GPU facts that cannot be accounted or rendered are reported in ``gpu_error`` and no GPU is
accounted. Every other engine's numbers are unaffected.

The render check belongs to the output side (``output.prometheus.check_renderable``); the
caller passes it in, so nothing in this module reads the metric catalogue.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvledger.collect.label_limits import LabelLimitError, LimitCounts, limit_labels
from kvledger.collect.sources.base import Contribution, EngineContribution
from kvledger.config.types import LimitsConfig
from kvledger.domain.accounts import Accounts, EngineAccount
from kvledger.domain.facts import EngineFacts, Sharing, Snapshot
from kvledger.policy.device_budget import budget_terms, gpu_accounts
from kvledger.policy.engine_accounts import engine_account, engine_violations

#: raises (ValueError) unless every sample of the Accounts can be exported
RenderCheck = Callable[[Accounts], None]


@dataclass(frozen=True, eq=False)
class EngineInputs:
    """What one engine's facts in the assembled Snapshot were made from."""

    #: the engine's configured facts (the object the configuration holds, not a copy);
    #: None for an engine that only a source names
    configured: EngineFacts | None = None
    #: the contributions applied to the engine, in the order they were applied
    contributions: tuple[Contribution, ...] = ()

    @property
    def reported(self) -> bool:
        """A source gave the engine's primary facts (an EngineContribution was applied)."""
        return any(isinstance(c, EngineContribution) for c in self.contributions)


@dataclass(frozen=True, eq=False)
class AccountKey:
    """Everything an engine's account is a function of: its configured facts, the
    contributions applied to them in order, the sharing rule and the label limits.

    Two keys are the same (``same_as``) when the sharing rule is equal and every other
    part is the very same object (``is``). Identity is sound because none of these
    objects changes once made: the configured facts are built once per configuration (the
    collector assembles from copies of them), a Contribution is what one poll returned
    and is never modified afterwards (a source that finds nothing new, e.g. on HTTP 304,
    hands back the same object; anything new is a new object), and a LimitsConfig is
    frozen. An engine's assembled facts are determined by its configured facts and the
    contributions applied to it, in order; its account by those facts, the sharing rule
    and the limits. The key holds the objects themselves, not their ``id()``, so an id
    can never be recycled while an entry refers to it. Identity rather than equality also
    keeps a cache hit cheap: comparing facts by value would cost as much as accounting."""

    configured: EngineFacts | None
    contributions: tuple[Contribution, ...]
    sharing: Sharing
    limits: LimitsConfig

    def same_as(self, other: AccountKey) -> bool:
        return (
            self.configured is other.configured
            and self.sharing == other.sharing
            and self.limits is other.limits
            and len(self.contributions) == len(other.contributions)
            and all(a is b for a, b in zip(self.contributions, other.contributions, strict=True))
        )


@dataclass(frozen=True)
class CachedAccount:
    """An account made from the engine's own facts (limited, accounted and render-checked),
    with the key it was made under and the label values limiting counted on the way."""

    key: AccountKey
    account: EngineAccount
    limited: LimitCounts


class AccountCache:
    """Each engine's latest account, by engine name, kept while its key stays the same
    (``AccountKey``): an idle engine's unchanged document is not accounted and checked
    again every cycle. Only accounts of an engine's own facts are kept (never one made
    from its configured facts after its facts were invalid); each cycle keeps the entries
    of the engines it accounted and forgets the others.

    The collector owns one and passes it to every ``account_snapshot``; it is not thread
    safe (one cycle at a time uses it)."""

    def __init__(self) -> None:
        self._entries: dict[str, CachedAccount] = {}

    def lookup(self, engine: str, key: AccountKey) -> CachedAccount | None:
        """The cached account of ``engine`` if it was made under the same ``key``."""
        entry = self._entries.get(engine)
        if entry is None or not entry.key.same_as(key):
            return None
        return entry

    def replace(self, entries: dict[str, CachedAccount]) -> None:
        """Keep ``entries`` (engine name -> account) and forget every other engine."""
        self._entries = entries

    def engines(self) -> list[str]:
        return list(self._entries)


@dataclass
class AccountingResult:
    """What one accounting step produced.

    ``accounts`` holds the engines (in Snapshot order, those that could be accounted), the
    GPUs, the budget terms, the driver version, the sharing rule and the time of the
    Snapshot; its health and cumulative totals are left empty (the collector's to fill).
    ``limited`` and ``invariants`` are the findings of each engine's facts, whether or not
    its account was reused: the collector counts them once per fresh poll."""

    accounts: Accounts
    #: engine -> label values of its facts shortened or dropped, by (label, action)
    limited: dict[str, LimitCounts] = field(default_factory=dict)
    #: engine -> the invariant checks its account (from its own facts) violates
    invariants: dict[str, list[str]] = field(default_factory=dict)
    #: engine -> why its facts could not be accounted or rendered
    invalid: dict[str, BaseException] = field(default_factory=dict)
    #: why the GPU facts could not be accounted or rendered (no GPU is accounted then)
    gpu_error: BaseException | None = None


def engine_findings(facts: EngineFacts, limits: LimitsConfig) -> tuple[LimitCounts, list[str]]:
    """What ``account_snapshot`` finds in one engine's facts, without accounting them: the
    label values limiting counted and the invariant checks violated (the collector counts
    them at every fresh poll, also in the cycles that make no Accounts). Facts the label
    limits or the policy cannot carry give what was found up to there: the account made
    for the next read reports them invalid, naming why."""
    try:
        limited_facts, limited = limit_labels(facts, limits)
    except LabelLimitError as exc:
        return exc.counts, []
    try:
        return limited, engine_violations(limited_facts)
    except Exception:  # the account names it (invalid)
        return limited, []


def alone(account: EngineAccount, snapshot: Snapshot) -> Accounts:
    """Accounts holding one engine only (and its budget terms), to render it alone."""
    return Accounts([account], [], budget_terms([account.facts]), None, [], snapshot.sharing, snapshot.taken_at)


def account_snapshot(
    snapshot: Snapshot,
    inputs: Mapping[str, EngineInputs],
    limits: LimitsConfig,
    cache: AccountCache,
    render_check: RenderCheck,
) -> AccountingResult:
    """Account the assembled ``snapshot`` one engine at a time (see the module's doc).

    ``inputs`` says what each engine's facts were made from (an engine missing from it
    has neither configured facts nor contributions); it keys the ``cache``, which this
    step reads and then updates to this cycle's accounts. ``snapshot`` is not modified."""
    sharing = snapshot.sharing
    result = AccountingResult(Accounts([], [], [], snapshot.driver_version, [], sharing, snapshot.taken_at))
    kept: dict[str, CachedAccount] = {}
    for facts in snapshot.engines:
        name = facts.name
        given = inputs.get(name) or EngineInputs()
        key = AccountKey(given.configured, given.contributions, sharing, limits)
        cached = cache.lookup(name, key)
        if cached is not None:  # the same inputs as last cycle: the same account, already checked
            result.accounts.engines.append(cached.account)
            result.limited[name] = cached.limited
            result.invariants[name] = list(cached.account.invariant_violations)
            kept[name] = cached
            continue
        limited: LimitCounts | None = None
        try:
            limited_facts, limited = limit_labels(facts, limits)
            result.limited[name] = limited
            account = engine_account(limited_facts, sharing)
            render_check(alone(account, snapshot))
        except Exception as exc:  # facts the label limits, the policy or the renderer cannot carry
            if isinstance(exc, LabelLimitError):
                result.limited[name] = exc.counts
            result.invalid[name] = exc
            fallback = _configured_account(given, snapshot, render_check)
            if fallback is not None:
                result.accounts.engines.append(fallback)
            continue
        result.invariants[name] = list(account.invariant_violations)
        result.accounts.engines.append(account)
        kept[name] = CachedAccount(key, account, limited)
    cache.replace(kept)

    engines = [a.facts for a in result.accounts.engines]
    terms = budget_terms(engines)
    result.accounts.budget = terms
    try:
        gpus = gpu_accounts(dataclasses.replace(snapshot, engines=engines), terms)
        render_check(Accounts([], gpus, terms, snapshot.driver_version, [], sharing, snapshot.taken_at))
    except Exception as exc:  # GPU facts that cannot be accounted fail the GPUs alone
        result.gpu_error = exc
        result.accounts.driver_version = None
        gpus = []
    result.accounts.gpus = gpus
    return result


def _configured_account(given: EngineInputs, snapshot: Snapshot, render_check: RenderCheck) -> EngineAccount | None:
    """An invalid engine's account from what the configuration alone says of it (like an
    engine whose source is down), if a source reported it and the configuration names it
    and those facts can be accounted and rendered; else None (the engine is left out)."""
    if given.configured is None or not given.reported:
        return None
    try:
        account = engine_account(dataclasses.replace(given.configured), snapshot.sharing)
        render_check(alone(account, snapshot))
    except Exception:
        return None
    return account

