"""The TLS context of an https:// engine from its ``tls_config`` (Prometheus scrape_config's
keys): used by the HTTP client of every source, and by the configuration loader, which
loads it once to name a file that does not load. Every file is opened as a regular file
without blocking (kvledger.config.files): a FIFO given as ca_file is refused."""

from __future__ import annotations

import ssl

from kvledger.config.files import regular_path
from kvledger.config.types import TlsClientConfig


def client_ssl_context(tls: TlsClientConfig | None) -> ssl.SSLContext:
    """The TLS context of an https:// engine: the system's CAs or ``ca_file``'s, a client
    certificate when ``cert_file`` and ``key_file`` are given, no verification at all with
    ``insecure_skip_verify``. ValueError names the key whose file does not load."""
    ca_file = tls.ca_file if tls else None
    try:
        if ca_file is None:
            context = ssl.create_default_context()
        else:
            with regular_path(ca_file) as ca:  # a FIFO is refused, never waited on
                context = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"ca_file {ca_file}: {_why(exc)}") from None
    if tls is None:
        return context
    if tls.cert_file or tls.key_file:
        try:
            with regular_path(tls.cert_file or "") as cert, regular_path(tls.key_file or "") as key:
                context.load_cert_chain(cert, key)
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
