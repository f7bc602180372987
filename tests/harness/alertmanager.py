"""Start a real Alertmanager for a test.

    from harness.alertmanager import start_alertmanager

    with start_alertmanager(tmp_path, config_dict) as am:
        am.url            # http://127.0.0.1:PORT ; am.address -> "127.0.0.1:PORT"
        am.alerts()       # GET /api/v2/alerts

The binary is ``prometheus-alertmanager`` (Debian) or ``alertmanager``. Clustering is
disabled (``--cluster.listen-address=``) so several tests can run side by side.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.httpjson import get_json
from harness.process import PORT_ATTEMPTS, ManagedProcess, ProcessError, free_port, port_taken, start_ready


def alertmanager_binary() -> str:
    for name in ("alertmanager", "prometheus-alertmanager"):
        path = shutil.which(name)
        if path:
            return path
    raise ProcessError("alertmanager not found on PATH; install the Debian package prometheus-alertmanager")


@dataclass
class AlertmanagerServer:
    url: str
    port: int
    config_path: Path
    process: ManagedProcess = field(repr=False)

    @property
    def address(self) -> str:
        """host:port, as Prometheus' alerting static_configs want it."""
        return f"127.0.0.1:{self.port}"

    def alerts(self) -> list[dict[str, Any]]:
        return list(get_json(f"{self.url}/api/v2/alerts"))

    def stop(self) -> None:
        self.process.stop()

    def log_tail(self, chars: int = 4000) -> str:
        return self.process.log_tail(chars)


def start_alertmanager_with_config(workdir: Path, config: dict[str, Any] | str, port: int | None = None,
                                   ready_timeout: float = 30.0,
                                   extra_args: Sequence[str] = ()) -> AlertmanagerServer:
    """Write ``config`` (a dict or YAML text) as alertmanager.yml under ``workdir`` and
    start Alertmanager on 127.0.0.1:``port``; return once /-/ready answers."""
    binary = alertmanager_binary()
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "alertmanager.yml"
    text = config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)
    config_path.write_text(text)
    for attempt in range(PORT_ATTEMPTS):
        chosen = port or free_port()
        argv = [binary, f"--config.file={config_path}", f"--storage.path={workdir / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{chosen}", "--cluster.listen-address=",
                "--log.level=info", *extra_args]
        url = f"http://127.0.0.1:{chosen}"
        try:
            proc = start_ready(argv, workdir / "alertmanager.log", f"{url}/-/ready", ready_timeout, cwd=workdir)
        except ProcessError as exc:
            if port is not None or attempt == PORT_ATTEMPTS - 1 or not port_taken(exc):
                raise
            continue
        return AlertmanagerServer(url=url, port=chosen, config_path=config_path, process=proc)
    raise AssertionError("unreachable")


@contextmanager
def start_alertmanager(workdir: Path, config: dict[str, Any] | str, port: int | None = None,
                       ready_timeout: float = 30.0) -> Iterator[AlertmanagerServer]:
    server = start_alertmanager_with_config(workdir, config, port=port, ready_timeout=ready_timeout)
    try:
        yield server
    finally:
        server.stop()
