"""Engines behind a token, basic auth or mTLS (issue 22): an engine entry takes Prometheus
scrape_config's `authorization`, `basic_auth` and `tls_config`, with its key names and
checks, for every HTTP source; the secrets never reach a message; and the one bounded
client keeps its connection to the engine alive, handling a connection the engine closed.

Fake engines (tests/harness/secure_engine.py) demand a bearer token, basic auth, or a
client certificate over real TLS sockets (certificates made by openssl: tests/tls_support.py)."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tls_support import Pki, make_pki

from harness.secure_engine import SecureEngine
from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.document import LedgerSource
from kvledger.collect.sources.http_client import HttpClient
from kvledger.collect.sources.registry import build_sources
from kvledger.config.engine_kinds import KINDS
from kvledger.config.loader import config_from_mapping, load_config
from kvledger.config.types import ConfigError, EngineConfig, Secret

TOKEN = "tok-3f9a1c0e7d"  # every secret here is a string no message may contain
PASSWORD = "pw-b71e44a2c9"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def engine_config(tmp_path: Path, url: str, **keys: Any) -> EngineConfig:
    """An engine entry as a YAML file gives it (relative files resolve next to the file)."""
    path = tmp_path / "kvledger.yml"
    path.write_text(yaml.safe_dump({"nvml": {"enabled": False},
                                    "engines": [{"name": "e", "kind": "ledger", "url": url, **keys}]}))
    (engine,) = load_config(str(path)).engines
    return engine


def poll(cfg: EngineConfig) -> Any:
    source = LedgerSource(cfg)
    try:
        return source.poll()
    finally:
        source.close()


def failure(cfg: EngineConfig) -> SourceError:
    with pytest.raises(SourceError) as info:
        poll(cfg)
    return info.value


# ---------------------------------------------------------------- bearer token


def test_a_bearer_token_from_the_configuration_or_a_file(tmp_path: Path) -> None:
    with SecureEngine(bearer=TOKEN) as engine:
        err = failure(engine_config(tmp_path, engine.url))
        assert err.reason == "http_status" and "HTTP 401" in err.message and "credentials" in err.message
        assert poll(engine_config(tmp_path, engine.url, authorization={"credentials": TOKEN})).facts.pools
        (tmp_path / "token").write_text(TOKEN + "\n")  # a trailing newline, as `echo` writes one
        assert poll(engine_config(tmp_path, engine.url, authorization={"type": "Bearer", "credentials_file": "token"})).facts.pools
        assert engine.authorizations[-1] == f"Bearer {TOKEN}"


def test_a_rotated_token_file_is_used_at_the_next_poll(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("old-token")
    with SecureEngine(bearer="old-token") as engine:
        source = LedgerSource(engine_config(tmp_path, engine.url, authorization={"credentials_file": "token"}))
        try:
            assert source.poll().facts.pools
            engine.bearer = "new-token"
            with pytest.raises(SourceError):
                source.poll()
            (tmp_path / "token").write_text("new-token\n")
            assert source.poll().facts.pools
        finally:
            source.close()


def test_an_unreadable_token_file_at_poll_time_names_the_key_not_the_content(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN)
    cfg = engine_config(tmp_path, "http://127.0.0.1:1/", authorization={"credentials_file": "token"})
    (tmp_path / "token").unlink()
    err = failure(cfg)
    assert err.reason == "config"
    assert err.message == f"http://127.0.0.1:1/: authorization.credentials_file: cannot read {tmp_path / 'token'}: No such file or directory"


# ---------------------------------------------------------------- basic auth


def test_basic_auth_with_a_password_or_a_password_file(tmp_path: Path) -> None:
    with SecureEngine(basic=("kvledger", PASSWORD)) as engine:
        assert poll(engine_config(tmp_path, engine.url, basic_auth={"username": "kvledger", "password": PASSWORD})).facts.pools
        (tmp_path / "pw").write_text(PASSWORD)
        assert poll(engine_config(tmp_path, engine.url, basic_auth={"username": "kvledger", "password_file": str(tmp_path / "pw")}))
        err = failure(engine_config(tmp_path, engine.url, basic_auth={"username": "kvledger", "password": "wrong-" + PASSWORD}))
        assert err.reason == "http_status" and "HTTP 401" in err.message
        assert PASSWORD not in err.message and "kvledger:" not in err.message


# ---------------------------------------------------------------- TLS


def test_a_client_certificate_opens_an_engine_that_requires_one(tmp_path: Path, pki: Pki) -> None:
    with SecureEngine(server_cert=(pki.server_cert, pki.server_key), client_ca=pki.client_ca) as engine:
        good = {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert), "key_file": str(pki.client_key)}
        assert poll(engine_config(tmp_path, engine.url, tls_config=good)).facts.pools
        assert "URI:spiffe://example/prometheus" in engine.client_names
        # no client certificate, or one of another CA: the engine refuses the handshake
        for tls in ({"ca_file": str(pki.ca)},
                    {"ca_file": str(pki.ca), "cert_file": str(pki.stranger_cert), "key_file": str(pki.stranger_key)}):
            err = failure(engine_config(tmp_path, engine.url, tls_config=tls))
            assert err.reason in ("connect", "parse"), err
        # the engine's certificate is checked: not against the system's CAs
        err = failure(engine_config(tmp_path, engine.url))
        assert err.reason == "connect" and "CERTIFICATE_VERIFY_FAILED" in err.message


def test_server_name_and_insecure_skip_verify(tmp_path: Path, pki: Pki) -> None:
    with SecureEngine(server_cert=(pki.server_cert, pki.server_key)) as engine:
        # the certificate names IP:127.0.0.1 and DNS:localhost
        assert poll(engine_config(tmp_path, engine.url, tls_config={"ca_file": str(pki.ca), "server_name": "localhost"}))
        err = failure(engine_config(tmp_path, engine.url, tls_config={"ca_file": str(pki.ca), "server_name": "engine.example"}))
        assert err.reason == "connect" and "CERTIFICATE_VERIFY_FAILED" in err.message
        assert poll(engine_config(tmp_path, engine.url, tls_config={"insecure_skip_verify": True}))


def test_token_and_client_certificate_together(tmp_path: Path, pki: Pki) -> None:
    """An authenticating proxy inside an mTLS mesh: both at once, on every HTTP source."""
    with SecureEngine(bearer=TOKEN, server_cert=(pki.server_cert, pki.server_key), client_ca=pki.client_ca) as engine:
        cfg = engine_config(tmp_path, engine.url, authorization={"credentials": TOKEN},
                            tls_config={"ca_file": str(pki.ca), "cert_file": str(pki.client_cert), "key_file": str(pki.client_key)})
        assert poll(cfg).facts.pools


def test_every_http_source_of_every_kind_presents_the_engine_settings(tmp_path: Path) -> None:
    """Each kind's HTTP clients are built with the engine's ClientAuth (none is left out)."""
    extras: dict[str, dict[str, str]] = {"sglang": {"server_info_url": "http://127.0.0.1:1/server_info"}}
    kinds = {kind: extras.get(kind, {}) for kind in KINDS}  # every registered kind
    for kind, extra in kinds.items():
        path = tmp_path / f"{kind}.yml"
        path.write_text(yaml.safe_dump({"nvml": {"enabled": False}, "engines": [
            {"name": "e", "kind": kind, "url": "http://127.0.0.1:1/prometheus/metrics", "authorization": {"credentials": TOKEN},
             "block_bytes": 4096, "max_model_len": 256, **extra}]}))
        config = load_config(str(path))
        sources, _timeouts, _base = build_sources(config)
        clients = [c for s in sources for c in vars(s).values() if isinstance(c, HttpClient)]
        assert clients, kind
        assert all(c.auth is not None and c.auth.authorization is not None for c in clients), kind
        for s in sources:
            s.close()


# ---------------------------------------------------------------- configuration errors


@pytest.mark.parametrize(("keys", "message"), [
    ({"authorization": {"credentials": TOKEN, "credentials_file": "token"}},
     "engines[0].authorization: give one of credentials and credentials_file"),
    ({"authorization": {"type": "Bearer"}}, "engines[0].authorization: give one of credentials and credentials_file"),
    ({"authorization": {"type": "Basic", "credentials": TOKEN}},
     "engines[0].authorization.type: type Basic is basic_auth's: give basic_auth: {{username, password}} instead"),
    ({"authorization": {"credentials": 31337}}, "engines[0].authorization.credentials: expected a non-empty string, got int (the value is not shown)"),
    ({"authorization": {"credentials": TOKEN}, "basic_auth": {"username": "u", "password": PASSWORD}},
     "engines[0]: give authorization or basic_auth, not both"),
    ({"authorization": {"credential": TOKEN}}, "engines[0].authorization: unknown key(s): credential (did you mean credentials?)"),
    ({"basic_auth": {"password": PASSWORD}}, "engines[0].basic_auth.username: is required"),
    ({"basic_auth": {"username": "u", "password": PASSWORD, "password_file": "token"}},
     "engines[0].basic_auth: give password or password_file, not both"),
    ({"authorization": {"credentials_file": "missing"}}, "engines[0].authorization.credentials_file: cannot read {dir}/missing: No such file or directory"),
    ({"tls_config": {"cert_file": "token"}}, "engines[0].tls_config: cert_file and key_file go together (a client certificate and its key)"),
    ({"tls_config": {"ca_file": "token"}}, "engines[0].tls_config: ca_file {dir}/token: not usable"),
    ({"tls_config": {"insecure_skip_verify": "yes"}}, "engines[0].tls_config.insecure_skip_verify: expected true or false, got 'yes'"),
])
def test_bad_settings_are_refused_naming_the_key_and_never_the_secret(tmp_path: Path, keys: dict[str, Any], message: str) -> None:
    (tmp_path / "token").write_text("not a certificate")
    path = tmp_path / "kvledger.yml"
    path.write_text(yaml.safe_dump({"engines": [{"name": "e", "kind": "ledger", "url": "https://127.0.0.1:1/", **keys}]}))
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    text = str(info.value)
    assert text.startswith(f"{path}: {message.format(dir=tmp_path)}"), text
    assert TOKEN not in text and PASSWORD not in text and "31337" not in text


def test_tls_config_on_an_http_url_and_credentials_twice_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"engines\[0\].tls_config: applies to https:// URLs; the url is not one"):
        config_from_mapping({"engines": [{"name": "e", "kind": "ledger", "url": "http://e/", "tls_config": {"insecure_skip_verify": True}}]})
    with pytest.raises(ConfigError) as info:
        config_from_mapping({"engines": [{"name": "e", "kind": "ledger", "url": f"http://u:{PASSWORD}@e/",
                                          "basic_auth": {"username": "u", "password": PASSWORD}}]})
    assert "engines[0].url: the url carries credentials (user:password@) and so does basic_auth: give one" in str(info.value)
    assert PASSWORD not in str(info.value)


def test_a_loaded_configuration_never_prints_a_secret() -> None:
    config = config_from_mapping({"engines": [
        {"name": "a", "kind": "ledger", "url": "http://a/", "authorization": {"credentials": TOKEN}},
        {"name": "b", "kind": "ledger", "url": "http://b/", "basic_auth": {"username": "u", "password": PASSWORD}}]})
    for text in (repr(config), str(config), f"{config.engines}", f"{config.engines[0].authorization}"):
        assert TOKEN not in text and PASSWORD not in text and "<secret>" in text
    assert isinstance(config.engines[0].authorization.credentials, Secret)  # type: ignore[union-attr]
    assert config.engines[0].authorization.credentials.reveal() == TOKEN  # type: ignore[union-attr]


# ---------------------------------------------------------------- keep-alive


@pytest.fixture
def plain_engine() -> Iterator[SecureEngine]:
    engine = SecureEngine()
    try:
        yield engine
    finally:
        engine.stop()


def test_one_connection_serves_every_poll(plain_engine: SecureEngine, tmp_path: Path, pki: Pki) -> None:
    client = HttpClient(plain_engine.url, timeout=2, accept="application/json")
    try:
        for _ in range(20):
            assert client.get() == plain_engine.body
    finally:
        client.close()
    assert (plain_engine.connections, plain_engine.requests, client.connections) == (1, 20, 1)
    with SecureEngine(bearer=TOKEN, server_cert=(pki.server_cert, pki.server_key), client_ca=pki.client_ca) as tls_engine:
        cfg = engine_config(tmp_path, tls_engine.url, authorization={"credentials": TOKEN},
                            tls_config={"ca_file": str(pki.ca), "cert_file": str(pki.client_cert), "key_file": str(pki.client_key)})
        tls_client = HttpClient(tls_engine.url, timeout=2, auth=cfg.client_auth)
        try:
            for _ in range(20):
                tls_client.get()
        finally:
            tls_client.close()
        assert (tls_engine.connections, tls_engine.requests) == (1, 20)  # one handshake for twenty polls


def test_a_connection_the_engine_closed_while_idle_is_replaced_without_an_error(plain_engine: SecureEngine) -> None:
    plain_engine.drop_idle = True
    client = HttpClient(plain_engine.url, timeout=2)
    try:
        for _ in range(5):
            assert client.get() == plain_engine.body
            idle = client._idle  # the kept connection, idle between polls
            if idle is not None and idle.sock is not None:  # the engine's FIN arrives while it is idle
                assert select.select([idle.sock], [], [], 5)[0], "the engine never closed the idle connection"
    finally:
        client.close()
    assert plain_engine.connections == plain_engine.requests == 5


def test_a_connection_closed_as_the_request_goes_out_is_retried_once(plain_engine: SecureEngine) -> None:
    """The race the idle check cannot see: the engine reads the GET on the kept connection
    and closes it without an answer. The GET is sent again on a new connection."""
    plain_engine.drop_on_request = True
    client = HttpClient(plain_engine.url, timeout=2)
    try:
        assert client.get() == plain_engine.body  # first connection, first request: answered
        assert client.get() == plain_engine.body  # its second request is dropped: a new connection answers
        assert client.get() == plain_engine.body
    finally:
        client.close()
    assert plain_engine.connections == 3 and plain_engine.requests == 5


def test_a_fresh_connection_that_closes_is_an_error_not_a_retry(tmp_path: Path) -> None:
    """Only a reused connection is retried: an engine that drops every request fails the poll once."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.recv(65536)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        with pytest.raises(SourceError) as info:
            HttpClient(f"http://127.0.0.1:{listener.getsockname()[1]}/", timeout=2).get()
        assert info.value.reason == "connect" and "closed the connection without an answer" in info.value.message
        assert len(accepted) == 1
    finally:
        listener.close()


def test_a_kept_connection_keeps_the_absolute_deadline(plain_engine: SecureEngine) -> None:
    """A stall on a reused connection ends at the poll's deadline, as on a new one."""
    client = HttpClient(plain_engine.url, timeout=0.5)
    try:
        client.get()
        plain_engine.stall = 2.0  # then it answers: a timeout naming 0.5 s is the deadline ending the stall
        with pytest.raises(SourceError) as info:
            client.get()
        assert info.value.reason == "timeout" and "within 0.5s" in info.value.message
        assert client.connections == 1  # it was the kept connection that stalled
    finally:
        client.close()


def test_tls_files_are_loaded_again_when_they_change(tmp_path: Path, pki: Pki) -> None:
    """A renewed client certificate is used by the next connection, without a reload."""
    cert, key = tmp_path / "client.crt", tmp_path / "client.key"
    cert.write_bytes(pki.stranger_cert.read_bytes())
    key.write_bytes(pki.stranger_key.read_bytes())
    with SecureEngine(server_cert=(pki.server_cert, pki.server_key), client_ca=pki.client_ca) as engine:
        cfg = engine_config(tmp_path, engine.url, tls_config={"ca_file": str(pki.ca), "cert_file": str(cert), "key_file": str(key)})
        client = HttpClient(engine.url, timeout=2, auth=cfg.client_auth)
        try:
            with pytest.raises(SourceError):
                client.get()
            cert.write_bytes(pki.client_cert.read_bytes())
            key.write_bytes(pki.client_key.read_bytes())
            later = time.time() + 5
            for p in (cert, key):
                os.utime(p, (later, later))
            assert client.get() == engine.body
        finally:
            client.close()


def test_the_readme_example_loads(tmp_path: Path, pki: Pki) -> None:
    """The configuration page's engine entry behind TLS, with its files present, is a valid configuration."""
    readme = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    section = readme.split("## Engines behind a token, basic auth or TLS", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "ca.pem").write_bytes(pki.ca.read_bytes())
    (tmp_path / "client.pem").write_bytes(pki.client_cert.read_bytes())
    (tmp_path / "client-key.pem").write_bytes(pki.client_key.read_bytes())
    (tmp_path / "kvledger.yml").write_text(block)
    (engine,) = load_config(str(tmp_path / "kvledger.yml")).engines
    assert engine.authorization is not None and engine.authorization.credentials_file == str(tmp_path / "token")
    assert engine.tls_config is not None and engine.tls_config.server_name == "llama.internal"
    assert engine.tls_config.cert_file == str(tmp_path / "client.pem") and engine.basic_auth is None


def test_a_stopped_ledger_server_ends_its_kept_connections() -> None:
    """The engine-side document server's stop() ends open connections too: a kept-alive
    client is not answered by a server that stopped, it finds the engine gone."""
    from kvledger_engine.document_server import serve_http

    server = serve_http(lambda: {"schema": "kvledger/v1", "pools": [], "requests": []})
    client = HttpClient(server.url, timeout=2, accept="application/json")
    try:
        assert b"kvledger/v1" in client.get()
        assert client.connections == 1
        server.stop()
        with pytest.raises(SourceError) as info:
            client.get()
        assert info.value.reason == "connect"
    finally:
        client.close()
        server.stop()


# ---------------------------------------------------------------- TLS failures name the check (issue 31)


def _leaf(directory: Path, name: str, ca: tuple[Path, Path] | None, days: int) -> tuple[Path, Path]:
    """A server certificate for IP:127.0.0.1 and DNS:localhost valid ``days`` (negative:
    expired), signed by ``ca``, or self-signed when ``ca`` is None."""
    from tls_support import _openssl

    cert, key, csr, ext = (directory / f"{name}.{x}" for x in ("crt", "key", "csr", "ext"))
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={name}",
             "-keyout", str(key), "-out", str(csr), cwd=directory)
    signer = ["-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial"] if ca else ["-key", str(key)]
    _openssl("x509", "-req", "-in", str(csr), *signer, "-days", str(days), "-extfile", str(ext), "-out", str(cert),
             cwd=directory)
    return cert, key


def test_a_refused_engine_certificate_names_the_check_that_failed(tmp_path: Path, pki: Pki) -> None:
    """Before: every case read "TLS handshake failed: CERTIFICATE_VERIFY_FAILED" alone."""
    from tls_support import make_ca

    ca = make_ca(tmp_path / "pki", "ca")
    expired = _leaf(tmp_path / "pki", "expired", ca, -1)
    self_signed = _leaf(tmp_path / "pki", "self", None, 2)
    cases = [
        (expired, {"ca_file": str(ca[0])}, "has expired"),
        (self_signed, {}, "self-signed"),
        ((pki.server_cert, pki.server_key), {"ca_file": str(pki.ca), "server_name": "engine.example"},
         "does not name 'engine.example' (hostname mismatch"),
        ((pki.server_cert, pki.server_key), {}, "no tls_config.ca_file is set"),
        ((pki.server_cert, pki.server_key), {"ca_file": str(ca[0])}, f"not trusted by tls_config.ca_file {ca[0]}"),
    ]
    for cert, tls, check in cases:
        with SecureEngine(server_cert=cert) as engine:
            keys = {"tls_config": tls} if tls else {}
            err = failure(engine_config(tmp_path, engine.url, **keys))
            assert err.reason == "connect", err
            assert "CERTIFICATE_VERIFY_FAILED" in err.message and check in err.message, err.message
