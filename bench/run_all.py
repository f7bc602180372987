"""Run every benchmark in bench/ (make bench)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
SCRIPTS = ("bench_scrape.py", "bench_accounting.py", "bench_events.py", "bench_protocol.py", "bench_poll.py", "bench_daemon.py",
           "bench_http.py", "bench_keepalive.py", "bench_vllm_ledger_document.py", "bench_vllm_publish.py")
for script in SCRIPTS:
    print(f"== {script}", flush=True)
    subprocess.run([sys.executable, str(HERE / script)], check=True)
