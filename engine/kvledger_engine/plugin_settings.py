"""What every engine plugin reads from its engine's environment, parsed once for all of them.

Four variables, named ``KVLEDGER_<ENGINE>_LEDGER`` (the one that enables the plugin: where to
serve the ledger, ``unix:///path/to/socket`` or an absolute socket path, or
``http://host:PORT``, with ``{dp_rank}`` replaced by the data-parallel rank),
``KVLEDGER_<ENGINE>_TENANT`` (where a request's tenant comes from), ``KVLEDGER_<ENGINE>_INTERVAL``
(the shortest time between two publications, in seconds, default 0.1) and
``KVLEDGER_<ENGINE>_UNTESTED=1`` (try an engine release the plugin was not tested with).

A plugin's own settings module (``vllm/settings.py``, ``sglang/settings.py``) subclasses
``PluginSettings`` with what differs: its variables' names, its tenant modes and when its
address must hold ``{dp_rank}``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Self
from urllib.parse import urlsplit

DP_PLACEHOLDER = "{dp_rank}"


class SettingsError(ValueError):
    """A setting the plugin cannot use; the message names the variable."""


@dataclass(frozen=True)
class EnvNames:
    """The names of one engine's four variables."""

    ledger: str
    tenant: str
    interval: str
    untested: str

    @classmethod
    def for_engine(cls, engine: str) -> EnvNames:
        """``KVLEDGER_<ENGINE>_LEDGER`` and its siblings (``engine``: ``VLLM``, ``SGLANG``)."""
        prefix = f"KVLEDGER_{engine}_"
        return cls(f"{prefix}LEDGER", f"{prefix}TENANT", f"{prefix}INTERVAL", f"{prefix}UNTESTED")


@dataclass(frozen=True)
class PluginSettings:
    """One plugin's settings; a subclass sets the three class variables and ``placeholder_needed``."""

    address: str  # as given, with {dp_rank} possibly in it
    tenant_mode: str = ""
    min_interval: float = 0.1
    allow_untested: bool = False

    ENV: ClassVar[EnvNames]
    TENANT_MODES: ClassVar[tuple[str, ...]]  # "" (no tenant) first
    TENANT_EXPECTED: ClassVar[str]  # what the error message says is expected

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Self | None:
        """The settings, or None when the plugin is not enabled."""
        env = os.environ if env is None else env
        address = env.get(cls.ENV.ledger, "").strip()
        if not address:
            return None
        tenant = env.get(cls.ENV.tenant, "").strip()
        if tenant not in cls.TENANT_MODES:
            raise SettingsError(f"{cls.ENV.tenant}={tenant!r}: expected {cls.TENANT_EXPECTED} (or unset)")
        raw_interval = env.get(cls.ENV.interval, "").strip()
        interval = 0.1
        if raw_interval:
            try:
                interval = float(raw_interval)
            except ValueError:
                interval = math.nan
            if not (math.isfinite(interval) and 0 < interval <= 60):
                raise SettingsError(f"{cls.ENV.interval}={raw_interval!r}: expected seconds in (0, 60]")
        settings = cls(address, tenant, interval, env.get(cls.ENV.untested, "").strip() in ("1", "true", "yes"))
        settings.endpoint(0, 1)  # validates the address
        return settings

    def placeholder_needed(self, dp_rank: int, dp_size: int) -> str | None:
        """Why this rank's address must contain ``{dp_rank}``, the words that open the error
        message ("with 2 data-parallel ranks"), or None when one address serves; asked only of
        an address without the placeholder."""
        raise NotImplementedError

    def endpoint(self, dp_rank: int, dp_size: int) -> tuple[str, str]:
        """("unix", path) or ("http", "host:port") for this data-parallel rank."""
        if DP_PLACEHOLDER not in self.address:
            why = self.placeholder_needed(dp_rank, dp_size)
            if why is not None:
                raise SettingsError(
                    f"{self.ENV.ledger}={self.address!r}: {why} the address must contain {DP_PLACEHOLDER} "
                    "(each rank serves its own pool)"
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
            f"{self.ENV.ledger}={self.address!r}: expected unix:///absolute/path, an absolute socket path "
            "or http://host:port"
        )
