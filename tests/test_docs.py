"""Generated documentation stays in step with the catalogue."""

from __future__ import annotations

from pathlib import Path

from kvledger.catalog import CATALOG
from kvledger.docgen import main

ROOT = Path(__file__).resolve().parents[1]


def test_readme_metric_reference_is_fresh() -> None:
    assert main(["--check", str(ROOT / "README.md")]) == 0


def test_readme_lists_every_metric() -> None:
    text = (ROOT / "README.md").read_text()
    assert all(f"`{m.name}`" in text for m in CATALOG)


def test_stale_reference_detected(tmp_path: Path) -> None:
    stale = (ROOT / "README.md").read_text().replace("`kvledger_kv_capacity_bytes`", "`kvledger_old_name`", 1)
    p = tmp_path / "README.md"
    p.write_text(stale)
    assert main(["--check", str(p)]) == 1
    assert main([str(p)]) == 0 and main(["--check", str(p)]) == 0
