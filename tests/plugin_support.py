"""What the in-engine plugin tests share (test_vllm_integration.py, test_sglang_plugin.py): the
plugin's environment variables set for a block and restored after it, a short directory for
Unix sockets, and the served document fetched as the daemon fetches it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvledger.collect.sources.http_client import HttpClient


@contextmanager
def plugin_environment(names: Sequence[str], **values: str | None) -> Iterator[None]:
    """The variables ``names`` set to ``values`` (the others of ``names`` unset; None: unset),
    each restored afterwards."""
    saved = {k: os.environ.get(k) for k in names}
    try:
        for k in names:
            os.environ.pop(k, None)
        for k, v in values.items():
            if v is not None:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def short_dir(prefix: str) -> Iterator[Path]:
    """A directory for Unix sockets (pytest's tmp_path can exceed the 107-byte path limit)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fetch(url: str) -> bytes:
    """The ledger's document (JSON rows) at ``url``, as the daemon's client asks for it."""
    return HttpClient(url, timeout=5.0, accept="application/json").get()

