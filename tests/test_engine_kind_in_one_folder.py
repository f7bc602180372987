"""An engine kind is one folder and one registration (docs/adding-an-engine.md): a kind that
exists only in a temporary folder, outside the package (its source, and its registration in
its ``kind.py``: its source class by reference, its own keys, its rules), imported by the one
line a kind adds to ``collect/sources/kinds.py``, is accepted by the configuration loader
with its own key, built by the daemon's registry, polled by the collector over a real
socket, and exported with the catalogue's families and the default rules its registration
gives, while no file of the package names it. Every registered kind is one such line and
its folder."""

from __future__ import annotations

import ast
import http.server
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from import_graph import parse_python

from kvledger.collect.collector import Collector
from kvledger.collect.sources.registry import build_sources
from kvledger.config.engine_kinds import KINDS
from kvledger.config.loader import load_config
from kvledger.config.types import ConfigError
from kvledger.output.prometheus import render_text
from kvledger.tools.docgen import engine_kinds

ROOT = Path(__file__).resolve().parents[1]
KIND = "toykv"

#: the whole kind: a source folder with its registration (kind.py), as collect/sources/<kind>/
FOLDER = {
    "__init__.py": f'''
        """The {KIND} engine kind."""
    ''',
    "kind.py": f'''
        """The {KIND} engine kind's registration (the one place that names it)."""

        from kvledger.config.engine_kinds import EngineKind, Option, register
        from kvledger_{KIND}.source import ToySource

        register(EngineKind(
            name="{KIND}",
            source=ToySource,
            options=(Option("block_tokens", "tokens", "tokens per KV block"),),
            admission="reserve-cap",
            overflow="reject",
            docs="docs/engines/{KIND}.md",
            summary="a toy engine's /metrics: blocks in use of a fixed pool",
        ))
    ''',
    "source.py": f'''
        """Reads the toy engine's /metrics: toy_blocks_total (the pool) and toy_blocks_used."""

        from kvledger.collect.sources.base import EngineContribution, Source, SourceError
        from kvledger.collect.sources.http_client import HttpClient
        from kvledger.collect.sources.metric_values import configured_block_bytes
        from kvledger.collect.sources.prom_text import parse_exposition
        from kvledger.config.types import EngineConfig
        from kvledger.domain.facts import EngineFacts, PoolFacts


        class ToySource(Source):
            kind = "{KIND}"

            def __init__(self, cfg: EngineConfig) -> None:
                self.cfg, self.engine = cfg, cfg.name
                self._http = HttpClient(cfg.url, timeout=cfg.timeout_seconds, max_bytes=cfg.max_response_bytes,
                                        auth=cfg.client_auth)

            def poll(self) -> EngineContribution:
                exp = parse_exposition(self._http.get_text())
                try:
                    total, used = (int(exp[name][0].value) for name in ("toy_blocks_total", "toy_blocks_used"))
                except (KeyError, IndexError) as exc:
                    raise SourceError("parse", f"no {{exc}} in the exposition") from None
                block_size = int(self.cfg.option("block_tokens") or "16")
                pool = PoolFacts(id="0", block_size=block_size, num_blocks=total, in_use=used,
                                 block_bytes=configured_block_bytes(self.cfg, block_size, total))
                return EngineContribution(EngineFacts(name=self.cfg.name, kind="{KIND}", source="{KIND}", pools=[pool]))

            def close(self) -> None:
                self._http.abort()
    ''',
}


class _Engine(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"# TYPE toy_blocks_total gauge\ntoy_blocks_total 1000\n# TYPE toy_blocks_used gauge\ntoy_blocks_used 250\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def toy_engine() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def toy_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The kind's folder written outside the package, and the one line a kind adds to
    collect/sources/kinds.py run: its registration runs."""
    folder = tmp_path / f"kvledger_{KIND}"
    folder.mkdir()
    for name, text in FOLDER.items():
        (folder / name).write_text(textwrap.dedent(text).lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        exec(f"import kvledger_{KIND}.kind", {})  # the kind's line, as kinds.py holds one per kind
        yield KIND
    finally:
        KINDS.pop(KIND, None)
        for module in [m for m in sys.modules if m.split(".")[0] == f"kvledger_{KIND}"]:
            del sys.modules[module]


def test_a_kind_in_its_own_folder_is_loaded_polled_and_exported(tmp_path: Path, toy_kind: str, toy_engine: str) -> None:
    path = tmp_path / "kvledger.yml"
    path.write_text(f"nvml: {{enabled: false}}\nengines:\n"
                    f"  - {{name: toy, kind: {toy_kind}, url: '{toy_engine}', block_tokens: 16, block_bytes: 2MiB}}\n")
    config = load_config(path)  # the loader knows the kind and its own key from the registration
    (engine,) = config.engines
    assert (engine.kind, engine.option("block_tokens")) == (toy_kind, "16")

    sources, timeouts, base = build_sources(config)
    assert [s.kind for s in sources] == [toy_kind]
    collector = Collector(sources, base_engines=base, timeouts=timeouts, limits=config.limits)
    try:
        text = render_text(collector.poll_once()).decode()
    finally:
        collector.stop()
    lines = set(text.splitlines())
    assert 'kvledger_kv_capacity_blocks{engine="toy",pool="0"} 1000.0' in lines
    assert 'kvledger_kv_blocks{engine="toy",pool="0",state="in_use"} 250.0' in lines
    assert f'kvledger_kv_capacity_bytes{{engine="toy",pool="0"}} {1000.0 * 2**21}' in lines
    # the rules the registration gives when neither the engine nor the configuration says
    assert any(line.startswith('kvledger_policy_info{engine="toy"') and 'admission="reserve-cap"' in line
               and 'overflow="reject"' in line for line in lines), text
    assert any(line.startswith("kvledger_engine_info{") and 'engine="toy"' in line and f'kind="{toy_kind}"' in line
               for line in lines), text
    # the README's generated table of kinds lists it
    assert f"`{toy_kind}`" in engine_kinds()


def test_the_kinds_own_key_and_name_are_checked_from_its_registration(tmp_path: Path, toy_kind: str) -> None:
    path = tmp_path / "kvledger.yml"
    path.write_text("engines:\n  - {name: e, kind: vllm, url: 'http://127.0.0.1:1/metrics', block_tokens: 16}\n")
    with pytest.raises(ConfigError, match=rf"block_tokens is for kind {toy_kind} only \(this engine is kind vllm\)"):
        load_config(path)
    path.write_text(f"engines:\n  - {{name: e, kind: {toy_kind}, url: 'http://127.0.0.1:1/metrics', block_tokens: 0}}\n")
    with pytest.raises(ConfigError, match=r"engines\[0\]\.block_tokens: expected a positive integer"):
        load_config(path)
    path.write_text("engines:\n  - {name: e, kind: nope, url: 'http://127.0.0.1:1/metrics'}\n")
    with pytest.raises(ConfigError, match=rf"must be one of .*\b{toy_kind}\b"):
        load_config(path)


def test_no_file_of_the_package_names_the_new_kind() -> None:
    """What made the kind work was its folder alone: the package never names it."""
    package = [p for p in (ROOT / "exporter" / "kvledger").rglob("*") if p.is_file() and p.suffix in (".py", ".json", ".yml")]
    assert package and not [p for p in package if KIND in p.read_text(errors="replace")]


def test_every_registered_kind_has_its_source_class() -> None:
    """Each registration names, by reference, the source class of the kind it registers."""
    assert {name: getattr(kind.source, "kind", None) for name, kind in KINDS.items()} == {name: name for name in KINDS}


def test_each_kind_is_its_folder_and_one_line_of_the_kinds_list() -> None:
    """collect/sources/kinds.py is one import per kind and nothing else: the import of the kind's
    registration (``<folder>/kind.py``), which registers the kind of that folder and no other."""
    sources = ROOT / "exporter" / "kvledger" / "collect" / "sources"
    tree = parse_python((sources / "kinds.py").read_text())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    imports = [n for n in body if isinstance(n, ast.Import) and len(n.names) == 1]
    assert len(imports) == len(body) - 1  # and ``from __future__ import annotations``
    modules = [n.names[0].name for n in imports]
    assert sorted(modules) == sorted(f"kvledger.collect.sources.{p.parent.name}.kind" for p in sources.glob("*/kind.py"))
    registered_in = {}
    for path in sources.glob("*/kind.py"):
        names = [k.value for n in ast.walk(parse_python(path.read_text())) if isinstance(n, ast.keyword) and n.arg == "name"
                 and isinstance(k := n.value, ast.Constant)]
        assert len(names) == 1, path
        registered_in[names[0]] = path.parent.name
    assert list(registered_in.keys()) != [] and set(registered_in) == set(KINDS)
    assert [registered_in[k] for k in KINDS] == [m.split(".")[-2] for m in modules]  # KINDS in the lines' order
    assert all(folder == kind.replace("-", "_") for kind, folder in registered_in.items())


def test_outside_its_folder_and_its_registration_no_module_names_a_kind() -> None:
    """Every registered kind is named (as a string) only in its source folder (its registration
    among them) and the simulator of that engine: the kinds table, the registry, the loader, the
    merge, the policy, the outputs and the web take it from the registration. ``ledger`` is
    left out: the word is also the key of the vLLM and SGLang in-engine ledgers' address."""
    package = ROOT / "exporter" / "kvledger"
    wrong = []
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "sim":
            continue
        named = {n.value for n in ast.walk(parse_python(path.read_text())) if isinstance(n, ast.Constant)
                 and isinstance(n.value, str) and n.value in KINDS and n.value != "ledger"}
        home = package / "collect" / "sources"
        wrong += [f"{path.relative_to(ROOT)} names {kind!r}" for kind in sorted(named)
                  if home / kind.replace("-", "_") not in path.parents]
    assert wrong == []
