"""Certificates for TLS tests, made with the openssl CLI: a CA, a server certificate
for IP:127.0.0.1 and DNS:localhost, and client certificates signed by a client CA."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import bcrypt


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """(cert, key) of a self-signed CA named ``name``."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert),
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=directory)
    return cert, key


def make_leaf(directory: Path, name: str, ca: tuple[Path, Path], san: str, usage: str) -> tuple[Path, Path]:
    """(cert, key) named ``name`` signed by ``ca`` with subjectAltName ``san``
    (e.g. "IP:127.0.0.1,DNS:localhost") and extendedKeyUsage ``usage`` (serverAuth | clientAuth)."""
    cert, key, csr = directory / f"{name}.crt", directory / f"{name}.key", directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={name}",
             "-keyout", str(key), "-out", str(csr), cwd=directory)
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-days", "2", "-extfile", str(ext), "-out", str(cert), cwd=directory)
    return cert, key


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_ca: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # a client certificate signed by another CA
    stranger_key: Path


def make_pki(directory: Path) -> Pki:
    ca = make_ca(directory, "server-ca")
    server = make_leaf(directory, "server", ca, "IP:127.0.0.1,DNS:localhost", "serverAuth")
    client_ca = make_ca(directory, "client-ca")
    client = make_leaf(directory, "client", client_ca, "DNS:prometheus.example,URI:spiffe://example/prometheus",
                       "clientAuth")
    other_ca = make_ca(directory, "other-ca")
    stranger = make_leaf(directory, "stranger", other_ca, "DNS:prometheus.example", "clientAuth")
    return Pki(ca[0], server[0], server[1], client_ca[0], client[0], client[1], stranger[0], stranger[1])


def bcrypt_hash(password: str, rounds: int = 4) -> str:
    """A bcrypt hash as htpasswd -nB writes it (low cost: tests only)."""
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=rounds)).decode()
