"""The ``host`` source: kernel socket queue bytes of an engine's serving port.

Reads ``<proc_root>/net/tcp`` and ``<proc_root>/net/tcp6`` (the network namespace of
the reader; pass ``proc_root="/proc/<pid>"`` to read the namespace of process ``pid``)
and sums, over the sockets whose LOCAL port is the serving port (the server side of
its connections, IPv4, IPv6 and IPv4-mapped alike):

- ``tx_queue``: bytes the server wrote that the peer has not acknowledged yet
  (unsent plus in flight; what ``ioctl(SIOCOUTQ)`` reports) -> send queue;
- ``rx_queue``: bytes received that the server has not read yet (``SIOCINQ``)
  -> receive queue.

LISTEN sockets are left out: their ``rx_queue`` is the accept backlog, a count of
connections, not bytes (and their ``tx_queue`` is 0). Connections waiting in the accept
queue are full sockets and are counted: their received bytes are held by the kernel
for this port too. Client-side sockets whose REMOTE port happens to be the serving port
(e.g. a local client of the engine) are not the server's queues and are left out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from kvledger.collect.sources.base import EnginePatch, Source, SourceError
from kvledger.domain.facts import EngineFacts

TCP_LISTEN = 0x0A


@dataclass(frozen=True, slots=True)
class PortQueues:
    send_bytes: int
    receive_bytes: int
    sockets: int  # server-side sockets counted (LISTEN excluded)


def _parse_table(path: Path, port: int) -> tuple[int, int, int]:
    send = receive = sockets = 0
    try:
        text = path.read_text()
    except OSError as exc:
        raise SourceError("proc", f"cannot read {path}: {exc.strerror or exc}") from None
    lines = text.splitlines()
    if not lines or not lines[0].split()[:2] == ["sl", "local_address"]:
        raise SourceError("parse", f"{path} line 1: expected the header 'sl local_address ...'")
    for lineno, line in enumerate(lines[1:], start=2):
        fields = line.split()
        if not fields:
            continue
        try:
            local = fields[1]
            state = int(fields[3], 16)
            tx_hex, rx_hex = fields[4].split(":")
            local_port = int(local.rsplit(":", 1)[1], 16)
            tx, rx = int(tx_hex, 16), int(rx_hex, 16)
        except (IndexError, ValueError):
            raise SourceError(
                "parse", f"{path} line {lineno}: expected 'sl local rem st tx:rx ...' with hex fields, got {line.strip()!r}"
            ) from None
        if local_port != port or state == TCP_LISTEN:
            continue
        send += tx
        receive += rx
        sockets += 1
    return send, receive, sockets


def read_port_queues(port: int, proc_root: str | Path = "/proc") -> PortQueues:
    """Sum the server-side queues of ``port`` over net/tcp and net/tcp6 (tcp6 may be absent)."""
    net = Path(proc_root) / "net"
    send, receive, sockets = _parse_table(net / "tcp", port)
    tcp6 = net / "tcp6"
    if tcp6.exists():  # absent when IPv6 is disabled
        s6, r6, n6 = _parse_table(tcp6, port)
        send, receive, sockets = send + s6, receive + r6, sockets + n6
    return PortQueues(send, receive, sockets)


class HostSocketSource(Source):
    """Kernel socket queues of one engine's serving port, as a patch of its host facts."""

    kind = "host"

    def __init__(self, engine_name: str, port: int, proc_root: str | Path = "/proc") -> None:
        if not 0 < port < 65536:
            raise ValueError(f"host.port must be a TCP port (1-65535), got {port}")
        self.engine = engine_name
        self.port = port
        self.proc_root = Path(proc_root)

    def poll(self) -> EnginePatch:
        q = read_port_queues(self.port, self.proc_root)

        def patch(engine: EngineFacts) -> EngineFacts:
            host = dataclasses.replace(
                engine.host, socket_send_queue_bytes=q.send_bytes, socket_receive_queue_bytes=q.receive_bytes
            )
            return dataclasses.replace(engine, host=host)

        return EnginePatch(engine=self.engine, fn=patch)
