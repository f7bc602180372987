"""The listen address, one parser for the configuration's ``listen:`` and the
``--web.listen-address`` flag (``serve``, ``demo``, ``lab --serve``, ``check``).

``HOST:PORT`` where PORT is a decimal 0..65535 (0: any free port) and HOST is empty (every
interface), a dotted-quad IPv4 address, a bracketed IPv6 address (``[::1]:9477``) or a host
name. Refused, each with a message that says what to write instead: an empty value, a
missing or non-numeric port, a port above 65535 or of more than five digits, an IPv6
address without brackets (``::1:9477``: is 9477 the port or a group of the address?), an
IPv4 address with a leading zero (``0177.0.0.1`` is 127.0.0.1 to inet_aton, octal, and
177.0.0.1 to others) or with fewer than four parts (``127.1``), and a host name that is
not one (blanks, ``/``, non-ASCII).
"""

from __future__ import annotations

import ipaddress
import re

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}\.?$){_LABEL}(?:\.{_LABEL})*\.?")
_DOTTED = re.compile(r"[0-9.]+")


def _shown(value: str) -> str:
    return repr(value) if len(value) <= 60 else repr(value[:57]) + "..."


def _bad(value: str, why: str) -> ValueError:
    return ValueError(f"expected HOST:PORT such as 127.0.0.1:9477, got {_shown(value)}: {why}")


def parse_listen(value: object) -> tuple[str, int]:
    """(host, port) of a listen address; ValueError says what is wrong and what to write."""
    if not isinstance(value, str):
        raise ValueError(f"expected HOST:PORT such as 127.0.0.1:9477, got {type(value).__name__}")
    if not value:
        raise ValueError("expected HOST:PORT such as 127.0.0.1:9477 (or :9477 for every interface), got an empty value")
    host, sep, port = value.rpartition(":")
    if not sep:
        raise _bad(value, "no port")
    if not (port.isascii() and port.isdigit()):
        raise _bad(value, f"the port {_shown(port)} is not a number in 0..65535")
    if len(port) > 5 or int(port) > 65535:
        raise _bad(value, "the port is not a number in 0..65535")
    if len(port) > 1 and port.startswith("0"):
        raise _bad(value, f"write the port without leading zeros ({int(port)})")
    return _host(host, value), int(port)


def _host(host: str, value: str) -> str:
    if host.startswith("[") and host.endswith("]"):
        inner = host[1:-1]
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise _bad(value, f"{_shown(inner)} in brackets is not an IPv6 address") from None
        return inner
    if "[" in host or "]" in host:
        raise _bad(value, "unbalanced brackets (an IPv6 address is written [::1]:9477)")
    if ":" in host:
        raise _bad(value, f"an IPv6 address goes in brackets, e.g. [{_shown(host)[1:-1]}]:{value.rpartition(':')[2]} "
                          "(without them the port cannot be told from the address)")
    if not host:
        return ""
    if _DOTTED.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)  # four decimal parts, no leading zeros
        except ValueError:
            raise _bad(value, f"{_shown(host)} is not a dotted-quad IPv4 address (four decimal numbers 0..255 "
                              "without leading zeros: some read 0177 as octal, others as decimal)") from None
        return host
    if not host.isascii() or not _HOSTNAME.fullmatch(host):
        raise _bad(value, f"{_shown(host)} is not a host name or an IP address")
    return host


def listen_address(value: object) -> str:
    """The listen address as checked by ``parse_listen``, returned as given."""
    parse_listen(value)
    assert isinstance(value, str)
    return value
