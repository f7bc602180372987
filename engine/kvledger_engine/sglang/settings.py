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
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

ENV_LEDGER = "KVLEDGER_SGLANG_LEDGER"
ENV_TENANT = "KVLEDGER_SGLANG_TENANT"
ENV_INTERVAL = "KVLEDGER_SGLANG_INTERVAL"
ENV_UNTESTED = "KVLEDGER_SGLANG_UNTESTED"
TENANT_MODES = ("", "priority")
DP_PLACEHOLDER = "{dp_rank}"


class SettingsError(ValueError):
    """A setting the plugin cannot use; the message names the variable."""


@dataclass(frozen=True)
class Settings:
    address: str  # as given, with {dp_rank} possibly in it
    tenant_mode: str = ""
    min_interval: float = 0.1
    allow_untested: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings | None:
        """The settings, or None when the plugin is not enabled."""
        env = os.environ if env is None else env
        address = env.get(ENV_LEDGER, "").strip()
        if not address:
            return None
        tenant = env.get(ENV_TENANT, "").strip()
        if tenant not in TENANT_MODES:
            raise SettingsError(f"{ENV_TENANT}={tenant!r}: expected priority (or unset)")
        raw = env.get(ENV_INTERVAL, "").strip()
        interval = 0.1
        if raw:
            try:
                interval = float(raw)
            except ValueError:
                interval = math.nan
            if not (math.isfinite(interval) and 0 < interval <= 60):
                raise SettingsError(f"{ENV_INTERVAL}={raw!r}: expected seconds in (0, 60]")
        settings = cls(address, tenant, interval, env.get(ENV_UNTESTED, "").strip() in ("1", "true", "yes"))
        settings.endpoint(0, 1)  # validates the address
        return settings

    def endpoint(self, dp_rank: int, dp_size: int) -> tuple[str, str]:
        """("unix", path) or ("http", "host:port") for this data-parallel rank."""
        if DP_PLACEHOLDER not in self.address and (dp_size > 1 or dp_rank > 0):
            raise SettingsError(
                f"{ENV_LEDGER}={self.address!r}: with {max(dp_size, dp_rank + 1)} data-parallel ranks the address must "
                f"contain {DP_PLACEHOLDER} (each rank serves its own pool)"
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
            f"{ENV_LEDGER}={self.address!r}: expected unix:///absolute/path, an absolute socket path or http://host:port"
        )
