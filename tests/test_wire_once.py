"""The wire once (issue 29, point 1): every word of kvledger/v1 is the engine-side
library's, and one writer, built from the one request definition, writes every producer's
requests.

- A new request field is one entry, and so is a new KV-cache group kind (its word and how
  it holds blocks, in ``wire_terms.GROUPS``).
- A new request field: the test copies the engine-side distribution, adds one
  line to ``request_wire.REQUEST_FIELDS`` and, in a fresh interpreter, shows that the
  writer writes it in both forms and that both of the daemon's readers (the typed decoder
  and the checked reader) read it and name it when its value is wrong, with nothing else
  changed.
- Every producer in the engine-side distribution writes its requests through
  ``RequestWriter`` (no second encoder); the daemon's wire words are the engine side's
  objects, and the published schema spells the same.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvledger.protocol import wire
from kvledger_engine.request_wire import REQUEST_FIELDS, RequestWriter
from kvledger_engine.wire_terms import ADMISSIONS, GROUP_KINDS, OVERFLOWS, WINDOW_GROUP_KINDS

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine" / "kvledger_engine"

_ONE_ENTRY = '    count_field("draft_tokens", default=0, ranges={"draft_tokens": (0, 64)}),\n'

_PROBE = textwrap.dedent('''
    import json
    from kvledger_engine import request_wire
    from kvledger_engine.request_wire import RequestWriter
    from kvledger.protocol import fast_decoder, reader, wire

    assert "draft_tokens" in wire.FIELDS, "the daemon's definition is the engine's"
    writer = RequestWriter({"pool": "0"})
    requests = [{"id": "a", "state": "running", "prompt_tokens": 10, "max_output_tokens": 5, "draft_tokens": 7},
                {"id": "b", "state": "waiting", "prompt_tokens": 3, "max_output_tokens": 2, "draft_tokens": 0}]

    def document(key, value):
        return {"schema": "kvledger/v1", "engine": {"kind": "probe"},
                "pools": [{"id": "0", "block_size": 16, "block_bytes": 1024, "num_blocks": 100}], key: value}

    out = {"row": json.loads(writer.row_json(requests[0])), "columns": writer.columns(requests)}
    for key, value in (("requests", [json.loads(writer.row_json(r)) for r in requests]),
                       ("request_columns", writer.columns(requests))):
        body = json.dumps(document(key, value))
        typed = reader.typed_facts(body, "e")
        assert typed is not None, key + ": the typed decoder refused it"
        checked = reader.facts_from_document(json.loads(body), "e")
        out[key] = [typed.requests.column("draft_tokens").tolist(), checked.requests.column("draft_tokens").tolist()]
    bad = document("requests", [dict(json.loads(writer.row_json(requests[0])), draft_tokens=65)])
    assert reader.typed_facts(json.dumps(bad), "e") is None
    try:
        reader.facts_from_document(bad, "e")
    except reader.ProtocolError as exc:
        out["error"] = str(exc)
    print(json.dumps(out))
''')


def test_a_new_request_field_is_one_entry(tmp_path: Path) -> None:
    copy = tmp_path / "kvledger_engine"
    shutil.copytree(ENGINE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    source = (copy / "request_wire.py").read_text()
    anchor = '    Field("block_ids", "integers"'
    assert source.count(anchor) == 1
    (copy / "request_wire.py").write_text(source.replace(anchor, _ONE_ENTRY + anchor))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "exporter")]))
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["row"]["draft_tokens"] == 7
    assert "draft_tokens" in out["columns"]
    assert out["requests"] == [[7, 0], [7, 0]]
    assert out["request_columns"] == [[7, 0], [7, 0]]
    assert out["error"].startswith("requests[0].draft_tokens:"), out["error"]


_ONE_GROUP_KIND = '    "local_window": "window",\n'

_GROUP_PROBE = textwrap.dedent('''
    import json
    from kvledger.collect.accounting import AccountCache, account_snapshot
    from kvledger.config.types import LimitsConfig
    from kvledger.domain.facts import GROUP_KINDS, Snapshot
    from kvledger.output.catalog import LABELS
    from kvledger.output.prometheus import check_renderable, render_text
    from kvledger.policy.reservations import group_shape
    from kvledger.protocol import reader

    assert "local_window" in GROUP_KINDS, "the daemon's group kinds are the engine's"

    def document(kind, **group):
        return {"schema": "kvledger/v1", "engine": {"kind": "probe"},
                "pools": [{"id": "0", "block_size": 16, "block_bytes": 1024, "num_blocks": 1000,
                           "groups": [{"id": "0", "kind": "full_attention"}, dict(id="1", kind=kind, **group)]}],
                "requests": [{"id": "a", "state": "running", "prompt_tokens": 1000, "max_output_tokens": 24}]}

    def samples(kind):
        body = json.dumps(document(kind, window=64))
        typed, checked = reader.typed_facts(body, "e"), reader.facts_from_document(json.loads(body), "e")
        assert typed is not None and typed.pools[0].groups == checked.pools[0].groups, kind
        step = account_snapshot(Snapshot(engines=[checked]), {}, LimitsConfig(), AccountCache(), check_renderable)
        assert not step.invalid, step.invalid
        text = render_text(step.accounts).decode()
        return {"shape": repr(group_shape(checked.pools[0].groups[1])),
                "lines": sorted(ln for ln in text.splitlines() if ln.startswith("kvledger_kv_group"))}

    out = {kind: samples(kind) for kind in ("local_window", "sliding_window", "full_attention")}
    out["vocabulary"] = sorted(LABELS["layer_type"].values or ())
    try:
        reader.facts_from_document(document("local_window"), "e")
    except reader.ProtocolError as exc:
        out["error"] = str(exc)
    print(json.dumps(out))
''')


def test_a_new_group_kind_is_one_entry(tmp_path: Path) -> None:
    """A new KV-cache group kind is one entry in ``wire_terms.GROUPS``: its word and how it holds
    blocks (here a window, as a sliding window does). In a fresh interpreter over a copy of the
    engine-side distribution with that one line added, both readers read it (and require its
    window), the policy reserves for it by its holding's formula, and the accounts, the label
    vocabulary and the exposition carry it, with nothing else changed. (The published schema,
    the contract, is held to the wire terms by test_the_schema_spells_the_wire_terms, as it is
    to a new request field by tests/test_protocol.py.)"""
    copy = tmp_path / "kvledger_engine"
    shutil.copytree(ENGINE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    source = (copy / "wire_terms.py").read_text()
    anchor = '    MAMBA: "state",\n}'
    assert source.count(anchor) == 1
    (copy / "wire_terms.py").write_text(source.replace(anchor, _ONE_GROUP_KIND + anchor))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "exporter")]))
    done = subprocess.run([sys.executable, "-c", _GROUP_PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    new, window, full = out["local_window"], out["sliding_window"], out["full_attention"]
    assert new["shape"] == window["shape"] != full["shape"]
    assert any('layer_type="local_window",window_tokens="64"} 1.0' in ln for ln in new["lines"]), new["lines"]
    # the same figures as a sliding window of the same span, under its own name; not full attention's
    assert new["lines"] == sorted(ln.replace('"sliding_window"', '"local_window"') for ln in window["lines"])
    reserved = [ln for ln in new["lines"] if ln.startswith("kvledger_kv_group_reserved_blocks") and 'group="1"' in ln]
    assert reserved and not set(reserved) & set(full["lines"])
    assert "local_window" in out["vocabulary"]
    assert out["error"].startswith("pools[0].groups[1].window:"), out["error"]


def test_every_group_holding_has_its_formula() -> None:
    """Each way a group kind may hold blocks has its reservation formula in policy/, and every
    group kind one of those ways."""
    from kvledger.policy.reservations import GROUP_SHAPES
    from kvledger_engine.wire_terms import GROUP_HOLDINGS, GROUPS

    assert tuple(GROUP_SHAPES) == GROUP_HOLDINGS
    assert set(GROUPS.values()) <= set(GROUP_HOLDINGS)


def test_the_daemon_reads_the_engines_definition() -> None:
    assert wire.REQUEST_FIELDS is REQUEST_FIELDS


def test_the_daemon_takes_every_wire_word_from_the_engine_side() -> None:
    """Request fields, group kinds, admission and overflow modes, states, output bounds,
    counters and the request ranges: the daemon's names are the engine-side objects."""
    from kvledger.domain import facts, limits
    from kvledger_engine import wire_terms

    for name in ("ADMISSIONS", "OVERFLOWS", "REQUEST_STATES", "OUTPUT_BOUNDS", "COUNTER_NAMES", "GROUP_KINDS",
                 "WINDOW_GROUP_KINDS", "BUDGET_CATEGORIES", "TERM_SOURCES", "LIMIT_KINDS"):
        assert getattr(facts, name) is getattr(wire_terms, name), name
    assert limits.REQUEST_INT_RANGES is wire_terms.REQUEST_INT_RANGES


def test_the_schema_spells_the_wire_terms() -> None:
    schema = json.loads((ROOT / "exporter/kvledger/protocol/schema/kvledger-v1.json").read_text())
    group = schema["$defs"]["pool"]["properties"]["groups"]["items"]
    assert tuple(group["properties"]["kind"]["enum"]) == GROUP_KINDS
    assert tuple(group["if"]["properties"]["kind"]["enum"]) == WINDOW_GROUP_KINDS
    assert tuple(schema["properties"]["admission"]["enum"][:-1]) == ADMISSIONS
    assert tuple(schema["properties"]["overflow"]["enum"][:-1]) == OVERFLOWS


#: the engine-side modules that write kvledger/v1 requests (the SGLang plugin's ledger
#: publishes through the vLLM plugin's document, which writes through the writer)
PRODUCERS = ("vllm/published.py", "reference_ledger.py")


def test_every_engine_side_producer_writes_requests_through_the_writer() -> None:
    """No producer of the engine-side distribution encodes a request by hand: each one
    writes through ``RequestWriter``, and no module but the definition spells a request's
    JSON key in text."""
    for name in PRODUCERS:
        assert "RequestWriter" in (ENGINE / name).read_text(), name
    assert "PublishedLedger(" in (ENGINE / "sglang" / "ledger.py").read_text()
    for path in ENGINE.rglob("*.py"):
        if path.name != "request_wire.py":
            text = path.read_text()
            for f in REQUEST_FIELDS:
                assert f'"{f.name}":{{' not in text and f'\\"{f.name}\\":' not in text, f"{path}: {f.name} encoded by hand"


def test_the_writer_writes_what_it_is_given_in_definition_order() -> None:
    writer = RequestWriter({"pool": "p", "contexts": 1})
    row = json.loads(writer.row_json({"id": "r", "state": "running", "tenant": None, "prompt_tokens": 3,
                                      "max_output_tokens": 4, "blocks_held": 1}))
    assert list(row) == ["id", "pool", "state", "prompt_tokens", "max_output_tokens", "contexts", "blocks_held"]
    with pytest.raises(ValueError, match="prompt_tokens"):
        writer.row_json({"id": "r", "state": "running", "max_output_tokens": 4})
    with pytest.raises(ValueError, match="not a field"):
        RequestWriter({"nope": 1})
    with pytest.raises(ValueError, match="one value per request"):
        RequestWriter({"id": "x"})
