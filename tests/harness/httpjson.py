"""Small JSON-over-HTTP helpers (standard library only)."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def get_json(url: str, params: dict[str, str] | None = None, timeout: float = 5.0) -> Any:
    if params:
        url = f"{url}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def post_json(url: str, payload: Any, timeout: float = 5.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read().decode()
        return json.loads(body) if body else None


def wait_until(probe: Callable[[], T | None], timeout: float, interval: float = 0.25,
               what: str = "condition") -> T:
    """Call ``probe`` until it returns something truthy; return it. TimeoutError naming
    ``what`` (and the last value seen) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s (last: {last!r})")
        time.sleep(interval)
