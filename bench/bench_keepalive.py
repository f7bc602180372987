"""Keep-alive connections to engines (issue 22): the daemon's CPU for one poll's GET, with a
new TCP (and TLS) connection per GET, as the client did before issue 22, and with the
connection kept alive, as it does now.

Both are the same client (kvledger.collect.sources.http_client.HttpClient) in this run,
against the same servers and bodies; "new connection" closes the kept connection after each
GET (``client.close()``), which leaves exactly the connect-per-GET client of before. Rounds
alternate between the two so the machine's drift touches both alike; each figure is the
median over rounds of the client's CPU per GET (``time.process_time``: the servers run in
another process, so only the client is counted), and the wall time per GET. The servers
are Python's http.server without TCP_NODELAY, the case where keep-alive meets Nagle's
algorithm (the client's quick ACK answers it: http_client._quick_ack). Bodies: a small /metrics-like text (4 KiB)
and the realistic ledger document of 1,250 requests (bench/realistic_load.py), over plain
HTTP and over TLS (a CA made with openssl, verified as tls_config: {ca_file} does).

Run: .venv/bin/python bench/bench_keepalive.py [--rounds 15] [--gets 100]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from realistic_load import Load, dumps

from kvledger.collect.sources.http_client import HttpClient
from kvledger.config.types import ClientAuth, TlsClientConfig

SERVER = textwrap.dedent("""
    import ssl, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    body = open(sys.argv[1], "rb").read()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = len(sys.argv) > 4 and sys.argv[4] == "nodelay"
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), H)
    server.daemon_threads = True
    if len(sys.argv) > 2 and sys.argv[2]:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(sys.argv[2], sys.argv[3])
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print(server.server_address[1], flush=True)
    server.serve_forever()
""")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """(CA, server certificate for IP:127.0.0.1, its key)."""
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1", "-subj", "/CN=bench-ca",
             "-keyout", "ca.key", "-out", "ca.crt", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", "/CN=engine",
             "-keyout", "server.key", "-out", "server.csr", cwd=d)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
             "-extfile", "ext", "-out", "server.crt", cwd=d)
    return d / "ca.crt", d / "server.crt", d / "server.key"


def per_get(client: HttpClient, gets: int, new_connection: bool) -> tuple[float, float]:
    """(client CPU seconds, wall seconds) per GET over ``gets`` GETs."""
    t, w = time.process_time(), time.perf_counter()
    for _ in range(gets):
        client.get()
        if new_connection:
            client.close()
    return (time.process_time() - t) / gets, (time.perf_counter() - w) / gets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--gets", type=int, default=100)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    ca, cert, key = make_certs(work)
    load = Load(1250, seed=7)
    load.tick()
    bodies = {"4 KiB text": b"x" * 4096, "ledger, 1,250 requests": dumps(load.rows_document())}
    servers = []
    try:
        print(f"{args.rounds} rounds x {args.gets} GETs per case; client CPU per GET, median over rounds")
        print("| body | transport | CPU, new connection per GET | CPU, kept alive | kept / new | wall, new | wall, kept |")
        print("|---|---|---|---|---|---|---|")
        for name, body in bodies.items():
            path = work / f"body-{len(body)}"
            path.write_bytes(body)
            for transport in ("http", "https"):
                extra = [str(cert), str(key)] if transport == "https" else []
                server = subprocess.Popen([sys.executable, "-c", SERVER, str(path), *extra], stdout=subprocess.PIPE, text=True)
                servers.append(server)
                assert server.stdout is not None
                port = int(server.stdout.readline())
                auth = ClientAuth(tls_config=TlsClientConfig(ca_file=str(ca))) if transport == "https" else None
                client = HttpClient(f"{transport}://127.0.0.1:{port}/", timeout=5, max_bytes=64 << 20, auth=auth)
                client.get()  # warm up
                new, kept = [], []
                for _ in range(args.rounds):
                    new.append(per_get(client, args.gets, True))
                    kept.append(per_get(client, args.gets, False))
                client.close()
                n, k = statistics.median(c for c, _ in new), statistics.median(c for c, _ in kept)
                nw, kw = statistics.median(w for _, w in new), statistics.median(w for _, w in kept)
                print(f"| {name} ({len(body) / 1024:.0f} KiB) | {transport} | {n * 1e6:.0f} µs | {k * 1e6:.0f} µs | {k / n:.2f} "
                      f"| {nw * 1e6:.0f} µs | {kw * 1e6:.0f} µs |", flush=True)
                server.terminate()
    finally:
        for s in servers:
            s.kill()


if __name__ == "__main__":
    main()
