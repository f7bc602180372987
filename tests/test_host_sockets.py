"""Kernel socket queues of a serving port: real loopback sockets, and a fake /proc for parsing."""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvledger.collect.sources.base import EnginePatch, SourceError
from kvledger.collect.sources.host_sockets import HostSocketSource, PortQueues, read_port_queues
from kvledger.domain.facts import EngineFacts, HostFacts, Snapshot

BUF = 64 * 1024


def ioctl_int(sock: socket.socket, request: int) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0\0\0\0"))[0]


def inq(sock: socket.socket) -> int:  # SIOCINQ: received, not read
    return ioctl_int(sock, termios.FIONREAD)


def outq(sock: socket.socket) -> int:  # SIOCOUTQ: written, not acknowledged
    return ioctl_int(sock, termios.TIOCOUTQ)


def fill(sock: socket.socket) -> int:
    """Write without blocking until the kernel refuses more; the bytes written."""
    sock.setblocking(False)
    total = 0
    chunk = b"x" * 8192
    while True:
        try:
            total += sock.send(chunk)
        except BlockingIOError:
            return total


def settled(measure: Callable[[], tuple]) -> tuple:
    """The measurement once two consecutive readings agree (loopback delivery is asynchronous)."""
    last = measure()
    for _ in range(1000):
        now = measure()
        if now == last:
            return now
        last = now
    raise AssertionError(f"socket queues never settled: {last}")


class Conn:
    def __init__(self, family: int, host: str) -> None:
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.bind((host, 0))
        self.listener.listen(8)
        self.port = self.listener.getsockname()[1]
        self.client = socket.socket(family, socket.SOCK_STREAM)
        for s in (self.client,):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUF)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUF)
        self.client.connect((host, self.port))
        self.server, _ = self.listener.accept()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUF)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUF)
        self.extra: list[socket.socket] = []

    def close(self) -> None:
        for s in (self.client, self.server, self.listener, *self.extra):
            s.close()


@pytest.fixture(params=[(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")], ids=["ipv4", "ipv6"])
def conn(request) -> Iterator[Conn]:
    c = Conn(*request.param)
    yield c
    c.close()


def test_receive_queue_is_what_the_server_has_not_read(conn):
    written = fill(conn.client)

    def measure():
        return read_port_queues(conn.port), inq(conn.server), outq(conn.client)

    q, server_unread, client_unacked = settled(measure)
    assert server_unread > 0
    assert q.receive_bytes == server_unread
    # Every byte the client wrote is in the server's receive queue (received, unread) or
    # still in the client's send queue (not acknowledged) or both (received, ACK pending).
    assert server_unread <= written and client_unacked <= written
    assert server_unread + client_unacked >= written
    assert q.send_bytes == 0  # the server wrote nothing
    assert q.sockets == 1


def test_send_queue_is_what_the_server_wrote_and_the_peer_has_not_taken(conn):
    written = fill(conn.server)

    def measure():
        return read_port_queues(conn.port), outq(conn.server), inq(conn.client)

    q, server_unacked, client_unread = settled(measure)
    assert server_unacked > 0
    assert q.send_bytes == server_unacked
    assert server_unacked <= written and client_unread <= written
    assert server_unacked + client_unread >= written
    assert q.receive_bytes == 0


def test_listen_backlog_is_not_counted_but_unaccepted_connections_bytes_are(conn):
    family = conn.listener.family
    host = conn.listener.getsockname()[0]
    waiting = socket.socket(family, socket.SOCK_STREAM)  # connected, never accepted
    conn.extra.append(waiting)
    waiting.connect((host, conn.port))
    waiting.sendall(b"y" * 100)
    conn.client.sendall(b"z" * 7)

    def measure():
        return read_port_queues(conn.port), inq(conn.server), outq(waiting)

    q, server_unread, waiting_unacked = settled(measure)
    assert (server_unread, waiting_unacked) == (7, 0)
    # 7 bytes on the accepted connection + 100 on the one waiting in the accept queue;
    # the listening socket's rx_queue (1 connection waiting) is not bytes and is left out.
    assert q.receive_bytes == 107
    assert q.sockets == 2


def test_source_patches_the_engine_host_facts_without_mutating(conn):
    conn.client.sendall(b"a" * 1000)
    settled(lambda: (read_port_queues(conn.port), inq(conn.server)))
    base = EngineFacts(name="e1", kind="vllm", source="vllm", host=HostFacts(output_buffer_bytes=5))
    snap = Snapshot(engines=[base])
    patch = HostSocketSource("e1", conn.port).poll()
    assert isinstance(patch, EnginePatch) and patch.engine == "e1"
    patch.apply(snap)
    host = snap.engines[0].host
    assert (host.socket_receive_queue_bytes, host.socket_send_queue_bytes) == (1000, 0)
    assert host.output_buffer_bytes == 5
    assert base.host.socket_receive_queue_bytes is None  # the incoming object is untouched
    assert snap.engines[0] is not base


# ---------------------------------------------------------------- fake /proc

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
TAIL = " 00:00000000 00000000  1000        0 1234 1 0000000000000000 20 4 30 10 -1\n"


def line(sl: int, local: str, remote: str, state: int, tx: int, rx: int) -> str:
    return f"{sl:4d}: {local} {remote} {state:02X} {tx:08X}:{rx:08X}{TAIL}"


@pytest.fixture
def fake_proc(tmp_path: Path) -> Path:
    net = tmp_path / "net"
    net.mkdir()
    port = f"{8000:04X}"
    (net / "tcp").write_text(
        HEADER
        + line(0, f"00000000:{port}", "00000000:0000", 0x0A, 0, 5)  # LISTEN, backlog 5: excluded
        + line(1, f"0100007F:{port}", "0100007F:D431", 0x01, 0x10, 0x20)  # server side: counted
        + line(2, "0100007F:D431", f"0100007F:{port}", 0x01, 0x400, 0x800)  # client side: excluded
        + line(3, f"0100007F:{port}", "0100007F:D432", 0x08, 0, 0x3)  # CLOSE_WAIT with unread: counted
        + line(4, f"0100007F:{8001:04X}", "0100007F:D433", 0x01, 0x99, 0x99)  # another port
    )
    (net / "tcp6").write_text(
        HEADER
        + line(0, f"00000000000000000000000000000000:{port}", "0" * 32 + ":0000", 0x0A, 0, 2)
        + line(1, f"0000000000000000FFFF00000100007F:{port}", "0000000000000000FFFF00000100007F:D434", 0x01, 0x100, 0)
    )
    return tmp_path


def test_parse_fake_proc(fake_proc):
    assert read_port_queues(8000, fake_proc) == PortQueues(send_bytes=0x110, receive_bytes=0x23, sockets=3)
    assert read_port_queues(8001, fake_proc) == PortQueues(0x99, 0x99, 1)
    assert read_port_queues(9999, fake_proc) == PortQueues(0, 0, 0)


def test_missing_tcp6_is_ipv6_disabled(fake_proc):
    (fake_proc / "net" / "tcp6").unlink()
    assert read_port_queues(8000, fake_proc) == PortQueues(0x10, 0x23, 2)


def test_missing_tcp_is_an_error(tmp_path):
    (tmp_path / "net").mkdir()
    with pytest.raises(SourceError) as err:
        read_port_queues(8000, tmp_path)
    assert err.value.reason == "proc" and "net/tcp" in err.value.message


def test_malformed_line_names_file_and_line(fake_proc):
    tcp = fake_proc / "net" / "tcp"
    tcp.write_text(tcp.read_text() + "   5: 0100007F:1F40 0100007F:D431 01 zz:00000000\n")
    with pytest.raises(SourceError) as err:
        read_port_queues(8000, fake_proc)
    assert err.value.reason == "parse"
    assert "net/tcp line 7" in err.value.message


def test_bad_header(fake_proc):
    (fake_proc / "net" / "tcp").write_text("garbage\n")
    with pytest.raises(SourceError, match="line 1"):
        read_port_queues(8000, fake_proc)


def test_bad_port():
    with pytest.raises(ValueError, match="1-65535"):
        HostSocketSource("e", 0)
