"""The web configuration file (``--web.config.file``): TLS, extra headers, basic auth.

The format is Prometheus exporter-toolkit's ``web-config.yml``, so one file serves
kvledger and the Go exporters beside it. Errors name the file and the key path; unknown
keys are rejected by name. Relative file names are resolved against the directory of
the web configuration file, as exporter-toolkit does.

What Python's ``ssl`` module cannot do is an error naming the key, never silently
weakened: ``RequestClientCert`` and ``RequireAnyClientCert`` (a certificate asked for
but not verified), inline ``cert``/``key``/``client_ca`` and ``rate_limit``.
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvledger.config.loader import MappingReader, parse_bool, read_yaml

TLS_VERSIONS: dict[str, ssl.TLSVersion] = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}

#: Go's crypto/tls ClientAuthType names -> (ssl verify mode, whether a client CA is needed);
#: None where Python's ssl module has no equivalent
CLIENT_AUTH_TYPES: dict[str, tuple[ssl.VerifyMode, bool] | None] = {
    "NoClientCert": (ssl.CERT_NONE, False),
    "RequestClientCert": None,
    "RequireAnyClientCert": None,
    "VerifyClientCertIfGiven": (ssl.CERT_OPTIONAL, True),
    "RequireAndVerifyClientCert": (ssl.CERT_REQUIRED, True),
}

#: Go cipher-suite names (crypto/tls constants) for TLS 1.0-1.2 -> OpenSSL names
GO_TO_OPENSSL_CIPHERS: dict[str, str] = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
}

#: TLS 1.3 suites: accepted, and like Go not configurable (OpenSSL's defaults apply)
TLS13_CIPHERS = frozenset({"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"})

#: Go CurveID names -> OpenSSL group names
GO_TO_OPENSSL_CURVES: dict[str, str] = {
    "CurveP256": "prime256v1",
    "CurveP384": "secp384r1",
    "CurveP521": "secp521r1",
    "X25519": "X25519",
}

#: the response headers exporter-toolkit lets a web config set, with their allowed values (None: any)
ALLOWED_HEADERS: dict[str, frozenset[str] | None] = {
    "Content-Security-Policy": None,
    "X-Frame-Options": frozenset({"deny", "sameorigin"}),
    "X-Content-Type-Options": frozenset({"nosniff"}),
    "X-XSS-Protection": None,
    "Strict-Transport-Security": None,
}

_BCRYPT_RE = re.compile(r"^\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}$")

_UNSUPPORTED = {
    "cert": "inline certificates are not supported; use cert_file",
    "key": "inline keys are not supported; use key_file",
    "client_ca": "an inline client CA is not supported; use client_ca_file",
}


@dataclass(frozen=True)
class TlsServerConfig:
    cert_file: Path
    key_file: Path
    client_auth_type: str = "NoClientCert"
    client_ca_file: Path | None = None
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    #: OpenSSL names, in the configured order; empty: OpenSSL's defaults
    cipher_suites: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True
    #: OpenSSL group names, most preferred first
    curve_preferences: tuple[str, ...] = ()

    def files(self) -> tuple[Path, ...]:
        """The files this TLS configuration reads (watched for changes)."""
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p is not None)


@dataclass(frozen=True)
class WebConfig:
    path: str = "<web config>"
    tls: TlsServerConfig | None = None
    http2: bool = True
    headers: tuple[tuple[str, str], ...] = ()
    #: username -> bcrypt hash
    basic_auth_users: dict[str, bytes] = field(default_factory=dict)

    @property
    def basic_auth(self) -> bool:
        return bool(self.basic_auth_users)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _str_list(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"expected a list of non-empty strings, got {value!r}")
    return tuple(value)


def _choice(options: list[str] | dict[str, Any]) -> Any:
    def conv(value: Any) -> str:
        if not isinstance(value, str) or value not in options:
            raise ValueError(f"must be one of {', '.join(options)}; got {value!r}")
        return value

    return conv


def _ciphers(value: Any) -> tuple[str, ...]:
    names = _str_list(value)
    unknown = [n for n in names if n not in GO_TO_OPENSSL_CIPHERS and n not in TLS13_CIPHERS]
    if unknown:
        raise ValueError(f"unknown or unsupported cipher suite(s): {', '.join(unknown)} "
                         f"(supported: {', '.join(GO_TO_OPENSSL_CIPHERS)})")
    out: list[str] = []
    for n in names:
        mapped = GO_TO_OPENSSL_CIPHERS.get(n)
        if mapped is not None and mapped not in out:
            out.append(mapped)
    return tuple(out)


def _curves(value: Any) -> tuple[str, ...]:
    names = _str_list(value)
    unknown = [n for n in names if n not in GO_TO_OPENSSL_CURVES]
    if unknown:
        raise ValueError(f"unknown curve(s): {', '.join(unknown)} (supported: {', '.join(GO_TO_OPENSSL_CURVES)})")
    return tuple(GO_TO_OPENSSL_CURVES[n] for n in names)


def _tls(r: MappingReader, base: Path) -> TlsServerConfig | None:
    for name, why in _UNSUPPORTED.items():
        if r.has(name):
            raise r.error(why, name)

    def path(name: str) -> Path | None:
        value = r.get(name, _str, "")
        return (base / value) if value else None

    none: tuple[str, ...] = ()
    cert, key = path("cert_file"), path("key_file")
    auth = r.get("client_auth_type", _choice(CLIENT_AUTH_TYPES), "NoClientCert")
    ca = path("client_ca_file")
    sans = r.get("client_allowed_sans", _str_list, none)
    min_v = r.get("min_version", _choice(TLS_VERSIONS), "TLS12")
    max_v = r.get("max_version", _choice(TLS_VERSIONS), "TLS13")
    ciphers = r.get("cipher_suites", _ciphers, none)
    prefer = r.get("prefer_server_cipher_suites", parse_bool, True)
    curves = r.get("curve_preferences", _curves, none)
    r.finish()
    if cert is None and key is None:
        if auth != "NoClientCert" or ca is not None or sans:
            raise r.error("client authentication is configured but cert_file and key_file are missing")
        return None  # exporter-toolkit: no certificate, no TLS
    if cert is None:
        raise r.error("is required when key_file is set", "cert_file")
    if key is None:
        raise r.error("is required when cert_file is set", "key_file")
    mode = CLIENT_AUTH_TYPES[auth]
    if mode is None:
        raise r.error(f"{auth} is not supported: Python's ssl module verifies every client certificate it "
                      "asks for; use VerifyClientCertIfGiven or RequireAndVerifyClientCert with client_ca_file",
                      "client_auth_type")
    if mode[1] and ca is None:
        raise r.error(f"is required with client_auth_type {auth}", "client_ca_file")
    if ca is not None and not mode[1]:
        raise r.error("client_ca_file is set without a client authentication policy (client_auth_type)",
                      "client_auth_type")
    if sans and auth != "RequireAndVerifyClientCert":
        raise r.error("needs client_auth_type RequireAndVerifyClientCert", "client_allowed_sans")
    if TLS_VERSIONS[min_v] > TLS_VERSIONS[max_v]:
        raise r.error(f"{min_v} is above max_version {max_v}", "min_version")
    return TlsServerConfig(cert, key, auth, ca, sans, min_v, max_v, ciphers, prefer, curves)


def _headers(r: MappingReader) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for name, allowed in ALLOWED_HEADERS.items():
        value = r.get(name, _str, "")
        if not value:
            continue  # exporter-toolkit: unset if blank
        if allowed is not None and value.lower() not in allowed:
            raise r.error(f"must be one of {', '.join(sorted(allowed))}; got {value!r}", name)
        out.append((name, value))
    unknown = sorted(str(k) for k in r.data if k not in r.seen)
    if unknown:
        raise r.error(f"header(s) that cannot be configured: {', '.join(unknown)} "
                      f"(allowed: {', '.join(ALLOWED_HEADERS)})")
    return tuple(out)


def _users(r: MappingReader) -> dict[str, bytes]:
    users: dict[str, bytes] = {}
    for name, hashed in r.data.items():
        if not isinstance(name, str) or not name or ":" in name:
            raise r.error("a user name must be a non-empty string without ':'", str(name))
        if not isinstance(hashed, str) or not _BCRYPT_RE.match(hashed):
            raise r.error("expected a bcrypt hash ($2a$, $2b$ or $2y$, e.g. from htpasswd -nBC 10)", name)
        users[name] = hashed.encode()
        r.seen.add(name)
    return users


def web_config_from_mapping(data: object, file: str = "<web config>", base: Path | None = None) -> WebConfig:
    """Validate a parsed web-config.yml; ``base`` resolves relative file names."""
    base = base if base is not None else Path(file).resolve().parent
    top = MappingReader(file, "", {} if data is None else data)
    if top.has("rate_limit"):
        raise top.error("is not supported by kvledger", "rate_limit")
    tls = None
    if (t := top.child("tls_server_config")) is not None:
        tls = _tls(t, base)
    http2 = True
    headers: tuple[tuple[str, str], ...] = ()
    if (h := top.child("http_server_config")) is not None:
        http2 = h.get("http2", parse_bool, True)
        if (hd := h.child("headers")) is not None:
            headers = _headers(hd)
        h.finish()
    users: dict[str, bytes] = {}
    if (u := top.child("basic_auth_users")) is not None:
        users = _users(u)
    top.finish()
    return WebConfig(file, tls, http2, headers, users)


def load_web_config(path: str | Path) -> WebConfig:
    path = Path(path)
    return web_config_from_mapping(read_yaml(path), str(path), path.resolve().parent)
