"""The TLS context of an https:// engine from its ``tls_config`` (Prometheus scrape_config's
keys): used by the HTTP client of every source, and by the configuration loader, which
loads it once to name a file that does not load."""

from __future__ import annotations

import ssl

from kvledger.config.model import TlsClientConfig


def client_ssl_context(tls: TlsClientConfig | None) -> ssl.SSLContext:
    """The TLS context of an https:// engine: the system's CAs or ``ca_file``'s, a client
    certificate when ``cert_file`` and ``key_file`` are given, no verification at all with
    ``insecure_skip_verify``. ValueError names the key whose file does not load."""
    ca_file = tls.ca_file if tls else None
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"ca_file {ca_file}: {_why(exc)}") from None
    if tls is None:
        return context
    if tls.cert_file or tls.key_file:
        try:
            context.load_cert_chain(tls.cert_file or "", tls.key_file or "")
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cert_file {tls.cert_file} and key_file {tls.key_file}: {_why(exc)}") from None
    if tls.insecure_skip_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _why(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return f"not usable ({exc.reason or exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__
