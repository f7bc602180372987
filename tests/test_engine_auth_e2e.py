"""The real daemon against engines behind a bearer token, basic auth and mTLS (issue 22):
`kvledger serve` reads all three, marks the one given a wrong token down with its reason,
and no secret appears in its debug log, /metrics (text and OpenMetrics), the JSON view,
the ledger page's data, `kvledger check`, `kvledger snapshot --json`, or a refused reload."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from tls_support import make_pki

from harness.kvledger_daemon import _env, start_daemon
from harness.secure_engine import SecureEngine

TOKEN = "tok-e2e-9c41d7"
MESH_TOKEN = "mesh-e2e-51b0aa"
PASSWORD = "pw-e2e-0f3e6b"
WRONG = "wrong-e2e-77aa12"
SECRETS = (TOKEN, MESH_TOKEN, PASSWORD, WRONG, base64.b64encode(f"kvledger:{PASSWORD}".encode()).decode())

pytestmark = pytest.mark.e2e


def _get(url: str, accept: str = "") -> str:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(resp.read().decode())


def _value(text: str, line_start: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_the_daemon_reads_engines_behind_credentials_and_never_shows_them(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    (tmp_path / "token").write_text(TOKEN + "\n")
    with SecureEngine(bearer=TOKEN) as tok, SecureEngine(basic=("kvledger", PASSWORD)) as basic, \
            SecureEngine(bearer=MESH_TOKEN, server_cert=(pki.server_cert, pki.server_key), client_ca=pki.client_ca) as mesh:
        config = {
            "interval_seconds": 0.5, "json_view": True, "nvml": {"enabled": False},
            "engines": [
                {"name": "tok", "kind": "ledger", "url": tok.url, "authorization": {"credentials_file": "token"}},
                {"name": "basic", "kind": "ledger", "url": basic.url, "basic_auth": {"username": "kvledger", "password": PASSWORD}},
                {"name": "mesh", "kind": "ledger", "url": mesh.url, "authorization": {"credentials": MESH_TOKEN},
                 "tls_config": {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert), "key_file": str(pki.client_key),
                                "server_name": "localhost"}},
                {"name": "wrong", "kind": "ledger", "url": tok.url, "authorization": {"credentials": WRONG}},
            ],
        }
        cfg = tmp_path / "kvledger.yml"
        cfg.write_text(yaml.safe_dump(config))
        daemon = start_daemon(tmp_path / "run", ["--log.level", "debug", "serve", "--config", str(cfg)])
        try:
            deadline = time.monotonic() + 30
            while True:
                text = _get(f"{daemon.url}/metrics")
                up = {e: _value(text, f'kvledger_source_up{{engine="{e}",source="ledger"}}') for e in ("tok", "basic", "mesh", "wrong")}
                errors = _value(text, 'kvledger_source_errors_total{engine="wrong",source="ledger",reason="http_status"}')
                if up == {"tok": 1, "basic": 1, "mesh": 1, "wrong": 0} and errors and errors >= 2:
                    break
                assert time.monotonic() < deadline, (up, errors)
                time.sleep(0.3)
            assert _value(text, 'kvledger_kv_capacity_blocks{engine="mesh",pool="0"}') == 64
            assert basic.connections == 1 and basic.requests >= 2  # one connection kept alive for every poll
            assert mesh.connections == 1 and "URI:spiffe://example/prometheus" in mesh.client_names
            shown = {
                "metrics": text,
                "openmetrics": _get(f"{daemon.url}/metrics", "application/openmetrics-text; version=1.0.0"),
                "accounts": _get(f"{daemon.url}/api/v1/accounts"),
                "ledger page data": _get(f"{daemon.url}/ui/ledger.json"),
            }
            assert "HTTP 401 (the engine refused the request's credentials" in shown["accounts"]
            env = _env(None)
            for command in (["check", "--config", str(cfg)], ["snapshot", "--json", "--config", str(cfg)]):
                res = subprocess.run([sys.executable, "-m", "kvledger.cli", "--log.level", "debug", *command], capture_output=True,
                                     text=True, env=env, timeout=60)
                assert res.returncode == 1, res.stderr  # the "wrong" engine is down
                shown[command[0]] = res.stdout + res.stderr
            assert "wrong" in shown["check"] and "HTTP 401" in shown["check"]

            # a reload with a broken entry: refused naming the key, the running configuration kept
            config["engines"][0]["authorization"]["credentials"] = TOKEN
            cfg.write_text(yaml.safe_dump(config))
            os.kill(daemon.process.pid, signal.SIGHUP)
            deadline = time.monotonic() + 20
            while "reload failed" not in daemon.process.log_tail(100_000):
                assert time.monotonic() < deadline, daemon.process.log_tail()
                time.sleep(0.2)
            assert "engines[0].authorization: give one of credentials and credentials_file" in daemon.process.log_tail(100_000)
            # the running configuration kept: the engine still polled and up (a poll that timed
            # out on a loaded machine is followed by the next)
            while _value(_get(f"{daemon.url}/metrics"), 'kvledger_source_up{engine="tok",source="ledger"}') != 1:
                assert time.monotonic() < deadline + 20, daemon.process.log_tail()
                time.sleep(0.2)
        finally:
            daemon.stop()
        shown["log"] = daemon.process.log_path.read_text()
        assert "level=debug" in shown["log"]
    for where, text in shown.items():
        for secret in SECRETS:
            assert secret not in text, f"{where} shows a secret"
