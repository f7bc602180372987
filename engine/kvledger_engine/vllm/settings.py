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
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

ENV_LEDGER = "KVLEDGER_VLLM_LEDGER"
ENV_TENANT = "KVLEDGER_VLLM_TENANT"
ENV_INTERVAL = "KVLEDGER_VLLM_INTERVAL"
ENV_UNTESTED = "KVLEDGER_VLLM_UNTESTED"
TENANT_MODES = ("", "priority", "request")
DP_PLACEHOLDER = "{dp_rank}"


class SettingsError(ValueError):
    """A setting the integration cannot use; the message names the variable."""


@dataclass(frozen=True)
class Settings:
    address: str  # as given, with {dp_rank} possibly in it
    tenant_mode: str = ""
    min_interval: float = 0.1
    allow_untested: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings | None:
        """The settings, or None when the integration is not enabled."""
        env = os.environ if env is None else env
        address = env.get(ENV_LEDGER, "").strip()
        if not address:
            return None
        tenant = env.get(ENV_TENANT, "").strip()
        if tenant not in TENANT_MODES:
            raise SettingsError(f"{ENV_TENANT}={tenant!r}: expected one of priority, request (or unset)")
        raw_interval = env.get(ENV_INTERVAL, "").strip()
        interval = 0.1
        if raw_interval:
            try:
                interval = float(raw_interval)
            except ValueError:
                interval = math.nan
            if not (math.isfinite(interval) and 0 < interval <= 60):
                raise SettingsError(f"{ENV_INTERVAL}={raw_interval!r}: expected seconds in (0, 60]")
        settings = cls(address, tenant, interval, env.get(ENV_UNTESTED, "").strip() in ("1", "true", "yes"))
        settings.endpoint(0, 1)  # validates the address
        return settings

    def endpoint(self, dp_rank: int, dp_size: int) -> tuple[str, str]:
        """("unix", path) or ("http", "host:port") for this rank (``dp_rank``: vLLM's
        ``data_parallel_index``; ``dp_size``: what the engine core's configuration says)."""
        if DP_PLACEHOLDER not in self.address:
            if dp_size > 1:
                raise SettingsError(
                    f"{ENV_LEDGER}={self.address!r}: with {dp_size} data-parallel ranks the address must contain "
                    f"{DP_PLACEHOLDER} (each rank serves its own pool)"
                )
            if dp_rank > 0:
                raise SettingsError(
                    f"{ENV_LEDGER}={self.address!r}: this engine core is data-parallel rank {dp_rank}: the address "
                    f"must contain {DP_PLACEHOLDER} (each rank serves its own pool)"
                )
        address = self.address.replace(DP_PLACEHOLDER, str(dp_rank))
        if address.startswith("/"):
            return "unix", address
        parts = urlsplit(address)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme == "unix" and parts.path.startswith("/") and not parts.netloc:
            return "unix", parts.path
        if parts.scheme == "http" and parts.hostname and port is not None and parts.path in ("", "/"):
            return "http", f"{parts.hostname}:{port}"
        raise SettingsError(
            f"{ENV_LEDGER}={self.address!r}: expected unix:///absolute/path, an absolute socket path "
            "or http://host:port"
        )
