"""The SGLang plugin's settings: environment variables of the SGLang server.

- ``KVLEDGER_SGLANG_LEDGER`` (the one setting that enables it): where to serve the ledger,
  ``unix:///path/to/socket`` or an absolute socket path, or ``http://127.0.0.1:PORT``.
  ``{dp_rank}`` in it is replaced by the data-parallel rank; with data parallelism it must
  be there (each rank's scheduler holds its own pool). Only the first tensor- and
  pipeline-parallel rank of a data-parallel rank serves: the others hold the same pages.
- ``KVLEDGER_SGLANG_TENANT``: ``priority`` (the request's priority, as text; SGLang takes it
  from the request body's ``priority``) or unset: no tenant.
- ``KVLEDGER_SGLANG_INTERVAL``: the shortest time between two publications, in seconds
  (default 0.1; the publication's own cost can stretch it, see ``vllm.tracker.Throttle``).
- ``KVLEDGER_SGLANG_UNTESTED=1``: try an SGLang release the plugin was not tested with.

The parsing is every plugin's (``kvledger_engine.plugin_settings``); this module holds what
is SGLang's: the names, the tenant modes and the data-parallel rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger_engine.plugin_settings import DP_PLACEHOLDER, EnvNames, PluginSettings, SettingsError

__all__ = ["DP_PLACEHOLDER", "ENV_INTERVAL", "ENV_LEDGER", "ENV_TENANT", "ENV_UNTESTED", "TENANT_MODES", "Settings", "SettingsError"]

ENV = EnvNames.for_engine("SGLANG")
ENV_LEDGER, ENV_TENANT, ENV_INTERVAL, ENV_UNTESTED = ENV.ledger, ENV.tenant, ENV.interval, ENV.untested
TENANT_MODES = ("", "priority")


@dataclass(frozen=True)
class Settings(PluginSettings):
    ENV = ENV
    TENANT_MODES = TENANT_MODES
    TENANT_EXPECTED = "priority"

    def placeholder_needed(self, dp_rank: int, dp_size: int) -> str | None:
        """SGLang tells the scheduler its rank and the size alike: either above one is data parallelism."""
        if dp_size > 1 or dp_rank > 0:
            return f"with {max(dp_size, dp_rank + 1)} data-parallel ranks"
        return None
