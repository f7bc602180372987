"""Hardening round three (issue 31), the input side, in-process:

1. the shared Prometheus text parser reads label values of any escapes exactly, in one
   pass (a 4 MiB value of mixed escapes kept an engine down as ``timeout``: the old parser
   took 36 s), stops at its deadline and when the daemon stops;
2. every file the configuration names is a regular file opened without blocking: a FIFO
   as a credentials, password, CA, certificate, key, model-config, log, web-config or
   configuration file is refused at once with a message naming it (it blocked ``open()``);
3. command-line values are read by the configuration's checks (one parser for
   ``--web.listen-address`` and ``listen:``): a clear message and exit 2, never a
   traceback; an empty value is an error; ``check`` reads the web config too;
4. a credential an HTTP header cannot carry (not Latin-1) is a configuration error at
   load; ``layer_groups`` beside ``groups`` must count them.

The process-level checks (SIGTERM within its bound with pollers busy, a SIGHUP reload
with a FIFO) are in tests/test_hardening_input_e2e.py; the cost per byte in
bench/bench_parse_worst.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fuzz_support import FUZZ
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from test_engine_text_hardening import KINDS as TEXT_KINDS

from harness.hostile import HostileEngine
from kvledger.cli import main
from kvledger.collect.collector import Collector
from kvledger.collect.sources.base import SourceError
from kvledger.collect.sources.http_client import HttpClient
from kvledger.collect.sources.metric_values import series_text
from kvledger.collect.sources.prom_text import Sample, abandon_parses, allow_parses, parse_exposition
from kvledger.collect.sources.registry import build_sources
from kvledger.collect.sources.vllm.startup_log import VllmLogReader
from kvledger.config.files import read_regular
from kvledger.config.loader import config_from_mapping, load_config
from kvledger.config.types import ConfigError
from kvledger.protocol.reader import ProtocolError, facts_from_document
from kvledger.web.runtime import WebRuntime

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
VLLM_TEXT = (FIXTURES / "vllm" / "vllm-0.32-like.txt").read_text()
MIB = 1 << 20


def escape(value: str) -> str:
    """A label value as the text format writes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def fill(unit: str, size: int) -> str:
    return (unit * (size // len(unit) + 1))[:size - size % len(unit)]


# ---------------------------------------------------------------- 1. the parser

#: characters that matter to the grammar, and some that do not
HOSTILE = st.sampled_from(['\\', '"', "\n", "{", "}", ",", "=", " ", "\t", "#", "a", "n", "t", "é", "\u2028", "\x00", "\x01",
                           "\ufffe", "\\n", '\\"', "\\\\"])
VALUES = st.lists(HOSTILE, max_size=40).map("".join)


@FUZZ
@given(st.lists(VALUES, min_size=1, max_size=4))
def test_escaped_label_values_of_any_kind_read_back_exactly(values: list[str]) -> None:
    pairs = [f'l{i}="{escape(v)}"' for i, v in enumerate(values)]
    for text in (f"m{{{','.join(pairs)}}} 1\n", f"# TYPE m gauge\nm {{ {' , '.join(pairs)} }} 2 17\n"):
        (sample,) = parse_exposition(text)["m"]
        assert sample.labels == {f"l{i}": v for i, v in enumerate(values)}
        # prometheus_client's parser (used before) reads the same text the same way
        (family,) = text_string_to_metric_families(text)
        assert dict(family.samples[0].labels) == sample.labels


@FUZZ
@given(st.lists(st.sampled_from(['\\', '"', "{", "}", ",", "=", " ", "a", "m", "1", "#", "\t", "é", "_", ":", "."]),
                max_size=60).map("".join))
def test_any_line_is_a_sample_or_a_parse_error(body: str) -> None:
    for text in (f"m{{a=\"{body}\"}} 1\n", f"m{{{body}}} 1\n", f"{body}\n", f"# HELP {body}\n", f"# TYPE {body}\n"):
        try:
            parse_exposition(text)
        except SourceError as exc:
            assert exc.reason == "parse" and exc.message.startswith("invalid exposition line 1: ")


#: the hostile shapes of the issue, each a 4 MiB label value (bench/bench_parse_worst.py has them all)
SHAPES = {
    "quotes": fill('\\"', 4 * MIB),
    "mixed": fill('\\\\a\\n\\"b\\tc\\"\\"', 4 * MIB),
    "backslashes": fill("\\\\", 4 * MIB),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_value_of_4_mib_of_escapes_reads_exactly(shape: str) -> None:
    raw = SHAPES[shape]
    (sample,) = parse_exposition(f'm{{a="{raw}"}} 1\n')["m"]
    expected = "\\".join(p.replace("\\n", "\n").replace('\\"', '"') for p in raw.split("\\\\"))
    assert sample.labels["a"] == expected and sample.value == 1.0


def test_an_unclosed_value_of_escapes_is_a_parse_error_naming_the_line() -> None:
    with pytest.raises(SourceError) as err:
        parse_exposition("a 1\n" + 'm{a="' + fill('\\"', 4 * MIB) + "} 1\n")
    assert err.value.reason == "parse" and err.value.message.startswith("invalid exposition line 2: 'm{a=")
    assert len(err.value.message) < 400  # the line is quoted cut short


def test_an_engine_sending_4_mib_of_escapes_stays_up() -> None:
    # before: 4 MiB of mixed escapes took 36 s to parse against the poll's timeout: the
    # engine was down (timeout) at every poll, and the parse went on in a thread nobody stopped
    body = (VLLM_TEXT + 'vllm:hostile{a="' + SHAPES["mixed"] + '"} 1\n').encode()
    engine = HostileEngine(body)
    config = config_from_mapping({"nvml": {"enabled": "false"}, "engines": [
        {"name": "e", "kind": "vllm", "url": engine.url, "timeout_seconds": 10, "block_bytes": 4096}]})
    sources, timeouts, base = build_sources(config)
    collector = Collector(sources, base, timeouts=timeouts)
    try:
        collector.poll_once()
        (health, message), *_ = collector.health()
        assert health.up, message
    finally:
        collector.stop()
        engine.stop()


#: every hostile shape of bench/bench_parse_worst.py, 256 KiB each, as one more line of a capture
LINE_SHAPES = {
    "quotes": 'hostile{a="' + fill('\\"', 256 << 10) + '"} 1',
    "mixed": 'hostile{a="' + fill('\\\\a\\n\\"b\\tc\\"\\"', 256 << 10) + '"} 1',
    "backslashes": 'hostile{a="' + fill("\\\\", 256 << 10) + '"} 1',
    "labels": "hostile{" + ",".join(f'a{i}="\\"{i}\\\\"' for i in range(16 << 10)) + "} 1",
    "help": "# HELP hostile " + fill('\\"x"', 256 << 10),
    "unclosed": 'hostile{a="' + fill('\\"', 256 << 10) + "} 1",
}


@pytest.mark.parametrize("shape", sorted(LINE_SHAPES))
@pytest.mark.parametrize("kind", sorted(TEXT_KINDS))
def test_every_kind_reads_a_capture_with_a_hostile_line(kind: str, shape: str) -> None:
    capture, adapter = TEXT_KINDS[kind]
    text = (FIXTURES / capture).read_text()
    if shape == "unclosed":  # a parse error naming the line, for every kind
        with pytest.raises(SourceError) as err:
            adapter(text + LINE_SHAPES[shape] + "\n")
        assert err.value.reason == "parse" and err.value.message.startswith(f"invalid exposition line {text.count(chr(10)) + 1}:")
    else:  # a series no adapter reads: the facts are those of the capture alone
        assert adapter(text + LINE_SHAPES[shape] + "\n") == adapter(text)


def test_a_parse_stops_at_its_deadline_naming_the_line() -> None:
    text = 'm{a="b"} 1\n' * 5000
    with pytest.raises(SourceError) as err:
        parse_exposition(text, deadline=time.monotonic() - 1)
    assert err.value.reason == "timeout"
    assert err.value.message == "parsing the exposition passed the poll's deadline at line 256 of 5001"
    assert len(parse_exposition(text, deadline=time.monotonic() + 60)["m"]) == 5000


def test_a_parse_stops_when_the_daemon_stops() -> None:
    abandon_parses()
    try:
        with pytest.raises(SourceError, match="kvledger is shutting down"):
            parse_exposition("m 1\n" * 1000)
    finally:
        allow_parses()
    assert len(parse_exposition("m 1\n" * 1000)["m"]) == 1000


@pytest.mark.parametrize(("line", "says"), [
    ("m 1 1.5", "timestamp '1.5' is not a count of milliseconds"),
    ("m 1 " + "9" * 5000, "is not a count of milliseconds"),
    ("m 1_000", "value '1_000' is not a number"),
    ("m \u0661", "is not a number"),  # an Arabic-Indic digit: float() reads it, Prometheus does not
    ("m 1 2 3", "expected a value and an optional timestamp, got 3 fields"),
    ('m{a="1",,b="2"} 1', "expected a label name at column"),
    ('m{a="1" b="2"} 1', "expected ',' or '}' after label 'a'"),
    ('m{a="1",a="2"} 1', "label 'a' given twice"),
    ('m{a} 1', "label 'a' has no '=' and value"),
    ('m{a=1} 1', "the value is not a closed quoted string"),
    ('{a="1"} 1', "no metric name"),
    ('m{"n"} 1', "the metric name given twice"),
    ("# TYPE m", "TYPE line without a type"),
    ("# TYPE m.n gauge", "invalid metric name"),
    ("m", "no value"),
    ("m-1 2", "invalid character '-' in the metric name"),
])
def test_a_bad_line_is_named_with_what_is_wrong(line: str, says: str) -> None:
    with pytest.raises(SourceError) as err:
        parse_exposition(line + "\n")
    assert err.value.reason == "parse" and says in err.value.message, err.value.message


def test_what_prometheus_reads_is_read() -> None:
    text = ('# HELP c_total A counter.\n# TYPE c_total counter\nc_total{a="x"} 3 1700000000000\n'
            '# TYPE d counter\nd 4\nd_created 1.7e9\n# TYPE h histogram\nh_bucket{le="+Inf"} 2\nh_sum 1.5\nh_count 2\n'
            '{"my.metric", "my.label"="v"} 5\nm { a = "1" , } NaN\nm{,b="2"} -Inf\n# a comment\n\n')
    exp = parse_exposition(text)
    assert exp["c_total"] == [Sample({"a": "x"}, 3.0)]
    assert exp["d_total"] == [Sample({}, 4.0)]  # a counter named without _total: read as <name>_total
    assert exp["d_created"] == [Sample({}, 1.7e9)]
    assert [s.value for s in exp["h_bucket"] + exp["h_sum"] + exp["h_count"]] == [2.0, 1.5, 2.0]
    assert exp["my.metric"] == [Sample({"my.label": "v"}, 5.0)]
    assert exp["m"][0].labels == {"a": "1"} and exp["m"][1] == Sample({"b": "2"}, float("-inf"))


def test_every_capture_reads_as_prometheus_client_read_it() -> None:
    engines = ("vllm", "sglang", "tgi", "trtllm", "triton-trtllm", "llamacpp")  # captures of engines' /metrics
    captures = [p for kind in engines for p in (FIXTURES / kind).glob("*.txt") if "metrics" in p.name or kind == "vllm"]
    captures.append(FIXTURES / "metrics.golden.prom")
    assert len(captures) >= 10
    for path in captures:
        text = path.read_text()
        ours = {name: [(dict(s.labels), s.value) for s in samples] for name, samples in parse_exposition(text).items()}
        theirs: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                theirs.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
        assert repr(ours) == repr(theirs), path


def test_a_series_quoted_in_a_message_is_cut_short() -> None:
    sample = Sample({"a": "x" * (4 * MIB), "b": "y"}, 1.0)
    assert len(series_text("m", sample)) <= 160


# ---------------------------------------------------------------- 2. files that would block


@contextlib.contextmanager
def fifo(path: Path) -> Iterator[Path]:
    """A FIFO at ``path``; on leaving, a writer opens it, so a reader blocked on it returns."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # releases an open() blocked on it
        path.unlink(missing_ok=True)


def returns_within(seconds: float, fn: Callable[[], Any], path: Path) -> Any:
    """fn() run in a thread; AssertionError when it is still running after ``seconds``
    (a FIFO open blocked: it is released so the thread ends)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(5)
        raise AssertionError(f"blocked on the FIFO {path} for {seconds}s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _cert_pair(tmp_path: Path) -> tuple[Path, Path]:
    from tls_support import make_ca, make_leaf

    ca = make_ca(tmp_path / "pki", "ca")
    return make_leaf(tmp_path / "pki", "server", ca, "IP:127.0.0.1", "serverAuth")


ENGINE = {"name": "e", "kind": "ledger", "url": "https://127.0.0.1:1/"}


@pytest.mark.parametrize(("key", "section"), [
    ("credentials_file", "authorization"),
    ("password_file", "basic_auth"),
    ("ca_file", "tls_config"),
    ("cert_file", "tls_config"),
    ("key_file", "tls_config"),
])
def test_a_fifo_named_in_an_engine_is_refused_at_once(tmp_path: Path, key: str, section: str) -> None:
    cert, key_file = _cert_pair(tmp_path)
    entry: dict[str, Any] = {"username": "u"} if section == "basic_auth" else {}
    if section == "tls_config":
        entry = {"cert_file": str(cert), "key_file": str(key_file)}
    with fifo(tmp_path / "pipe") as pipe:
        entry[key] = str(pipe)
        cfg = {"engines": [{**ENGINE, section: entry}]}
        with pytest.raises(ConfigError) as err:
            returns_within(5, lambda: build_sources(config_from_mapping(cfg, str(tmp_path / "kvledger.yml"))), pipe)
    assert f"{section}.{key}" in str(err.value) or key in str(err.value)
    assert "a FIFO, not a regular file" in str(err.value)


def test_a_fifo_as_the_configuration_or_the_model_config_is_refused(tmp_path: Path) -> None:
    with fifo(tmp_path / "kvledger.yml") as pipe:
        with pytest.raises(ConfigError, match=r"kvledger.yml: cannot read: .*a FIFO, not a regular file"):
            returns_within(5, lambda: load_config(pipe), pipe)
    with fifo(tmp_path / "config.json") as pipe:
        entry = {"name": "s", "kind": "sglang", "url": "http://127.0.0.1:1/metrics", "model": {"config": str(pipe)}}
        with pytest.raises(ConfigError, match=r"engines\[0\].model.config: cannot read .*a FIFO, not a regular file"):
            returns_within(5, lambda: config_from_mapping({"nvml": {"enabled": "false"}, "engines": [entry]}), pipe)


def test_a_credentials_file_swapped_for_a_fifo_fails_the_poll_at_once(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret\n")
    cfg = config_from_mapping({"engines": [{"name": "e", "kind": "ledger", "url": "http://127.0.0.1:1/",
                                            "authorization": {"credentials_file": str(token)}}]})
    client = HttpClient("http://127.0.0.1:1/", timeout=1, auth=cfg.engines[0].client_auth)
    with fifo(token) as pipe:
        with pytest.raises(SourceError) as err:
            returns_within(5, client.get, pipe)
    assert err.value.reason == "config" and "a FIFO, not a regular file" in err.value.message


def test_a_log_file_or_a_web_config_file_swapped_for_a_fifo_is_refused(tmp_path: Path) -> None:
    with fifo(tmp_path / "vllm.log") as pipe:
        reader = VllmLogReader(str(pipe))
        with pytest.raises(OSError, match="a FIFO, not a regular file"):
            returns_within(5, reader.read, pipe)
    cert, key = _cert_pair(tmp_path)
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": str(cert), "key_file": str(key)}}))
    runtime = WebRuntime(web)
    with fifo(cert) as pipe:
        assert returns_within(5, runtime.reload, pipe) is False  # logged; the certificate in force is kept
    with fifo(web) as pipe:
        assert returns_within(5, runtime.reload, pipe) is False
        with pytest.raises(ConfigError, match="a FIFO, not a regular file"):
            returns_within(5, lambda: WebRuntime(pipe), pipe)


def test_a_file_over_its_limit_or_a_directory_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b"x" * 100)
    with pytest.raises(OSError, match="over the limit of 10 bytes"):
        read_regular(big, 10)
    with pytest.raises(OSError, match="a directory, not a regular file"):
        read_regular(tmp_path)


# ---------------------------------------------------------------- 3. command-line values


def _config(tmp_path: Path, **extra: Any) -> Path:
    path = tmp_path / "kvledger.yml"
    path.write_text(yaml.safe_dump({"nvml": {"enabled": "false"}, **extra}))
    return path


BAD_LISTEN = {
    "127.0.0.1:99999": "the port is not a number in 0..65535",
    ":abc": "the port 'abc' is not a number",
    "[::1]:x": "the port 'x' is not a number",
    ":65536": "the port is not a number in 0..65535",
    "127.0.0.1": "no port",
    "9" * 5000: "no port",
    ":" + "9" * 5000: "the port is not a number in 0..65535",
    "::1:9477": "an IPv6 address goes in brackets, e.g. [::1]:9477",
    "0177.0.0.1:9477": "'0177.0.0.1' is not a dotted-quad IPv4 address",
    "": "got an empty value",
}


@pytest.mark.parametrize("value", sorted(BAD_LISTEN), ids=lambda v: v[:20] or "empty")
@pytest.mark.parametrize("command", ["serve", "demo", "lab", "check"])
def test_a_bad_listen_flag_exits_2_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str,
                                                   value: str) -> None:
    argv = {"serve": ["serve", "--config", str(_config(tmp_path))], "demo": ["demo"], "lab": ["lab", "--serve"],
            "check": ["check", "--config", str(_config(tmp_path))]}[command]
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--web.listen-address", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --web.listen-address/--listen: " in err and BAD_LISTEN[value] in err and "Traceback" not in err
    assert len(err) < 1500


@pytest.mark.parametrize("value", sorted(BAD_LISTEN), ids=lambda v: v[:20] or "empty")
def test_the_configuration_reads_listen_as_the_flag(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_config(tmp_path, listen=value))
    assert "listen: expected HOST:PORT" in str(err.value) and BAD_LISTEN[value] in str(err.value)


@pytest.mark.parametrize("value", ["127.0.0.1:0", ":9477", "[::1]:9477", "localhost:9477", "0.0.0.0:80"])
def test_good_listen_values_are_kept_as_given(tmp_path: Path, value: str) -> None:
    assert load_config(_config(tmp_path, listen=value)).listen == value


@pytest.mark.parametrize(("argv", "says"), [
    (["serve", "--config", ""], "argument --config: expected a value, got an empty one"),
    (["serve", "--config", "x.yml", "--web.config.file", ""], "argument --web.config.file: expected a value"),
    (["demo", "--interval", "nan"], "argument --interval: expected a duration"),
    (["demo", "--interval", "0"], "argument --interval: a duration must be positive"),
    (["demo", "--interval", "7200"], "argument --interval: must be between 0.1 s and 3600 s"),
    (["demo", "--seed", "9" * 5000], "argument --seed: invalid int value"),
])
def test_other_bad_flags_exit_2_naming_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and says in err and "Traceback" not in err


def test_check_reads_the_web_config_as_serve_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config: {cert_file: missing.pem, key_file: missing.key}\n")
    config = _config(tmp_path, web_config_file="web.yml")
    assert main(["check", "--config", str(config)]) == 2
    assert "tls_server_config: cannot load cert_file" in capsys.readouterr().err
    web.write_text("basic_auth_users: {alice: not-a-hash}\n")
    (tmp_path / "plain").mkdir()
    assert main(["check", "--config", str(_config(tmp_path / "plain")), "--web.config.file", str(web)]) == 2
    assert "basic_auth_users.alice: expected a bcrypt hash" in capsys.readouterr().err
    cert, key = _cert_pair(tmp_path)
    web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": str(cert), "key_file": str(key)}}))
    assert main(["check", "--config", str(config)]) == 0
    assert f"{web}: web config is valid (TLS)" in capsys.readouterr().out


# ---------------------------------------------------------------- 4. credentials and layer_groups


@pytest.mark.parametrize("token", ["tökenΩ", "token\x01"])
def test_a_credential_a_header_cannot_carry_is_a_configuration_error_at_load(tmp_path: Path, token: str) -> None:
    cfg = {"engines": [{"name": "e", "kind": "ledger", "url": "http://127.0.0.1:1/", "authorization": {"credentials": token}}]}
    with pytest.raises(ConfigError) as err:
        config_from_mapping(cfg)
    assert "engines[0].authorization.credentials: the credential: character" in str(err.value)
    assert token not in str(err.value)
    (tmp_path / "token").write_text(token + "\n")
    cfg["engines"][0]["authorization"] = {"credentials_file": "token"}
    with pytest.raises(ConfigError, match=r"authorization.credentials_file: .*token: character \d+ is"):
        config_from_mapping(cfg, str(tmp_path / "kvledger.yml"))


def test_a_credentials_file_rewritten_with_one_is_a_config_error_of_the_poll(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("good\n")
    cfg = config_from_mapping({"engines": [{"name": "e", "kind": "ledger", "url": "http://127.0.0.1:1/",
                                            "authorization": {"credentials_file": str(token)}}]})
    token.write_text("tökenΩ\n")
    with pytest.raises(SourceError) as err:
        HttpClient("http://127.0.0.1:1/", timeout=1, auth=cfg.engines[0].client_auth).get()
    assert err.value.reason == "config" and "outside Latin-1" in err.value.message and "Ω" not in err.value.message


def test_a_basic_auth_password_beyond_latin_1_is_fine() -> None:
    config_from_mapping({"engines": [{"name": "e", "kind": "ledger", "url": "http://127.0.0.1:1/",
                                      "basic_auth": {"username": "ü", "password": "pässwΩrd"}}]})


def _document(groups: int, layer_groups: int | None) -> dict[str, Any]:
    pool: dict[str, Any] = {"id": "0", "block_size": 16, "block_bytes": 4096, "num_blocks": 1024,
                            "groups": [{"id": str(i), "kind": "full_attention"} for i in range(groups)]}
    if layer_groups is not None:
        pool["layer_groups"] = layer_groups
    return {"schema": "kvledger/v1", "engine": {"kind": "vllm"}, "pools": [pool], "requests": []}


def test_layer_groups_beside_groups_must_count_them() -> None:
    with pytest.raises(ProtocolError) as err:
        facts_from_document(json.loads(json.dumps(_document(64, 1))), "e")
    assert "pools[0].layer_groups" in str(err.value) and "is 1 but the pool states 64 group(s)" in str(err.value)
    assert facts_from_document(_document(64, 64), "e").pools[0].layer_groups == 64
    assert facts_from_document(_document(3, None), "e").pools[0].layer_groups == 3
    assert facts_from_document(_document(0, 2), "e").pools[0].layer_groups == 2


# ---------------------------------------------------------------- reloads that cannot finish


SERVER = object()  # what a reload is given: the reload function's business


class _Reloads:
    """A reload function whose calls block until released; records what each applied."""

    def __init__(self) -> None:
        self.started: list[threading.Event] = []
        self.release: list[threading.Event] = []
        self.applied: list[int] = []
        self.dropped: list[int] = []

    def __call__(self, _server: Any, applying: Callable[[], Any]) -> None:
        n = len(self.started)
        self.started.append(threading.Event())
        self.release.append(threading.Event())
        self.started[n].set()
        self.release[n].wait(30)
        with applying() as current:
            (self.applied if current else self.dropped).append(n)


def _wait(predicate: Callable[[], bool], seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "not reached"
        time.sleep(0.01)


def test_a_reload_that_cannot_finish_is_reported_and_does_not_block_the_next() -> None:
    from kvledger.cli import ReloadRunner

    reloads, overdue = _Reloads(), threading.Event()
    runner = ReloadRunner(reloads, on_overdue=overdue.set, bound=0.3)
    runner.request(SERVER)  # type: ignore[arg-type]  # the server is the reload function's business
    _wait(lambda: len(reloads.started) == 1)
    assert overdue.wait(10)  # stuck past its bound: reported failed
    runner.request(SERVER)  # type: ignore[arg-type]
    _wait(lambda: len(reloads.started) == 2)  # the next one runs at once
    reloads.release[1].set()
    _wait(lambda: reloads.applied == [1])
    reloads.release[0].set()  # the stuck one ends at last: its result is dropped
    _wait(lambda: reloads.dropped == [0])
    assert reloads.applied == [1]


def test_a_sighup_storm_runs_one_reload_at_a_time() -> None:
    from kvledger.cli import ReloadRunner

    reloads = _Reloads()
    runner = ReloadRunner(reloads, bound=30)
    for _ in range(50):
        runner.request(SERVER)  # type: ignore[arg-type]
    _wait(lambda: len(reloads.started) == 1)
    time.sleep(0.2)
    assert len(reloads.started) == 1  # the other 49 signals are one more reload, kept for later
    reloads.release[0].set()
    _wait(lambda: len(reloads.started) == 2)
    reloads.release[1].set()
    _wait(lambda: reloads.applied == [0, 1])
    time.sleep(0.2)
    assert len(reloads.started) == 2
