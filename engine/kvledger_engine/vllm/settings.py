"""The integration's settings: environment variables of the vLLM process.

- ``KVLEDGER_VLLM_LEDGER`` (the one setting that enables it): where to serve the ledger,
  ``unix:///path/to/socket`` or an absolute socket path, or ``http://127.0.0.1:PORT``.
  ``{dp_rank}`` in it is replaced by the data-parallel rank; with data parallelism it must
  be there (each rank is its own process and serves its own pool). The rank is what vLLM
  gives the engine core: for a dense model vLLM makes every rank an independent engine
  (``data_parallel_size`` 1, ``data_parallel_rank`` 0) and only ``data_parallel_index``
  tells the ranks apart, so a rank above 0 is data parallelism whatever the size says; rank
  0 of such an engine cannot tell, and a second engine core claiming an address already
  served is refused when it binds (``engine_core.claim_address``).
- ``KVLEDGER_VLLM_TENANT``: ``priority`` (the request's priority, as text) or ``request``
  (``vllm_xargs.kvledger_tenant`` of the request body, which the ``TenantHeader``
  middleware fills from a header); unset: no tenant.
- ``KVLEDGER_VLLM_INTERVAL``: the shortest time between two publications, in seconds
  (default 0.1; the publication's own cost can stretch it, see ``tracker.Throttle``).
- ``KVLEDGER_VLLM_UNTESTED=1``: try a vLLM release the integration was not tested with.

The parsing is every plugin's (``kvledger_engine.plugin_settings``); this module holds what
is vLLM's: the names, the tenant modes and the data-parallel rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger_engine.plugin_settings import DP_PLACEHOLDER, EnvNames, PluginSettings, SettingsError

__all__ = ["DP_PLACEHOLDER", "ENV_INTERVAL", "ENV_LEDGER", "ENV_TENANT", "ENV_UNTESTED", "TENANT_MODES", "Settings", "SettingsError"]

ENV = EnvNames.for_engine("VLLM")
ENV_LEDGER, ENV_TENANT, ENV_INTERVAL, ENV_UNTESTED = ENV.ledger, ENV.tenant, ENV.interval, ENV.untested
TENANT_MODES = ("", "priority", "request")


@dataclass(frozen=True)
class Settings(PluginSettings):
    ENV = ENV
    TENANT_MODES = TENANT_MODES
    TENANT_EXPECTED = "one of priority, request"

    def placeholder_needed(self, dp_rank: int, dp_size: int) -> str | None:
        """``dp_rank``: vLLM's ``data_parallel_index``; ``dp_size``: what the engine core's
        configuration says (1 for every rank of a dense model, module docstring)."""
        if dp_size > 1:
            return f"with {dp_size} data-parallel ranks"
        if dp_rank > 0:
            return f"this engine core is data-parallel rank {dp_rank}:"
        return None
