"""Every file the configuration names is opened here: regular files only, never blocking.

A FIFO given as ``credentials_file``, ``ca_file`` or ``web_config_file`` used to block in
``open()`` (a FIFO's open waits for a writer): ``kvledger check`` hung, ``serve`` never
listened, a SIGHUP reload never finished and a poller stopped for good. Each file is
opened with ``O_NONBLOCK`` (a FIFO or a device then opens at once) and refused unless
``fstat`` says it is a regular file; a file that is swapped for a FIFO between two reads
is refused at the next one. OpenSSL, which takes file names, is given ``/proc/self/fd/N``
of the descriptor checked here (``regular_path``), so it reads the very file checked and
cannot be handed anything else.

Errors are ``OSError`` with ``strerror`` saying what is wrong (the callers' messages name
the key and the path), never the file's content.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

#: the largest configuration file read (kvledger.yml, web-config.yml, a model's config.json)
MAX_CONFIG_FILE_BYTES = 16 << 20
#: the largest credentials or password file read
MAX_SECRET_FILE_BYTES = 64 << 10

#: what an HTTP header value cannot hold: control characters (but tab) and beyond Latin-1
_NOT_HEADER_TEXT = re.compile(r"[^\t\x20-\x7e\x80-\xff]")

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


class FileRefused(OSError):
    """A file kvledger does not read: not a regular file (a FIFO, a device, a directory, a
    socket), or over its size limit. Its text is "PATH: why"."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


class NotRegularFile(FileRefused):
    """The path names a FIFO, a device, a directory or a socket."""


def open_regular(path: str | Path) -> int:
    """A read-only descriptor of ``path``, opened without blocking; OSError (NotRegularFile
    for anything but a regular file) otherwise. The caller closes it."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _kind(mode)
            raise NotRegularFile(0, f"{kind}, not a regular file" if kind != "not a regular file" else kind, str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | Path, max_bytes: int = MAX_CONFIG_FILE_BYTES) -> bytes:
    """The content of a regular file of at most ``max_bytes`` bytes; OSError otherwise
    (``strerror`` says why: not a regular file, over the limit, the system's reason)."""
    fd = open_regular(path)
    try:
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise FileRefused(0, f"over the limit of {max_bytes} bytes", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def _fd_dir() -> str | None:
    for candidate in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(candidate):
            return candidate
    return None


@contextlib.contextmanager
def regular_path(path: str | Path) -> Iterator[str]:
    """A name under which a library that opens files itself (OpenSSL) reads ``path``, checked
    to be a regular file and held open meanwhile: ``/proc/self/fd/N`` of that descriptor
    (``path`` itself where the system has no such directory, after the same check)."""
    fd = open_regular(path)
    try:
        where = _fd_dir()
        yield f"{where}/{fd}" if where is not None else str(path)
    finally:
        os.close(fd)


def why(exc: OSError) -> str:
    """The reason an OSError gives, without its errno prefix."""
    return exc.strerror or type(exc).__name__


def read_secret_file(path: str, *, header: bool = False) -> str:
    """A credentials or password file's content without its trailing whitespace (as
    Prometheus reads it). ``header``: the text goes into an HTTP header as it is (a bearer
    token), so it must be Latin-1 (what a header carries). ValueError says why the file
    cannot be used, never what it holds."""
    try:
        raw = read_regular(path, MAX_SECRET_FILE_BYTES)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {why(exc)}") from None
    try:
        text = raw.decode("utf-8").rstrip()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    if not text or any(c in text for c in "\r\n\x00"):
        raise ValueError(f"{path} must hold one non-empty line")
    if header:
        check_header_text(text, str(path))
    return text


def check_header_text(text: str, what: str) -> None:
    """ValueError unless ``text`` can go into an HTTP header as it is: Latin-1 (ISO-8859-1)
    without control characters. The message names ``what`` and the position, not the value."""
    bad = _NOT_HEADER_TEXT.search(text)
    if bad is None:
        return
    at, c = bad.start() + 1, bad.group()
    if ord(c) > 0xFF:
        raise ValueError(f"{what}: character {at} is outside Latin-1 (ISO-8859-1), which an HTTP header cannot carry "
                         "(the value is not shown)")
    raise ValueError(f"{what}: character {at} is a control character, which an HTTP header cannot carry "
                     "(the value is not shown)")
