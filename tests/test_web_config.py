"""The exporter-toolkit web config: every field parsed, bad values and unknown keys
named with the file and key; basic-auth verification, its caches and the gate that runs
bcrypt; the config key and the flag."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import yaml
from tls_support import Pki, bcrypt_hash, make_pki

from kvledger.cli import build_parser
from kvledger.config.loader import config_from_mapping
from kvledger.config.types import ConfigError
from kvledger.web import basic_auth as basic_auth_module
from kvledger.web.basic_auth import BasicAuth, parse_basic
from kvledger.web.server import basic_auth_header
from kvledger.web.tls import sans_allowed, server_context
from kvledger.web.web_config import load_web_config, web_config_from_mapping


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def write(tmp_path: Path, doc: object) -> Path:
    path = tmp_path / "web-config.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def error_of(tmp_path: Path, doc: object) -> str:
    path = write(tmp_path, doc)
    with pytest.raises(ConfigError) as exc:
        load_web_config(path)
    assert str(exc.value).startswith(f"{path}: ")
    return str(exc.value)


def test_every_field_parsed(tmp_path: Path, pki: Pki) -> None:
    hashed = bcrypt_hash("secret")
    path = write(tmp_path, {
        "tls_server_config": {
            "cert_file": str(pki.server_cert), "key_file": pki.server_key.name,  # relative: to the file's directory
            "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": str(pki.client_ca),
            "client_allowed_sans": ["prometheus.example"],
            "min_version": "TLS12", "max_version": "TLS13",
            "cipher_suites": ["TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256", "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305",
                              "TLS_AES_128_GCM_SHA256"],
            "prefer_server_cipher_suites": False,
            "curve_preferences": ["X25519", "CurveP256"],
        },
        "http_server_config": {"http2": False, "headers": {
            "X-Frame-Options": "deny", "X-Content-Type-Options": "nosniff", "Content-Security-Policy": "default-src 'self'",
            "X-XSS-Protection": "1; mode=block", "Strict-Transport-Security": "max-age=31536000"}},
        "basic_auth_users": {"prometheus": hashed},
    })
    (tmp_path / pki.server_key.name).write_bytes(pki.server_key.read_bytes())
    cfg = load_web_config(path)
    tls = cfg.tls
    assert tls is not None
    assert tls.cert_file == pki.server_cert and tls.key_file == tmp_path / pki.server_key.name
    assert tls.client_auth_type == "RequireAndVerifyClientCert" and tls.client_ca_file == pki.client_ca
    assert tls.client_allowed_sans == ("prometheus.example",)
    assert (tls.min_version, tls.max_version) == ("TLS12", "TLS13")
    assert tls.cipher_suites == ("ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-CHACHA20-POLY1305")  # TLS 1.3 suites: not configurable
    assert tls.prefer_server_cipher_suites is False
    assert tls.curve_preferences == ("X25519", "prime256v1")
    assert cfg.http2 is False
    assert dict(cfg.headers) == {"X-Frame-Options": "deny", "X-Content-Type-Options": "nosniff",
                                 "Content-Security-Policy": "default-src 'self'", "X-XSS-Protection": "1; mode=block",
                                 "Strict-Transport-Security": "max-age=31536000"}
    assert cfg.basic_auth_users == {"prometheus": hashed.encode()}
    ctx = server_context(tls, str(path))
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2 and ctx.maximum_version == ssl.TLSVersion.TLSv1_3
    assert not ctx.options & ssl.OP_CIPHER_SERVER_PREFERENCE
    tls12 = {c["name"] for c in ctx.get_ciphers() if c["protocol"] == "TLSv1.2"}
    assert tls12 == {"ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-CHACHA20-POLY1305"}


def test_defaults_and_empty_file(tmp_path: Path, pki: Pki) -> None:
    assert load_web_config(write(tmp_path, None)).tls is None
    cfg = web_config_from_mapping({"tls_server_config": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)}})
    assert cfg.tls is not None and cfg.tls.client_auth_type == "NoClientCert"
    assert (cfg.tls.min_version, cfg.tls.max_version, cfg.tls.prefer_server_cipher_suites) == ("TLS12", "TLS13", True)
    assert cfg.http2 is True and cfg.headers == () and not cfg.basic_auth
    ctx = server_context(cfg.tls)
    assert ctx.verify_mode == ssl.CERT_NONE and ctx.options & ssl.OP_CIPHER_SERVER_PREFERENCE
    # exporter-toolkit: a tls_server_config without certificate and key means plain HTTP
    assert web_config_from_mapping({"tls_server_config": {"min_version": "TLS13"}}).tls is None


@pytest.mark.parametrize(("doc", "expected"), [
    ({"tls_server_confg": {}}, "<top>: unknown key(s): tls_server_confg"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "keyfile": "c"}}, "tls_server_config: unknown key(s): keyfile"),
    ({"http_server_config": {"http3": True}}, "http_server_config: unknown key(s): http3"),
    ({"http_server_config": {"http2": "yes"}}, "http_server_config.http2: expected true or false"),
    ({"http_server_config": {"headers": {"Server": "x"}}}, "http_server_config.headers: header(s) that cannot be configured: Server"),
    ({"http_server_config": {"headers": {"X-Frame-Options": "allow"}}}, "http_server_config.headers.X-Frame-Options: must be one of deny, sameorigin"),
    ({"http_server_config": {"headers": {"X-Content-Type-Options": "sniff"}}}, "X-Content-Type-Options: must be one of nosniff"),
    ({"tls_server_config": {"cert_file": "a"}}, "tls_server_config.key_file: is required when cert_file is set"),
    ({"tls_server_config": {"key_file": "a"}}, "tls_server_config.cert_file: is required when key_file is set"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "min_version": "TLS14"}},
     "tls_server_config.min_version: must be one of TLS10, TLS11, TLS12, TLS13; got 'TLS14'"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "max_version": 12}}, "tls_server_config.max_version: must be one of"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "min_version": "TLS13", "max_version": "TLS12"}},
     "tls_server_config.min_version: TLS13 is above max_version TLS12"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "client_auth_type": "VerifyAll"}},
     "tls_server_config.client_auth_type: must be one of NoClientCert, RequestClientCert"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "client_auth_type": "RequireAnyClientCert"}},
     "tls_server_config.client_auth_type: RequireAnyClientCert is not supported"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "client_auth_type": "RequestClientCert"}},
     "tls_server_config.client_auth_type: RequestClientCert is not supported"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "client_auth_type": "RequireAndVerifyClientCert"}},
     "tls_server_config.client_ca_file: is required with client_auth_type RequireAndVerifyClientCert"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "client_ca_file": "ca"}},
     "tls_server_config.client_auth_type: client_ca_file is set without a client authentication policy"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "client_auth_type": "VerifyClientCertIfGiven",
                            "client_ca_file": "ca", "client_allowed_sans": ["x"]}},
     "tls_server_config.client_allowed_sans: needs client_auth_type RequireAndVerifyClientCert"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "client_allowed_sans": "x"}},
     "tls_server_config.client_allowed_sans: expected a list of non-empty strings"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b",
                            "cipher_suites": ["TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256", "TLS_RSA_WITH_RC4_128_SHA", "BOGUS"]}},
     "tls_server_config.cipher_suites: unknown or unsupported cipher suite(s): TLS_RSA_WITH_RC4_128_SHA, BOGUS"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "curve_preferences": ["CurveP256", "P-999"]}},
     "tls_server_config.curve_preferences: unknown curve(s): P-999"),
    ({"tls_server_config": {"cert_file": "a", "key_file": "b", "prefer_server_cipher_suites": "no"}},
     "tls_server_config.prefer_server_cipher_suites: expected true or false"),
    ({"tls_server_config": {"cert": "PEM", "key_file": "b"}}, "tls_server_config.cert: inline certificates are not supported"),
    ({"tls_server_config": {"client_ca": "PEM"}}, "tls_server_config.client_ca: an inline client CA is not supported"),
    ({"rate_limit": {"interval": "1s", "burst": 5}}, "rate_limit: is not supported by kvledger"),
    ({"basic_auth_users": {"alice": "plaintext"}}, "basic_auth_users.alice: expected a bcrypt hash"),
    ({"basic_auth_users": {"a:b": "$2b$04$" + "a" * 53}}, "basic_auth_users.a:b: a user name must be a non-empty string without ':'"),
    ({"basic_auth_users": ["alice"]}, "basic_auth_users: expected a mapping"),
    ([1, 2], "<top>: expected a mapping"),
])
def test_bad_values_and_unknown_keys_are_named(tmp_path: Path, doc: object, expected: str) -> None:
    assert expected in error_of(tmp_path, doc)


def test_unreadable_files_are_named(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(ConfigError, match=r"missing.yml: cannot read"):
        load_web_config(tmp_path / "missing.yml")
    (tmp_path / "bad.yml").write_text("tls_server_config: [\n")
    with pytest.raises(ConfigError, match=r"bad.yml: invalid YAML at line"):
        load_web_config(tmp_path / "bad.yml")
    cfg = web_config_from_mapping({"tls_server_config": {"cert_file": str(tmp_path / "nope.crt"), "key_file": str(pki.server_key)}})
    assert cfg.tls is not None
    with pytest.raises(ConfigError, match=r"web.yml: tls_server_config: cannot load cert_file .*nope.crt"):
        server_context(cfg.tls, "web.yml")
    cfg = web_config_from_mapping({"tls_server_config": {
        "cert_file": str(pki.server_cert), "key_file": str(pki.server_key),
        "client_auth_type": "VerifyClientCertIfGiven", "client_ca_file": str(tmp_path / "ca.pem")}})
    assert cfg.tls is not None
    with pytest.raises(ConfigError, match=r"web.yml: tls_server_config.client_ca_file: cannot load .*ca.pem"):
        server_context(cfg.tls, "web.yml")


def test_client_allowed_sans_match_exactly() -> None:
    cfg = web_config_from_mapping({"tls_server_config": {
        "cert_file": "a", "key_file": "b", "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": "c",
        "client_allowed_sans": ["prometheus.example", "spiffe://example/prometheus"]}}, base=Path("/"))
    assert cfg.tls is not None
    assert sans_allowed(cfg.tls, {"subjectAltName": (("DNS", "prometheus.example"),)})
    assert sans_allowed(cfg.tls, {"subjectAltName": (("URI", "spiffe://example/prometheus"),)})
    assert not sans_allowed(cfg.tls, {"subjectAltName": (("DNS", "other.example"), ("IP Address", "127.0.0.1"))})
    assert not sans_allowed(cfg.tls, {"subjectAltName": (("DNS", "sub.prometheus.example"),)})
    assert not sans_allowed(cfg.tls, None)


def test_basic_auth_verifies_and_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    auth = BasicAuth({"prometheus": bcrypt_hash("s3cret").encode(), "other": bcrypt_hash("x").encode()})
    calls: list[bytes] = []
    real = basic_auth_module.bcrypt.checkpw

    def counting(password: bytes, hashed: bytes) -> bool:
        calls.append(password)
        return real(password, hashed)

    monkeypatch.setattr(basic_auth_module.bcrypt, "checkpw", counting)
    good = basic_auth_header("prometheus", "s3cret")
    assert auth.check(good) and auth.check(good) and auth.check(good)
    assert calls == [b"s3cret"]  # verified once, then remembered
    assert not auth.check(basic_auth_header("prometheus", "wrong"))
    assert not auth.check(basic_auth_header("prometheus", "wrong"))
    assert calls.count(b"wrong") == 1  # a failure is remembered too: a repeated wrong password costs one bcrypt
    assert auth.check(good) and calls.count(b"s3cret") == 1  # ... and never blocks the right one
    assert not auth.check(basic_auth_header("other", "s3cret"))  # the cache is per user
    assert not auth.check(basic_auth_header("nobody", "s3cret"))  # unknown users pay bcrypt too
    assert calls[-1] == b"s3cret"
    assert not auth.check(None) and not auth.check("Bearer abc") and not auth.check("Basic !!!")
    # a password with a colon: only the first colon separates the user
    assert parse_basic(basic_auth_header("u", "a:b")) == ("u", "a:b")
    assert parse_basic("Basic " + "dXNlcg==") is None  # "user" without a colon


def test_config_key_and_flag(tmp_path: Path) -> None:
    (tmp_path / "web.yml").write_text("{}\n")  # checked at load (tests/test_first_hour_docs.py: a missing one is named)
    cfg = config_from_mapping({"web_config_file": "web.yml"}, str(tmp_path / "kvledger.yml"))
    assert cfg.web_config_file == str(tmp_path / "web.yml")
    assert config_from_mapping({}).web_config_file is None
    with pytest.raises(ConfigError, match="web_config_file: expected a non-empty string"):
        config_from_mapping({"web_config_file": 3})
    args = build_parser().parse_args(["serve", "--config", "c.yml", "--web.config.file", "/etc/web.yml"])
    assert args.web_config_file == "/etc/web.yml"
    args = build_parser().parse_args(["demo", "--web.config.file", "w.yml"])
    assert args.web_config_file == "w.yml"


def test_web_config_file_is_read_like_the_configuration(tmp_path: Path) -> None:
    """The same reader as kvledger.yml: non-UTF-8 text and a key given twice are named."""
    (tmp_path / "latin1.yml").write_bytes(b"basic_auth_users:\n  caf\xe9: x\n")
    with pytest.raises(ConfigError, match=r"latin1.yml: not UTF-8 text: .* at byte offset 23"):
        load_web_config(tmp_path / "latin1.yml")
    (tmp_path / "twice.yml").write_text("http_server_config: {}\nhttp_server_config: {}\n")
    with pytest.raises(ConfigError, match=r"twice.yml: invalid YAML at line 2.*duplicate key"):
        load_web_config(tmp_path / "twice.yml")


def test_remembered_verdicts_are_keyed_bounded_and_never_lock_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Verdicts are kept under a keyed hash of the whole credential (no password, no plain
    hash of one), in two bounded tables: wrong passwords only ever evict wrong passwords."""
    auth = BasicAuth({"prometheus": bcrypt_hash("s3cret", rounds=4).encode()}, cache_size=2, failure_cache_size=8)
    good = basic_auth_header("prometheus", "s3cret")
    assert auth.check(good)
    for i in range(50):  # a brute force: every password new
        assert not auth.check(basic_auth_header("prometheus", f"guess-{i}"))
    assert len(auth._failed) == 8 and len(auth._ok) == 1  # bounded; the success survived the flood
    checks = auth.bcrypt_checks
    assert auth.check(good) and auth.bcrypt_checks == checks  # still remembered: no bcrypt
    cred = auth.credential(good)
    assert cred is not None and b"s3cret" not in cred.mac and "s3cret" not in repr(cred)
    other = BasicAuth(dict(auth.users))  # another process (or config) keys differently
    other_cred = other.credential(good)
    assert other_cred is not None and other_cred.mac != cred.mac
    # a remembered success is checked against the hash in force
    auth.users["prometheus"] = bcrypt_hash("new", rounds=4).encode()
    assert auth.remembered(cred) is False


def test_auth_gate_runs_bcrypt_in_its_own_pool_fairly() -> None:
    """bcrypt runs in the gate's own thread; one client gets at most ``per_client`` checks
    waiting (then None: 429), a second client's check is served before the first one's
    backlog (round robin), and the same credential is checked once however many ask."""
    import asyncio
    import threading
    import time

    from kvledger.web.basic_auth import AuthGate, client_key

    threads: list[str] = []
    order: list[str] = []

    class SlowAuth(BasicAuth):
        def verify(self, cred):  # type: ignore[no-untyped-def]
            threads.append(threading.current_thread().name)
            order.append(cred.password)
            time.sleep(0.02)
            return cred.password == "right"

    auth = SlowAuth({"u": bcrypt_hash("right", rounds=4).encode()})

    async def scenario() -> tuple[list[bool | None], list[bool | None], list[bool | None]]:
        gate = AuthGate(workers=1, per_client=3, queued=100)
        try:
            flood = [asyncio.ensure_future(gate.check(auth, auth.credential(basic_auth_header("u", f"w{i}")), "10.0.0.1"))  # type: ignore[arg-type]
                     for i in range(5)]
            await asyncio.sleep(0)
            same = [asyncio.ensure_future(gate.check(auth, auth.credential(basic_auth_header("u", "right")), "10.0.0.2"))  # type: ignore[arg-type]
                    for _ in range(10)]
            first = await asyncio.gather(*flood)
            second = await asyncio.gather(*same)
            v6 = [await gate.check(auth, auth.credential(basic_auth_header("u", f"x{i}")), f"2001:db8::{i}")  # type: ignore[arg-type]
                  for i in range(2)]
            return first, second, v6
        finally:
            gate.close()

    first, second, v6 = asyncio.run(scenario())
    assert first == [False, False, False, None, None]  # three admitted, two refused at once
    assert second == [True] * 10 and order.count("right") == 1  # ten asked, one bcrypt
    assert order.index("right") < order.index("w2")  # round robin: not behind the whole backlog of the first client
    assert v6 == [False, False] and all(name.startswith("kvledger-bcrypt") for name in threads)
    assert client_key("2001:db8::1") == client_key("2001:db8::ffff") == "2001:db8::/64"
    assert client_key("::ffff:10.0.0.1") == "10.0.0.1" and client_key("10.0.0.1") == "10.0.0.1"
