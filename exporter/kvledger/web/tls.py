"""The server's ssl.SSLContext built from a web config's tls_server_config, and the
client-certificate SAN check (``client_allowed_sans``)."""

from __future__ import annotations

import logging
import ssl
from typing import Any

from kvledger.config.files import regular_path
from kvledger.config.types import ConfigError
from kvledger.web.web_config import CLIENT_AUTH_TYPES, TLS_VERSIONS, TlsServerConfig

log = logging.getLogger("kvledger.web.server")

#: subjectAltName kinds as ssl.getpeercert() names them, matched by client_allowed_sans
SAN_KINDS = ("DNS", "IP Address", "email", "URI")


def server_context(tls: TlsServerConfig, source: str = "<web config>") -> ssl.SSLContext:
    """A server-side context; reads the certificate, key and client CA files now.
    ConfigError (naming ``source`` and the key) when a file cannot be used."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = TLS_VERSIONS[tls.min_version]
    ctx.maximum_version = TLS_VERSIONS[tls.max_version]
    try:
        with regular_path(tls.cert_file) as cert, regular_path(tls.key_file) as key:  # a FIFO: refused, not waited on
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{source}: tls_server_config: cannot load cert_file {tls.cert_file} "
                          f"with key_file {tls.key_file}: {exc}") from None
    mode = CLIENT_AUTH_TYPES[tls.client_auth_type]
    assert mode is not None  # web_config rejects the types Python cannot do
    if tls.client_ca_file is not None:
        try:
            with regular_path(tls.client_ca_file) as ca:
                ctx.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{source}: tls_server_config.client_ca_file: cannot load "
                              f"{tls.client_ca_file}: {exc}") from None
    ctx.verify_mode = mode[0]
    if tls.cipher_suites:
        try:
            ctx.set_ciphers(":".join(tls.cipher_suites))
        except ssl.SSLError as exc:
            raise ConfigError(f"{source}: tls_server_config.cipher_suites: OpenSSL accepts none of "
                              f"{', '.join(tls.cipher_suites)}: {exc}") from None
    if tls.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    if tls.curve_preferences:
        # Python's ssl module sets one ECDH group; the most preferred one is used
        ctx.set_ecdh_curve(tls.curve_preferences[0])
        if len(tls.curve_preferences) > 1:
            log.warning("%s: tls_server_config.curve_preferences: only %s is offered (Python's ssl module "
                        "sets a single group)", source, tls.curve_preferences[0])
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def peer_sans(peercert: dict[str, Any] | None) -> list[str]:
    """The DNS, IP, e-mail and URI subject alternative names of a verified peer certificate."""
    if not peercert:
        return []
    return [value for kind, value in peercert.get("subjectAltName", ()) if kind in SAN_KINDS]


def sans_allowed(tls: TlsServerConfig, peercert: dict[str, Any] | None) -> bool:
    """True when no SAN list is configured or the certificate has an exactly matching SAN."""
    if not tls.client_allowed_sans:
        return True
    allowed = set(tls.client_allowed_sans)
    return any(san in allowed for san in peer_sans(peercert))
