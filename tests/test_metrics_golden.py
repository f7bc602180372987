"""The whole /metrics page, node_exporter style: a deterministic snapshot covering every
catalogue family is rendered and compared line for line with a committed file.

Regenerate after an intended change (and read the diff before committing it):

    make golden        # or: KVLEDGER_REGEN=1 .venv/bin/python -m pytest tests/test_metrics_golden.py -q
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from unittest import mock

from accounting_support import accounts_of
from test_exposition import rich_snapshot

from kvledger import BuildInfo
from kvledger.domain.accounts import ConfigReload
from kvledger.output.catalog import CATALOG
from kvledger.output.prometheus import render_text

GOLDEN = Path(__file__).parent / "fixtures" / "metrics.golden.prom"
REGEN = os.environ.get("KVLEDGER_REGEN") == "1"


#: the build the golden page shows: the version, the revision and the Python version vary by release, checkout
#: and machine (a fixed build: the page pins the exposition, not a release)
GOLDEN_BUILD = BuildInfo(version="0.1.0", revision="0123456789abcdef0123456789abcdef01234567", build_date="unknown",
                         python_version="3.11.0")


def rendered() -> str:
    accounts = accounts_of(rich_snapshot())
    accounts.invariant_totals = {("sim", "partition"): 1}
    accounts.labels_limited = {("sim", "tenant", "dropped"): 3}
    accounts.config_reload = ConfigReload(successful=True, success_at=1_700_000_000.0)
    with mock.patch("kvledger.output.catalog.build_info", return_value=GOLDEN_BUILD):
        return render_text(accounts).decode()


def test_metrics_page_matches_the_golden_file() -> None:
    text = rendered()
    if REGEN:
        GOLDEN.write_text(text)
    expected = GOLDEN.read_text()
    diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), "golden", "rendered", n=1))
    assert not diff, f"/metrics changed; if intended, regenerate with `make golden`:\n{diff[:6000]}"


def test_golden_file_covers_every_family() -> None:
    text = GOLDEN.read_text()
    assert [m.name for m in CATALOG if f"\n{m.name}{{" not in text and f"\n{m.name} " not in text] == []
