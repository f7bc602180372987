"""Accounts as the daemon makes them, for tests and benchmarks that start from a Snapshot.

``accounts_of`` runs the collector's own accounting step (``collect.accounting.
account_snapshot``: the label limits, the policy of each engine alone, the render check,
the GPUs) over a Snapshot, as if no engine had been accounted before; there is no second
accounting path to drift from it. Where the daemon would mark an engine (or the GPU
facts) invalid and export the others, this raises that engine's exception: a test that
builds facts the daemon cannot carry sees why. The Snapshot's source health is copied
into the Accounts, as the collector publishes its sources' health.

``render_check=no_render_check`` leaves the exposition check out, for the tests of that
check itself (they build Accounts the renderer must refuse).
"""

from __future__ import annotations

from kvledger.collect.accounting import AccountCache, RenderCheck, account_snapshot
from kvledger.config.types import LimitsConfig
from kvledger.domain.accounts import Accounts
from kvledger.domain.facts import Snapshot
from kvledger.output.prometheus import check_renderable


def no_render_check(accounts: Accounts) -> None:
    """A render check that lets everything through."""


def accounts_of(snapshot: Snapshot, *, limits: LimitsConfig | None = None, render_check: RenderCheck = check_renderable) -> Accounts:
    """The Accounts the daemon's accounting step makes of ``snapshot`` (see the module's doc)."""
    result = account_snapshot(snapshot, {}, limits or LimitsConfig(), AccountCache(), render_check)
    for exc in result.invalid.values():
        raise exc
    if result.gpu_error is not None:
        raise result.gpu_error
    accounts = result.accounts
    accounts.health = list(snapshot.health)
    return accounts
