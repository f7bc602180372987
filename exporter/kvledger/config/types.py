"""The typed configuration: what a YAML file (``loader``) becomes, with its defaults and bounds.

Frozen dataclasses only; nothing here reads a file or knows the engine kinds' table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvledger.domain.facts import (
    Admission,
    LimitKind,
    NvmlEnabled,
    Overflow,
    Sharing,
    TermSource,
)

DEFAULT_LISTEN = "0.0.0.0:9477"
DEFAULT_INTERVAL = 1.0
DEFAULT_TIMEOUT = 2.0
DEFAULT_MAX_RESPONSE_BYTES = 16 << 20
#: the memory engine answers in flight may hold, all engines together (kvledger.collect.poll_budget)
DEFAULT_MEMORY_BUDGET_BYTES = 256 << 20
DEFAULT_MAX_TENANTS = 100
DEFAULT_MAX_POOLS = 64
DEFAULT_MAX_LABEL_LENGTH = 128
#: polling faster than this costs CPU for no information (1 ms polling took 0.78 cores)
MIN_INTERVAL = 0.1
MAX_INTERVAL = 3600.0
MIN_TIMEOUT = 0.1
MAX_TIMEOUT = 600.0


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the key path."""


@dataclass(frozen=True)
class SizeWithSource:
    value: int
    source: TermSource = "configured"


@dataclass(frozen=True)
class LimitConfig:
    value: float
    kind: LimitKind = "hard"


@dataclass(frozen=True)
class ModelDerivation:
    """Derive bytes per block from a model's config.json."""

    config: str
    kv_dtype: str = "auto"
    tensor_parallel: int = 1


@dataclass(frozen=True)
class ProcessMatch:
    match: str | None = None  # substring of the process command line
    pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class HostConfig:
    port: int | None = None
    output_buffer_limit_bytes: LimitConfig | None = None
    network_queue_limit: LimitConfig | None = None


@dataclass(frozen=True)
class TenantConfig:
    name: str
    quota_bytes: int


@dataclass(frozen=True)
class MemoryConfig:
    """Budget terms declared in configuration, by category (bytes per GPU of the engine)."""

    terms: Mapping[str, SizeWithSource] = field(default_factory=dict)


class Secret(str):
    """A credential read from the configuration: a str whose repr and str never show it
    (a configuration or an engine entry printed or logged names it ``<secret>``); the value
    is ``reveal()``, for the request header alone."""

    __slots__ = ()

    def reveal(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return "<secret>"

    def __str__(self) -> str:
        return "<secret>"

    def __format__(self, spec: str) -> str:
        return "<secret>"


@dataclass(frozen=True)
class AuthorizationConfig:
    """Prometheus scrape_config's ``authorization``: ``Authorization: TYPE CREDENTIALS``."""

    type: str = "Bearer"
    credentials: Secret | None = None
    credentials_file: str | None = None  # read at every request, trailing whitespace dropped (rotation)


@dataclass(frozen=True)
class BasicAuthConfig:
    """Prometheus scrape_config's ``basic_auth``."""

    username: str
    password: Secret | None = None
    password_file: str | None = None  # read at every request, trailing whitespace dropped (rotation)


@dataclass(frozen=True)
class TlsClientConfig:
    """Prometheus scrape_config's ``tls_config`` for https:// engines."""

    ca_file: str | None = None  # else the system's CAs
    cert_file: str | None = None  # a client certificate (mTLS), with key_file
    key_file: str | None = None
    server_name: str | None = None  # SNI and the name the certificate must carry, else the URL's host
    insecure_skip_verify: bool = False


@dataclass(frozen=True)
class ClientAuth:
    """What an engine's HTTP sources present: at most one of authorization and basic_auth,
    and the TLS settings of https:// URLs."""

    authorization: AuthorizationConfig | None = None
    basic_auth: BasicAuthConfig | None = None
    tls_config: TlsClientConfig | None = None


@dataclass(frozen=True)
class EngineConfig:
    name: str
    kind: str
    url: str
    timeout_seconds: float = DEFAULT_TIMEOUT
    #: the kind's own keys (engine_kinds: EngineKind.options), as (name, value) pairs
    options: tuple[tuple[str, str], ...] = ()
    admission: Admission | None = None
    overflow: Overflow | None = None
    block_bytes: int | None = None
    model: ModelDerivation | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpus: tuple[int, ...] = ()
    processes: ProcessMatch | None = None
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    host: HostConfig = field(default_factory=HostConfig)
    tenants: tuple[TenantConfig, ...] = ()
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    #: the most lines of Prometheus text read from one answer (None: MAX_TEXT_LINES)
    max_response_lines: int | None = None
    #: how its HTTP sources authenticate and verify the engine (Prometheus scrape_config's keys)
    authorization: AuthorizationConfig | None = None
    basic_auth: BasicAuthConfig | None = None
    tls_config: TlsClientConfig | None = None

    @property
    def client_auth(self) -> ClientAuth | None:
        """The engine's authentication and TLS settings for its HTTP clients; None when it has none."""
        if self.authorization is None and self.basic_auth is None and self.tls_config is None:
            return None
        return ClientAuth(self.authorization, self.basic_auth, self.tls_config)

    def option(self, name: str) -> str | None:
        """The value of one of the kind's own keys, or None when not configured."""
        return dict(self.options).get(name)


@dataclass(frozen=True)
class LimitsConfig:
    """Bounds on what engine data may add to the exported series (cardinality)."""

    tenants_per_engine: int = DEFAULT_MAX_TENANTS  # configured tenants always count first
    pools_per_engine: int = DEFAULT_MAX_POOLS
    label_value_length: int = DEFAULT_MAX_LABEL_LENGTH
    #: bytes engine answers may hold while they stream in and are parsed, all engines together
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES


@dataclass(frozen=True)
class NvmlConfig:
    enabled: NvmlEnabled = "auto"


@dataclass(frozen=True)
class Config:
    listen: str = DEFAULT_LISTEN
    interval_seconds: float = DEFAULT_INTERVAL
    sharing: Sharing = "per-request"
    nvml: NvmlConfig = field(default_factory=NvmlConfig)
    engines: tuple[EngineConfig, ...] = ()
    json_view: bool = False
    otlp_endpoint: str | None = None
    path: str = "<config>"
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    #: exporter-toolkit web-config.yml (TLS, basic auth); relative to the config file's directory
    web_config_file: str | None = None
    #: what is valid but probably not meant (an empty file, no engines); the commands print or log them
    warnings: tuple[str, ...] = field(default=(), compare=False)
