"""Capture the llama.cpp fixtures of tests/fixtures/llamacpp/ from the real server.

    bash tests/llamacpp_real/setup_env.sh
    PYTHONPATH=exporter .venv/bin/python -m tests.llamacpp_real.capture_fixtures

Starts llama-server b11434 (the tiny model, ``-c 8192 -np 4``, then the same with
``--kv-unified``), sends concurrent completions sharing a prefix, and writes, for each
moment, the three answers kvledger reads, fetched back to back (/slots, /props, /metrics;
a busy moment is kept only when the server's ``requests_processing`` equals the busy
slots of /slots, i.e. nothing started or ended in between):

- ``llamacpp-b11434-split-busy-*``: during the burst;
- ``llamacpp-b11434-split-idle-*``: after it (idle slots keep their tokens);
- ``llamacpp-b11434-unified-busy-*``: the unified server during a burst.

The model path in /props (``model_path``, ``model_alias``) is shortened to
``tiny-llama.gguf``; nothing else is edited. Then regenerate the goldens:
``KVLEDGER_REGEN=1 pytest tests/test_llamacpp_metrics.py``.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from .server import LlamaServer, ensure_llamacpp, http_get

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
PREFIX = " ".join(f"Shared context line {i} of the capture." for i in range(24))


def answers(server: LlamaServer) -> dict[str, bytes]:
    out = {}
    for path in ("/slots", "/props", "/metrics"):
        status, body = http_get(server.url + path)
        assert status == 200, (path, status)
        out[path] = body
    return out


def consistent_busy(got: dict[str, bytes], min_busy: int) -> bool:
    slots = json.loads(got["/slots"])
    busy = [s for s in slots if s["is_processing"] and s.get("n_prompt_tokens", 0) > 0]
    processing = next(float(line.split()[1]) for line in got["/metrics"].decode().splitlines()
                      if line.startswith("llamacpp:requests_processing "))
    return len(busy) >= min_busy and processing == sum(s["is_processing"] for s in slots)


def write(name: str, got: dict[str, bytes], model: Path) -> None:
    props: dict[str, Any] = json.loads(got["/props"])
    for key in ("model_path", "model_alias"):
        if props.get(key) == str(model):
            props[key] = "tiny-llama.gguf"
    slots = json.loads(got["/slots"])
    (OUT / f"{name}-slots.json").write_text(json.dumps(slots, indent=2) + "\n")
    (OUT / f"{name}-props.json").write_text(json.dumps(props, indent=2) + "\n")
    (OUT / f"{name}-metrics.txt").write_bytes(got["/metrics"])
    print(f"wrote {name}: {sum(s['is_processing'] for s in slots)} busy of {len(slots)} slots")


def busy_capture(server: LlamaServer, n_requests: int) -> dict[str, bytes]:
    server.complete(PREFIX + " Warm-up.", 8)
    threads = server.burst([PREFIX + f" Question {i}: what does slot {i} hold?" for i in range(n_requests)], 300)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = answers(server)
        if consistent_busy(got, 2):
            for t in threads:
                t.join(timeout=120)
            return got
        time.sleep(0.02)
    raise SystemExit("no consistent busy moment seen")


def main() -> int:
    binary, model = ensure_llamacpp()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llamacpp-capture-") as tmp:
        split = LlamaServer(binary, model, Path(tmp) / "split.log")
        split.start()
        try:
            write("llamacpp-b11434-split-busy", busy_capture(split, 3), model)
            split.wait_idle()
            write("llamacpp-b11434-split-idle", answers(split), model)
        finally:
            split.stop()
        unified = LlamaServer(binary, model, Path(tmp) / "unified.log", extra_flags=("--kv-unified",))
        unified.start()
        try:
            write("llamacpp-b11434-unified-busy", busy_capture(unified, 3), model)
        finally:
            unified.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
