"""Configuration (YAML) loaded into typed objects.

Errors name the file, the key path and what is wrong; unknown keys are rejected so a
typo never passes silently, and so does a key given twice in one mapping. Sizes accept
integers or unit suffixes (``2GiB``, ``500MB``) up to 2**53 - 1 bytes; durations accept
seconds (``1.5``) or suffixed text (``500ms``, ``2s``, ``1m``); NaN and infinities are
rejected everywhere. ``interval_seconds`` lies in [``MIN_INTERVAL``, ``MAX_INTERVAL``]
(0.1 s .. 1 h), ``timeout_seconds`` in [``MIN_TIMEOUT``, ``MAX_TIMEOUT``] (0.1 s .. 10 min);
token budgets (``max_model_len`` ...) in 1 .. 2**30. A ``unix:`` URL is
``unix:///absolute/path``. The file must be UTF-8.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import yaml

from kvledger.config.engine_kinds import KINDS, PLANNED, kind_specific_keys
from kvledger.config.files import check_header_text, open_regular, read_regular, read_secret_file, why
from kvledger.config.listen import listen_address
from kvledger.config.types import (
    DEFAULT_INTERVAL,
    DEFAULT_LISTEN,
    DEFAULT_MAX_LABEL_LENGTH,
    DEFAULT_MAX_POOLS,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_MAX_TENANTS,
    DEFAULT_MEMORY_BUDGET_BYTES,
    DEFAULT_TIMEOUT,
    MAX_INTERVAL,
    MAX_TIMEOUT,
    MIN_INTERVAL,
    MIN_TIMEOUT,
    AuthorizationConfig,
    BasicAuthConfig,
    Config,
    ConfigError,
    EngineConfig,
    HostConfig,
    LimitConfig,
    LimitsConfig,
    MemoryConfig,
    ModelDerivation,
    NvmlConfig,
    ProcessMatch,
    Secret,
    SizeWithSource,
    TenantConfig,
    TlsClientConfig,
)
from kvledger.domain.facts import (
    ADMISSIONS,
    LIMIT_KINDS,
    NVML_ENABLED,
    OVERFLOWS,
    SHARINGS,
    TERM_SOURCES,
    Sharing,
)
from kvledger.domain.limits import MAX_SAFE_INT, MAX_TOKENS

#: largest integer a config list (gpus, pids) or count may hold
_MAX_ID = 2**31 - 1


# ---------------------------------------------------------------- value parsers

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "h": 3600.0}


def parse_size(value: object) -> int:
    """Bytes from an integer or a string with a unit (``2GiB``, ``500MB``, ``64k``)."""
    if isinstance(value, bool):
        raise ValueError("expected a size in bytes, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative ({value})")
        return _size_in_range(value, value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and value >= 0:
        return _size_in_range(value, value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            number = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
            if number.is_integer():
                return _size_in_range(number, value)
            raise ValueError(f"size {value!r} is not a whole number of bytes")
    raise ValueError(f"expected a size such as 2147483648, '2GiB' or '500MB', got {_brief(value)}")


def _size_in_range(number: float, given: object) -> int:
    if number > MAX_SAFE_INT:
        raise ValueError(f"size {_brief(given)} exceeds {MAX_SAFE_INT} bytes (2**53 - 1)")
    return int(number)


def _brief(value: object) -> str:
    text = repr(value) if not isinstance(value, int) or value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 60 else text[:57] + "..."


def parse_duration(value: object) -> float:
    """Seconds from a number or a string (``500ms``, ``2s``, ``1m``)."""
    if isinstance(value, bool):
        raise ValueError("expected a duration in seconds, got a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value) if not isinstance(value, int) or value.bit_length() <= 64 else math.inf
    elif isinstance(value, str) and (m := re.match(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|)\s*$", value)):
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    else:
        raise ValueError(f"expected a duration in seconds such as 1.5 or '500ms', got {_brief(value)}")
    if not math.isfinite(seconds):
        raise ValueError(f"a duration must be a finite number of seconds, got {_brief(value)}")
    if seconds <= 0:
        raise ValueError(f"a duration must be positive, got {_brief(value)}")
    return seconds


def _duration_in(minimum: float, maximum: float) -> Callable[[Any], float]:
    """parse_duration, bounded to [minimum, maximum] seconds."""

    def conv(value: Any) -> float:
        seconds = parse_duration(value)
        if not minimum <= seconds <= maximum:
            raise ValueError(f"must be between {minimum:g} s and {maximum:g} s, got {_brief(value)}")
        return seconds

    return conv


# ---------------------------------------------------------------- structure helpers

T = TypeVar("T")
D = TypeVar("D")
L = TypeVar("L", bound=str)


class MappingReader:
    """Walks a mapping, recording which keys were read, and names the key path in errors.

    ``keys``, when given, are the keys the mapping may hold: a missing required key is
    then reported together with the unknown keys given instead (a typo of it, mostly).
    Without them, unread keys that look like the missing one are named. Public: the web
    configuration (``kvledger.web.web_config``) is read with it too."""

    def __init__(self, file: str, path: str, data: object, keys: Iterable[str] = ()) -> None:
        self.file = file
        self.path = path
        if not isinstance(data, Mapping):
            raise self.error(f"expected a mapping, got {type(data).__name__}")
        self.data: Mapping[str, Any] = data
        self.seen: set[str] = set()
        self.keys = frozenset(keys)

    def error(self, message: str, key: str | None = None) -> ConfigError:
        where = self.path if key is None else (f"{self.path}.{key}" if self.path else key)
        return ConfigError(f"{self.file}: {where or '<top>'}: {message}")

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def get(self, key: str, conv: Callable[[Any], T], default: D) -> T | D:
        """conv(value) when the key is given (not null), else default."""
        self.seen.add(key)
        if key not in self.data or self.data[key] is None:
            return default
        return self._convert(key, conv)

    def require(self, key: str, conv: Callable[[Any], T]) -> T:
        if key not in self.data or self.data[key] is None:
            if self.keys:
                unknown = self._unknown(self.keys | self.seen)
            else:  # keys not declared: name only the unread keys that look like this one
                unread = [str(k) for k in self.data if k not in self.seen]
                unknown = sorted(difflib.get_close_matches(key, unread, n=3, cutoff=0.6))
            if unknown:
                raise self.error(f"{self._unknown_message(unknown, {key})}; {key} is required")
            raise self.error("is required", key)
        self.seen.add(key)
        return self._convert(key, conv)

    def _convert(self, key: str, conv: Callable[[Any], T]) -> T:
        try:
            return conv(self.data[key])
        except ConfigError:
            raise
        except (ValueError, TypeError) as exc:
            raise self.error(str(exc), key) from None

    def child(self, key: str, keys: Iterable[str] = ()) -> MappingReader | None:
        self.seen.add(key)
        if key not in self.data or self.data[key] is None:
            return None
        return MappingReader(self.file, f"{self.path}.{key}" if self.path else key, self.data[key], keys)

    def _unknown(self, known: Iterable[str]) -> list[str]:
        known = set(known)
        return sorted(str(k) for k in self.data if k not in known)

    def _unknown_message(self, unknown: list[str], valid: Iterable[str]) -> str:
        """"unknown key(s): a (did you mean b?), c" — the hint names the closest valid key."""
        candidates = sorted(set(valid) - {str(k) for k in self.data})
        named = []
        for name in unknown:
            close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
            named.append(f"{name} (did you mean {close[0]}?)" if close else name)
        return f"unknown key(s): {', '.join(named)}"

    def finish(self) -> None:
        unknown = self._unknown(self.seen)
        if unknown:
            raise self.error(self._unknown_message(unknown, self.keys | self.seen))


def _choice(options: tuple[L, ...]) -> Callable[[Any], L]:
    def conv(value: Any) -> L:
        if isinstance(value, bool):  # YAML turns true/false into booleans
            value = "true" if value else "false"
        for option in options:
            if value == option and isinstance(value, str):
                return option
        raise ValueError(f"must be one of {', '.join(options)}; got {value!r}")

    return conv


def _engine_kind(value: Any) -> str:
    if isinstance(value, str) and value in KINDS:
        return value
    if not KINDS:  # a program that reads a configuration without the kinds' registrations
        raise ValueError("no engine kind is registered: import kvledger.collect.sources.kinds first (the CLI does)")
    known = ", ".join(KINDS)
    if isinstance(value, str) and value in PLANNED:
        raise ValueError(
            f"kind {value!r} has no adapter in this release (kinds: {known}); "
            "an engine with an in-engine kvledger/v1 integration is kind: ledger"
        )
    raise ValueError(f"must be one of {known}; got {value!r}")


def _str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


def _pos_int(value: Any, maximum: int = _MAX_ID) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"expected a positive integer, got {_brief(value)}")
    if value > maximum:
        raise ValueError(f"must be at most {maximum}, got {_brief(value)}")
    return value


def _tokens(value: Any) -> int:
    """A token budget (max_model_len ...): 1 .. 2**30."""
    return _pos_int(value, MAX_TOKENS)


def _tokens_text(value: Any) -> str:
    """A kind's ``tokens`` option, kept as the decimal text of a token count in 1 .. 2**30."""
    return str(_tokens(value))


def _steps_text(value: Any) -> str:
    """A kind's ``steps`` option, kept as the decimal text of a number of engine steps in 1 .. 2**30."""
    return str(_pos_int(value, MAX_TOKENS))


def _nonneg_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_SAFE_INT:
        raise ValueError(f"expected a finite non-negative number, got {_brief(value)}")
    return float(value)


def _listen(raw: Any) -> str:
    """HOST:PORT, read as the --web.listen-address flag is (kvledger.config.listen)."""
    return listen_address(raw)


def _url(raw: Any) -> str:
    value = _str(raw)
    if not re.match(r"^(https?://|unix://|tcp://|ipc://)", value):
        raise ValueError(f"expected an http(s)://, unix://, tcp:// or ipc:// address, got {_brief(value)}")
    if value.startswith("unix://") and not re.match(r"^unix:///[^/]", value):
        # unix://etc/passwd would name host "etc" and path /passwd
        raise ValueError(f"a unix URL is unix:///absolute/path (three slashes), e.g. unix:///run/engine.sock; got {_brief(value)}")
    if re.match(r"^https?://[/?#]|^https?://$", value):
        raise ValueError(f"an http(s) URL needs a host, e.g. http://127.0.0.1:8000/metrics; got {_brief(value)}")
    return value


def _int_list(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_ID for v in value
    ):
        raise ValueError(f"expected a list of integers in [0, {_MAX_ID}], got {_brief(value)}")
    return tuple(value)


# ---------------------------------------------------------------- sections

def _size_with_source(r: MappingReader, key: str) -> SizeWithSource | None:
    raw = r.data.get(key)
    if raw is None:
        r.seen.add(key)
        return None
    if isinstance(raw, Mapping):
        c = r.child(key, ("value", "source"))
        assert c is not None
        out = SizeWithSource(c.require("value", parse_size), c.get("source", _choice(TERM_SOURCES), "configured"))
        c.finish()
        return out
    return SizeWithSource(r.get(key, parse_size, 0), "configured")


def _limit(r: MappingReader, key: str, conv: Callable[[Any], float]) -> LimitConfig | None:
    raw = r.data.get(key)
    if raw is None:
        r.seen.add(key)
        return None
    if isinstance(raw, Mapping):
        c = r.child(key, ("value", "kind"))
        assert c is not None
        out = LimitConfig(float(c.require("value", conv)), c.get("kind", _choice(LIMIT_KINDS), "hard"))
        c.finish()
        return out
    return LimitConfig(float(r.get(key, conv, 0)), "hard")


def _secret(value: Any) -> Secret:
    """A credential: a non-empty one-line string. Errors never show the value."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {type(value).__name__} (the value is not shown)")
    if any(c in value for c in "\r\n\x00"):
        raise ValueError("must be one line (the value is not shown)")
    return Secret(value)


def _header_secret(value: Any) -> Secret:
    """A credential sent in the Authorization header as it is (a bearer token): Latin-1,
    what a header can carry, checked now rather than failing every poll."""
    secret = _secret(value)
    check_header_text(secret.reveal(), "the credential")
    return secret


def _secret_file_in(base: Path | None, header: bool) -> Callable[[Any], str]:
    """A credentials or password file: a regular file holding one line, read now as every
    poll reads it (``header``: sent as it is, so Latin-1); its path is kept."""
    path_of = _file_in(base)

    def conv(value: Any) -> str:
        path = path_of(value)
        read_secret_file(path, header=header)
        return path

    return conv


def _auth_type(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", value):
        raise ValueError(f"expected an HTTP authentication scheme such as Bearer, got {_brief(value)}")
    if value.lower() == "basic":
        raise ValueError("type Basic is basic_auth's: give basic_auth: {username, password} instead")
    return value


def _username(value: Any) -> str:
    name = _str(value)
    if ":" in name or any(c in name for c in "\r\n\x00"):
        raise ValueError("a basic_auth username holds no colon and no line break")
    return name


def _file_in(base: Path | None) -> Callable[[Any], str]:
    """A path to a readable file, relative to the configuration file's directory."""

    def conv(value: Any) -> str:
        path = Path(_str(value))
        if base is not None and not path.is_absolute():
            path = base / path
        try:
            os.close(open_regular(path))  # a FIFO would block a plain open(): refused, never waited on
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {why(exc)}") from None
        return str(path)

    return conv


def _json_file_in(base: Path | None) -> Callable[[Any], str]:
    """A readable file holding a JSON object (a model's config.json), checked at load rather
    than when the engine first answers; relative to the configuration file's directory."""
    readable = _file_in(base)

    def conv(value: Any) -> str:
        path = readable(value)
        try:
            data = json.loads(read_regular(path))  # a regular file only, as _file_in checked
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a JSON file: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object (a model's config.json)")
        return path

    return conv


def _zmq_address(raw: Any) -> str:
    """A ZMQ endpoint (vLLM's KV events): tcp://HOST:PORT or ipc:///path; an http(s):// or
    unix:// URL is refused at load, naming the scheme to use."""
    value = _str(raw)
    if re.match(r"^(https?|unix)://", value):
        scheme = value.split(":", 1)[0]
        raise ValueError(f"KV events are a ZMQ endpoint, not {scheme}://: use tcp://HOST:PORT (vLLM's "
                         f"--kv-events-config endpoint) or ipc:///path; got {_brief(value)}")
    if not re.match(r"^(tcp://[^/]+:\d+$|ipc://.+)", value):
        raise ValueError(f"expected a ZMQ endpoint tcp://HOST:PORT or ipc:///path, got {_brief(value)}")
    return value


def _client_auth(r: MappingReader, url: str) -> tuple[AuthorizationConfig | None, BasicAuthConfig | None, TlsClientConfig | None]:
    """An engine's authorization, basic_auth and tls_config, checked as Prometheus checks a
    scrape_config's: at most one way to authenticate, a credential or its file (not both),
    a client certificate with its key; every file readable, the TLS ones loadable."""
    from kvledger.config.engine_tls import client_ssl_context

    base = Path(r.file).parent if r.file != "<config>" else None
    authorization = None
    if (a := r.child("authorization", ("type", "credentials", "credentials_file"))) is not None:
        authorization = AuthorizationConfig(a.get("type", _auth_type, "Bearer"), a.get("credentials", _header_secret, None),
                                            a.get("credentials_file", _secret_file_in(base, header=True), None))
        a.finish()
        if (authorization.credentials is None) == (authorization.credentials_file is None):
            raise a.error("give one of credentials and credentials_file")
    basic = None
    if (b := r.child("basic_auth", ("username", "password", "password_file"))) is not None:
        basic = BasicAuthConfig(b.require("username", _username), b.get("password", _secret, None),
                                b.get("password_file", _secret_file_in(base, header=False), None))
        b.finish()
        if basic.password is not None and basic.password_file is not None:
            raise b.error("give password or password_file, not both")
    if authorization is not None and basic is not None:
        raise r.error("give authorization or basic_auth, not both")
    if (authorization is not None or basic is not None) and re.match(r"^[a-z]+://[^/@]*@", url):
        raise r.error("the url carries credentials (user:password@) and so does "
                      f"{'authorization' if authorization is not None else 'basic_auth'}: give one", "url")
    tls = None
    keys = ("ca_file", "cert_file", "key_file", "server_name", "insecure_skip_verify")
    if (c := r.child("tls_config", keys)) is not None:
        tls = TlsClientConfig(c.get("ca_file", _file_in(base), None), c.get("cert_file", _file_in(base), None),
                              c.get("key_file", _file_in(base), None), c.get("server_name", _str, None),
                              c.get("insecure_skip_verify", parse_bool, False))
        c.finish()
        if (tls.cert_file is None) != (tls.key_file is None):
            raise c.error("cert_file and key_file go together (a client certificate and its key)")
        if not url.startswith("https://"):
            raise c.error("applies to https:// URLs; the url is not one")
        try:
            client_ssl_context(tls)
        except ValueError as exc:
            raise c.error(str(exc)) from None
    return authorization, basic, tls


_MEMORY_KEYS = {
    "weights_bytes": "weights",
    "workspace_bytes": "workspace",
    "runtime_buffers_bytes": "runtime_buffers",
    "reserve_bytes": "reserve",
    "kv_pool_bytes": "kv_pool",
}


def _engine(r: MappingReader, names: set[str]) -> EngineConfig:
    name = r.require("name", _str)
    if name in names:
        raise r.error(f"duplicate engine name {name!r}", "name")
    names.add(name)
    kind = r.require("kind", _engine_kind)
    owners = kind_specific_keys()
    foreign = sorted(k for k in map(str, r.data) if kind not in owners.get(k, (kind,)))
    if foreign:
        raise r.error(", ".join(f"{k} is for kind {' or '.join(owners[k])} only" for k in foreign)
                      + f" (this engine is kind {kind})")
    url = r.require("url", _url)
    authorization, basic_auth, tls_config = _client_auth(r, url)
    model = None
    if (m := r.child("model", ("config", "kv_dtype", "tensor_parallel"))) is not None:
        base = Path(r.file).parent if r.file != "<config>" else None
        model = ModelDerivation(
            m.require("config", _json_file_in(base)), m.get("kv_dtype", _str, "auto"), m.get("tensor_parallel", _pos_int, 1)
        )
        m.finish()
        if r.has("block_bytes"):  # two answers to one question: which one was meant is not ours to guess
            raise r.error("give block_bytes or model, not both (model derives block_bytes from config.json)")
    processes = None
    if (p := r.child("processes", ("match", "pids"))) is not None:
        processes = ProcessMatch(p.get("match", _str, None), p.get("pids", _int_list, ()))
        p.finish()
        if processes.match is None and not processes.pids:
            raise r.error("needs 'match' or 'pids'", "processes")
    memory = MemoryConfig()
    if (mem := r.child("memory", _MEMORY_KEYS)) is not None:
        terms = {}
        for key, category in _MEMORY_KEYS.items():
            term = _size_with_source(mem, key)
            if term is not None:
                terms[category] = term
        mem.finish()
        memory = MemoryConfig(terms)
    host = HostConfig()
    if (h := r.child("host", ("port", "output_buffer_limit_bytes", "network_queue_limit"))) is not None:
        port = h.get("port", _pos_int, None)
        if port is not None and port > 65535:
            raise h.error("must be a TCP port (1-65535)", "port")
        host = HostConfig(
            port,
            _limit(h, "output_buffer_limit_bytes", parse_size),
            _limit(h, "network_queue_limit", _pos_int),
        )
        h.finish()
    tenants: list[TenantConfig] = []
    r.seen.add("tenants")
    raw_tenants = r.data.get("tenants") or []
    if not isinstance(raw_tenants, list):
        raise r.error("expected a list of {name, quota_bytes}", "tenants")
    for i, raw in enumerate(raw_tenants):
        t = MappingReader(r.file, f"{r.path}.tenants[{i}]", raw, ("name", "quota_bytes"))
        tenants.append(TenantConfig(t.require("name", _str), t.require("quota_bytes", parse_size)))
        t.finish()
    if len({t.name for t in tenants}) != len(tenants):
        raise r.error("tenant names must be unique", "tenants")
    out = EngineConfig(
        name=name,
        kind=kind,
        url=url,
        timeout_seconds=r.get("timeout_seconds", _duration_in(MIN_TIMEOUT, MAX_TIMEOUT), DEFAULT_TIMEOUT),
        options=tuple(
            (o.name, value)
            for o in KINDS[kind].options
            if (value := r.get(o.name, _OPTION_READERS[o.value], None)) is not None
        ),
        admission=r.get("admission", _choice(ADMISSIONS), None),
        overflow=r.get("overflow", _choice(OVERFLOWS), None),
        block_bytes=r.get("block_bytes", parse_size, None),
        model=model,
        max_model_len=r.get("max_model_len", _tokens, None),
        max_num_batched_tokens=r.get("max_num_batched_tokens", _tokens, None),
        max_num_seqs=r.get("max_num_seqs", _tokens, None),
        gpus=r.get("gpus", _int_list, ()),
        processes=processes,
        memory=memory,
        host=host,
        tenants=tuple(tenants),
        max_response_bytes=r.get("max_response_bytes", _response_limit, DEFAULT_MAX_RESPONSE_BYTES),
        max_response_lines=r.get("max_response_lines", _line_limit, None),
        authorization=authorization,
        basic_auth=basic_auth,
        tls_config=tls_config,
    )
    r.finish()
    return out


def config_from_mapping(data: object, file: str = "<config>") -> Config:
    if data is None:
        data = {}
    top = MappingReader(file, "", data)
    listen = top.get("listen", _listen, DEFAULT_LISTEN)
    interval = top.get("interval_seconds", _duration_in(MIN_INTERVAL, MAX_INTERVAL), DEFAULT_INTERVAL)
    sharing: Sharing = "per-request"
    if (pol := top.child("policy")) is not None:
        sharing = pol.get("sharing", _choice(SHARINGS), "per-request")
        pol.finish()
    nvml = NvmlConfig()
    if (n := top.child("nvml")) is not None:
        nvml = NvmlConfig(n.get("enabled", _choice(NVML_ENABLED), "auto"))
        n.finish()
    json_view = top.get("json_view", parse_bool, False)
    otlp = None
    if (o := top.child("otlp", ("endpoint",))) is not None:
        otlp = o.require("endpoint", _url)
        o.finish()
    limits = LimitsConfig()
    if (lim := top.child("limits")) is not None:
        limits = LimitsConfig(
            lim.get("tenants_per_engine", _pos_int, DEFAULT_MAX_TENANTS),
            lim.get("pools_per_engine", _pos_int, DEFAULT_MAX_POOLS),
            lim.get("label_value_length", _label_length, DEFAULT_MAX_LABEL_LENGTH),
            lim.get("memory_budget_bytes", _memory_budget, DEFAULT_MEMORY_BUDGET_BYTES),
        )
        lim.finish()
    # checked at load: a missing file is named with the key that points to it
    web_config_file = top.get("web_config_file", _file_in(Path(file).parent if file != "<config>" else None), None)
    top.seen.add("engines")
    raw_engines = top.data.get("engines") or []
    if not isinstance(raw_engines, list):
        raise top.error("expected a list of engines", "engines")
    names: set[str] = set()
    engines = tuple(_engine(MappingReader(file, f"engines[{i}]", raw, _engine_keys()), names) for i, raw in enumerate(raw_engines))
    top.finish()
    warnings = []
    if not top.data:
        warnings.append(f"{file}: the file is empty: every setting is at its default")
    if not engines:
        exported = "the GPUs (NVML) and kvledger's own health are" if nvml.enabled != "false" else "kvledger's own health is"
        warnings.append(f"{file}: no engines configured (engines: is missing or empty): nothing to account; only {exported} exported")
    return Config(listen, interval, sharing, nvml, engines, json_view, otlp, file, limits, web_config_file,
                  tuple(warnings))


def _engine_keys() -> frozenset[str]:
    """Every key an engine entry may hold: EngineConfig's fields (``options`` stands for
    the kinds' own keys, checked against the engine's kind by ``_engine``)."""
    general = {f.name for f in fields(EngineConfig)} - {"options"}
    return frozenset(general | set(kind_specific_keys()))


def _memory_budget(value: Any) -> int:
    size = parse_size(value)
    if not 1 << 20 <= size <= 1 << 40:
        raise ValueError(f"must be between 1MiB and 1TiB, got {value!r}")
    return size


def _line_limit(value: Any) -> int:
    return _pos_int(value, 10_000_000)


def _response_limit(value: Any) -> int:
    size = parse_size(value)
    if not 4096 <= size <= 1 << 30:
        raise ValueError(f"must be between 4KiB and 1GiB, got {value!r}")
    return size


def _label_length(value: Any) -> int:
    n = _pos_int(value)
    if not 16 <= n <= 4096:
        raise ValueError(f"must be between 16 and 4096 characters, got {value!r}")
    return n


def parse_bool(value: Any) -> bool:
    """true or false (a YAML boolean, never the text "yes"); the web configuration's too."""
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _bool_text(value: Any) -> str:
    """A kind's ``boolean`` option, kept as the text "true" or "false"."""
    return "true" if parse_bool(value) else "false"


#: how the loader reads a kind's own key, by its Option.value (engine_kinds); options are
#: kept as text
_OPTION_READERS: dict[str, Callable[[Any], str]] = {
    "address": _url,
    "zmq": _zmq_address,
    "path": _str,
    "boolean": _bool_text,
    "tokens": _tokens_text,
    "steps": _steps_text,
}


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (YAML would keep the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # merged mappings may override; complex keys are rejected later
            key = self.construct_object(key_node, deep=False)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"duplicate key {_brief(key)} (first given at line {seen[key]})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> object:
    """A YAML file's data, read as kvledger reads every file it is given: UTF-8 checked,
    duplicate keys rejected, deep nesting refused; ConfigError names the file and where."""
    path = Path(path)
    try:
        raw = read_regular(path)  # a regular file only, never a blocking open (a FIFO)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {why(exc)}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc.reason} at byte offset {exc.start}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: safe
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    except ValueError as exc:  # an implicit timestamp that is no date (2001-02-30)
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None


def load_config(path: str | Path) -> Config:
    return config_from_mapping(read_yaml(path), str(path))
