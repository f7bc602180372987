"""TLS and basic auth end to end: the real daemon with an exporter-toolkit web config,
scraped by a real Prometheus over https with basic_auth and tls_config; wrong
passwords, plain HTTP and missing or foreign client certificates are refused."""

from __future__ import annotations

import http.client
import ssl
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from tls_support import Pki, bcrypt_hash, make_pki

from harness.httpjson import wait_until
from harness.kvledger_daemon import _env
from harness.process import ManagedProcess, ProcessError, free_port
from harness.prometheus import PrometheusServer, prometheus_config, start_prometheus_with_config
from kvledger.web.server import basic_auth_header

pytestmark = pytest.mark.e2e

USER, PASSWORD = "prometheus", "s3cret pass"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def client_context(pki: Pki, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        ctx.load_cert_chain(cert[0], cert[1])
    return ctx


def get(port: int, ctx: ssl.SSLContext, path: str = "/metrics", password: str | None = PASSWORD) -> tuple[int, bytes, Any]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    try:
        headers = {"Authorization": basic_auth_header(USER, password)} if password is not None else {}
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp
    finally:
        conn.close()


@contextmanager
def tls_demo(workdir: Path, web: dict[str, Any], ready_ctx: ssl.SSLContext) -> Iterator[int]:
    """`kvledger demo --web.config.file` on a free port; yields the port once /-/ready answers over TLS."""
    workdir.mkdir(parents=True, exist_ok=True)
    web_file = workdir / "web-config.yml"
    web_file.write_text(yaml.safe_dump(web))
    port = free_port()
    proc = ManagedProcess([sys.executable, "-m", "kvledger.cli", "demo", "--listen", f"127.0.0.1:{port}",
                           "--web.config.file", str(web_file)], workdir / "kvledger.log", cwd=workdir, env=_env(None))
    try:
        deadline = time.monotonic() + 30
        while True:
            if not proc.running():
                raise ProcessError(f"kvledger exited early:\n{proc.log_tail()}")
            try:
                if get(port, ready_ctx, "/-/ready")[0] == 200:
                    break
            except (OSError, http.client.HTTPException):
                pass
            if time.monotonic() > deadline:
                raise ProcessError(f"kvledger not ready over TLS:\n{proc.log_tail()}")
            time.sleep(0.2)
        yield port
    finally:
        proc.stop()


def scrape_job(name: str, port: int, pki: Pki, password: str, client_cert: tuple[Path, Path] | None) -> dict[str, Any]:
    tls: dict[str, Any] = {"ca_file": str(pki.ca)}
    if client_cert is not None:
        tls.update(cert_file=str(client_cert[0]), key_file=str(client_cert[1]))
    # 3 s rather than the harness's 1 s: a refused password costs a bcrypt check and the 401 is
    # held back 0.25 s, which a loaded 2-core machine can stretch past 1 s ("context deadline
    # exceeded" instead of the 401 the test reads)
    return {"job_name": name, "scheme": "https", "basic_auth": {"username": USER, "password": password},
            "scrape_interval": "3s", "scrape_timeout": "3s",
            "tls_config": tls, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}


@contextmanager
def prometheus(workdir: Path, jobs: list[dict[str, Any]]) -> Iterator[PrometheusServer]:
    cfg = prometheus_config([])
    cfg["scrape_configs"] = jobs
    prom = start_prometheus_with_config(workdir, cfg)
    try:
        yield prom
    finally:
        prom.stop()


def wait_for_health(prom: PrometheusServer, expected: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Wait until each job's target has the expected health; return the targets by job."""
    def probe() -> dict[str, dict[str, Any]] | None:
        by_job = {t["labels"]["job"]: t for t in prom.targets()}
        return by_job if all(by_job.get(j, {}).get("health") == h for j, h in expected.items()) else None
    return wait_until(probe, 30, what=f"targets {expected}")


def test_prometheus_scrapes_over_tls_with_basic_auth(tmp_path: Path, pki: Pki) -> None:
    web = {"tls_server_config": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)},
           "basic_auth_users": {USER: bcrypt_hash(PASSWORD, rounds=10)},
           "http_server_config": {"headers": {"X-Content-Type-Options": "nosniff"}}}
    ctx = client_context(pki)
    with tls_demo(tmp_path / "daemon", web, ctx) as port:
        jobs = [scrape_job("kvledger", port, pki, PASSWORD, None), scrape_job("wrong-password", port, pki, "nope", None)]
        with prometheus(tmp_path / "prom", jobs) as prom:
            targets = wait_for_health(prom, {"kvledger": "up", "wrong-password": "down"})
            assert "401" in targets["wrong-password"]["lastError"]
            assert prom.query_value('up{job="kvledger"}') == 1.0
            assert prom.query_value('up{job="wrong-password"}') == 0.0
            wait_until(lambda: prom.query('kvledger_build_info{job="kvledger"}') or None, 30, what="a kvledger series")
        status, body, resp = get(port, ctx)
        assert status == 200 and b"kvledger_build_info" in body and resp.getheader("X-Content-Type-Options") == "nosniff"
        for password in ("wrong", None):
            status, _, resp = get(port, ctx, password=password)
            assert status == 401 and resp.getheader("WWW-Authenticate") == "Basic"
        status, _, _ = get(port, ctx, "/-/healthy", password="wrong")
        assert status == 401  # every endpoint
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            plain.request("GET", "/metrics", headers={"Authorization": basic_auth_header(USER, PASSWORD)})
            plain.getresponse().read()


def test_client_certificate_required_and_verified(tmp_path: Path, pki: Pki) -> None:
    web = {"tls_server_config": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key),
                                 "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": str(pki.client_ca),
                                 "client_allowed_sans": ["prometheus.example"]},
           "basic_auth_users": {USER: bcrypt_hash(PASSWORD)}}
    client = (pki.client_cert, pki.client_key)
    with tls_demo(tmp_path / "daemon", web, client_context(pki, client)) as port:
        jobs = [scrape_job("with-cert", port, pki, PASSWORD, client), scrape_job("no-cert", port, pki, PASSWORD, None),
                scrape_job("foreign-cert", port, pki, PASSWORD, (pki.stranger_cert, pki.stranger_key))]
        with prometheus(tmp_path / "prom", jobs) as prom:
            wait_for_health(prom, {"with-cert": "up", "no-cert": "down", "foreign-cert": "down"})
            assert prom.query_value('up{job="with-cert"}') == 1.0
        assert get(port, client_context(pki, client))[0] == 200
        assert get(port, client_context(pki, client), password="wrong")[0] == 401  # both factors are checked
        for ctx in (client_context(pki), client_context(pki, (pki.stranger_cert, pki.stranger_key))):
            with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
                get(port, ctx)
